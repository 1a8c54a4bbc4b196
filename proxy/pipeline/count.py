"""Token counts of what the client sent and of what is forwarded.

Long tool outputs dominate both the cost of counting (tiktoken runs at ~20 MB/s here) and the
size of a history that is resent every turn. Their text is counted once and cached keyed by the
string itself (a dict lookup hashes it in microseconds), so a repeat costs no tokenization and
no canonical-JSON hashing; everything else goes through TokenCounter's per-message cache.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from .tokens import REPLY_PRIMING, TokenCounter

# Text at least this long is counted through the content cache (and off the event loop when
# not cached yet); shorter text is cheap enough either way.
BIG_TEXT = 8192


class RequestCounter:
    """Counts whole requests for one process; thread-safe (counting may run in a worker)."""

    def __init__(self, counter: TokenCounter, *, cache_chars: int = 256 * 1024 * 1024) -> None:
        self.counter = counter
        self._texts: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._chars = 0
        self._limit = cache_chars
        self._lock = threading.Lock()

    def _big_text(self, text: str, model: str) -> int:
        key = (self.counter.encoding_name(model), text)
        with self._lock:
            hit = self._texts.get(key)
            if hit is not None:
                self._texts.move_to_end(key)
                return hit
        n = self.counter.count_text(text, model)
        with self._lock:
            if key not in self._texts:
                self._texts[key] = n
                self._chars += len(text)
                while self._chars > self._limit and len(self._texts) > 1:
                    (_, old), _ = self._texts.popitem(last=False)
                    self._chars -= len(old)
        return n

    def _message(self, msg: Any, model: str) -> int:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str) and len(content) >= BIG_TEXT:
            return self.counter.count_message({**msg, "content": ""}, model) + self._big_text(
                content, model
            )
        return self.counter.count_message(msg, model)

    def messages(self, messages: Sequence[Any], model: str) -> int:
        return sum(self._message(m, model) for m in messages)

    def message(self, msg: Any, model: str) -> int:
        return self._message(msg, model)

    def request(
        self, messages: Sequence[Any], model: str, tools: Sequence[Mapping[str, Any]] | None
    ) -> int:
        tools_n = self.counter.count_tools(tools, model) if tools else 0
        return self.messages(messages, model) + tools_n + REPLY_PRIMING

    def needs_work(self, messages: Sequence[Any], model: str) -> bool:
        """True when some big text is not cached yet (worth moving to a worker thread)."""
        enc = self.counter.encoding_name(model)
        with self._lock:
            for m in messages:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, str) and len(content) >= BIG_TEXT:
                    if (enc, content) not in self._texts:
                        return True
        return False

    async def ready(self, model: str) -> None:
        """Load ``model``'s encoding off the event loop the first time the model is seen."""
        if not self.counter.resolved(model):
            await asyncio.to_thread(self.counter.encoding_name, model)

    async def request_async(
        self, messages: Sequence[Any], model: str, tools: Sequence[Mapping[str, Any]] | None
    ) -> int:
        """Like `request`, but loading an encoding and tokenizing megabytes happen off the
        event loop."""
        await self.ready(model)
        if self.needs_work(messages, model):
            return await asyncio.to_thread(self.request, messages, model, tools)
        return self.request(messages, model, tools)


class CountStage:
    """Last stage: tokens the client sent (originals) and tokens forwarded."""

    name = "count"

    def __init__(self, counter: RequestCounter) -> None:
        self.counter = counter

    async def __call__(self, messages: list[Any], request: Any) -> Any:
        from . import StageOutcome

        tools = request.body.get("tools")
        tools = tools if isinstance(tools, list) else None
        out = await self.counter.request_async(messages, request.model, tools)
        sent = request.body["messages"]
        inn = out if sent is messages else await self.counter.request_async(sent, request.model, tools)
        return StageOutcome(messages, False, {"tokens_in": inn, "tokens_out": out})

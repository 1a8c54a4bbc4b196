"""Token counts of what the client sent and of what is forwarded.

Long tool outputs dominate both the cost of counting (tiktoken runs at ~20 MB/s here) and the
size of a history that is resent every turn. Their text is counted once and cached keyed by the
string itself (a dict lookup hashes it in microseconds), so a repeat costs no tokenization and
no canonical-JSON hashing; everything else goes through TokenCounter's per-message cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.lru import LRU
from proxy.model import Message, RequestView, StageOutcome
from proxy.tokens.counter import REPLY_PRIMING, TokenCounter

# Text at least this long is counted through the content cache (and off the event loop when
# not cached yet); shorter text is cheap enough either way.
BIG_TEXT = 8192


class RequestCounter:
    """Counts whole requests for one process; thread-safe (counting may run in a worker)."""

    def __init__(self, counter: TokenCounter, *, cache_chars: int = 256 * 1024 * 1024) -> None:
        self.counter = counter
        # Sized by the text each entry pins.
        self._texts: LRU[tuple[str, str], int] = LRU(cache_chars, lambda key, _: len(key[1]))

    def _big_text(self, text: str, model: str) -> int:
        key = (self.counter.encoding_name(model), text)
        hit = self._texts.get(key)
        if hit is not None:
            return hit
        n = self.counter.count_text(text, model)
        self._texts.put(key, n)
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


def estimate(messages: Sequence[Message]) -> int:
    """Tokens at 4 characters each (the count stage over the work budget): the text of each
    message's content and calls, without tokenizing."""
    chars = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(p.get("text") or "") for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list):
            chars += sum(len(str(c)) for c in calls)
    return chars // 4 + 4 * len(messages) + REPLY_PRIMING


class CountStage:
    """Last stage: tokens the client sent (originals) and tokens forwarded. Pure (CPU only;
    the runner moves large requests off the event loop)."""

    name = "count"

    def __init__(self, counter: RequestCounter) -> None:
        self.counter = counter

    def __call__(self, messages: list[Message], request: RequestView) -> StageOutcome:
        work = request.work
        if work is not None:
            work.spend(len(messages))
            if work.exhausted:  # over the budget: what is forwarded is not changed by counts
                work.degrade(self.name)
                out = estimate(messages)
                inn = out if request.messages is messages else estimate(request.messages)
                return StageOutcome(messages, False, {"tokens_in": inn, "tokens_out": out})
        tools = request.tool_schemas
        out = self.counter.request(messages, request.model, tools)
        sent = request.messages
        inn = out if sent is messages else self.counter.request(sent, request.model, tools)
        return StageOutcome(messages, False, {"tokens_in": inn, "tokens_out": out})

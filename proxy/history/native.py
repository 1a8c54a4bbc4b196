"""Provider-native context management, read from the request: pure, no I/O.

Providers compact and clear context themselves (docs/native.md);
ctxproxy's own stages must not fight them:

* a **compaction item** (a Responses ``compaction`` input item, an Anthropic ``compaction``
  content block) is opaque state the provider wrote: it stands for everything before it, which
  is no longer in the provider's context. The format readers mark the history message holding
  one (:data:`~.model.NATIVE` = ``"compaction"``). :func:`head` extends the never-compacted
  head through the newest such message (and the tool results answering its calls, so a unit is
  never split): ctxproxy's compaction may only summarize what comes after it.
  :func:`in_context` is what the threshold counts: the leading system block and everything from
  the newest compaction message on;
* a request that asks the provider to **compact** (Codex's ``compaction_trigger`` item, a
  Responses ``context_management`` compaction entry, an Anthropic ``compact_*`` edit) gets no
  new summary from ctxproxy (:attr:`Native.compacts`): the provider summarizes, one summary;
* a request whose provider **clears old tool results** itself (Anthropic ``clear_tool_uses_*``)
  gets no stage-2 ageing (:attr:`Native.clears_tool_results`); stage 1 still cuts a huge
  output on arrival.

Everything else (``clear_thinking_*``, unknown edits and items) changes nothing here: it is
forwarded as the client wrote it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from proxy.history.turns import leading_system_count, units
from proxy.model import NATIVE, Message, RequestView

__all__ = ["COMPACTION", "Native", "head", "in_context", "native", "newest_compaction",
           "opaque_tokens"]

COMPACTION: Final = "compaction"  # the NATIVE mark of a message holding a compaction item
COMPACTION_TRIGGER: Final = "compaction_trigger"
# An encrypted item is base64: 3 bytes of ciphertext per 4 characters. What the provider expands
# it to is unknown; counted as that much plain text at ~4 bytes a token (the counter's fallback).
_BASE64_BYTES: Final = 3 / 4
_BYTES_PER_TOKEN: Final = 4


@dataclass(frozen=True, slots=True)
class Native:
    """What the client asked the provider to do itself, for this request."""

    compacts: bool = False  # the provider compacts (now or at its own threshold)
    clears_tool_results: bool = False  # the provider clears old tool results itself


def opaque_tokens(item: Mapping[str, Any]) -> int:
    """The tokens an opaque item (``encrypted_content``) is counted as."""
    blob = item.get("encrypted_content")
    if not isinstance(blob, str):
        return 0
    return int(len(blob) * _BASE64_BYTES / _BYTES_PER_TOKEN)


def is_compaction(message: Message) -> bool:
    return message.get(NATIVE) == COMPACTION


def newest_compaction(messages: Sequence[Message]) -> int | None:
    for i in range(len(messages) - 1, -1, -1):
        if is_compaction(messages[i]):
            return i
    return None


def head(messages: Sequence[Message]) -> int:
    """The messages never compacted: the leading system block, and through the unit holding
    the newest compaction item when there is one."""
    lead = leading_system_count(messages)
    k = newest_compaction(messages)
    if k is None or k < lead:
        return lead
    for begin, end in units(messages, k):
        if begin <= k < end:
            return end
    return k + 1  # unreachable: the units cover messages[k:]


def in_context(messages: Sequence[Message]) -> Sequence[Message]:
    """What the provider reads of ``messages``: what precedes the newest compaction item (past
    the leading system block, which the provider always reads) is replaced by it."""
    k = newest_compaction(messages)
    lead = leading_system_count(messages)
    if k is None or k <= lead:
        return messages
    return [*messages[:lead], *messages[k:]]


def native(request: RequestView) -> Native:
    body = request.body
    if request.api == "responses":
        given = body.get("input")
        trigger = isinstance(given, list) and any(
            isinstance(item, dict) and item.get("type") == COMPACTION_TRIGGER for item in given
        )
        compacts = trigger or any(_kind(e) == COMPACTION for e in _entries(body))
        return Native(compacts=compacts)
    if request.api == "messages":
        kinds = [_kind(e) for e in _entries(body)]
        return Native(
            compacts=any(k.startswith("compact") for k in kinds),
            clears_tool_results=any(k.startswith("clear_tool_uses") for k in kinds),
        )
    return Native()


def _entries(body: Mapping[str, Any]) -> list[Any]:
    """The ``context_management`` entries: Anthropic's ``{"edits": [...]}``, the Responses
    API's list (a lone entry object read as one)."""
    found = body.get("context_management")
    if isinstance(found, list):
        return found
    if isinstance(found, dict):
        edits = found.get("edits")
        return edits if isinstance(edits, list) else [found]
    return []


def _kind(entry: Any) -> str:
    kind = entry.get("type") if isinstance(entry, dict) else None
    return kind if isinstance(kind, str) else ""

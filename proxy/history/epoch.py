"""Epochs: a session's forwarded history is append-only between two rewrites (pure, no I/O).

Every byte the proxy rewrites after it was forwarded (stage-2 ageing, a new summary, a memory
version, the read tool, a cache marker) is rewritten at a compaction, all at once; between two
compactions each request forwards the previous one's messages unchanged plus what is new. The
span between two compactions is an *epoch*; it starts with the request that made the compaction
(``SummaryRecord.seen`` messages long).

Providers with *preserved thinking* (Anthropic's newest models) bind every signed ``thinking`` /
``redacted_thinking`` block to its prefix (``system``, ``tools``, every earlier message): a block
whose prefix changed after it was produced, and every later one, fails the request. A compaction
changes the prefix of every turn it keeps, so at an epoch's start the thinking blocks of the kept
turns that were produced before it are removed, whole (every such block of a message: never one
between others, which the check also refuses). Turns produced during the epoch were produced
after the new prefix and keep theirs: their prefix is, by the epoch rule, unchanged.

Which messages lose their thinking is a pure function of the history and the summary in use, so
every request of the epoch (on any replica) forwards the same bytes for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from proxy.model import Message

__all__ = [
    "SIGNED",
    "THINKING_DROPPED",
    "ageing_epoch",
    "drop_thinking",
    "has_signed",
    "without_thinking",
]

# On an assistant message read from a Messages body: how many signed (thinking or
# redacted_thinking) blocks it holds. The format's writer needs nothing else to rebuild it.
SIGNED: Final = "signed_blocks"
# Set on the copy of an assistant message whose signed blocks must not be forwarded: the index
# of the history message it copies (the format's writer rebuilds it from that one's blocks).
THINKING_DROPPED: Final = "thinking_dropped"


def has_signed(message: Message) -> bool:
    return message.get("role") == "assistant" and bool(message.get(SIGNED))


def without_thinking(message: Message, index: int) -> Message:
    """History message ``index`` without its signed blocks (and the reasoning they stood for)."""
    out = {k: v for k, v in message.items() if k not in (SIGNED, "reasoning_content")}
    out[THINKING_DROPPED] = index
    return out


def drop_thinking(
    messages: list[Message], history: Sequence[Message], before: int, after: int = 0
) -> list[Message]:
    """``messages`` with the signed blocks removed from every history message at index
    ``after <= k < before`` (the turns produced before the epoch began that it keeps); the
    very list when nothing changes."""
    if before <= after:
        return messages
    index = {id(m): k for k, m in enumerate(history)}
    out: list[Message] | None = None
    for i, m in enumerate(messages):
        k = index.get(id(m))
        if k is None or not (after <= k < before) or not has_signed(m):
            continue
        if out is None:
            out = list(messages)
        out[i] = without_thinking(m, k)
    return out if out is not None else messages


def ageing_epoch(history: Sequence[Message], aged_turns: int, recent_n: int) -> int:
    """Where stage 2 without compaction began its epoch: the first ``aged_turns`` tool-call
    turns are re-cut since the turn that aged the last of them arrived (``aged_turns +
    recent_n - 1``, see :func:`proxy.pipeline.ageing.aged_upto`); the messages up to that
    turn's assistant message were produced before the rewrite."""
    if aged_turns <= 0:
        return 0
    trigger = aged_turns + recent_n - 1
    turn = -1
    for i, m in enumerate(history):
        if m.get("role") == "assistant" and (m.get("tool_calls") or m.get("function_call")):
            turn += 1
            if turn == trigger:
                return i + 1
    return len(history)

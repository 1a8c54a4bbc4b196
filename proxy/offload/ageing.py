"""Which tool results have aged, as a pure function of the history.

Stage 2 of the offload (docs/offload.md#stage-2-on-ageing).

A *tool-call turn* is an assistant message with `tool_calls` (or a legacy `function_call`) plus
the results answering it; parallel results belong to their turn and age together. The newest
`recent_n` turns are recent; older ones have aged.

With the `batched` policy the aged turns are not re-cut one by one as they age (that would
change the forwarded prefix every turn and discard the provider's prompt cache each time).
Instead a watermark W moves over the turns: replaying the history turn by turn, W jumps to the
current ageing boundary only when re-cutting every aged-but-not-yet-re-cut turn saves at least
`batch_bytes`. Turns up to W are re-cut. Because W is computed from the history alone, the same
history always gets the same answer, and a longer history's W is never behind a shorter one's:
the forwarded prefix changes only when W jumps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from proxy.model import Message


def tool_turns(messages: Sequence[Message]) -> tuple[dict[int, int], int]:
    """Map each tool/function result's index to its turn number; also return the turn count.

    A result belongs to the turn of the assistant message holding its `tool_call_id`; a result
    whose call cannot be found (orphan) joins the nearest preceding turn.
    """
    call_turn: dict[str, int] = {}
    turn_of: dict[int, int] = {}
    turn = -1
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "assistant" and (m.get("tool_calls") or m.get("function_call")):
            turn += 1
            for call in m.get("tool_calls") or ():
                if isinstance(call, dict) and isinstance(call.get("id"), str):
                    call_turn[call["id"]] = turn
        elif role in ("tool", "function"):
            tid = m.get("tool_call_id")
            t = call_turn.get(tid, turn) if isinstance(tid, str) else turn
            turn_of[i] = max(t, 0)
    return turn_of, turn + 1


def aged_upto(
    turn_count: int,
    recent_n: int,
    savings: Callable[[int], int],
    *,
    batched: bool,
    batch_bytes: int,
) -> int:
    """Number of leading turns whose results are re-cut (turns `0 .. result-1`).

    `savings(t)` is how many bytes re-cutting turn t's results would save.
    """
    boundary = max(turn_count - recent_n, 0)
    if not batched:
        return boundary
    watermark = 0
    pending = 0
    # Replay: after turn j arrives, turns < j + 1 - recent_n are aged.
    for aged in range(1, boundary + 1):
        pending += savings(aged - 1)
        if pending >= batch_bytes:
            watermark = aged
            pending = 0
    return watermark


def aged_at(history: Sequence[Message], seen: int, recent_n: int) -> int:
    """The watermark of stage 2 timed to a compaction made when the history held ``seen``
    messages: every turn that had aged by then is re-cut, at the same moment the summary
    changed the prefix anyway (so the prefix breaks once per compaction, not twice)."""
    if seen <= 0:
        return 0
    _, turns_then = tool_turns(history[:seen])
    return max(turns_then - recent_n, 0)

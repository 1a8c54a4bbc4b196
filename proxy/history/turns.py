"""Turn grouping and the compaction split (docs/compaction.md#split): pure, no I/O.

Token counts come from the caller (``count``); this module never counts itself.

Units. Messages after the leading system/developer block are grouped into atomic units:

* an ``assistant`` message that opens results (a non-empty ``tool_calls`` list and/or a
  ``function_call``) together with every ``tool``/``function`` message that directly follows it,
  up to the next message of any other role. Results may come in any order; they are grouped by
  position, not by id, so a unit is never split even when the input is malformed (pairing by id is
  the validator's job, :mod:`proxy.pipeline.validate`);
* every other message is a unit of its own (user, plain assistant, a system/developer message in
  the middle of the conversation, a stray tool message that follows no call).

Consequence used by :func:`split`: every ``assistant`` message starts a unit and a ``tool`` or
``function`` message never starts one (unless it is stray), so "the kept suffix starts at a user
message or at a whole assistant turn" is the same as "the kept suffix starts at a message whose
role is ``user`` or ``assistant``". Those indices are the *boundaries*.

Split rules, exactly (``head = leading_system_count(messages)`` unless the caller gives a longer
one, ``n = len(messages)``):

1. ``count`` is called once per message in ``messages[head:]`` (never for the leading block) and
   must return a non-negative int.
2. If ``sum(count(m) for m in messages[head:]) <= keep_budget`` there is nothing to evict: ``None``.
3. The *budget window* is the longest suffix ``messages[e:]`` (``e >= head``) whose token sum is
   ``<= keep_budget``.
4. If the window holds a ``user`` message (and ``prefer_user``, the default), ``cut`` is the
   earliest ``user`` message in the window: the kept part starts with a user request even if that
   keeps less than the budget would allow. Otherwise ``cut`` is the earliest boundary in the window
   (with ``prefer_user`` this is an assistant unit start). ``over_budget`` is False and
   ``kept_tokens <= keep_budget``.
5. If the window holds no boundary (the newest unit alone, or the run of messages after the last
   boundary, exceeds the budget), ``over_budget`` is True and ``cut`` is, with
   ``over_budget_keep="turn"`` (default), the last ``user`` message, or the last assistant unit
   start when there is no user message after ``head``; with ``over_budget_keep="unit"`` it is the
   last boundary of either kind (the smallest valid suffix, for a caller's harder re-cut).
   If there is no boundary at all after ``head`` the result is ``None``.
6. If ``cut <= head`` the result is ``None`` (only possible in case 5).
7. ``evicted_tokens`` is the sum over ``messages[head:cut]``, ``kept_tokens`` over
   ``messages[cut:]``; the leading block is in neither.

Because a cut is always a boundary and results always directly follow their call, a valid history
stays valid as ``messages[:head] + [summary] + messages[cut:]``; this also covers the agent loop
being mid-turn (last message a tool result): the open tool-call unit is kept whole, and the turn's
user message is kept too whenever it fits the window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from proxy.model import Message

__all__ = ["LEADING_ROLES", "RESULT_ROLES", "Split", "leading_system_count", "split", "units"]

LEADING_ROLES = frozenset({"system", "developer"})
RESULT_ROLES = frozenset({"tool", "function"})


@dataclass(frozen=True, slots=True)
class Split:
    """Evict ``messages[head:cut]``, keep ``messages[:head]`` and ``messages[cut:]``."""

    head: int
    cut: int
    evicted_tokens: int
    kept_tokens: int
    over_budget: bool = False


def leading_system_count(messages: Sequence[Message]) -> int:
    """Number of leading system/developer messages (the block that is never compacted)."""
    i = 0
    for message in messages:
        if message.get("role") not in LEADING_ROLES:
            break
        i += 1
    return i


def _opens_results(message: Message) -> bool:
    # An empty tool_calls list opens nothing (and is repaired by the validator); function_call is
    # the legacy single-call form.
    return message.get("role") == "assistant" and (
        bool(message.get("tool_calls")) or message.get("function_call") is not None
    )


def units(messages: Sequence[Message], start: int = 0) -> list[tuple[int, int]]:
    """The atomic units of ``messages[start:]`` as half-open ``(begin, end)`` index ranges.

    The ranges are contiguous and cover ``start..len(messages)`` exactly.
    """
    n = len(messages)
    out: list[tuple[int, int]] = []
    i = max(start, 0)
    while i < n:
        j = i + 1
        if _opens_results(messages[i]):
            while j < n and messages[j].get("role") in RESULT_ROLES:
                j += 1
        out.append((i, j))
        i = j
    return out


def split(
    messages: Sequence[Message],
    count: Callable[[Message], int],
    keep_budget: int,
    *,
    prefer_user: bool = True,
    over_budget_keep: Literal["turn", "unit"] = "turn",
    head: int | None = None,
) -> Split | None:
    """Choose the kept suffix; see the module docstring for the exact rules. O(n).
    ``head``: the untouchable head when it is longer than the leading system block (a
    provider's compaction item, :func:`proxy.pipeline.native.head`); must end at a unit."""
    n = len(messages)
    head = leading_system_count(messages) if head is None else head
    if head >= n:
        return None
    counts: list[int] = []
    for i in range(head, n):
        c = count(messages[i])
        if c < 0:
            raise ValueError(f"count() returned {c} for message {i}")
        counts.append(c)
    total = sum(counts)
    if total <= keep_budget:
        return None

    # One backward pass: the window is a suffix, and suffix sums only grow going back (counts are
    # non-negative), so the first message that overflows closes it for good.
    suffix = 0
    in_window = True
    first_user = first_asst = -1  # earliest boundaries inside the window
    last_user = last_asst = -1  # latest boundaries overall (fallback for rule 5)
    for i in range(n - 1, head - 1, -1):
        if in_window:
            suffix += counts[i - head]
            in_window = suffix <= keep_budget
        role = messages[i].get("role")
        if role == "user":
            if in_window:
                first_user = i
            if last_user < 0:
                last_user = i
        elif role == "assistant":
            if in_window:
                first_asst = i
            if last_asst < 0:
                last_asst = i
        if not in_window and last_user >= 0 and last_asst >= 0:
            break  # nothing earlier can change the decision

    over_budget = False
    if first_user >= 0 and (prefer_user or first_asst < 0):
        cut = first_user
    elif first_asst >= 0:
        cut = first_asst if first_user < 0 else min(first_user, first_asst)
    else:
        over_budget = True
        if over_budget_keep == "turn":
            cut = last_user if last_user >= 0 else last_asst
        else:
            cut = max(last_user, last_asst)
        if cut < 0:
            return None  # no user or assistant message to start a kept part at
    if cut <= head:
        return None
    kept = sum(counts[cut - head :])
    return Split(head, cut, total - kept, kept, over_budget)

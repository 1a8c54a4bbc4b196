"""Turn grouping and the compaction split (proxy.history.turns)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.history.turns import Split, leading_system_count, split, units
from proxy.pipeline.validate import is_valid
from tests.test_validate import asst, calls, conversations, damaged, fcall, fres, res, user

from .conftest import examples

Message = dict[str, Any]
FAST = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
SUMMARY: Message = {"role": "system", "content": "# Summary of previous conversation"}


def count(m: Message) -> int:
    """A stand-in token count: overhead, text, and tool-call arguments."""
    n = 3 + len(m.get("content") or "")
    for c in m.get("tool_calls") or []:
        if isinstance(c, dict) and "function" in c:  # damaged histories hold junk calls
            n += len(c["function"]["arguments"])
    if m.get("function_call"):
        n += len(m["function_call"]["arguments"])
    return n


def sys(text: str = "s") -> Message:
    return {"role": "system", "content": text}


def const(n: int) -> Any:
    return lambda m: n


def oracle(
    msgs: list[Message], budget: int, prefer_user: bool = True, keep: str = "turn"
) -> Split | None:
    """The rules of the module docstring, by brute force (O(n^2))."""
    head = leading_system_count(msgs)
    tokens = [count(m) for m in msgs]

    def suffix(i: int) -> int:
        return sum(tokens[i:])

    if suffix(head) <= budget:
        return None
    bounds = [i for i in range(head, len(msgs)) if msgs[i]["role"] in ("user", "assistant")]
    fitting = [i for i in bounds if suffix(i) <= budget]
    users = [i for i in fitting if msgs[i]["role"] == "user"]
    over = False
    if prefer_user and users:
        cut = users[0]
    elif fitting:
        cut = fitting[0]
    else:
        over = True
        if not bounds:
            return None
        last_users = [i for i in bounds if msgs[i]["role"] == "user"]
        cut = last_users[-1] if keep == "turn" and last_users else bounds[-1]
    if cut <= head:
        return None
    return Split(head, cut, suffix(head) - suffix(cut), suffix(cut), over)


def unit_starts(msgs: list[Message]) -> set[int]:
    return {b for b, _ in units(msgs, leading_system_count(msgs))}


# --- properties --------------------------------------------------------------------------------


@st.composite
def with_budget(
    draw: st.DrawFn, histories: st.SearchStrategy[list[Message]]
) -> tuple[list[Message], int]:
    msgs = draw(histories)
    total = sum(count(m) for m in msgs[leading_system_count(msgs) :])
    return msgs, draw(st.integers(0, total + 5))


@FAST
@given(with_budget(conversations()), st.booleans(), st.sampled_from(["turn", "unit"]))
def test_split_properties_on_valid_histories(
    case: tuple[list[Message], int], prefer_user: bool, keep: str
) -> None:
    msgs, budget = case
    s = split(msgs, count, budget, prefer_user=prefer_user, over_budget_keep=keep)  # type: ignore[arg-type]
    assert s == oracle(msgs, budget, prefer_user, keep)
    head = leading_system_count(msgs)
    if s is None:
        return
    assert s.head == head < s.cut < len(msgs)
    # (d) the compacted request is still valid.
    assert is_valid(msgs[:head] + [SUMMARY] + msgs[s.cut :])
    # (f) it starts at a user message or a whole assistant unit, never inside a unit.
    assert msgs[s.cut]["role"] in ("user", "assistant")
    assert s.cut in unit_starts(msgs)
    # (e) within budget unless reported otherwise.
    assert s.kept_tokens == sum(count(m) for m in msgs[s.cut :])
    assert s.evicted_tokens == sum(count(m) for m in msgs[head : s.cut])
    if not s.over_budget:
        assert s.kept_tokens <= budget
        # (g) maximal: every earlier boundary of the kind chosen would exceed the budget; and a
        # user start is taken whenever one fits.
        kinds = (
            ("user",) if msgs[s.cut]["role"] == "user" and prefer_user else ("user", "assistant")
        )
        for b in range(head, s.cut):
            if msgs[b]["role"] in kinds:
                assert sum(count(m) for m in msgs[b:]) > budget
        if prefer_user and msgs[s.cut]["role"] == "assistant":
            assert all(m["role"] != "user" for m in msgs[s.cut :])
    else:
        assert all(
            sum(count(m) for m in msgs[b:]) > budget
            for b in range(head, len(msgs))
            if msgs[b]["role"] in ("user", "assistant")
        )


@FAST
@given(with_budget(damaged()))
def test_split_never_starts_inside_a_unit_even_on_broken_histories(
    case: tuple[list[Message], int],
) -> None:
    msgs, budget = case
    s = split(msgs, count, budget)
    assert s == oracle(msgs, budget)
    if s is not None:
        assert s.cut in unit_starts(msgs)
        assert msgs[s.cut]["role"] in ("user", "assistant")
        assert not any(b < s.cut < e for b, e in units(msgs))


@FAST
@given(damaged())
def test_units_partition_the_list(msgs: list[Message]) -> None:
    head = leading_system_count(msgs)
    us = units(msgs, head)
    assert [b for b, _ in us] == ([head] + [e for _, e in us[:-1]] if us else [])
    assert (us[-1][1] if us else head) == len(msgs)
    for b, e in us:
        if e - b > 1:
            assert msgs[b]["role"] == "assistant"
            assert all(m["role"] in ("tool", "function") for m in msgs[b + 1 : e])
        # A call's unit runs to the end of its result run.
        if e < len(msgs) and (e - b > 1 or msgs[b].get("tool_calls")):
            assert msgs[e]["role"] not in ("tool", "function")
        # Every assistant message starts a unit (what split relies on).
        assert all(m["role"] != "assistant" for m in msgs[b + 1 : e])


# --- rules, by example -------------------------------------------------------------------------


def test_leading_system_count() -> None:
    assert leading_system_count([]) == 0
    assert leading_system_count([sys(), {"role": "developer", "content": "d"}, user(), sys()]) == 2
    assert leading_system_count([user(), sys()]) == 0


def test_units_group_calls_with_their_results() -> None:
    msgs = [
        sys(),
        user(),
        calls("a", "b"),
        res("b"),
        res("a"),
        asst(),
        fcall(),
        fres(),
        sys(),
        res("z"),
        user(),
    ]
    assert units(msgs, 1) == [(1, 2), (2, 5), (5, 6), (6, 8), (8, 9), (9, 10), (10, 11)]
    assert units(msgs) == [(0, 1)] + units(msgs, 1)
    assert units(msgs, 3) == [(3, 4), (4, 5), (5, 6), (6, 8), (8, 9), (9, 10), (10, 11)]
    assert units([], 0) == []


def test_nothing_to_evict() -> None:
    msgs = [sys(), user(), asst()]
    assert split(msgs, const(10), 20) is None  # everything fits
    assert split([sys(), sys()], const(10), 0) is None  # nothing but the leading block
    assert split([], const(1), 0) is None
    # Over budget, but the only turn starts right after the head: nothing can go.
    assert split([sys(), user(), calls("a"), res("a")], const(10), 5) is None


def test_keeps_newest_messages_from_a_user_message() -> None:
    msgs = [sys(), user(), asst(), user(), asst(), user(), asst()]
    assert split(msgs, const(10), 40) == Split(1, 3, 20, 40)
    assert split(msgs, const(10), 39) == Split(1, 5, 40, 20)


def test_prefers_a_user_start_over_a_larger_assistant_start() -> None:
    msgs = [user(), asst(), asst(), asst(), user(), asst()]
    assert split(msgs, const(10), 45) == Split(0, 4, 40, 20)
    assert split(msgs, const(10), 45, prefer_user=False) == Split(0, 2, 20, 40)


def test_assistant_unit_start_when_no_user_fits() -> None:
    # One long agentic turn: the user request is too far back, so the kept part begins at the
    # earliest whole tool-call unit that fits.
    msgs = [user(), calls("a"), res("a"), calls("b"), res("b"), calls("c"), res("c")]
    assert split(msgs, const(10), 45) == Split(0, 3, 30, 40)
    # Shrinking the budget never cuts between a call and its result.
    assert split(msgs, const(10), 35) == Split(0, 5, 50, 20)


def test_mid_turn_keeps_the_whole_turn_from_its_user_message_when_it_fits() -> None:
    msgs = [user(), asst(), user(), calls("a", "b"), res("a"), res("b"), calls("c"), res("c")]
    assert split(msgs, const(10), 60) == Split(0, 2, 20, 60)


def test_never_starts_at_a_tool_message() -> None:
    msgs = [user(), asst(), calls("a", "b", "c"), res("a"), res("b"), res("c")]
    # The window holds only the results; the newest unit (40 tokens) exceeds 25.
    # With "turn" the fallback is the last user message, which is at head: nothing to evict.
    assert split(msgs, const(10), 25) is None
    assert split(msgs, const(10), 25, over_budget_keep="unit") == Split(0, 2, 20, 40, True)


def test_over_budget_keeps_the_newest_turn() -> None:
    big = {"role": "tool", "tool_call_id": "b", "content": "x" * 1000}
    msgs = [sys(), user("old"), asst(), user("now"), calls("a"), res("a"), calls("b"), big]
    s = split(msgs, count, 100)
    assert s is not None and s.over_budget and s.cut == 3
    assert s.kept_tokens > 100
    s = split(msgs, count, 100, over_budget_keep="unit")
    assert s is not None and s.over_budget and s.cut == 6


def test_over_budget_last_message_is_a_huge_user_message() -> None:
    msgs = [user(), asst(), user("x" * 500)]
    assert split(msgs, count, 50) == Split(0, 2, 8, 503, True)


def test_no_user_messages() -> None:
    msgs = [sys(), asst(), calls("a"), res("a"), asst(), calls("b"), res("b")]
    assert split(msgs, const(10), 30) == Split(1, 4, 30, 30)
    assert split(msgs, const(10), 15) == Split(1, 5, 40, 20, True)


def test_system_messages_in_the_middle_may_be_evicted_but_never_start_the_kept_part() -> None:
    msgs = [sys(), user(), asst(), sys("mid"), asst(), user(), asst()]
    assert split(msgs, const(10), 30) == Split(1, 5, 40, 20)
    msgs = [sys(), asst(), asst(), sys("mid"), asst()]
    assert split(msgs, const(10), 20) == Split(1, 4, 30, 10)
    # A trailing system message that fits is not a boundary: fall back to the last unit.
    msgs = [sys(), user(), asst("x" * 100), sys("late")]
    s = split(msgs, count, 10)
    assert s is None  # the last user is right after the head
    s = split(msgs, count, 10, over_budget_keep="unit")
    assert s == Split(1, 2, 4, 103 + 7, True)


def test_legacy_function_call_is_kept_with_its_result() -> None:
    msgs = [user(), asst(), fcall(), fres(), asst()]
    assert split(msgs, const(10), 25) == Split(0, 4, 40, 10)
    assert split(msgs, const(10), 30) == Split(0, 2, 20, 30)


def test_counts_each_message_once_and_never_the_leading_block() -> None:
    seen: list[int] = []
    msgs = [sys(), user(), asst(), user(), asst()]

    def counting(m: Message) -> int:
        seen.append(id(m))
        return 10

    split(msgs, counting, 20)
    assert sorted(seen) == sorted(id(m) for m in msgs[1:])


def test_negative_count_is_rejected() -> None:
    with pytest.raises(ValueError):
        split([user(), asst()], const(-1), 0)

"""Pairing validator/repair (proxy.pipeline.validate), with the conversation generators that
tests/test_turns.py reuses."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.pipeline.validate import PLACEHOLDER, Validation, is_valid, validate

from .conftest import examples

Message = dict[str, Any]
FAST = settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])

RESULT_ROLES = ("tool", "function")


# --- generators --------------------------------------------------------------------------------


def _text(draw: st.DrawFn, tag: str) -> str:
    # Sizes vary so that token budgets in test_turns land on every kind of boundary.
    return tag + "." * draw(st.integers(0, 40))


@st.composite
def conversations(draw: st.DrawFn) -> list[Message]:
    """A valid history: leading system/developer messages, then turns of a user message (sometimes
    missing) and assistant steps: plain text, 1-4 parallel tool calls with shuffled results,
    a legacy function call, or a system message in the middle. Call ids are sometimes reused in
    every turn, as some servers do."""
    msgs: list[Message] = []
    for _ in range(draw(st.integers(0, 2))):
        role = draw(st.sampled_from(["system", "developer"]))
        msgs.append({"role": role, "content": _text(draw, role)})
    reuse_ids = draw(st.booleans())
    users = draw(st.sampled_from(["always", "always", "sometimes", "never"]))
    serial = 0
    for turn in range(draw(st.integers(0, 6))):
        if users == "always" or (users == "sometimes" and draw(st.booleans())):
            msgs.append({"role": "user", "content": _text(draw, f"user{turn}")})
        for step in range(draw(st.integers(0, 4))):
            kind = draw(st.sampled_from(["text", "tools", "tools", "tools", "function", "system"]))
            if kind == "text":
                msgs.append({"role": "assistant", "content": _text(draw, "answer")})
            elif kind == "system":
                msgs.append({"role": "system", "content": _text(draw, "note")})
            elif kind == "function":
                msgs.append(
                    {
                        "role": "assistant",
                        "content": None,
                        "function_call": {"name": "f", "arguments": _text(draw, "{}")},
                    }
                )
                msgs.append({"role": "function", "name": "f", "content": _text(draw, "fres")})
            else:
                ids = []
                for j in range(draw(st.integers(1, 4))):
                    serial += 1
                    ids.append(f"call_{j}" if reuse_ids else f"call_{serial}")
                msgs.append(
                    {
                        "role": "assistant",
                        "content": draw(st.sampled_from([None, "", "calling"])),
                        "tool_calls": [
                            {
                                "id": i,
                                "type": "function",
                                "function": {"name": "t", "arguments": _text(draw, "{}")},
                            }
                            for i in ids
                        ],
                    }
                )
                results = [
                    {"role": "tool", "tool_call_id": i, "content": _text(draw, f"res-{i}-{step}")}
                    for i in ids
                ]
                msgs.extend(draw(st.permutations(results)))
    return msgs


@st.composite
def damaged(draw: st.DrawFn) -> list[Message]:
    """A history broken the ways compaction, client edits and buggy clients break them: deleted
    messages (orphans, unanswered calls), duplicated or moved results, empty or malformed
    tool_calls, a tool message that answers nothing."""
    msgs = list(draw(conversations()))
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["del", "del", "del", "dup", "move", "empty", "junk", "stray"]),
                st.integers(0, 10**6),
                st.integers(0, 10**6),
            ),
            min_size=1,
            max_size=6,
        )
    )
    for op, a, b in ops:
        if not msgs and op != "stray":
            continue
        i = a % max(len(msgs), 1)
        if op == "del":
            del msgs[i]
        elif op == "dup":
            msgs.insert(b % (len(msgs) + 1), copy.deepcopy(msgs[i]))
        elif op == "move":
            m = msgs.pop(i)
            msgs.insert(b % (len(msgs) + 1), m)
        elif op == "empty" and msgs[i].get("tool_calls"):
            msgs[i] = {**msgs[i], "tool_calls": []}
        elif op == "junk" and msgs[i].get("tool_calls"):
            msgs[i] = {**msgs[i], "tool_calls": [*msgs[i]["tool_calls"], {"type": "function"}]}
        elif op == "stray":
            msgs.insert(
                a % (len(msgs) + 1), {"role": "tool", "tool_call_id": f"x{b}", "content": "?"}
            )
    return msgs


# --- helpers -----------------------------------------------------------------------------------


def user(text: str = "u") -> Message:
    return {"role": "user", "content": text}


def asst(text: str = "a") -> Message:
    return {"role": "assistant", "content": text}


def calls(*ids: str) -> Message:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "t", "arguments": "{}"}} for i in ids
        ],
    }


def res(call_id: str, text: str = "r") -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def fcall(name: str = "f") -> Message:
    return {
        "role": "assistant",
        "content": None,
        "function_call": {"name": name, "arguments": "{}"},
    }


def fres(name: str = "f") -> Message:
    return {"role": "function", "name": name, "content": "fr"}


def placeholder(call_id: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": PLACEHOLDER}


# --- properties --------------------------------------------------------------------------------


@FAST
@given(conversations())
def test_generated_histories_are_valid_and_returned_as_is(msgs: list[Message]) -> None:
    assert is_valid(msgs)
    v = validate(msgs)
    assert v.messages is msgs
    assert v == Validation(msgs, (), False)


@FAST
@given(damaged())
def test_repair_is_valid_idempotent_and_minimal(msgs: list[Message]) -> None:
    before = copy.deepcopy(msgs)
    v = validate(msgs)
    assert msgs == before, "input mutated"
    assert is_valid(v.messages)
    assert v.changed == bool(v.repairs) == (not is_valid(msgs))
    again = validate(v.messages)
    assert again.messages is v.messages and not again.changed

    # Non-result messages all survive, in order; only assistants may be (shallow-)copied, and
    # only their tool_calls/content may differ.
    kept = [m for m in v.messages if m.get("role") not in RESULT_ROLES]
    orig = [m for m in msgs if m.get("role") not in RESULT_ROLES]
    assert len(kept) == len(orig)
    for k, o in zip(kept, orig, strict=True):
        if k is not o:
            assert o["role"] == "assistant"
            rest = {key: val for key, val in k.items() if key not in ("tool_calls", "content")}
            assert rest == {
                key: val for key, val in o.items() if key not in ("tool_calls", "content")
            }
    # Results are either the input's own objects, in input order, or placeholders.
    ids = {id(m) for m in msgs}
    real = [m for m in v.messages if m.get("role") in RESULT_ROLES and id(m) in ids]
    positions = [next(i for i, o in enumerate(msgs) if o is m) for m in real]
    assert positions == sorted(positions)
    for m in v.messages:
        if m.get("role") in RESULT_ROLES and id(m) not in ids:
            assert m["content"] == PLACEHOLDER


@FAST
@given(damaged())
def test_repair_keeps_every_valid_pair(msgs: list[Message]) -> None:
    # A result is dropped only when it is an orphan; so applying the repair to the repaired list's
    # real results changes nothing and the number of dropped results matches the notes.
    v = validate(msgs)
    dropped = sum(
        1
        for r in v.repairs
        if r.startswith("dropped tool result") or r.startswith("dropped function")
    )
    real_in = sum(1 for m in msgs if m.get("role") in RESULT_ROLES)
    real_out = sum(
        1 for m in v.messages if m.get("role") in RESULT_ROLES and m.get("content") != PLACEHOLDER
    )
    assert real_in - real_out == dropped
    inserted = sum(1 for r in v.repairs if r.startswith("inserted"))
    assert inserted == sum(1 for m in v.messages if m.get("content") == PLACEHOLDER)


# --- rules, by example -------------------------------------------------------------------------


def test_parallel_results_in_any_order_are_valid() -> None:
    msgs = [user(), calls("a", "b", "c"), res("c"), res("a"), res("b"), asst()]
    assert is_valid(msgs)


def test_empty_and_trivial_lists() -> None:
    assert is_valid([])
    assert is_valid([{"role": "system", "content": "s"}, user(), asst()])
    assert is_valid([asst(), {"role": "assistant", "content": "x", "tool_calls": None}])


def test_orphan_tool_result_is_dropped() -> None:
    msgs = [user(), res("gone"), asst()]
    v = validate(msgs)
    assert v.messages == [user(), asst()]
    assert v.changed and "dropped tool result 1" in v.repairs[0]


def test_result_after_another_message_is_an_orphan_and_its_call_gets_a_placeholder() -> None:
    msgs = [user(), calls("a"), user("again"), res("a")]
    v = validate(msgs)
    assert v.messages == [user(), calls("a"), placeholder("a"), user("again")]
    assert len(v.repairs) == 2


def test_unanswered_call_gets_placeholder_after_existing_results_in_call_order() -> None:
    msgs = [user(), calls("a", "b", "c"), res("b"), asst()]
    v = validate(msgs)
    assert v.messages == [
        user(),
        calls("a", "b", "c"),
        res("b"),
        placeholder("a"),
        placeholder("c"),
        asst(),
    ]
    assert all("inserted a placeholder" in r for r in v.repairs)


def test_trailing_unanswered_call_is_repaired_too() -> None:
    msgs = [user(), calls("a")]
    assert not is_valid(msgs)
    assert validate(msgs).messages == [user(), calls("a"), placeholder("a")]


def test_duplicate_result_keeps_the_first() -> None:
    first, second = res("a", "first"), res("a", "second")
    v = validate([user(), calls("a"), first, second])
    assert v.messages == [user(), calls("a"), first]
    assert v.messages[2] is first


def test_ids_reused_in_later_turns_are_matched_within_their_block() -> None:
    msgs = [user(), calls("call_0"), res("call_0"), user(), calls("call_0"), res("call_0")]
    assert is_valid(msgs)
    # A result answering the *previous* block's id is not accepted in the next block.
    bad = [user(), calls("a"), res("a"), calls("b"), res("a")]
    v = validate(bad)
    assert v.messages == [user(), calls("a"), res("a"), calls("b"), placeholder("b")]


def test_id_repeated_within_one_message_needs_one_result_per_occurrence() -> None:
    msgs = [user(), calls("x", "x"), res("x")]
    assert not is_valid(msgs)
    assert validate(msgs).messages == [user(), calls("x", "x"), res("x"), placeholder("x")]
    assert is_valid([user(), calls("x", "x"), res("x"), res("x")])


def test_empty_tool_calls_is_removed_and_content_made_a_string() -> None:
    msg: Message = {"role": "assistant", "content": None, "tool_calls": []}
    v = validate([user(), msg])
    assert v.messages == [user(), {"role": "assistant", "content": ""}]
    assert msg == {"role": "assistant", "content": None, "tool_calls": []}  # input untouched
    assert "removed empty tool_calls from message 1" in v.repairs


def test_malformed_call_entries_are_dropped() -> None:
    msg: Message = calls("a")
    msg["tool_calls"].append({"type": "function", "function": {"name": "t"}})
    msg["tool_calls"].append("nonsense")
    v = validate([user(), msg, res("a")])
    assert v.messages == [user(), calls("a"), res("a")]
    assert v.repairs == ("dropped 2 malformed tool call(s) from message 1",)
    not_a_list = {"role": "assistant", "content": "c", "tool_calls": {"id": "a"}}
    v = validate([user(), not_a_list, res("a")])
    assert v.messages == [user(), {"role": "assistant", "content": "c"}]


def test_tool_result_without_id_is_an_orphan() -> None:
    v = validate([user(), calls("a"), {"role": "tool", "content": "r"}, res("a")])
    assert v.messages == [user(), calls("a"), res("a")]


def test_legacy_function_pairing() -> None:
    assert is_valid([user(), fcall(), fres(), asst()])
    assert validate([user(), fres()]).messages == [user()]
    v = validate([user(), fcall("lookup"), asst()])
    assert v.messages == [
        user(),
        fcall("lookup"),
        {"role": "function", "name": "lookup", "content": PLACEHOLDER},
        asst(),
    ]
    # One function_call takes one result.
    assert validate([user(), fcall(), fres(), fres()]).messages == [user(), fcall(), fres()]


def test_tool_result_for_function_call_and_vice_versa_are_orphans() -> None:
    v = validate([user(), fcall(), res("a"), fres()])
    assert v.messages == [user(), fcall(), fres()]
    v = validate([user(), calls("a"), fres(), res("a")])
    assert v.messages == [user(), calls("a"), res("a")]


def test_system_message_inside_a_block_ends_it() -> None:
    sysmsg = {"role": "system", "content": "note"}
    v = validate([user(), calls("a"), sysmsg, res("a")])
    assert v.messages == [user(), calls("a"), placeholder("a"), sysmsg]


def test_unchanged_messages_are_shared_not_copied() -> None:
    msgs = [user(), res("x"), calls("a"), res("a")]
    v = validate(msgs)
    assert v.messages[0] is msgs[0] and v.messages[1] is msgs[2] and v.messages[2] is msgs[3]


# --- the client's own breaks are left alone ----------------------------------------------------


@FAST
@given(damaged())
def test_the_clients_own_list_is_never_repaired(msgs: list[Message]) -> None:
    """Whatever the client's list breaks, the list forwarded is the client's (a copy of the
    list object, as the pipeline hands the validator a new list)."""
    v = validate(list(msgs), msgs)
    assert v.messages == msgs and not v.changed and not v.repairs
    assert all(a is b for a, b in zip(v.messages, msgs, strict=True))


@FAST
@given(conversations(), st.data())
def test_what_the_proxy_broke_in_a_valid_list_is_repaired_as_before(
    msgs: list[Message], data: st.DataObject
) -> None:
    broken = data.draw(damaged_from(msgs))
    assert validate(broken, msgs) == validate(broken)


@st.composite
def damaged_from(draw: st.DrawFn, msgs: list[Message]) -> list[Message]:
    """``msgs`` with messages deleted (what an eviction does)."""
    keep = draw(st.lists(st.booleans(), min_size=len(msgs), max_size=len(msgs)))
    return [m for m, k in zip(msgs, keep, strict=True) if k]


def test_a_client_orphan_stays_while_the_proxys_are_dropped() -> None:
    gone = res("gone")
    sent = [user(), gone, user(), calls("a"), res("a"), asst()]
    evicted = [sent[0], gone, sent[2], sent[4], sent[5]]  # the proxy evicted calls("a")
    v = validate(evicted, sent)
    assert v.messages == [user(), gone, user(), asst()]
    assert v.repairs == ("dropped tool result 3 (tool_call_id 'a'): no pending call",)


def test_a_cut_copy_of_a_client_orphan_is_still_the_clients() -> None:
    """Offload hands the validator a copy of a result with its text cut: the same break."""
    sent = [user(), res("gone", "long output"), calls("a"), res("a")]
    cut = [sent[0], res("gone", "[cut]"), sent[2], sent[3]]
    v = validate(cut, sent)
    assert v.messages is cut and not v.changed


def test_a_call_the_client_left_unanswered_gets_no_placeholder_but_the_proxys_does() -> None:
    sent = [user(), calls("a", "b"), res("a"), asst()]  # the client never answered b
    lost = [sent[0], sent[1], sent[3]]  # and the proxy lost a's result
    v = validate(lost, sent)
    assert v.messages == [user(), calls("a", "b"), placeholder("a"), asst()]
    assert len(v.repairs) == 1


def test_the_clients_malformed_tool_calls_stay() -> None:
    empty: Message = {"role": "assistant", "content": None, "tool_calls": []}
    sent = [user(), empty, res("x")]
    v = validate([*sent], sent)
    assert v.messages == sent and v.messages[1] is empty and not v.changed

"""The prefix-checking fake: Anthropic's "preserved thinking" check (proxy/demo/fake/prefix_check.py)
in process, then served (``FakeUpstream(prefix_check=True)``) to the real anthropic SDK."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from anthropic.types.beta import BetaThinkingDroppedInputTransformation
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.demo.fake.prefix_check import (
    BETA,
    HEADER_REQUIRED_MESSAGE,
    Binder,
    Failure,
    mismatch_message,
)
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.fake.wire import reasoning_of_token, reasoning_token
from proxy.demo.servers import ServerThread, serve_in_thread

from .conftest import examples

EPHEMERAL = {"type": "ephemeral"}
SYSTEM: list[Any] = [{"type": "text", "text": "You read files.", "cache_control": EPHEMERAL}]
TOOLS: list[Any] = [{"name": "Read", "description": "Read a file",
                     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
DROP: dict[str, Any] = {"type": "adaptive",
                        "block_binding": {"prefix_mismatch_behavior": "drop_block"}}


def answer(binder: Binder, body: dict[str, Any], n: int) -> dict[str, Any]:
    """The assistant turn the model gives after ``body``: thinking, text, a Read."""
    thinking = f"next I read f{n}"
    return {"role": "assistant", "content": [
        {"type": "thinking", "thinking": thinking, "signature": binder.sign(body, thinking)},
        {"type": "text", "text": f"Reading f{n}."},
        {"type": "tool_use", "id": f"toolu_{n}", "name": "Read", "input": {"path": f"f{n}"}},
    ]}


def result(n: int) -> dict[str, Any]:
    return {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": f"contents of f{n}"}]}


def conversation(binder: Binder, turns: int) -> dict[str, Any]:
    """An append-only history: the user's request, then ``turns`` answered Reads (assistant
    turns at messages 1, 3, 5...), each answer signed after the history as it was then."""
    body: dict[str, Any] = copy.deepcopy({
        "model": "claude-opus-5-5", "max_tokens": 1024, "system": SYSTEM, "tools": TOOLS,
        "messages": [{"role": "user", "content": "go"}]})
    for n in range(turns):
        body["messages"] = [*body["messages"], answer(binder, body, n), result(n)]
    return body


def positions(failures: list[Failure]) -> list[tuple[int, int]]:
    return [(f.message_index, f.content_index) for f in failures]


# --- the checker, in process ------------------------------------------------------------------


def test_an_append_only_history_passes_every_turn() -> None:
    binder = Binder()
    body = conversation(binder, 0)
    for n in range(12):
        assert binder.check(body) == []
        body["messages"] = [*body["messages"], answer(binder, body, n), result(n)]
    assert binder.check(body) == [] and len(binder) == 12


@pytest.mark.parametrize(("edit", "first", "changed"), [
    (lambda b: b["system"][0].update(text="You read files. Today is Friday."), 1, "system"),
    (lambda b: b["tools"].append({"name": "Grep", "input_schema": {"type": "object"}}), 1, "tools"),
    (lambda b: b["messages"][0].update(content="go on"), 1, "messages.0"),
    (lambda b: b["messages"][4]["content"][0].update(content="<<<TRUNCATED>>>"), 5, "messages.4"),
    (lambda b: b["messages"][3]["content"][1].update(text="Reading f1 now."), 5, "messages.3"),
], ids=["system", "tools", "first-message", "tool-result", "assistant-text"])
def test_a_change_invalidates_the_blocks_after_it(edit: Any, first: int, changed: str) -> None:
    binder = Binder()
    body = conversation(binder, 4)  # thinking at messages 1, 3, 5, 7
    edit(body)
    failures = binder.check(body)
    assert positions(failures) == [(n, 0) for n in (1, 3, 5, 7) if n >= first]
    assert failures[0].reason == "prefix_mismatch" and failures[0].changed == changed
    assert failures[0].message == (
        f"messages.{first}.content.0: Invalid `signature` in `thinking` block. The block is "
        "bound to a different conversation. Remove the block, or set "
        '`thinking.block_binding.prefix_mismatch_behavior` to "drop_block".')


def test_thinking_produced_after_a_change_stays_valid() -> None:
    binder = Binder()
    body = conversation(binder, 2)
    body["system"] = "A new system prompt"
    body["messages"] = [*body["messages"], answer(binder, body, 2), result(2)]
    assert positions(binder.check(body)) == [(1, 0), (3, 0)]


def test_leaving_out_a_block_between_others_fails_the_later_ones() -> None:
    binder = Binder()
    body = conversation(binder, 4)
    del body["messages"][3]["content"][0]
    failures = binder.check(body)
    assert positions(failures) == [(5, 0), (7, 0)] and failures[0].changed == "messages.3"
    moved = conversation(binder, 2)  # the first turn's block moved behind its text
    blocks = moved["messages"][1]["content"]
    blocks[0], blocks[1] = blocks[1], blocks[0]
    assert positions(binder.check(moved)) == [(1, 1), (3, 0)]


def test_leaving_out_every_earlier_block_is_accepted() -> None:
    """What the docs advise for a trimmed or summarised history: no thinking in the kept turns."""
    binder = Binder()
    body = conversation(binder, 4)
    body["system"] = [*SYSTEM, {"type": "text", "text": "# Summary of previous conversation"}]
    for msg in body["messages"]:
        if msg["role"] == "assistant":
            msg["content"] = [b for b in msg["content"] if b["type"] != "thinking"]
    assert binder.check(body) == []
    # Leaving them out of all but the newest turn is not: its prefix held them.
    body = conversation(binder, 3)
    for msg in body["messages"][:5]:
        if msg["role"] == "assistant":
            del msg["content"][0]
    assert positions(binder.check(body)) == [(5, 0)]


def test_cache_control_and_json_spelling_are_no_part_of_the_prefix() -> None:
    binder = Binder()
    body = conversation(binder, 3)
    del body["system"][0]["cache_control"]
    body["messages"][4]["content"][0]["cache_control"] = EPHEMERAL
    body["tools"][0]["cache_control"] = EPHEMERAL
    respelled = orjson.loads(orjson.dumps(_reverse_keys(body), option=orjson.OPT_INDENT_2))
    assert binder.check(body) == [] and binder.check(respelled) == []


def test_a_string_content_is_the_text_block_it_stands_for() -> None:
    """Claude Code sends its newest ``role: "system"`` message as blocks, then as a string."""
    binder = Binder()
    body = conversation(binder, 0)
    body["messages"] = [*body["messages"], {"role": "system", "content": [
        {"type": "text", "text": "# Environment", "cache_control": EPHEMERAL}]}]
    body["messages"] = [*body["messages"], answer(binder, body, 0), result(0)]
    body["messages"][1]["content"] = "# Environment"
    body["messages"][0]["content"] = [{"type": "text", "text": "go"}]
    body["messages"][3]["content"][0]["content"] = [{"type": "text", "text": "contents of f0"}]
    body["system"] = "You read files."
    assert binder.check(body) == []
    body["messages"][1]["content"] = "# Environment\n"
    assert positions(binder.check(body)) == [(2, 0)]


def _reverse_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _reverse_keys(value[k]) for k in reversed(value)}
    if isinstance(value, list):
        return [_reverse_keys(v) for v in value]
    return value


def test_an_unknown_signature_or_an_edited_thinking_is_refused() -> None:
    binder = Binder()
    body = conversation(binder, 3)
    body["messages"][3]["content"][0]["signature"] = reasoning_token(Reply(reasoning="x"))
    assert [(f.message_index, f.reason) for f in binder.check(body)] == [
        (3, "unknown_signature"), (5, "prefix_mismatch")]
    body = conversation(binder, 2)
    body["messages"][3]["content"][0]["thinking"] = "something else"
    assert [(f.message_index, f.reason) for f in binder.check(body)] == [(3, "thinking_changed")]
    redacted = conversation(binder, 1)
    redacted["messages"][1]["content"][0] = {"type": "redacted_thinking", "data": "EmwK"}
    assert [f.reason for f in binder.check(redacted)] == ["unknown_signature"]
    binder.clear()  # a fresh fake: nothing it sees was issued by it
    assert len(binder.check(conversation(Binder(), 2))) == 2


def test_drop_removes_the_failing_blocks_and_reports_each() -> None:
    binder = Binder()
    body = conversation(binder, 3)
    body["messages"][2]["content"][0]["content"] = "cut"
    before = copy.deepcopy(body)
    kept, transformations = binder.drop(body)
    assert body == before  # a copy
    assert transformations == [
        {"type": "thinking_dropped", "path": f"messages.{n}.content.0",
         "reason": "prefix_binding_mismatch"} for n in (3, 5)]
    assert [b["type"] for b in kept["messages"][3]["content"]] == ["text", "tool_use"]
    assert kept["messages"][1] == body["messages"][1] and binder.check(kept) == []


def test_a_bound_signature_still_decodes_to_its_text() -> None:
    binder = Binder()
    body = conversation(binder, 1)
    signature = body["messages"][1]["content"][0]["signature"]
    assert reasoning_of_token(signature) == "next I read f0" and signature in binder


# --- properties ------------------------------------------------------------------------------

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
USER_TURN = st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                           "text": TEXT}), min_size=1, max_size=2))


@st.composite
def histories(draw: st.DrawFn) -> tuple[Binder, list[dict[str, Any]]]:
    """An append-only session: the requests a client sends, each the previous one plus the
    answer (signed after it) and a new user turn; thinking only in some answers."""
    binder = Binder()
    body: dict[str, Any] = {"system": draw(st.one_of(st.none(), TEXT)),
                            "tools": draw(st.one_of(st.none(), st.just(TOOLS))),
                            "messages": [{"role": "user", "content": draw(USER_TURN)}]}
    requests = [copy.deepcopy(body)]
    for n in range(draw(st.integers(1, 6))):
        blocks: list[dict[str, Any]] = []
        for j in range(draw(st.integers(1, 3))):
            if draw(st.booleans()):
                thinking = draw(TEXT)
                blocks.append({"type": "thinking", "thinking": thinking,
                               "signature": binder.sign(body, thinking, before=blocks)})
            else:
                blocks.append({"type": "text", "text": f"{n}.{j} " + draw(TEXT)})
        user = {"role": "user", "content": draw(USER_TURN)}
        body = {**body, "messages": [*body["messages"],
                                     {"role": "assistant", "content": blocks}, user]}
        requests.append(copy.deepcopy(body))
    return binder, requests


def _strings(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths of the string leaves an edit may change (markers and signatures excepted: a
    marker is no part of a prefix, and an edited signature is a block never issued)."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, dict):
        for k, v in value.items():
            if k not in ("cache_control", "signature"):
                yield from _strings(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, (*path, i))


@settings(max_examples=examples(150), deadline=None)
@given(histories())
def test_an_append_only_session_is_never_refused(session: tuple[Binder, Any]) -> None:
    binder, requests = session
    for body in requests:
        assert binder.check(body) == []


@settings(max_examples=examples(300), deadline=None)
@given(histories(), st.data())
def test_a_single_edit_before_a_block_always_fails_it(
    session: tuple[Binder, Any], data: st.DataObject
) -> None:
    binder, requests = session
    body = copy.deepcopy(requests[-1])
    blocks = [(n, m) for n, msg in enumerate(body["messages"]) if isinstance(msg["content"], list)
              for m, b in enumerate(msg["content"]) if b["type"] == "thinking"]
    if not blocks:
        return
    n, m = data.draw(st.sampled_from(blocks))
    before = {"system": body["system"], "tools": body["tools"],
              "messages": [*body["messages"][:n], {"content": body["messages"][n]["content"][:m]}]}
    paths = list(_strings(before))
    if not paths:  # nothing but nulls before it: an edit is a new value where there was none
        body["system"] = "added"
    else:
        *parent, leaf = data.draw(st.sampled_from(paths))
        target: Any = body
        for key in parent:
            target = target[key]
        target[leaf] += "!"
    assert (n, m) in positions(binder.check(body))


# --- the fake upstream, to the real SDK -------------------------------------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerThread, FakeUpstream]]:
    fake = FakeUpstream(prefix_check=True)
    with serve_in_thread(fake) as srv:
        yield srv, fake


@pytest.fixture
def fake(served: tuple[ServerThread, FakeUpstream]) -> FakeUpstream:
    served[1].reset()
    return served[1]


@pytest.fixture(scope="module")
def url(served: tuple[ServerThread, FakeUpstream]) -> str:
    return served[0].url


@pytest.fixture(scope="module")
def ant(url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=url, api_key="sk-ant-test", max_retries=0, timeout=5) as c:
        yield c


def read(n: int) -> Reply:
    return Reply(content=f"Reading f{n}.", reasoning=f"next I read f{n}",
                 tool_calls=[{"name": "Read", "id": f"toolu_{n}", "arguments": {"path": f"f{n}"}}])


def sdk_session(ant: anthropic.Anthropic, fake: FakeUpstream, turns: int) -> dict[str, Any]:
    """``turns`` Reads through the SDK, each answer sent back as the SDK returned it; the next
    request's body (not sent)."""
    fake.script(*(read(n) for n in range(turns)))
    body: dict[str, Any] = copy.deepcopy({
        "model": "claude-opus-5-5", "max_tokens": 1024, "system": SYSTEM, "tools": TOOLS,
        "messages": [{"role": "user", "content": "go"}]})
    for n in range(turns):
        msg = ant.messages.create(**body)
        body["messages"] = [*body["messages"], {"role": "assistant", "content": [
            b.model_dump(exclude_none=True) for b in msg.content]}, result(n)]
    return body


def test_the_sdk_session_passes_and_its_answers_are_bound(
    ant: anthropic.Anthropic, fake: FakeUpstream
) -> None:
    body = sdk_session(ant, fake, 5)
    fake.script("done")
    assert ant.messages.create(**body).content[0].type == "text"
    assert fake.refused == [] and fake.dropped == [] and len(fake.binder) == 5
    signature = body["messages"][1]["content"][0]["signature"]
    assert signature in fake.binder and reasoning_of_token(signature) == "next I read f0"
    assert fake.received[1].reply is not None
    assert fake.received[1].reply.reasoning_signature == body["messages"][3]["content"][0][
        "signature"]


def test_the_sdk_sees_the_400_and_no_reply_is_consumed(
    ant: anthropic.Anthropic, fake: FakeUpstream
) -> None:
    body = sdk_session(ant, fake, 3)
    body["messages"][2]["content"][0]["content"] = "cut short"
    fake.script("after")
    with pytest.raises(anthropic.BadRequestError) as info:
        ant.messages.create(**body)
    assert info.value.status_code == 400 and mismatch_message(3, 0) in info.value.message
    assert isinstance(info.value.body, dict) and info.value.body["error"] == {
        "type": "invalid_request_error", "message": mismatch_message(3, 0)}
    assert fake.pending == 1 and fake.refused_count == 1
    (refusal,) = fake.refused
    assert refusal.message == mismatch_message(3, 0)
    assert [(f.path, f.changed) for f in refusal.failures] == [
        ("messages.3.content.0", "messages.2"), ("messages.5.content.0", "messages.2")]
    with pytest.raises(anthropic.BadRequestError, match="bound to a different conversation"):
        with ant.messages.stream(**body) as stream:
            stream.until_done()
    assert fake.refused_count == 2 and fake.pending == 1


def test_a_streaming_refusal_is_plain_json_before_any_event(url: str, fake: FakeUpstream) -> None:
    binder = fake.binder
    body = conversation(binder, 2)
    body["tools"] = []
    r = httpx.post(url + "/v1/messages", json={**body, "stream": True}, timeout=5)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert r.headers["request-id"].startswith("req_fake_")
    assert r.json()["type"] == "error" and r.json()["error"] == {
        "type": "invalid_request_error", "message": mismatch_message(1, 0)}


def test_drop_block_with_the_beta_answers_200_and_reports(
    ant: anthropic.Anthropic, fake: FakeUpstream
) -> None:
    body = sdk_session(ant, fake, 3)
    body["system"] = "A new system prompt"
    fake.script(Reply(content="done", reasoning="all read"), "streamed")
    msg = ant.beta.messages.create(**body, thinking=DROP, betas=["context-1m-2025-08-07", BETA])
    assert msg.content[1].type == "text" and msg.content[1].text == "done"
    assert msg.input_transformations is not None
    assert [(t.type, t.path, t.reason) for t in msg.input_transformations] == [
        ("thinking_dropped", f"messages.{n}.content.0", "prefix_binding_mismatch")
        for n in (1, 3, 5)]
    assert all(isinstance(t, BetaThinkingDroppedInputTransformation)
               for t in msg.input_transformations)
    assert fake.refused == [] and fake.dropped_count == 1 and len(fake.dropped[0].failures) == 3
    shown = fake.dropped[0].shown
    assert shown is not None and fake.binder.check(shown) == []
    assert [[b["type"] for b in m["content"]] for m in shown["messages"][1::2]] == [
        ["text", "tool_use"]] * 3
    # Streaming: the report is final in message_start.
    with ant.beta.messages.stream(**body, thinking=DROP, betas=[BETA]) as stream:
        final = stream.get_final_message()
    assert final.input_transformations is not None and len(final.input_transformations) == 3
    # Nothing to report is an empty list with the beta, and no key without it.
    fresh = {**body, "system": SYSTEM, "messages": body["messages"][:1]}
    fake.script("a", "b")
    assert ant.beta.messages.create(**fresh, thinking=DROP, betas=[BETA]).input_transformations == []
    assert "input_transformations" not in ant.messages.create(**fresh).model_extra  # type: ignore[operator]


def test_the_answer_after_a_drop_is_bound_to_the_request_as_sent(
    ant: anthropic.Anthropic, fake: FakeUpstream
) -> None:
    body = sdk_session(ant, fake, 2)
    body["messages"][0]["content"] = "go, please"
    fake.script(read(2), "done")
    msg = ant.beta.messages.create(**body, thinking=DROP, betas=[BETA])
    body["messages"] += [{"role": "assistant", "content": [
        b.model_dump(exclude_none=True) for b in msg.content]}, result(2)]
    # The old blocks still fail (the change is still in the history), the new one does not.
    assert positions(fake.binder.check(body)) == [(1, 0), (3, 0)]
    ant.beta.messages.create(**body, thinking=DROP, betas=[BETA])
    assert [len(d.failures) for d in fake.dropped] == [2, 2]


def test_block_binding_needs_the_beta(ant: anthropic.Anthropic, fake: FakeUpstream) -> None:
    fake.script("never sent")
    with pytest.raises(anthropic.BadRequestError) as info:
        ant.messages.create(model="m", max_tokens=9, messages=[{"role": "user", "content": "hi"}],
                            extra_body={"thinking": DROP})
    assert HEADER_REQUIRED_MESSAGE in info.value.message and fake.pending == 1
    assert [r.message for r in fake.refused] == [HEADER_REQUIRED_MESSAGE]
    with pytest.raises(anthropic.BadRequestError, match="'error' or 'drop_block'"):
        ant.beta.messages.create(
            model="m", max_tokens=9, messages=[{"role": "user", "content": "hi"}], betas=[BETA],
            thinking={"type": "adaptive", "block_binding": {
                "prefix_mismatch_behavior": "ignore"}})  # type: ignore[typeddict-item]


def test_the_check_is_opt_in(ant: anthropic.Anthropic, fake: FakeUpstream, url: str) -> None:
    body = conversation(Binder(), 2)  # signatures this fake never issued
    fake.prefix_check = False
    fake.script("accepted")
    assert ant.messages.create(**body).content[0].type == "text" and fake.refused == []
    fake.reset()
    assert fake.prefix_check is True
    with pytest.raises(anthropic.BadRequestError):
        ant.messages.create(**body)
    plain = FakeUpstream()
    plain.script(Reply(content="x", reasoning="r"))
    with serve_in_thread(plain) as srv:
        r = httpx.post(srv.url + "/v1/messages", json=body, timeout=5)
    assert r.status_code == 200 and r.json()["content"][0]["signature"] == reasoning_token(
        Reply(reasoning="r"))

"""The strict fake upstream's provider rules (:mod:`proxy.demo.fake.rules`): each rule by
example (a valid request passes, an invalid one is refused with the provider's message), a
few through the real ``openai`` and ``anthropic`` SDKs (their typed ``BadRequestError``), and
a property: a request valid by construction is never refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from proxy.demo.fake.rules import (
    DEFAULT_MODEL_RULES,
    check_chat,
    check_messages,
    check_responses,
    model_key,
)
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread, serve_in_thread

from .conftest import examples

SONNET = "claude-sonnet-4-5"  # no mid-conversation system messages, sampling parameters
OPUS = "claude-opus-5-5"  # mid-conversation system messages, no sampling parameters


def msgs(*messages: dict[str, Any], model: str = SONNET, **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 1024, "messages": list(messages), **extra}


def user(content: Any = "hi") -> dict[str, Any]:
    return {"role": "user", "content": content}


def assistant(content: Any = "hello") -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def system(content: Any = "be brief") -> dict[str, Any]:
    return {"role": "system", "content": content}


def tool_use(tid: str, name: str = "Read") -> dict[str, Any]:
    return {"type": "tool_use", "id": tid, "name": name, "input": {}}


def tool_result(tid: str, text: str = "ok") -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tid, "content": text}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def messages_error(body: dict[str, Any], **kw: Any) -> str | None:
    found = check_messages(body, **kw)
    return None if found is None else found.message


# --- the model table --------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "key"), [
    ("claude-opus-5-5", "claude-opus-5-5"),
    ("anthropic/claude-sonnet-4-5-20250929", "claude-sonnet-4-5"),
    ("us.anthropic.claude-opus-4-8-v1:0", "claude-opus-4-8"),
    ("vertex_ai/claude-opus-5@default", "claude-opus-5"),
    ("openai/GPT-5-2025-08-07", "gpt-5"),
])
def test_model_key(name: str, key: str) -> None:
    assert model_key(name) == key


def test_model_table() -> None:
    rules = DEFAULT_MODEL_RULES
    assert rules.supports_mid_conversation_system("claude-opus-4-8")
    assert rules.supports_mid_conversation_system("anthropic/claude-opus-5-5-20261001")
    assert not rules.supports_mid_conversation_system("claude-opus-4-7")
    assert not rules.supports_mid_conversation_system("claude-sonnet-4-5")
    assert not rules.supports_mid_conversation_system("fake-model")  # unknown: none
    assert rules.refuses_sampling_params("claude-opus-4-7")
    assert not rules.refuses_sampling_params("claude-sonnet-4-5")
    assert not rules.refuses_sampling_params("fake-model")  # unknown: permissive
    assert rules.default_temperature("o3-mini") and rules.default_temperature("gpt-5.1")
    assert not rules.default_temperature("gpt-5-chat-latest")
    assert not rules.default_temperature("gpt-4o") and not rules.default_temperature("m")
    assert rules.responses_only_model("gpt-5.1-codex-max")
    assert rules.responses_only_model("o3-pro")
    assert not rules.responses_only_model("gpt-5.1") and not rules.responses_only_model("m")


# --- Anthropic Messages -----------------------------------------------------------------------


def test_messages_required_fields() -> None:
    assert messages_error(msgs(user())) is None
    assert messages_error({"max_tokens": 5, "messages": [user()]}) == "model: Field required"
    assert messages_error({"model": SONNET, "messages": [user()]}) == "max_tokens: Field required"
    assert messages_error(msgs(user(), max_tokens=0)) == (
        "max_tokens: Input should be greater than or equal to 1")
    assert messages_error(msgs(user(), max_tokens="9")) == (
        "max_tokens: Input should be a valid integer")
    assert messages_error(msgs()) == "messages: at least one message is required"
    assert messages_error({"model": SONNET, "max_tokens": 5}) == "messages: Field required"


def test_messages_roles() -> None:
    assert messages_error(msgs(user(), {"role": "tool", "content": "x"})) == (
        "messages.1.role: Input should be 'user' or 'assistant'")
    assert messages_error(msgs(assistant(), user())) == (
        'messages: first message must use the "user" role')
    # Consecutive turns of one role are combined, not refused.
    assert messages_error(msgs(user(), user("more"), assistant(), assistant("x"))) is None


def test_messages_system_role_only_on_models_that_support_it() -> None:
    conversation = (user(), system(), assistant(), user())
    assert messages_error(msgs(*conversation, model=OPUS)) is None
    assert messages_error(msgs(*conversation, model="claude-opus-4-8-20260528")) is None
    for model in (SONNET, "claude-opus-4-7", "fake-model"):
        assert messages_error(msgs(*conversation, model=model)) == (
            "role 'system' is not supported on this model")
    rules = dataclasses.replace(DEFAULT_MODEL_RULES, mid_conversation_system=("fake-*",))
    assert messages_error(msgs(*conversation, model="fake-model"), rules=rules) is None


def test_messages_system_role_placement() -> None:
    # Claude Code on claude-opus-5-5: one system message right after its first user turn.
    assert messages_error(msgs(user(), system(), model=OPUS)) is None
    # Where a compacted summary went: first.
    assert messages_error(msgs(system("summary"), user(), model=OPUS)) == (
        'messages: first message must use the "user" role')
    assert messages_error(msgs(user(), assistant(), system(), model=OPUS)) == (
        "messages.2: role 'system' must follow a 'user' message or an 'assistant' message "
        "ending in a server tool use")
    server_tool = assistant([{"type": "server_tool_use", "id": "srvtoolu_1",
                              "name": "web_search", "input": {"query": "x"}}])
    assert messages_error(msgs(user(), server_tool, system(), model=OPUS)) is None
    assert messages_error(msgs(user(), system(), user(), model=OPUS)) == (
        "messages.1: role 'system' must precede an 'assistant' message or end the array")
    assert messages_error(msgs(user(), system(), system(), model=OPUS)) is not None
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBOR"}}
    assert messages_error(msgs(user(), system([text("a"), image]), model=OPUS)) == (
        "messages.1.content.1: role 'system' messages support text blocks only")


def test_messages_content() -> None:
    assert messages_error(msgs(user(""))) == (
        "messages.0: all messages must have non-empty content except for the optional final "
        "assistant message")
    assert messages_error(msgs(user(), assistant(""))) is None  # an empty prefill
    assert messages_error(msgs(user([text("")]))) == (
        "messages: text content blocks must be non-empty")
    assert messages_error(msgs(user([text(" \n")]))) == (
        "messages: text content blocks must contain non-whitespace text")
    assert messages_error(msgs(user(), assistant([tool_result("t")]))) == (
        "messages.1.content.0: `tool_result` blocks can only be in `user` messages")
    thinking = {"type": "thinking", "thinking": "hm", "signature": "c2ln"}
    assert messages_error(msgs(user([thinking]))) == (
        "messages.0.content.0: `thinking` blocks can only be in `assistant` messages")
    # Newer and server-side block types pass: the docs refuse none of them by role.
    newer = [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
        {"type": "compaction", "content": "summary"},
        text("done"),
    ]
    documents = [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                        "data": "d"}},
        {"type": "search_result", "source": "s", "title": "t", "content": [text("c")]},
        {"type": "container_upload", "file_id": "file_1"},
        text("look"),
    ]
    assert messages_error(msgs(user(documents), assistant(newer), user())) is None


def test_messages_tool_pairing() -> None:
    asks = assistant([text("reading"), tool_use("t1"), tool_use("t2")])
    assert messages_error(msgs(user(), asks, user([tool_result("t1"), tool_result("t2"),
                                                    text("and then")]))) is None
    assert messages_error(msgs(user(), asks, user([tool_result("t1")]))) == (
        "messages.1: `tool_use` ids were found without `tool_result` blocks immediately "
        "after: t2. Each `tool_use` block must have a corresponding `tool_result` block in "
        "the next message.")
    assert messages_error(msgs(user(), asks)) is not None  # nothing answers them
    assert messages_error(msgs(user(), asks, user([text("first"), tool_result("t1"),
                                                    tool_result("t2")]))) == (
        "messages.2: Did not find 2 `tool_result` block(s) at the beginning of this message. "
        "Messages following `tool_use` blocks must begin with a matching number of "
        "`tool_result` blocks.")
    assert messages_error(msgs(user(), assistant(), user([tool_result("t9")]))) == (
        "messages.2.content.0: unexpected `tool_use_id` found in `tool_result` blocks: t9. "
        "Each `tool_result` block must have a corresponding `tool_use` block in the previous "
        "message.")
    # The result belongs right after its call: two turns later is too late.
    late = msgs(user(), assistant([tool_use("t1")]), user([tool_result("t1")]), assistant(),
                user([tool_result("t1")]))
    assert messages_error(late) is not None


def test_messages_cache_breakpoints() -> None:
    marker = {"type": "ephemeral"}
    tools = [{"name": f"t{i}", "input_schema": {"type": "object"}, "cache_control": marker}
             for i in range(2)]
    body = msgs(user([{**text("a"), "cache_control": marker}]), assistant(),
                user([{**text("b"), "cache_control": marker}]), tools=tools)
    assert messages_error(body) is None
    body["system"] = [{**text("sys"), "cache_control": marker}]
    assert messages_error(body) == (
        "A maximum of 4 blocks with cache_control may be provided. Found 5.")


def test_messages_sampling_parameters() -> None:
    assert messages_error(msgs(user(), temperature=0.2, top_p=0.9, top_k=5)) is None
    assert messages_error(msgs(user(), model=OPUS, temperature=1)) is None
    assert messages_error(msgs(user(), model=OPUS, temperature=0.2)) == (
        "`temperature` is deprecated for this model.")
    assert messages_error(msgs(user(), model="claude-opus-4-7", top_k=5)) == (
        "`top_k` is deprecated for this model.")
    # From API version 2026-10-21, on every model and at any value.
    assert messages_error(msgs(user(), temperature=1), api_version="2026-10-21") == (
        "temperature: Extra inputs are not permitted")
    assert messages_error(msgs(user(), temperature=1), api_version="2023-06-01") is None
    cited = user([{**text("q"), "citations": [{"type": "char_location"}]}])
    assert messages_error(msgs(cited), api_version="2026-10-21") is not None
    assert messages_error(msgs(cited)) is None


# --- OpenAI chat completions ------------------------------------------------------------------


def chat(*messages: dict[str, Any], model: str = "gpt-4o", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": list(messages), **extra}


def calls(*ids: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "ls", "arguments": "{}"}}
        for i in ids]}


def tool(tid: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": tid, "content": "ok"}


def chat_error(body: dict[str, Any]) -> str | None:
    found = check_chat(body)
    return None if found is None else found.message


def test_chat_messages() -> None:
    hi = {"role": "user", "content": "hi"}
    assert chat_error(chat({"role": "developer", "content": "x"}, hi)) is None
    assert chat_error(chat()) == (
        "Invalid 'messages': empty array. Expected an array with minimum length 1, but got "
        "an empty array instead.")
    assert chat_error({"model": "gpt-4o"}) == "Missing required parameter: 'messages'."
    assert chat_error(chat({"role": "robot", "content": "x"})) == (
        "Invalid value: 'robot'. Supported values are: 'system', 'assistant', 'user', "
        "'function', 'tool', and 'developer'.")
    assert chat_error({"messages": [hi]}) == "you must provide a model parameter"


def test_chat_tool_calls() -> None:
    hi = {"role": "user", "content": "hi"}
    assert chat_error(chat(hi, calls("a", "b"), tool("b"), tool("a"), hi)) is None
    assert chat_error(chat(hi, calls("a", "b"), tool("a"), hi)) == (
        "An assistant message with 'tool_calls' must be followed by tool messages responding "
        "to each 'tool_call_id'. The following tool_call_ids did not have response messages: b")
    assert chat_error(chat(hi, tool("a"))) == (
        "Invalid parameter: messages with role 'tool' must be a response to a preceeding "
        "message with 'tool_calls'.")
    assert chat_error(chat(hi, calls("a"), tool("a"), hi, tool("a"))) is not None
    assert chat_error(chat(hi, calls("a"), tool("z"))) == (
        "Invalid parameter: 'tool_call_id' of 'z' not found in 'tool_calls' of previous "
        "message.")
    empty = {"role": "assistant", "content": "x", "tool_calls": []}
    found = check_chat(chat(hi, empty, hi))
    assert found is not None and found.code == "empty_array"
    assert found.message == (
        "Invalid 'messages[1].tool_calls': empty array. Expected an array with minimum length "
        "1, but got an empty array instead.")


def test_chat_temperature_and_endpoint() -> None:
    hi = {"role": "user", "content": "hi"}
    assert chat_error(chat(hi, temperature=0)) is None
    assert chat_error(chat(hi, model="gpt-5-mini", temperature=1)) is None
    assert chat_error(chat(hi, model="gpt-5-mini", temperature=0)) == (
        "Unsupported value: 'temperature' does not support 0 with this model. Only the "
        "default (1) value is supported.")
    assert chat_error(chat(hi, model="o3", temperature=0.2)) is not None
    assert chat_error(chat(hi, model="gpt-5.1", temperature=0.2, reasoning_effort="none")) is None
    found = check_chat(chat(hi, model="gpt-5.1-codex"))
    assert found is not None and found.status == 404
    assert found.message == (
        "This model is only supported in v1/responses and not in v1/chat/completions.")


# --- OpenAI Responses -------------------------------------------------------------------------


def responses_error(body: dict[str, Any]) -> str | None:
    found = check_responses(body)
    return None if found is None else found.message


def test_responses_input_and_call_outputs() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    assert responses_error({"model": "gpt-5", "input": "hi"}) is None
    assert responses_error({"model": "gpt-5", "input": [call, output]}) is None
    assert responses_error({"model": "gpt-5", "input": {"role": "user"}}) == (
        "Invalid type for 'input': expected one of a string or array of input items, but got "
        "an object instead.")
    assert responses_error({"model": "gpt-5", "input": [output, call]}) == (
        "No tool call found for function call output with call_id c1.")
    # The call may live upstream.
    assert responses_error({"model": "gpt-5", "input": [output],
                            "previous_response_id": "resp_1"}) is None
    shell = {"type": "local_shell_call", "call_id": "c1", "action": {}}
    assert responses_error({"model": "gpt-5", "input": [shell, output]}) is None
    custom_out = {"type": "custom_tool_call_output", "call_id": "c2", "output": "ok"}
    assert responses_error({"model": "gpt-5", "input": [custom_out]}) is not None
    assert responses_error({"model": "gpt-5.1-codex", "input": "hi", "temperature": 0.5}) == (
        "Unsupported value: 'temperature' does not support 0.5 with this model. Only the "
        "default (1) value is supported.")
    assert responses_error({"model": "gpt-5.1", "input": "hi", "temperature": 0.5,
                            "reasoning": {"effort": "none"}}) is None


# --- valid by construction: never refused -----------------------------------------------------

_ids = st.text("abcdefgh0123456789", min_size=4, max_size=8).map(lambda s: "toolu_" + s)
_words = st.text("abc xyz\n", min_size=1, max_size=12).filter(str.strip)


@st.composite
def valid_messages(draw: st.DrawFn) -> dict[str, Any]:
    """A Messages conversation built valid: user first, tool calls answered right after
    (results first), mid-conversation system messages only on a model that has them and
    only after a user turn, at most 4 cache breakpoints."""
    model = draw(st.sampled_from([SONNET, OPUS, "fake-model", "claude-opus-4-7"]))
    with_system = DEFAULT_MODEL_RULES.supports_mid_conversation_system(model)
    messages: list[dict[str, Any]] = [user(draw(_words))]
    used: set[str] = set()
    for _ in range(draw(st.integers(0, 5))):
        if with_system and messages[-1]["role"] == "user" and draw(st.booleans()):
            messages.append(system(draw(_words)))
        ids = [i for i in draw(st.lists(_ids, max_size=3, unique=True)) if i not in used]
        used.update(ids)
        blocks: list[dict[str, Any]] = [text(draw(_words))] if draw(st.booleans()) else []
        blocks += [tool_use(i) for i in ids]
        messages.append(assistant(blocks or [text("ok")]))
        answer: list[dict[str, Any]] = [tool_result(i) for i in draw(st.permutations(ids))]
        if not ids or draw(st.booleans()):
            answer.append(text(draw(_words)))
        messages.append(user(answer))
    body = msgs(*messages, model=model)
    marked = draw(st.lists(st.sampled_from(range(len(messages))), max_size=4, unique=True))
    for i in marked:
        content = messages[i]["content"]
        if isinstance(content, list):
            content[-1] = {**content[-1], "cache_control": {"type": "ephemeral"}}
    if not DEFAULT_MODEL_RULES.refuses_sampling_params(model) and draw(st.booleans()):
        body["temperature"] = draw(st.floats(0, 1))
    return body


@st.composite
def valid_chat(draw: st.DrawFn) -> dict[str, Any]:
    model = draw(st.sampled_from(["gpt-4o", "gpt-5", "o3", "fake-model"]))
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": draw(st.sampled_from(["system", "developer"])),
                         "content": draw(_words)})
    messages.append({"role": "user", "content": draw(_words)})
    for n in range(draw(st.integers(0, 4))):
        ids = [f"call_{n}_{k}" for k in range(draw(st.integers(0, 3)))]
        if ids:
            messages.append(calls(*ids))
            messages += [tool(i) for i in draw(st.permutations(ids))]
        else:
            messages.append({"role": "assistant", "content": draw(_words)})
        messages.append({"role": "user", "content": draw(_words)})
    body = chat(*messages, model=model)
    if not DEFAULT_MODEL_RULES.default_temperature(model) and draw(st.booleans()):
        body["temperature"] = draw(st.floats(0, 2))
    return body


@st.composite
def valid_responses(draw: st.DrawFn) -> dict[str, Any]:
    items: list[dict[str, Any]] = [{"role": "user", "content": draw(_words)}]
    for n in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["function_call", "custom_tool_call", "local_shell_call"]))
        items.append({"type": kind, "call_id": f"call_{n}", "name": "t"})
        output = "custom_tool_call_output" if kind == "custom_tool_call" else (
            "function_call_output")
        items.append({"type": output, "call_id": f"call_{n}", "output": draw(_words)})
    return {"model": draw(st.sampled_from(["gpt-5", "gpt-5.1-codex", "fake-model"])),
            "input": items}


@settings(max_examples=examples(300), deadline=None)
@given(body=valid_messages())
def test_valid_messages_never_refused(body: dict[str, Any]) -> None:
    assert check_messages(body, api_version="2023-06-01") is None


@settings(max_examples=examples(300), deadline=None)
@given(body=valid_chat())
def test_valid_chat_never_refused(body: dict[str, Any]) -> None:
    assert check_chat(body) is None


@settings(max_examples=examples(300), deadline=None)
@given(body=valid_responses())
def test_valid_responses_never_refused(body: dict[str, Any]) -> None:
    assert check_responses(body) is None


@settings(max_examples=examples(150), deadline=None)
@given(body=valid_messages(), data=st.data())
def test_a_missing_tool_result_is_refused(body: dict[str, Any], data: st.DataObject) -> None:
    """The rules can fail: the same conversations, one tool result dropped."""
    where = [(i, j) for i, m in enumerate(body["messages"]) if isinstance(m["content"], list)
             for j, b in enumerate(m["content"]) if b.get("type") == "tool_result"]
    assume(where)
    i, j = data.draw(st.sampled_from(where))
    del body["messages"][i]["content"][j]
    assert check_messages(body) is not None


@settings(max_examples=examples(150), deadline=None)
@given(body=valid_chat(), data=st.data())
def test_a_missing_tool_message_is_refused(body: dict[str, Any], data: st.DataObject) -> None:
    where = [i for i, m in enumerate(body["messages"]) if m["role"] == "tool"]
    assume(where)
    del body["messages"][data.draw(st.sampled_from(where))]
    assert check_chat(body) is not None


@settings(max_examples=examples(150), deadline=None)
@given(body=valid_responses(), data=st.data())
def test_an_output_without_its_call_is_refused(body: dict[str, Any], data: st.DataObject) -> None:
    where = [i for i, it in enumerate(body["input"]) if it.get("type", "").endswith("_call")]
    assume(where)
    del body["input"][data.draw(st.sampled_from(where))]
    assert check_responses(body) is not None


# --- the fake upstream, to the real SDKs ------------------------------------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerThread, FakeUpstream]]:
    fake = FakeUpstream()
    with serve_in_thread(fake) as srv:
        yield srv, fake


@pytest.fixture
def fake(served: tuple[ServerThread, FakeUpstream]) -> FakeUpstream:
    served[1].reset()
    return served[1]


@pytest.fixture(scope="module")
def ant(served: tuple[ServerThread, FakeUpstream]) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=served[0].url, api_key="sk-ant-test", max_retries=0,
                             timeout=5) as client:
        yield client


@pytest.fixture(scope="module")
def oai(served: tuple[ServerThread, FakeUpstream]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=served[0].url + "/v1", api_key="sk-test", max_retries=0,
                       timeout=5) as client:
        yield client


def test_sdk_anthropic_refused_with_the_envelope(ant: anthropic.Anthropic,
                                                 fake: FakeUpstream) -> None:
    fake.script("never sent")
    with pytest.raises(anthropic.BadRequestError) as caught:
        ant.messages.create(model=SONNET, max_tokens=64, messages=[
            {"role": "system", "content": "summary"}, {"role": "user", "content": "go on"}])
    assert caught.value.status_code == 400
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error",
                  "message": "role 'system' is not supported on this model"},
        "request_id": caught.value.request_id,
    }
    assert fake.pending == 1  # no scripted reply consumed
    [verdict] = fake.invalid
    assert verdict.rule == "messages.system_role_unsupported"
    assert verdict.received.json()["messages"][0]["role"] == "system"
    # A valid request then gets the scripted reply.
    msg = ant.messages.create(model=SONNET, max_tokens=64,
                              messages=[{"role": "user", "content": "go on"}])
    assert msg.content[0].text == "never sent"  # type: ignore[union-attr]


def test_sdk_anthropic_stream_refused_before_any_event(ant: anthropic.Anthropic,
                                                       fake: FakeUpstream) -> None:
    unanswered: list[Any] = [{"role": "user", "content": "go"},
                             {"role": "assistant", "content": [tool_use("toolu_1")]},
                             {"role": "user", "content": "never mind"}]
    with pytest.raises(anthropic.BadRequestError, match="tool_use` ids were found"):
        with ant.messages.stream(model=OPUS, max_tokens=64, messages=unanswered) as stream:
            stream.get_final_message()
    assert [v.rule for v in fake.invalid] == ["messages.tool_use_answered"]


def test_sdk_openai_chat_refused(oai: openai.OpenAI, fake: FakeUpstream) -> None:
    fake.script("never sent")
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="gpt-5-mini", temperature=0, messages=[
            {"role": "user", "content": "hi"}])
    assert caught.value.code == "unsupported_value" and caught.value.param == "temperature"
    assert caught.value.message.endswith(
        "Unsupported value: 'temperature' does not support 0 with this model. Only the "
        "default (1) value is supported.")
    with pytest.raises(openai.NotFoundError, match="only supported in v1/responses"):
        oai.chat.completions.create(model="gpt-5.1-codex", stream=True,
                                    messages=[{"role": "user", "content": "hi"}])
    assert fake.pending == 1 and len(fake.invalid) == 2


def test_sdk_openai_responses_refused(oai: openai.OpenAI, fake: FakeUpstream) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model="gpt-5.1-codex", input=[
            {"type": "function_call_output", "call_id": "call_x", "output": "ok"}])
    assert caught.value.param == "input" and caught.value.code is None
    assert "No tool call found for function call output with call_id call_x." in str(
        caught.value)


def test_strict_off_answers_anything_and_reset_restores_it(served: tuple[ServerThread,
                                                                         FakeUpstream]) -> None:
    srv, fake = served
    fake.reset()
    body = {"model": "m", "messages": []}
    fake.strict = False
    assert httpx.post(srv.url + "/v1/chat/completions", json=body).status_code == 200
    fake.reset()
    assert fake.strict
    answer = httpx.post(srv.url + "/v1/chat/completions", json=body)
    assert answer.status_code == 400
    assert orjson.loads(answer.content)["error"] == {
        "message": "Invalid 'messages': empty array. Expected an array with minimum length 1, "
                   "but got an empty array instead.",
        "type": "invalid_request_error", "param": "messages", "code": "empty_array"}
    assert not fake.completed or fake.completed[-1].json() == body


def test_constructor_off_and_model_rules_override() -> None:
    lax = FakeUpstream(strict=False)
    assert not lax.strict
    lax.reset()
    assert not lax.strict
    rules = dataclasses.replace(DEFAULT_MODEL_RULES, mid_conversation_system=("m",))
    fake = FakeUpstream(model_rules=rules, default=Reply(content="ok"))
    with serve_in_thread(fake) as srv:
        body = msgs(user(), system(), model="m")
        assert httpx.post(srv.url + "/v1/messages", json=body).status_code == 200
        fake.model_rules = DEFAULT_MODEL_RULES
        assert httpx.post(srv.url + "/v1/messages", json=body).status_code == 400
        fake.reset()
        assert fake.model_rules is rules

"""The fake upstream's OpenAI Responses and Anthropic Messages formats, driven by the real SDKs.

Beyond what the SDKs parse (they are lenient: missing fields just read as None), every body
and every SSE event is also validated strictly against the SDKs' own pydantic types, so a
field the real API always sends cannot go missing unnoticed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent

from proxy.demo.fake.messages import message_events
from proxy.demo.fake.replies import Received
from proxy.demo.fake.responses import response_events
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.fake.wire import reasoning_of_token, reasoning_token
from proxy.demo.servers import ServerThread, serve_in_thread

from .conftest import examples

INPUT = "hi"
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
ENCRYPTED: list[Any] = ["reasoning.encrypted_content"]
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hello\n*** End Patch"
FULL = Reply(
    content="Hello there, friend",
    reasoning="Plan: greet, then list.",
    tool_calls=[
        {"name": "ls", "arguments": {"path": "."}, "id": "call_ls"},
        {"type": "custom", "name": "apply_patch", "input": PATCH},
    ],
    stream_pieces=2,
)

RESPONSE_EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
MESSAGE_EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)


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
def url(served: tuple[ServerThread, FakeUpstream]) -> str:
    return served[0].url


@pytest.fixture(scope="module")
def oai(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=5) as c:
        yield c


@pytest.fixture(scope="module")
def ant(url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=url, api_key="sk-ant-test", max_retries=0, timeout=5) as c:
        yield c


def sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """``(event name, data)`` of each SSE event; each must have exactly those two lines."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: ")
        name, data = lines[0][len("event: ") :], orjson.loads(lines[1][len("data: ") :])
        assert data["type"] == name, "the event line names the data's type"
        out.append((name, data))
    return out


def raw_post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=5)


# --- OpenAI Responses ---------------------------------------------------------------------


def test_responses_text_non_stream(oai: openai.OpenAI, fake: FakeUpstream) -> None:
    fake.script(Reply(content="hello there"))
    raw = oai.responses.with_raw_response.create(model="gpt-5", input=INPUT)
    Response.model_validate(raw.http_response.json())  # every required field is there
    assert raw.headers["x-request-id"] == "req_fake_1"
    resp = raw.parse()
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "completed" and resp.model == "gpt-5"
    assert resp.output_text == "hello there"
    [msg] = resp.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert msg.id.startswith("msg_")
    [part] = msg.content
    assert part.type == "output_text" and part.annotations == []
    usage = resp.usage
    assert usage is not None
    rec = fake.received[0]
    assert (
        usage.input_tokens == len(rec.body) // 4 and usage.output_tokens == len("hello there") // 4
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert (rec.method, rec.path) == ("POST", "/v1/responses")
    assert rec.json()["input"] == INPUT and rec.reply is not None
    assert fake.completed == [rec]


def test_responses_function_and_custom_calls(oai: openai.OpenAI, fake: FakeUpstream) -> None:
    fake.script(
        Reply(
            content=None,
            tool_calls=[
                {"name": "read_file", "arguments": {"path": "a.py"}, "id": "call_a"},
                {"name": "grep", "arguments": '{"pattern": "x"}'},
                {"type": "custom", "name": "apply_patch", "input": PATCH},
            ],
        )
    )
    resp = oai.responses.create(model="m", input=INPUT)
    fc1, fc2, ctc = resp.output
    assert fc1.type == "function_call" and fc2.type == "function_call"
    assert (fc1.name, orjson.loads(fc1.arguments), fc1.call_id) == (
        "read_file",
        {"path": "a.py"},
        "call_a",
    )
    assert fc2.arguments == '{"pattern": "x"}'  # a string is sent verbatim
    assert fc2.call_id and fc2.call_id != "call_a"
    assert fc1.id is not None and fc1.id.startswith("fc_") and fc1.status == "completed"
    assert ctc.type == "custom_tool_call"
    assert (ctc.name, ctc.input) == ("apply_patch", PATCH)
    assert ctc.call_id and ctc.id is not None and ctc.id.startswith("ctc_")
    assert resp.output_text == ""


def test_responses_reasoning_encrypted_only_when_included(
    oai: openai.OpenAI, fake: FakeUpstream
) -> None:
    reply = Reply(content="done", reasoning="I should answer briefly.")
    fake.script(reply, reply)
    with_enc = oai.responses.create(model="o4", input=INPUT, include=ENCRYPTED)
    without = oai.responses.create(model="o4", input=INPUT, reasoning={"effort": "low"})
    for resp in (with_enc, without):
        rs, msg = resp.output
        assert rs.type == "reasoning" and rs.id.startswith("rs_") and msg.type == "message"
        assert [(s.type, s.text) for s in rs.summary] == [
            ("summary_text", "I should answer briefly.")
        ]
        assert resp.usage is not None
        assert resp.usage.output_tokens_details.reasoning_tokens == len(reply.reasoning or "") // 4
    rs_enc = with_enc.output[0]
    assert rs_enc.type == "reasoning" and rs_enc.encrypted_content is not None
    assert reasoning_of_token(rs_enc.encrypted_content) == "I should answer briefly."
    assert without.output[0].type == "reasoning" and without.output[0].encrypted_content is None
    assert without.reasoning is not None and without.reasoning.effort == "low"  # echoed


def test_responses_stream_events(oai: openai.OpenAI, fake: FakeUpstream) -> None:
    text = "The quick brown fox jumps"
    fake.script(Reply(content=text, stream_pieces=5))
    events = list(oai.responses.create(model="m", input=INPUT, stream=True))
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 5,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == text
    first, last = events[0], events[-1]
    assert first.type == "response.created" and first.response.status == "in_progress"
    assert first.response.output == [] and first.response.usage is None
    assert last.type == "response.completed" and last.response.output_text == text
    assert last.response.usage is not None and last.response.usage.output_tokens == len(text) // 4
    assert fake.completed_count == 1


def test_responses_stream_helper(oai: openai.OpenAI, fake: FakeUpstream) -> None:
    """The SDK's accumulator checks item identities and order; it accepts the whole stream."""
    fake.script(FULL)
    with oai.responses.stream(model="m", input=INPUT, include=ENCRYPTED) as stream:
        text = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(text) == FULL.content
    assert [o.type for o in final.output] == [
        "reasoning",
        "message",
        "function_call",
        "custom_tool_call",
    ]
    rs, _, fc, ctc = final.output
    assert rs.type == "reasoning" and rs.encrypted_content == reasoning_token(FULL)
    assert fc.type == "function_call" and orjson.loads(fc.arguments) == {"path": "."}
    assert fc.call_id == "call_ls"
    assert ctc.type == "custom_tool_call" and ctc.input == PATCH
    assert final.output_text == FULL.content


def test_responses_raw_sse_order(url: str, fake: FakeUpstream) -> None:
    fake.script(FULL)
    r = raw_post(
        url, "/v1/responses", {"model": "m", "input": INPUT, "stream": True, "include": ENCRYPTED}
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"].startswith("req_fake_")
    assert not r.content.rstrip().endswith(b"[DONE]")  # the Responses API sends no [DONE]
    events = sse(r.content)
    for _, data in events:
        RESPONSE_EVENTS.validate_python(data)  # strictly, as the SDK types define them
    names = [n.removeprefix("response.") for n, _ in events]
    assert names == [
        "created",
        "in_progress",
        # reasoning: its summary streams, two pieces
        "output_item.added",
        "reasoning_summary_part.added",
        "reasoning_summary_text.delta",
        "reasoning_summary_text.delta",
        "reasoning_summary_text.done",
        "reasoning_summary_part.done",
        "output_item.done",
        # message
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        # function call
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        # custom tool call
        "output_item.added",
        "custom_tool_call_input.delta",
        "custom_tool_call_input.delta",
        "custom_tool_call_input.done",
        "output_item.done",
        "completed",
    ]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    final = events[-1][1]["response"]
    Response.model_validate(final)
    done_items = [d for n, d in events if n == "response.output_item.done"]
    assert [d["item"] for d in done_items] == final["output"]
    assert [d["output_index"] for d in done_items] == [0, 1, 2, 3]
    added = [d["item"] for n, d in events if n == "response.output_item.added"]
    assert [a["id"] for a in added] == [o["id"] for o in final["output"]]
    assert all(a.get("status", "in_progress") == "in_progress" for a in added)
    assert "encrypted_content" not in added[0]  # it comes with the finished item
    args = "".join(d["delta"] for n, d in events if n.endswith("function_call_arguments.delta"))
    assert args == final["output"][2]["arguments"]
    assert final["usage"]["total_tokens"] == (
        final["usage"]["input_tokens"] + final["usage"]["output_tokens"]
    )


def test_responses_incomplete(oai: openai.OpenAI, url: str, fake: FakeUpstream) -> None:
    fake.script(Reply(content="cut sh", finish_reason="length"))
    resp = oai.responses.create(model="m", input=INPUT)
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].type == "message" and resp.output[0].status == "incomplete"
    fake.script(Reply(content="cut sh", finish_reason="length"))
    events = sse(raw_post(url, "/responses", {"model": "m", "input": INPUT, "stream": True}).content)
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["status"] == "incomplete"


def test_responses_echo_request(oai: openai.OpenAI, fake: FakeUpstream) -> None:
    tools: Any = [
        {"type": "function", "name": "ls", "parameters": {"type": "object"}, "strict": False},
        {"type": "function", "name": "cat"},  # the API fills in what a tool left out
        {"type": "custom", "name": "apply_patch"},
    ]
    fake.script(Reply(model="gpt-5-2025-08-07"))
    raw = oai.responses.with_raw_response.create(
        model="gpt-5",
        input=INPUT,
        instructions="Be brief.",
        tools=tools,
        previous_response_id="resp_prev",
        store=False,
        metadata={"k": "v"},
    )
    Response.model_validate(raw.http_response.json())
    resp = raw.parse()
    assert resp.model == "gpt-5-2025-08-07"  # a Reply's model wins over the request's
    assert resp.instructions == "Be brief." and resp.previous_response_id == "resp_prev"
    assert [t.type for t in resp.tools] == ["function", "function", "custom"]
    ls, cat, _ = resp.tools
    assert ls.type == "function" and ls.strict is False
    assert cat.type == "function" and cat.strict is True and cat.parameters is None
    assert resp.metadata == {"k": "v"}
    assert resp.model_extra is not None and resp.model_extra.get("store") is False


async def test_responses_async_stream(url: str, fake: FakeUpstream) -> None:
    fake.script(Reply(content="async hello"))
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as c:
        stream = await c.responses.create(model="m", input=INPUT, stream=True)
        text = [e.delta async for e in stream if e.type == "response.output_text.delta"]
    assert "".join(text) == "async hello"


# --- Anthropic Messages -------------------------------------------------------------------


def test_messages_text_non_stream(ant: anthropic.Anthropic, fake: FakeUpstream) -> None:
    fake.script(Reply(content="hello there"))
    raw = ant.messages.with_raw_response.create(
        model="claude-sonnet-4-5", max_tokens=100, messages=MESSAGES
    )
    Message.model_validate(raw.http_response.json())
    assert raw.headers["request-id"] == "req_fake_1"
    msg = raw.parse()
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == "claude-sonnet-4-5"
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    [block] = msg.content
    assert block.type == "text" and block.text == "hello there"
    rec = fake.received[0]
    assert msg.usage.input_tokens == len(rec.body) // 4
    assert msg.usage.output_tokens == len("hello there") // 4
    assert msg.usage.cache_creation_input_tokens == 0 and msg.usage.cache_read_input_tokens == 0
    assert rec.path == "/v1/messages" and "anthropic-version" in rec.headers
    # Older SDKs send x-api-key, newer ones a bearer token.
    assert "sk-ant-test" in (rec.headers.get("x-api-key"), rec.headers.get("authorization", "")[7:])
    assert rec.json()["messages"] == MESSAGES and rec.reply is not None


def test_messages_tool_use(ant: anthropic.Anthropic, fake: FakeUpstream) -> None:
    fake.script(
        Reply(
            content=None,
            tool_calls=[
                {
                    "name": "read_file",
                    "arguments": {"path": "a.py", "lines": [1, 2]},
                    "id": "toolu_a",
                },
                {"name": "grep", "arguments": '{"pattern": "x"}'},
                {"type": "custom", "name": "apply_patch", "input": PATCH},
            ],
        )
    )
    msg = ant.messages.create(model="m", max_tokens=100, messages=MESSAGES)
    assert msg.stop_reason == "tool_use"
    blocks = msg.content
    assert [b.type for b in blocks] == ["tool_use"] * 3
    a, g, p = blocks
    assert a.type == "tool_use" and g.type == "tool_use" and p.type == "tool_use"
    assert (a.id, a.name, a.input) == ("toolu_a", "read_file", {"path": "a.py", "lines": [1, 2]})
    assert g.input == {"pattern": "x"} and g.id.startswith("toolu_") and g.id != a.id
    assert p.input == {"input": PATCH}  # Anthropic has no free-form tools: wrapped in an object


def test_messages_thinking(ant: anthropic.Anthropic, fake: FakeUpstream) -> None:
    fake.script(
        Reply(content="42", reasoning="Six times seven."),
        Reply(content="42", reasoning="again", reasoning_signature="EqQBCgIYAh"),
    )
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    msg = ant.messages.create(model="m", max_tokens=2048, thinking=thinking, messages=MESSAGES)
    think, text = msg.content
    assert think.type == "thinking" and think.thinking == "Six times seven."
    assert reasoning_of_token(think.signature) == "Six times seven."
    assert text.type == "text" and text.text == "42"
    msg2 = ant.messages.create(model="m", max_tokens=2048, thinking=thinking, messages=MESSAGES)
    assert msg2.content[0].type == "thinking" and msg2.content[0].signature == "EqQBCgIYAh"


def test_messages_stream_events(ant: anthropic.Anthropic, fake: FakeUpstream) -> None:
    fake.script(
        Reply(
            content=None,
            tool_calls=[{"name": "ls", "arguments": {"path": "src/"}}],
            stream_pieces=3,
        )
    )
    with ant.messages.create(model="m", max_tokens=100, messages=MESSAGES, stream=True) as stream:
        events = list(stream)
    assert [e.type for e in events] == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 4,  # an empty fragment first, then three pieces
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]
    assert start.type == "message_start" and start.message.content == []
    assert start.message.stop_reason is None
    block_start = events[1]
    assert block_start.type == "content_block_start"
    assert block_start.content_block.type == "tool_use" and block_start.content_block.input == {}
    fragments = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert fragments[0] == "" and orjson.loads("".join(fragments)) == {"path": "src/"}
    delta = events[-2]
    assert delta.type == "message_delta" and delta.delta.stop_reason == "tool_use"
    assert delta.usage.output_tokens >= 1


def test_messages_stream_helper(ant: anthropic.Anthropic, fake: FakeUpstream) -> None:
    fake.script(FULL)
    with ant.messages.stream(model="m", max_tokens=100, messages=MESSAGES) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) == 2 and "".join(pieces) == FULL.content
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use", "tool_use"]
    think, text, ls, patch = final.content
    assert think.type == "thinking" and think.thinking == FULL.reasoning
    assert think.signature == reasoning_token(FULL)
    assert text.type == "text" and text.text == FULL.content
    assert ls.type == "tool_use" and (ls.id, ls.input) == ("call_ls", {"path": "."})
    assert patch.type == "tool_use" and patch.input == {"input": PATCH}
    assert final.stop_reason == "tool_use"
    rec = fake.received[0]
    assert final.usage.input_tokens == len(rec.body) // 4
    assert final.usage.output_tokens > 1  # message_delta's count replaced message_start's


def test_messages_raw_sse_order(url: str, fake: FakeUpstream) -> None:
    fake.script(FULL)
    r = raw_post(
        url, "/v1/messages", {"model": "m", "max_tokens": 9, "messages": MESSAGES, "stream": True}
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["request-id"].startswith("req_fake_")
    events = sse(r.content)
    for name, data in events:
        if name != "ping":  # the SDK drops pings before parsing; its union has no type for them
            MESSAGE_EVENTS.validate_python(data)
    flat = [f"{n}:{d['delta']['type']}" if n == "content_block_delta" else n for n, d in events]
    assert flat == [
        "message_start",
        "content_block_start",  # 0: thinking
        "ping",
        "content_block_delta:thinking_delta",
        "content_block_delta:thinking_delta",
        "content_block_delta:signature_delta",
        "content_block_stop",
        "content_block_start",  # 1: text
        "content_block_delta:text_delta",
        "content_block_delta:text_delta",
        "content_block_stop",
        "content_block_start",  # 2: tool_use, dict arguments
        "content_block_delta:input_json_delta",
        "content_block_delta:input_json_delta",
        "content_block_delta:input_json_delta",
        "content_block_stop",
        "content_block_start",  # 3: tool_use, custom call
        "content_block_delta:input_json_delta",
        "content_block_delta:input_json_delta",
        "content_block_delta:input_json_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    indexes = [d["index"] for n, d in events if n.startswith("content_block")]
    assert indexes == sorted(indexes) and set(indexes) == {0, 1, 2, 3}
    opening = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert opening[0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert opening[1] == {"type": "text", "text": ""}
    assert opening[2]["input"] == {} and opening[2]["id"] == "call_ls"
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert set(start["usage"]) >= {
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
    }
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert set(delta["usage"]) == {"output_tokens"}


def test_messages_beta(ant: anthropic.Anthropic, url: str, fake: FakeUpstream) -> None:
    fake.script("beta hi", "query hi")
    msg = ant.beta.messages.create(model="m", max_tokens=10, messages=MESSAGES)
    assert msg.content[0].type == "text" and msg.content[0].text == "beta hi"
    # Clients such as Claude Code flag the beta API with a query string.
    body = {"model": "m", "max_tokens": 9, "messages": MESSAGES}
    r = httpx.post(url + "/v1/messages?beta=true", json=body)
    assert r.json()["content"] == [{"type": "text", "text": "query hi"}]
    assert [(rec.path, rec.query) for rec in fake.received][-1] == ("/v1/messages", "beta=true")


def test_count_tokens(ant: anthropic.Anthropic, url: str, fake: FakeUpstream) -> None:
    fake.script("kept for the next message")
    count = ant.messages.count_tokens(model="m", messages=MESSAGES, system="Be brief.")
    rec = fake.received[0]
    assert (rec.method, rec.path) == ("POST", "/v1/messages/count_tokens")
    assert count.input_tokens == len(rec.body) // 4
    assert rec.json()["system"] == "Be brief." and rec.reply is None
    assert fake.pending == 1 and fake.completed == [rec]  # no scripted reply consumed
    bad = httpx.post(url + "/v1/messages/count_tokens", content=b"{nope")
    assert bad.status_code == 400
    ErrorResponse.model_validate(bad.json())
    assert bad.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("finish_reason", "stop_reason"),
    [("length", "max_tokens"), ("stop", "end_turn"), ("pause_turn", "pause_turn")],
)
def test_messages_stop_reason(
    ant: anthropic.Anthropic, fake: FakeUpstream, finish_reason: str, stop_reason: str
) -> None:
    fake.script(Reply(finish_reason=finish_reason))
    assert (
        ant.messages.create(model="m", max_tokens=1, messages=MESSAGES).stop_reason == stop_reason
    )


# --- usage, in any shape ------------------------------------------------------------------


@pytest.mark.parametrize(
    "usage",
    [
        # Anthropic's shape: input_tokens leaves the cached 90 out
        {"input_tokens": 10, "cache_read_input_tokens": 90, "output_tokens": 7},
        # Responses' shape: input_tokens counts them in
        {
            "input_tokens": 100,
            "input_tokens_details": {"cached_tokens": 90},
            "output_tokens": 7,
            "output_tokens_details": {"reasoning_tokens": 3},
        },
        # chat's names and the flat ones
        {"prompt_tokens": 100, "completion_tokens": 7, "cached_tokens": 90, "reasoning_tokens": 3},
    ],
)
def test_usage_in_any_shape(
    oai: openai.OpenAI, ant: anthropic.Anthropic, fake: FakeUpstream, usage: dict[str, Any]
) -> None:
    fake.script(Reply(usage=usage, reasoning="r" * 12), Reply(usage=usage))
    resp = oai.responses.create(model="m", input=INPUT)
    msg = ant.messages.create(model="m", max_tokens=1, messages=MESSAGES)
    assert resp.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (
        100,
        7,
        107,
    )
    assert resp.usage.input_tokens_details.cached_tokens == 90
    assert resp.usage.output_tokens_details.reasoning_tokens == 3  # given, or 12 chars // 4
    u = msg.usage
    assert (u.input_tokens, u.cache_read_input_tokens, u.output_tokens) == (10, 90, 7)


def test_usage_passes_unknown_keys(ant: anthropic.Anthropic, fake: FakeUpstream) -> None:
    fake.script(Reply(usage={"output_tokens": 3, "service_tier": "priority", "x_extra": 1}))
    msg = ant.messages.create(model="m", max_tokens=1, messages=MESSAGES)
    assert msg.usage.service_tier == "priority" and msg.usage.output_tokens == 3
    assert msg.usage.model_extra == {"x_extra": 1}


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "exc_type"),
    [
        (
            Reply.error(400, "too long", code="context_length_exceeded", param="input"),
            openai.BadRequestError,
        ),
        (Reply(status=401), openai.AuthenticationError),
        (Reply.error(429, "slow down", headers={"Retry-After": "7"}), openai.RateLimitError),
        (Reply(status=500), openai.InternalServerError),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_responses_errors(
    oai: openai.OpenAI,
    fake: FakeUpstream,
    reply: Reply,
    exc_type: type[openai.APIStatusError],
    stream: bool,
) -> None:
    fake.script(reply)
    with pytest.raises(exc_type) as info:
        oai.responses.create(model="m", input=INPUT, stream=stream)
    err = info.value
    assert err.status_code == reply.status
    assert isinstance(err.body, dict) and set(err.body) >= {"message", "type", "code", "param"}
    if reply.status == 400:
        assert (err.code, err.param, err.body["message"]) == (
            "context_length_exceeded",
            "input",
            "too long",
        )
    if reply.status == 429:
        assert err.response.headers["retry-after"] == "7" and err.body["message"] == "slow down"


@pytest.mark.parametrize(
    ("reply", "exc_type", "kind"),
    [
        (
            Reply.error(400, "prompt is too long"),
            anthropic.BadRequestError,
            "invalid_request_error",
        ),
        (Reply(status=401), anthropic.AuthenticationError, "authentication_error"),
        (
            Reply.error(429, "slow down", headers={"retry-after": "7"}),
            anthropic.RateLimitError,
            "rate_limit_error",
        ),
        (Reply(status=500), anthropic.InternalServerError, "api_error"),
        (Reply(status=529), anthropic.OverloadedError, "overloaded_error"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_messages_errors(
    ant: anthropic.Anthropic,
    fake: FakeUpstream,
    reply: Reply,
    exc_type: type[anthropic.APIStatusError],
    kind: str,
    stream: bool,
) -> None:
    fake.script(reply)
    with pytest.raises(exc_type) as info:
        ant.messages.create(model="m", max_tokens=1, messages=MESSAGES, stream=stream)
    err = info.value
    assert err.status_code == reply.status
    assert isinstance(err.body, dict)
    ErrorResponse.model_validate(err.body)
    assert err.body["type"] == "error" and err.body["error"]["type"] == kind
    if reply.error_detail is not None:
        assert err.body["error"]["message"] == reply.error_detail.message
    if reply.status == 429:
        assert err.response.headers["retry-after"] == "7"


def test_error_type_override(ant: anthropic.Anthropic, fake: FakeUpstream) -> None:
    fake.script(Reply.error(500, "busy", type="overloaded_error"))
    with pytest.raises(anthropic.InternalServerError) as info:
        ant.messages.create(model="m", max_tokens=1, messages=MESSAGES)
    assert isinstance(info.value.body, dict)
    assert info.value.body["error"] == {"type": "overloaded_error", "message": "busy"}


def test_invalid_json_in_each_envelope(url: str, fake: FakeUpstream) -> None:
    r1 = httpx.post(url + "/v1/responses", content=b"{nope")
    r2 = httpx.post(url + "/v1/messages", content=b"[]")
    assert r1.status_code == r2.status_code == 400
    assert r1.json()["error"]["type"] == "invalid_request_error"
    assert r2.json()["type"] == "error" and r2.json()["error"]["type"] == "invalid_request_error"
    assert len(fake.completed) == 2


# --- broken streams and the shared scripting ----------------------------------------------


def test_responses_broken_stream(oai: openai.OpenAI, url: str, fake: FakeUpstream) -> None:
    fake.script(Reply(content="one two three four", break_after_events=3))
    got: list[Any] = []
    with pytest.raises(openai.APIConnectionError):
        got.extend(oai.responses.create(model="m", input=INPUT, stream=True))
    assert [e.type for e in got] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
    ]
    fake.script(Reply(break_after_events=0))  # non-streaming: half a body, then the drop
    with pytest.raises(openai.APIConnectionError):
        oai.responses.create(model="m", input=INPUT)
    assert fake.aborted_count == 2 and fake.completed == []


def test_messages_broken_stream(ant: anthropic.Anthropic, url: str, fake: FakeUpstream) -> None:
    fake.script(Reply(content="one two three four", break_after_events=5))
    got: list[Any] = []
    # The SDK lets the transport's error through mid-stream (httpx's or httpx2's, by version).
    with (
        pytest.raises(Exception, match="incomplete chunked read"),
        ant.messages.stream(model="m", max_tokens=9, messages=MESSAGES) as stream,
    ):
        got.extend(stream.text_stream)
    assert got == ["one t", "wo th"]  # start, block start, ping, two deltas, then the drop
    fake.script(Reply(content="abc", break_after_events=1))
    body = {"model": "m", "max_tokens": 9, "messages": MESSAGES, "stream": True}
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", url + "/v1/messages", json=body) as r,
    ):
        assert r.status_code == 200
        r.read()
    assert len(fake.aborted) == 2


def test_one_script_serves_every_format(
    oai: openai.OpenAI, ant: anthropic.Anthropic, fake: FakeUpstream
) -> None:
    seen: list[str] = []

    def responder(body: dict[str, Any]) -> Reply | None:
        seen.append(str(body.get("model")))
        return Reply(content="from responder") if body.get("model") == "r" else None

    fake.responder = responder
    fake.default = Reply(content="default")
    fake.script("first", Reply(content="second", delay_s=0.2))
    chat = oai.chat.completions.create(model="c", messages=MESSAGES)
    t0 = time.monotonic()
    resp = oai.responses.create(model="r", input=INPUT)
    assert time.monotonic() - t0 >= 0.2  # delay_s honoured on the Responses route too
    msg = ant.messages.create(model="r", max_tokens=1, messages=MESSAGES)
    msg2 = ant.messages.create(model="x", max_tokens=1, messages=MESSAGES)
    assert chat.choices[0].message.content == "first" and resp.output_text == "second"
    assert msg.content[0].type == "text" and msg.content[0].text == "from responder"
    assert msg2.content[0].type == "text" and msg2.content[0].text == "default"
    assert seen == ["r", "x"]  # the queue wins over the responder
    # One counter numbers the answers, whatever the format.
    assert (chat.id, resp.id, msg.id) == ("chatcmpl-fake-1", "resp_fake_2", "msg_fake_3")


def test_delay_and_client_timeout_anthropic(url: str, fake: FakeUpstream) -> None:
    fake.script(Reply(delay_s=3))
    with anthropic.Anthropic(base_url=url, api_key="k", max_retries=0, timeout=0.3) as c:
        with pytest.raises(anthropic.APITimeoutError):
            c.messages.create(model="m", max_tokens=1, messages=MESSAGES)
    assert fake.wait_for(lambda f: len(f.cancelled) == 1, timeout=2)


# --- rendering, for any text --------------------------------------------------------------


@settings(max_examples=examples(40), deadline=None)
@given(
    content=st.text(max_size=40),
    reasoning=st.none() | st.text(max_size=40),
    pieces=st.integers(1, 8),
    args=st.dictionaries(
        st.text(max_size=5), st.integers(-(10**9), 10**9) | st.text(max_size=8), max_size=3
    ),
)
def test_streams_reassemble_any_text(
    content: str, reasoning: str | None, pieces: int, args: dict[str, Any]
) -> None:
    reply = Reply(
        content=content,
        reasoning=reasoning,
        tool_calls=[{"name": "f", "arguments": args}],
        stream_pieces=pieces,
    )
    rec = Received("POST", "/v1/x", "", {}, [], b"{}", 0.0)
    revents = [d for _, d in sse(b"".join(response_events(rec, {}, reply, 1)))]
    for d in revents:
        RESPONSE_EVENTS.validate_python(d)
    text = [d["delta"] for d in revents if d["type"] == "response.output_text.delta"]
    assert "".join(text) == content and len(text) <= pieces
    summary = "".join(
        d["delta"] for d in revents if d["type"] == "response.reasoning_summary_text.delta"
    )
    assert summary == (reasoning or "")
    fargs = "".join(
        d["delta"] for d in revents if d["type"] == "response.function_call_arguments.delta"
    )
    assert orjson.loads(fargs) == args

    mevents = [d for _, d in sse(b"".join(message_events(rec, {}, reply, 1)))]
    deltas = [d["delta"] for d in mevents if d["type"] == "content_block_delta"]
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == content
    thinking = "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta")
    assert thinking == (reasoning or "")
    partial = "".join(d["partial_json"] for d in deltas if d["type"] == "input_json_delta")
    assert orjson.loads(partial) == args

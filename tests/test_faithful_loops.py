"""The read loops pass what they need not change byte for byte, both ways
(docs/retrieval.md#byte-for-byte-both-ways).

A client that declares tools of its own gets the read tool offered from its first request, so
nearly every agent request goes through a loop. With the tool offered but not called, the
upstream gets the forwarded bytes with only ``tools`` changed (compared member by member: the
splice may drop the whitespace between top-level members), and the client gets exactly the
bytes the upstream sent, for the three wire formats, streamed and not. A round that calls the
tool changes ``tools`` and the conversation array only. A property: streams of random events
without the proxy's tool, odd number formats and unknown fields in them, pass byte-identical.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.inprocess import InProcess
from proxy import rawjson as json
from proxy.app import create_app
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import serve_in_thread

from .conftest import InProcessFactory, examples, proxy_config

TOOL = "read_offloaded"
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
HEADERS = {
    "chat": {"authorization": "Bearer sk-faithful", "content-type": "application/json"},
    "responses": {"authorization": "Bearer sk-faithful", "content-type": "application/json"},
    "messages": {"x-api-key": "sk-ant-faithful", "anthropic-version": "2023-06-01",
                 "content-type": "application/json"},
}
# What orjson would never write: spaces, escapes, number spellings, unknown members.
ODD = b'"x_unknown" : { "n" : 1.50, "e" : 1E+2, "s" : "caf\\u00e9 \\/ \\ud83d\\ude00" }'
TOOLS = {
    "chat": b'[ {"type": "function", "function": {"name": "bash", "description": "Run it.",'
            b' "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}} ]',
    "responses": b'[ {"type": "function", "name": "shell", "description": "Run it.",'
                 b' "parameters": {"type": "object", "properties": {}}} ]',
    "messages": b'[ {"name": "Bash", "description": "Run it.",'
                b' "input_schema": {"type": "object", "properties": {}}} ]',
}
CONVERSATION = {
    "chat": b'"messages" : [ {"role": "system", "content": "Be brief."},'
            b' {"role": "user", "content": "caf\\u00e9 1.0"} ]',
    "responses": b'"input" : [ {"type": "message", "role": "user", "content": "caf\\u00e9 1.0"} ]',
    "messages": b'"messages" : [ {"role": "user", "content": [{"type": "text",'
                b' "text": "caf\\u00e9 1.0"}]} ]',
}
MODELS = {"chat": b'"gpt-4o"', "responses": b'"gpt-4o"', "messages": b'"claude-sonnet-4-5"'}


def body(api: str, *, stream: bool, extra: bytes = b"") -> bytes:
    """A request as a client might write it, every member with bytes orjson would not write."""
    parts = [b'"model" : ' + MODELS[api], CONVERSATION[api], b'"tools" : ' + TOOLS[api], ODD,
             b'"temperature" : 0.50']
    if api == "messages":
        parts.append(b'"max_tokens" : 1024')
    if api == "responses":
        parts.append(b'"store" : false')
    if stream:
        parts.append(b'"stream" : true')
    if extra:
        parts.append(extra)
    return b"{ " + b" ,\n ".join(parts) + b" }"


def tool_name(api: str, tool: dict[str, Any]) -> Any:
    return (tool.get("function") or {}).get("name") if api == "chat" else tool.get("name")


def assert_only_tools_changed(api: str, forwarded: bytes, sent: bytes) -> None:
    """``sent`` is ``forwarded`` member by member, but for ``tools``: the client's tools as
    they came, then the read tool."""
    before, after = json.members(forwarded), json.members(sent)
    assert list(after) == list(before)
    for name, value in before.items():
        if name != "tools":
            assert bytes(after[name]) == bytes(value), name
    given, now = json.array_items(before["tools"]), json.array_items(after["tools"])
    assert [bytes(t) for t in now[:-1]] == [bytes(t) for t in given]
    assert tool_name(api, orjson.loads(bytes(now[-1]))) == TOOL


class Recorder:
    """The fake upstream, with every response body it sent kept as sent (appended before the
    first byte goes out, filled in as the bytes go)."""

    def __init__(self, app: FakeUpstream) -> None:
        self.app = app
        self.sent: list[bytearray] = []

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = bytearray()
        self.sent.append(sent)

        async def tee(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.body":
                sent.extend(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, tee)


@pytest.fixture(scope="module")
def _recorded() -> Iterator[tuple[FakeUpstream, Recorder, str]]:
    fake = FakeUpstream()
    recorder = Recorder(fake)
    with serve_in_thread(recorder) as srv:
        yield fake, recorder, srv.url


@pytest.fixture
def recorded(
    _recorded: tuple[FakeUpstream, Recorder, str],
) -> Iterator[tuple[FakeUpstream, Recorder, dict[str, Any]]]:
    fake, recorder, url = _recorded
    fake.reset()
    recorder.sent.clear()
    yield fake, recorder, {"upstream": {"base_url": url + "/v1"}, "anthropic": {"base_url": url}}
    fake.reset()


def client_call(api: str) -> dict[str, Any]:
    name = {"chat": "bash", "responses": "shell", "messages": "Bash"}[api]
    return {"id": "call_c1", "name": name, "arguments": {"cmd": "ls -l"}}


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("calls", [False, True], ids=["text", "client-call"])
async def test_offered_not_called_passes_byte_for_byte(
    make_inproc: InProcessFactory, recorded: tuple[FakeUpstream, Recorder, dict[str, Any]],
    api: str, stream: bool, calls: bool,
) -> None:
    fake, recorder, upstream = recorded
    fake.script(Reply(content="Here: caf\u00e9 \u2713 " * 5, reasoning="think first",
                      tool_calls=[client_call(api)] if calls else None, stream_pieces=6))
    app = await make_inproc(upstream)
    forwarded = body(api, stream=stream)
    r = await app.client.post(PATHS[api], content=forwarded, headers=HEADERS[api])
    assert r.status_code == 200, r.text[:300]
    [rec] = fake.received
    assert_only_tools_changed(api, forwarded, rec.body)
    assert r.content == bytes(recorder.sent[-1])
    if not stream:
        assert r.headers["x-ctxproxy-read-rounds"] == "0"  # through the loop


@pytest.mark.parametrize("options", [b'"stream_options" : {"include_usage" : true}',
                                     b'"stream_options" : {"include_usage" : false}'])
async def test_chat_stream_options_stay_as_forwarded(
    make_inproc: InProcessFactory, recorded: tuple[FakeUpstream, Recorder, dict[str, Any]],
    options: bytes,
) -> None:
    """The loop asks for no usage the client did not ask for: no chunk to withhold."""
    fake, recorder, upstream = recorded
    fake.script(Reply(content="hi there", usage={"prompt_tokens": 3, "completion_tokens": 2}))
    app = await make_inproc(upstream)
    forwarded = body("chat", stream=True, extra=options)
    r = await app.client.post(PATHS["chat"], content=forwarded, headers=HEADERS["chat"])
    assert_only_tools_changed("chat", forwarded, fake.received[0].body)
    assert r.content == bytes(recorder.sent[-1])
    assert (b'"usage":{' in r.content) == (b"true" in options)


class ReadsOnce:
    """A model that calls the proxy's tool once, then answers."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.calls = 0

    def __call__(self, req: dict[str, Any]) -> Reply:
        self.calls += 1
        if self.calls == 1:
            return Reply(content=None, tool_calls=[
                {"id": "call_r1", "name": TOOL, "arguments": {"file_path": "tool_result/x.txt"}}])
        return Reply(content="done", stream_pieces=1)


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_read_round_changes_only_tools_and_the_conversation(
    make_inproc: InProcessFactory, recorded: tuple[FakeUpstream, Recorder, dict[str, Any]],
    api: str, stream: bool,
) -> None:
    fake, _, upstream = recorded
    fake.responder = ReadsOnce(api)
    app = await make_inproc(upstream)
    forwarded = body(api, stream=stream)
    r = await app.client.post(PATHS[api], content=forwarded, headers=HEADERS[api])
    assert r.status_code == 200
    first, second = fake.received
    assert_only_tools_changed(api, forwarded, first.body)
    key = "input" if api == "responses" else "messages"
    a, b = json.members(first.body), json.members(second.body)
    assert list(a) == list(b)
    for name in a:
        if name != key:
            assert bytes(b[name]) == bytes(a[name]), name
    items_a, items_b = json.array_items(a[key]), json.array_items(b[key])
    assert [bytes(i) for i in items_b[: len(items_a)]] == [bytes(i) for i in items_a]
    assert len(items_b) == len(items_a) + 2  # the round's answer and the read's result
    assert b"done" in r.content


async def test_a_continued_responses_round_changes_only_what_continues(
    make_inproc: InProcessFactory, recorded: tuple[FakeUpstream, Recorder, dict[str, Any]],
) -> None:
    fake, recorder, upstream = recorded
    fake.responder = ReadsOnce("responses")
    app = await make_inproc(upstream)
    forwarded = body("responses", stream=False, extra=b'"previous_response_id" : "resp_prev"')
    r = await app.client.post(PATHS["responses"], content=forwarded, headers=HEADERS["responses"])
    assert r.status_code == 200
    first, second = fake.received
    a, b = json.members(first.body), json.members(second.body)
    assert list(a) == list(b)
    for name in a:
        if name not in ("input", "previous_response_id"):
            assert bytes(b[name]) == bytes(a[name]), name
    assert orjson.loads(bytes(b["previous_response_id"])) == orjson.loads(recorder.sent[0])["id"]
    [result] = orjson.loads(bytes(b["input"]))
    assert result["type"] == "function_call_output" and result["call_id"] == "call_r1"


# --- a property: random streams without the proxy's tool ---------------------------------------

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_odd_number = st.sampled_from([b"1.50", b"1E+2", b"-0", b"0.0000001", b"12345678901234567890",
                               b"1e-7", b"3.0"])


@st.composite
def _odd(draw: st.DrawFn, obj: dict[str, Any]) -> bytes:
    """``obj`` as JSON bytes, maybe with an unknown member of an odd spelling, maybe spread over
    several data lines (pretty-printed)."""
    raw = orjson.dumps(obj, option=orjson.OPT_INDENT_2 if draw(st.integers(0, 9)) == 0 else 0)
    if draw(st.booleans()):
        raw = raw[:-1].rstrip() + b',"x_odd" : ' + draw(_odd_number) + b"}"
    return raw


def _data(raw: bytes, name: str = "") -> bytes:
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + raw.replace(b"\n", b"\ndata: ") + b"\n\n"


@st.composite
def chat_streams(draw: st.DrawFn) -> bytes:
    base = {"id": "chatcmpl-p", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    events = []
    for piece in draw(st.lists(_text, max_size=5)):
        choice = {"index": 0, "delta": {"content": piece}, "finish_reason": None}
        events.append(_data(draw(_odd({**base, "choices": [choice]}))))
    calls = draw(st.integers(0, 2))
    for i in range(calls):
        head = {"index": i, "id": f"call_{i}", "type": "function",
                "function": {"name": draw(st.sampled_from(["bash", "ls", "Read"])), "arguments": ""}}
        events.append(_data(draw(_odd({**base, "choices": [{"index": 0, "delta": {
            "tool_calls": [head]}, "finish_reason": None}]}))))
        for frag in draw(st.lists(_text, max_size=3)):
            events.append(_data(draw(_odd({**base, "choices": [{"index": 0, "delta": {
                "tool_calls": [{"index": i, "function": {"arguments": frag}}]},
                "finish_reason": None}]}))))
    finish = {"index": 0, "delta": {}, "finish_reason": "tool_calls" if calls else "stop"}
    events.append(_data(draw(_odd({**base, "choices": [finish]}))))
    if draw(st.booleans()):
        usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        events.append(_data(draw(_odd({**base, "choices": [], "usage": usage}))))
    return b"".join(events) + b"data: [DONE]\n\n"


@st.composite
def messages_streams(draw: st.DrawFn) -> bytes:
    def event(name: str, data: dict[str, Any]) -> bytes:
        return _data(draw(_odd({"type": name, **data})), name)

    events = [event("message_start", {"message": {
        "id": "msg_p", "type": "message", "role": "assistant", "model": "claude", "content": [],
        "stop_reason": None, "usage": {"input_tokens": 9, "output_tokens": 1}}})]
    kinds = draw(st.lists(st.sampled_from(["text", "thinking", "tool_use", "ping"]), max_size=4))
    index = 0
    for kind in kinds:
        if kind == "ping":
            events.append(event("ping", {}))
            continue
        if kind == "text":
            block: dict[str, Any] = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": t} for t in draw(st.lists(_text, max_size=3))]
        elif kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": t}
                      for t in draw(st.lists(_text, max_size=3))]
            deltas.append({"type": "signature_delta", "signature": "EqQBsig+/=="})
        else:
            block = {"type": "tool_use", "id": f"toolu_{index}",
                     "name": draw(st.sampled_from(["Bash", "Read"])), "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": p}
                      for p in ('{"cmd":', ' "ls"}')]
        events.append(event("content_block_start", {"index": index, "content_block": block}))
        events += [event("content_block_delta", {"index": index, "delta": d}) for d in deltas]
        events.append(event("content_block_stop", {"index": index}))
        index += 1
    stop = "tool_use" if "tool_use" in kinds else "end_turn"
    events.append(event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None},
                                          "usage": {"output_tokens": 7}}))
    events.append(event("message_stop", {}))
    return b"".join(events)


@st.composite
def responses_streams(draw: st.DrawFn) -> bytes:
    seq = [draw(st.integers(0, 1))]  # numbered from 0 (OpenAI) or from 1

    def event(name: str, **data: Any) -> bytes:
        out = _data(draw(_odd({"type": name, "sequence_number": seq[0], **data})), name)
        seq[0] += 1
        return out

    response: dict[str, Any] = {"id": "resp_p", "object": "response", "status": "in_progress",
                                "output": [], "usage": None}
    events = [event("response.created", response=response),
              event("response.in_progress", response=response)]
    items: list[Any] = []
    for i, kind in enumerate(draw(st.lists(st.sampled_from(["message", "reasoning", "call"]),
                                           max_size=4))):
        if kind == "message":
            text = draw(_text)
            item: dict[str, Any] = {"type": "message", "id": f"msg_{i}", "role": "assistant",
                                    "content": [{"type": "output_text", "text": text}]}
            events.append(event("response.output_item.added", output_index=i,
                                item={**item, "content": []}))
            events.append(event("response.output_text.delta", output_index=i, content_index=0,
                                item_id=item["id"], delta=text))
        elif kind == "reasoning":
            item = {"type": "reasoning", "id": f"rs_{i}", "summary": [],
                    "encrypted_content": "gAAAA+/=="}
            events.append(event("response.output_item.added", output_index=i, item=item))
        else:
            item = {"type": "function_call", "id": f"fc_{i}", "call_id": f"call_{i}",
                    "name": draw(st.sampled_from(["shell", "apply_patch"])), "arguments": "{}"}
            events.append(event("response.output_item.added", output_index=i,
                                item={**item, "arguments": ""}))
            events.append(event("response.function_call_arguments.delta", output_index=i,
                                item_id=item["id"], delta="{}"))
        events.append(event("response.output_item.done", output_index=i, item=item))
        items.append(item)
    usage = {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13}
    events.append(event("response.completed", response={**response, "status": "completed",
                                                         "output": items, "usage": usage}))
    return b"".join(events)


STREAMS = {"chat": chat_streams(), "messages": messages_streams(),
           "responses": responses_streams()}


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_random_streams_without_the_proxys_tool_pass_byte_identical(
    api: str, fake: FakeUpstream, fake_url: str, tmp_path: Path,
) -> None:
    """Synchronous for hypothesis: the app runs in a loop of this test's own."""
    with asyncio.Runner() as runner:
        app = runner.run(InProcess(create_app(proxy_config(fake_url, tmp_path / "data"))).start())

        @settings(max_examples=examples(90), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(STREAMS[api])
        def one(stream: bytes) -> None:
            fake.reset()
            fake.script(Reply(body=stream))
            r = runner.run(app.client.post(PATHS[api], content=body(api, stream=True),
                                           headers=HEADERS[api]))
            assert r.status_code == 200
            [rec] = fake.received
            assert TOOL in rec.body.decode()  # the loop's request
            assert r.content == stream

        try:
            one()
        finally:
            runner.run(app.stop())


# --- the encoder alone ---------------------------------------------------------------------------


def test_encoder_splices_into_the_forwarded_bytes() -> None:
    from proxy.retrieval.loop import Encoder

    read = {"type": "function", "name": TOOL}
    raw = b'{"input" : "caf\\u00e9", "n" : 1.50, "tools" : [ {"name": "a"} ]}'
    body = {"input": "caf\u00e9", "n": 1.5, "tools": [{"name": "a"}, read]}
    encoder = Encoder(body, raw, "input", lambda v: [{"role": "user", "content": v}])
    first = json.members(encoder.request())
    assert bytes(first["input"]) == b'"caf\\u00e9"' and bytes(first["n"]) == b"1.50"
    assert [bytes(t) for t in json.array_items(first["tools"])] == [b'{"name": "a"}',
                                                                    json.dumps(read)]
    # A string input becomes its one message once a round is appended to it.
    second = orjson.loads(encoder.request([b'{"k":1}', b'{"k":2}']))
    assert second["input"] == [{"role": "user", "content": "caf\u00e9"}, {"k": 1}, {"k": 2}]
    assert orjson.loads(encoder.request([b'{"k":3}']))["input"][-2:] == [{"k": 2}, {"k": 3}]
    # No tools in the bytes: the body's become them. The tool already there: nothing changes.
    assert orjson.loads(Encoder({"tools": [read]}, b"{}", "input").request()) == {"tools": [read]}
    same = b'{"tools":[{"name":"read_offloaded"}]}'
    assert Encoder(orjson.loads(same), same, "input").request() == same
    # Without the bytes, the dict.
    fallback = Encoder({"input": [1], "tools": [read]}, None, "input")
    assert orjson.loads(fallback.request([b"2"])) == {"input": [1, 2], "tools": [read]}
    assert orjson.loads(fallback.continued({"input": [3]}, ("tools",))) == {"input": [3]}

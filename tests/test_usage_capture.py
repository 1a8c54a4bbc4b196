"""What the proxy keeps of every billed call's ``usage`` (the ledger's capture points): the
answer taps of the three formats, the read loops' per-call usage, and the summarizer's and
memory fold's calls; read by :func:`proxy.ledger.usage.parse_usage`.

Hand-written answers mirror the real APIs' shapes; the fake upstream's answers (with its
provider-like prompt cache on) go through the proxy to the real openai and anthropic SDKs, and
what the tap kept must parse to what the SDK reports.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import anthropic
import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import proxy.app
from harness.inprocess import InProcess
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.formats import Tap
from proxy.formats.chat.request import ChatFormat, ChatTap
from proxy.formats.messages.answer import MessagesTap
from proxy.formats.messages.request import MessagesFormat
from proxy.formats.responses.answer import ResponsesTap
from proxy.formats.responses.request import ResponsesFormat
from proxy.retrieval.loop import ReadLoop, Rounds
from proxy.services import open_services
from proxy.session import Identity
from proxy.upstream.calls import Call
from proxy.usage import Usage, parse_usage

from . import test_compaction as compaction
from . import test_memory as memory
from . import test_messages as messages
from .conftest import InProcessFactory, ProxyFactory, examples

# --- real-API-shaped answers ------------------------------------------------------------------

# OpenAI chat completions, a reasoning model with a cache hit.
CHAT_USAGE = {
    "prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
    "prompt_tokens_details": {"cached_tokens": 1920, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 192, "audio_tokens": 0,
                                  "accepted_prediction_tokens": 0,
                                  "rejected_prediction_tokens": 0},
}
CHAT_BILLED = Usage(input=86, cache_read=1920, output=300, reasoning=192)
CHAT_BODY = {
    "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG", "object": "chat.completion",
    "created": 1741570283, "model": "o3-mini-2025-01-31",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Done.", "refusal": None,
                                         "annotations": []},
                 "logprobs": None, "finish_reason": "stop"}],
    "usage": CHAT_USAGE, "service_tier": "default", "system_fingerprint": "fp_42bfad963b",
}


def chat_stream(usage: Any) -> bytes:
    """A stream with ``include_usage``: ``usage: null`` on every chunk, then the usage chunk."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1741570283,
            "model": "o3-mini-2025-01-31", "system_fingerprint": "fp_42bfad963b", "usage": None}
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": "", "refusal": None},
                                    {"content": "Do"}, {"content": "ne."}, {}]
    chunks = [{**base, "choices": [{"index": 0, "delta": d, "logprobs": None,
                                    "finish_reason": "stop" if not d else None}]}
              for d in deltas]
    chunks.append({**base, "choices": [], "usage": usage})
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


# OpenAI Responses.
RESPONSES_USAGE = {
    "input_tokens": 5000, "input_tokens_details": {"cached_tokens": 4096},
    "output_tokens": 800, "output_tokens_details": {"reasoning_tokens": 512},
    "total_tokens": 5800,
}
RESPONSES_BILLED = Usage(input=904, cache_read=4096, output=800, reasoning=512)
MESSAGE_ITEM = {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": "Done.", "annotations": []}]}


def response(status: str, usage: Any) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "created_at": 1741570283, "status": status,
            "model": "gpt-5", "output": [MESSAGE_ITEM] if usage else [], "usage": usage,
            "error": None, "incomplete_details": None}


def sse(*events: tuple[str, dict[str, Any]]) -> bytes:
    return b"".join(b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
                    for name, data in events)


def responses_stream(terminal: str, usage: Any) -> bytes:
    seq = iter(range(100))
    return sse(
        ("response.created", {"type": "response.created", "sequence_number": next(seq),
                              "response": response("in_progress", None)}),
        ("response.in_progress", {"type": "response.in_progress", "sequence_number": next(seq),
                                  "response": response("in_progress", None)}),
        ("response.output_item.added", {"type": "response.output_item.added", "output_index": 0,
                                        "sequence_number": next(seq), "item": MESSAGE_ITEM}),
        ("response.output_item.done", {"type": "response.output_item.done", "output_index": 0,
                                       "sequence_number": next(seq), "item": MESSAGE_ITEM}),
        (f"response.{terminal}", {"type": f"response.{terminal}", "sequence_number": next(seq),
                                  "response": response(terminal, usage)}),
    )


# Anthropic Messages: a cache read, and a write split between the 5-minute and 1-hour TTLs.
MESSAGES_USAGE = {
    "input_tokens": 12, "cache_creation_input_tokens": 3000, "cache_read_input_tokens": 20000,
    "cache_creation": {"ephemeral_5m_input_tokens": 1000, "ephemeral_1h_input_tokens": 2000},
    "output_tokens": 400, "service_tier": "standard",
}
MESSAGES_BILLED = Usage(input=12, cache_read=20000, cache_write_5m=1000, cache_write_1h=2000,
                        output=400)
# Server-side compaction: two samplings; the top level is the last one's, the bill their sum.
ITERATIONS = [
    {"type": "compaction", "input_tokens": 150500, "output_tokens": 2400,
     "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
    {"type": "message", "input_tokens": 3000, "output_tokens": 200,
     "cache_read_input_tokens": 1000, "cache_creation_input_tokens": 500,
     "cache_creation": {"ephemeral_5m_input_tokens": 500, "ephemeral_1h_input_tokens": 0}},
]
COMPACTED_USAGE = {"input_tokens": 3000, "cache_read_input_tokens": 1000,
                   "cache_creation_input_tokens": 500, "output_tokens": 200,
                   "iterations": ITERATIONS}
COMPACTED_BILLED = Usage(input=153500, cache_read=1000, cache_write_5m=500, output=2600,
                         iterations=2)


def message(usage: Any) -> dict[str, Any]:
    return {"id": "msg_01", "type": "message", "role": "assistant", "model": "claude-opus-4-5",
            "content": [{"type": "text", "text": "Done."}], "stop_reason": "end_turn",
            "stop_sequence": None, "usage": usage}


def messages_stream(start: dict[str, Any], delta: dict[str, Any]) -> bytes:
    opening = {**message(start), "content": [], "stop_reason": None}
    return sse(
        ("message_start", {"type": "message_start", "message": opening}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("ping", {"type": "ping"}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "Done."}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": delta}),
        ("message_stop", {"type": "message_stop"}),
    )


def fed(tap: Tap, raw: bytes, *, piece: int = 7) -> Tap:
    """``raw`` streamed into ``tap`` in pieces that split lines and characters anywhere."""
    for at in range(0, len(raw), piece):
        tap.stream(raw[at : at + piece])
    return tap


def whole(tap: Tap, data: Any) -> Tap:
    tap.whole(orjson.dumps(data))
    return tap


WITHOUT_ITERATIONS = {k: v for k, v in COMPACTED_USAGE.items() if k != "iterations"}
# The real message_start: the prompt and a token or so of output; message_delta: cumulative
# counts (a null meaning "not reported"), and, after server-side compaction, the iterations.
CASES: dict[str, tuple[str, Callable[[], Tap], Usage]] = {
    "chat whole": ("chat", lambda: whole(ChatTap(), CHAT_BODY), CHAT_BILLED),
    "chat stream": ("chat", lambda: fed(ChatTap(), chat_stream(CHAT_USAGE)), CHAT_BILLED),
    "responses whole": ("responses",
                        lambda: whole(ResponsesTap(), response("completed", RESPONSES_USAGE)),
                        RESPONSES_BILLED),
    "responses stream": ("responses",
                         lambda: fed(ResponsesTap(), responses_stream("completed",
                                                                      RESPONSES_USAGE)),
                         RESPONSES_BILLED),
    "responses incomplete": ("responses",
                             lambda: fed(ResponsesTap(), responses_stream("incomplete",
                                                                          RESPONSES_USAGE)),
                             RESPONSES_BILLED),
    "responses failed": ("responses",
                         lambda: fed(ResponsesTap(), responses_stream("failed",
                                                                      RESPONSES_USAGE)),
                         RESPONSES_BILLED),
    "messages whole": ("messages", lambda: whole(MessagesTap(), message(MESSAGES_USAGE)),
                       MESSAGES_BILLED),
    "messages stream": ("messages", lambda: fed(MessagesTap(), messages_stream(
        {**MESSAGES_USAGE, "output_tokens": 1},
        {"output_tokens": 400, "input_tokens": 12, "cache_read_input_tokens": None})),
        MESSAGES_BILLED),
    "messages stream, old delta": ("messages", lambda: fed(MessagesTap(), messages_stream(
        {**MESSAGES_USAGE, "output_tokens": 1}, {"output_tokens": 400})), MESSAGES_BILLED),
    "messages compacted whole": ("messages", lambda: whole(MessagesTap(),
                                                           message(COMPACTED_USAGE)),
                                 COMPACTED_BILLED),
    "messages compacted stream": ("messages", lambda: fed(MessagesTap(), messages_stream(
        {**WITHOUT_ITERATIONS, "output_tokens": 1},
        {"output_tokens": 200, "input_tokens": 3000, "cache_read_input_tokens": 1000,
         "cache_creation_input_tokens": 500, "iterations": ITERATIONS})), COMPACTED_BILLED),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_tap_keeps_the_answers_usage(case: str) -> None:
    api, make, billed = CASES[case]
    tap = make()
    assert parse_usage(api, tap.usage()) == billed
    assert tap.answer()  # the archive's view is unchanged by it


def test_chat_stream_without_include_usage_has_none() -> None:
    raw = chat_stream(None).replace(b'"usage":null', b"")
    tap = fed(ChatTap(), raw)
    assert tap.usage() is None and parse_usage("chat", tap.usage()) is None
    tap.saw_usage(CHAT_USAGE)  # what a litellm route tells it
    assert parse_usage("chat", tap.usage()) == CHAT_BILLED
    nothing = ChatTap()
    assert nothing.usage() is None
    assert ResponsesTap().usage() is None and MessagesTap().usage() is None


def test_error_and_odd_bodies_report_no_usage() -> None:
    for tap in (ChatTap(), ResponsesTap(), MessagesTap()):
        tap.whole(b'{"error": {"message": "boom"}}')
        assert tap.usage() is None
        tap.whole(b"not json")
        assert tap.usage() is None


# --- parse_usage's properties -------------------------------------------------------------------

counts = st.one_of(st.none(), st.integers(min_value=-5, max_value=10**7), st.floats(
    allow_nan=False, allow_infinity=False, min_value=-5, max_value=1e7), st.booleans(),
    st.text(max_size=3))
sizes = st.integers(min_value=0, max_value=10**7)


def present(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


@st.composite
def openai_usages(draw: st.DrawFn, api: str) -> dict[str, Any]:
    prompt, output = ("prompt_tokens", "completion_tokens") if api == "chat" else (
        "input_tokens", "output_tokens")
    details = "prompt_tokens_details" if api == "chat" else "input_tokens_details"
    out_details = "completion_tokens_details" if api == "chat" else "output_tokens_details"
    total = draw(sizes)
    usage = present(**{prompt: total, output: draw(st.one_of(st.none(), sizes))})
    usage[details] = present(cached_tokens=draw(st.one_of(st.none(), sizes)))
    usage[out_details] = present(reasoning_tokens=draw(st.one_of(st.none(), sizes)))
    if draw(st.booleans()):  # litellm's translation of an Anthropic answer names its parts so
        usage["cache_creation_input_tokens"] = draw(sizes)
    return usage


@st.composite
def anthropic_usages(draw: st.DrawFn) -> dict[str, Any]:
    def one() -> dict[str, Any]:
        usage = present(input_tokens=draw(st.one_of(st.none(), sizes)),
                        output_tokens=draw(st.one_of(st.none(), sizes)),
                        cache_read_input_tokens=draw(st.one_of(st.none(), sizes)),
                        cache_creation_input_tokens=draw(st.one_of(st.none(), sizes)))
        if draw(st.booleans()):
            usage["cache_creation"] = present(
                ephemeral_5m_input_tokens=draw(st.one_of(st.none(), sizes)),
                ephemeral_1h_input_tokens=draw(st.one_of(st.none(), sizes)))
        return usage

    usage = one()
    if draw(st.booleans()):
        usage["iterations"] = [one() for _ in range(draw(st.integers(0, 3)))]
    return usage


def assert_sane(billed: Usage | None) -> None:
    if billed is None:
        return
    parts = (billed.input, billed.cache_read, billed.cache_write_5m, billed.cache_write_1h,
             billed.output, billed.reasoning, billed.iterations)
    assert all(isinstance(p, int) and p >= 0 for p in parts)
    assert billed.prompt == (billed.input + billed.cache_read + billed.cache_write_5m
                             + billed.cache_write_1h)
    assert Usage.from_json(billed.to_json()) == billed


@settings(max_examples=examples(300), deadline=None)
@given(st.sampled_from(["chat", "responses"]).flatmap(
    lambda api: st.tuples(st.just(api), openai_usages(api))))
def test_openai_prompt_is_the_providers_total(case: tuple[str, dict[str, Any]]) -> None:
    api, usage = case
    billed = parse_usage(api, usage)
    assert_sane(billed)
    total = usage.get("prompt_tokens" if api == "chat" else "input_tokens")
    assert billed is not None and billed.prompt == total  # cached / written are of it


@settings(max_examples=examples(300), deadline=None)
@given(anthropic_usages())
def test_anthropic_prompt_is_its_parts(usage: dict[str, Any]) -> None:
    billed = parse_usage("messages", usage)
    assert_sane(billed)
    samplings = [i for i in usage.get("iterations") or []
                 if any(k in i for k in ("input_tokens", "output_tokens", "cache_read_input_tokens",
                                         "cache_creation_input_tokens"))]
    parts = samplings or ([usage] if any(
        k in usage for k in ("input_tokens", "output_tokens", "cache_read_input_tokens",
                             "cache_creation_input_tokens")) else [])
    if not parts:
        assert billed is None
        return
    assert billed is not None

    def written(u: Mapping[str, Any]) -> int:
        split = u.get("cache_creation")
        if isinstance(split, dict) and split:
            return sum(split.values())
        return int(u.get("cache_creation_input_tokens", 0))

    assert billed.prompt == sum(u.get("input_tokens", 0) + u.get("cache_read_input_tokens", 0)
                                + written(u) for u in parts)
    assert billed.output == sum(u.get("output_tokens", 0) for u in parts)
    assert billed.iterations == len(samplings)


@settings(max_examples=examples(300), deadline=None)
@given(st.sampled_from(["chat", "responses", "messages"]),
       st.recursive(st.one_of(counts, st.dictionaries(st.sampled_from([
           "prompt_tokens", "completion_tokens", "input_tokens", "output_tokens",
           "cached_tokens", "cache_read_input_tokens", "cache_creation_input_tokens",
           "reasoning_tokens", "ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens"]),
           counts)),
           lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(
               st.sampled_from(["prompt_tokens_details", "input_tokens_details",
                                "completion_tokens_details", "output_tokens_details",
                                "cache_creation", "iterations", "usage"]), inner)),
           max_leaves=12))
def test_any_usage_parses_to_parts_never_negative(api: str, usage: Any) -> None:
    assert_sane(parse_usage(api, usage))


# --- the fake's answers, through the proxy, read by the SDKs ----------------------------------


@pytest.fixture
def taps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Tap]]:
    """Every answer tap the proxy makes, with its format's name."""
    made: list[tuple[str, Tap]] = []
    for cls in (ChatFormat, ResponsesFormat, MessagesFormat):
        def tap(self: Any, original: Callable[[Any], Tap] = cls.tap) -> Tap:
            t = original(self)
            made.append((self.name, t))
            return t

        monkeypatch.setattr(cls, "tap", tap)
    return made


LONG = "Explain the build. " + "context " * 800  # past OpenAI's 1024-token cache minimum


def billed_of(taps: list[tuple[str, Tap]]) -> Usage | None:
    api, tap = taps[-1]
    return parse_usage(api, tap.usage())


async def test_openai_sdk_and_the_tap_agree(
    make_inproc: InProcessFactory, fake: FakeUpstream, taps: list[tuple[str, Tap]]
) -> None:
    fake.prompt_cache = True
    app = await make_inproc()
    client = openai.AsyncOpenAI(base_url=app.url + "/v1", api_key="sk-u", max_retries=0,
                                http_client=app.client)
    msgs: Any = [{"role": "user", "content": LONG}]
    seen = []
    for _ in range(2):
        resp = await client.chat.completions.create(model="gpt-4o", messages=msgs)
        assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
        billed = billed_of(taps)
        assert billed is not None
        assert billed.prompt == resp.usage.prompt_tokens
        assert billed.cache_read == resp.usage.prompt_tokens_details.cached_tokens
        assert billed.output == resp.usage.completion_tokens
        seen.append(billed.cache_read)
    stream = await client.chat.completions.create(model="gpt-4o", messages=msgs, stream=True,
                                                  stream_options={"include_usage": True})
    usage = [c.usage async for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details is not None
    billed = billed_of(taps)
    assert billed is not None and billed.cache_read == usage[0].prompt_tokens_details.cached_tokens
    assert billed.prompt == usage[0].prompt_tokens
    seen.append(billed.cache_read)
    assert seen[0] == 0 and seen[1] == seen[2] > 1024  # the fake's cache read the prompt

    for stream_it in (False, True):
        if stream_it:
            async with client.responses.stream(model="gpt-4o", input=LONG) as events:
                final = await events.get_final_response()
        else:
            final = await client.responses.create(model="gpt-4o", input=LONG)
        assert final.usage is not None
        billed = billed_of(taps)
        assert billed is not None and taps[-1][0] == "responses"
        assert billed.prompt == final.usage.input_tokens
        assert billed.cache_read == final.usage.input_tokens_details.cached_tokens
        assert billed.output == final.usage.output_tokens
    assert billed.cache_read > 1024


def test_anthropic_sdk_and_the_tap_agree(
    make_proxy: ProxyFactory, fake: FakeUpstream, taps: list[tuple[str, Tap]]
) -> None:
    fake.prompt_cache = True
    srv = make_proxy()
    # The anthropic SDK's own httpx fork cannot take the in-process transport: a real server.
    client = anthropic.Anthropic(base_url=srv.url, api_key="sk-ant-u", max_retries=0,
                                 timeout=30)
    system: Any = [{"type": "text", "text": "You are terse. " * 50,
                    "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    msgs: Any = [{"role": "user", "content": [
        {"type": "text", "text": LONG, "cache_control": {"type": "ephemeral"}}]}]
    reads = []
    for stream_it in (False, True, False):
        if stream_it:
            with client.messages.stream(model="claude-x", max_tokens=100, system=system,
                                        messages=msgs) as events:
                final = events.get_final_message()
        else:
            final = client.messages.create(model="claude-x", max_tokens=100, system=system,
                                           messages=msgs)
        billed = billed_of(taps)
        assert billed is not None and taps[-1][0] == "messages"
        u = final.usage
        assert u.cache_creation is not None
        assert (billed.input, billed.cache_read, billed.cache_write_5m, billed.cache_write_1h,
                billed.output) == (u.input_tokens, u.cache_read_input_tokens,
                                   u.cache_creation.ephemeral_5m_input_tokens,
                                   u.cache_creation.ephemeral_1h_input_tokens, u.output_tokens)
        reads.append((billed.cache_read, billed.cache_write_5m, billed.cache_write_1h))
    assert reads[0][0] == 0 and reads[0][1] > 0 and reads[0][2] > 0  # written, 5m and 1h
    assert reads[1] == reads[2] == (sum(reads[0][1:]), 0, 0)  # then read whole


# --- the read loops: every upstream call's usage ------------------------------------------------


class Recording:
    """A read loop whose every result is kept (the loops are the services' ``readers``)."""

    def __init__(self, inner: ReadLoop) -> None:
        self.inner = inner
        self.done: list[Rounds] = []

    def needed(self, messages: Any) -> bool:
        return self.inner.needed(messages)

    def with_tool(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.inner.with_tool(body)

    async def non_stream(self, *args: Any, **kwargs: Any) -> Rounds:
        self.done.append(await self.inner.non_stream(*args, **kwargs))
        return self.done[-1]

    async def stream(self, *args: Any, **kwargs: Any) -> Rounds:
        self.done.append(await self.inner.stream(*args, **kwargs))
        return self.done[-1]


def recording(app: InProcess, api: str) -> Recording:
    readers = app.state["services"].readers
    readers[api] = Recording(readers[api])
    return readers[api]  # type: ignore[no-any-return]


PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
HEADERS = {
    "chat": {"authorization": "Bearer sk-loop"},
    "responses": {"authorization": "Bearer sk-loop"},
    "messages": {"x-api-key": "sk-ant-loop", "anthropic-version": "2023-06-01"},
}


def loop_body(api: str, stream: bool) -> dict[str, Any]:
    """A request declaring a tool of the client's: the read tool is offered with it."""
    schema = {"type": "object", "properties": {"cmd": {"type": "string"}}}
    if api == "chat":
        body: dict[str, Any] = {"model": "gpt-4o", "messages": [{"role": "user", "content": "go"}],
                                "tools": [{"type": "function", "function": {
                                    "name": "bash", "parameters": schema}}]}
        if stream:
            body["stream_options"] = {"include_usage": True}
    elif api == "responses":
        body = {"model": "gpt-4o", "input": "go",
                "tools": [{"type": "function", "name": "shell", "parameters": schema}]}
    else:
        body = {"model": "claude-x", "max_tokens": 100,
                "messages": [{"role": "user", "content": "go"}],
                "tools": [{"name": "Bash", "input_schema": schema}]}
    return {**body, "stream": stream}


def scripted_usage(api: str, i: int) -> dict[str, Any]:
    """Call ``i``'s usage, distinct per call, in ``api``'s shape."""
    if api == "chat":
        return {"prompt_tokens": 1000 * i, "completion_tokens": i, "total_tokens": 1001 * i,
                "prompt_tokens_details": {"cached_tokens": 100 * i}}
    if api == "responses":
        return {"input_tokens": 1000 * i, "output_tokens": i,
                "input_tokens_details": {"cached_tokens": 100 * i}}
    return {"input_tokens": 10 * i, "output_tokens": i, "cache_read_input_tokens": 100 * i,
            "cache_creation_input_tokens": 5 * i}


def expected_billed(api: str, i: int) -> Usage:
    if api == "messages":
        return Usage(input=10 * i, cache_read=100 * i, cache_write_5m=5 * i, output=i)
    return Usage(input=900 * i, cache_read=100 * i, output=i)


READ = {"name": "read_offloaded", "arguments": {"file_path": "tool_result/none.txt"}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_the_loops_keep_every_calls_usage(
    make_inproc: InProcessFactory, fake: FakeUpstream, api: str, stream: bool
) -> None:
    app = await make_inproc()
    loop = recording(app, api)
    fake.script(
        Reply(content=None, tool_calls=[{**READ, "id": "r1"}], usage=scripted_usage(api, 1)),
        Reply(content=None, tool_calls=[{**READ, "id": "r2"}], usage=scripted_usage(api, 2)),
        Reply(content="found it", usage=scripted_usage(api, 3)),
    )
    before = time.time()
    r = await app.client.post(PATHS[api], content=orjson.dumps(loop_body(api, stream)),
                              headers=HEADERS[api])
    after = time.time()
    assert r.status_code == 200 and (stream or b"found it" in r.content)
    assert len(fake.received) == 3 and fake.pending == 0
    [done] = loop.done
    assert done.rounds == 2
    assert [parse_usage(api, u) for u in done.calls] == [expected_billed(api, i)
                                                         for i in (1, 2, 3)]
    if api == "chat":  # sent verbatim: kept as it came
        assert done.calls == [scripted_usage(api, i) for i in (1, 2, 3)]
    assert len(done.sent_at) == 3
    assert before <= done.sent_at[0] <= done.sent_at[1] <= done.sent_at[2] <= after
    arrived = [rec.at for rec in fake.received]
    assert arrived == sorted(arrived)


async def test_a_loop_call_without_usage_is_kept_as_none(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    """A chat stream whose client asked no usage: the loop asks none either (what it forwards
    stays as the client sent it), so no call reports any; a failed call reports none."""
    app = await make_inproc()
    loop = recording(app, "chat")
    fake.script(Reply(content=None, tool_calls=[{**READ, "id": "r1"}]), Reply(content="done"))
    body = {k: v for k, v in loop_body("chat", True).items() if k != "stream_options"}
    r = await app.client.post(PATHS["chat"], content=orjson.dumps(body), headers=HEADERS["chat"])
    assert r.status_code == 200 and b'"usage"' not in r.content
    assert loop.done[-1].calls == [None, None] and len(loop.done[-1].sent_at) == 2
    fake.script(Reply(content=None, tool_calls=[{**READ, "id": "r1"}], usage=scripted_usage(
        "chat", 1)), Reply.error(500, "down"))
    r = await app.client.post(PATHS["chat"], content=orjson.dumps(loop_body("chat", False)),
                              headers=HEADERS["chat"])
    assert r.status_code == 500
    assert loop.done[-1].calls == [scripted_usage("chat", 1), None]


# --- the summarizer's and the fold's calls ------------------------------------------------------


class Sink:
    """A CallSink that keeps what it is told."""

    def __init__(self) -> None:
        self.calls: list[tuple[Identity, Call]] = []

    def record_call(self, identity: Identity, call: Call) -> None:
        self.calls.append((identity, call))


@pytest.fixture
def sink(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sink]:
    """The app's services built with a CallSink (the lead's ledger takes its place)."""
    made = Sink()
    monkeypatch.setattr(proxy.app, "open_services", functools.partial(open_services, calls=made))
    yield made


SUMMARY_USAGE = {"prompt_tokens": 3100, "completion_tokens": 420, "total_tokens": 3520,
                 "prompt_tokens_details": {"cached_tokens": 0}}


class Summarizer:
    """The fake's responder: the summarizer answers from ``replies`` (then validly), with
    ``SUMMARY_USAGE``; the model says ok."""

    def __init__(self, fake: FakeUpstream, *replies: Reply, delay: float = 0.0,
                 messages_api: bool = False) -> None:
        self.replies = list(replies)
        self.delay = delay
        self.messages_api = messages_api
        self.calls = 0
        fake.responder = self

    def __call__(self, body: dict[str, Any]) -> Reply:
        summarizer = (messages.is_summarizer(body) if self.messages_api
                      else "messages" in body and compaction.is_summarizer(body))
        if not summarizer:
            return Reply(content="ok")
        self.calls += 1
        if self.replies:
            return self.replies.pop(0)
        if self.messages_api:
            return Reply(content=messages.SUMMARY, delay_s=self.delay, usage={
                "input_tokens": 7000, "output_tokens": 300, "cache_read_input_tokens": 0})
        return Reply(content=compaction.SUMMARY, delay_s=self.delay, usage=SUMMARY_USAGE)


async def test_a_summarizer_call_is_reported_once_for_its_request(
    make_inproc: InProcessFactory, fake: FakeUpstream, sink: Sink
) -> None:
    script = Summarizer(fake, delay=0.3)
    app = await make_inproc(compaction.WINDOW)
    before = time.time()
    rs = await asyncio.gather(*(compaction.post(app, compaction.history(30), sid="flight")
                                for _ in range(6)))
    assert [r.headers["x-ctxproxy-compacted"] for r in rs] == ["1"] * 6
    assert script.calls == 1
    [(identity, call)] = sink.calls  # one call, told once: not for the five that waited on it
    assert identity.session == "flight"
    assert (call.kind, call.api, call.model, call.status) == ("summarizer", "chat", "gpt-4o", 200)
    assert call.usage == SUMMARY_USAGE and before <= call.ts <= time.time()
    assert parse_usage(call.api, call.usage) == Usage(input=3100, output=420)


async def test_a_retried_and_a_failed_summarizer_call_are_reported_too(
    make_inproc: InProcessFactory, fake: FakeUpstream, sink: Sink
) -> None:
    bad = Reply(content="no sections here", usage={"prompt_tokens": 3000, "completion_tokens": 9,
                                                    "total_tokens": 3009})
    script = Summarizer(fake, bad)
    app = await make_inproc(compaction.WINDOW)
    await compaction.post(app, compaction.history(30), sid="retry")
    assert script.calls == 2
    assert [(c.usage, c.status) for _, c in sink.calls] == [(bad.usage, 200),
                                                             (SUMMARY_USAGE, 200)]
    sink.calls.clear()
    Summarizer(fake, Reply.error(500, "down"), Reply.error(500, "down"))
    await compaction.post(app, compaction.history(31), sid="failing")
    assert [(c.kind, c.status, c.usage) for _, c in sink.calls] == [("summarizer", 500, None)]


async def test_a_messages_sessions_summarizer_call_is_a_messages_call(
    make_inproc: InProcessFactory, fake: FakeUpstream, sink: Sink
) -> None:
    Summarizer(fake, messages_api=True)
    app = await make_inproc({"compaction": {"context_windows": {messages.MODEL: 8000}}})
    r = await app.client.post("/v1/messages", content=orjson.dumps(messages.body(
        messages.long_session(20))), headers={"x-api-key": "sk-ant-s",
                                              "anthropic-version": "2023-06-01"})
    assert r.headers["x-ctxproxy-compacted"] == "1"
    [(_, call)] = sink.calls
    assert (call.kind, call.api, call.model) == ("summarizer", "messages", messages.MODEL)
    assert parse_usage("messages", call.usage) == Usage(input=7000, output=300)


async def test_a_timed_out_summarizer_call_is_reported_with_status_0(
    make_inproc: InProcessFactory, fake: FakeUpstream, sink: Sink
) -> None:
    Summarizer(fake, Reply(content=compaction.SUMMARY, delay_s=5))
    app = await make_inproc({**compaction.WINDOW, "compaction": {
        **compaction.WINDOW["compaction"], "summarizer_timeout_s": 0.2}})
    r = await compaction.post(app, compaction.history(30), sid="slow")
    assert r.status_code == 200
    assert [(c.status, c.usage) for _, c in sink.calls] == [(0, None)]


async def test_the_memory_fold_call_is_reported(
    make_inproc: InProcessFactory, fake: FakeUpstream, sink: Sink
) -> None:
    script = memory.Script(fake)
    fold_usage = {"prompt_tokens": 900, "completion_tokens": 80, "total_tokens": 980}
    original = script.__call__

    def answer(body: dict[str, Any]) -> Reply:
        reply = original(body)
        if "messages" in body and memory.is_fold(body):
            reply.usage = fold_usage
        return reply

    fake.responder = answer
    app = await make_inproc(memory.ON)
    r = await app.client.post("/v1/chat/completions", content=orjson.dumps(
        {"model": "gpt-4o", "messages": memory.session_one()}),
        headers={"authorization": f"Bearer {memory.KEY}", "x-session-id": "s1"})
    assert r.headers["x-ctxproxy-compacted"] == "1"
    await app.drain()  # the fold runs in the background
    assert script.folds == 1
    kinds = [(ident.session, c.kind, c.api) for ident, c in sink.calls]
    assert kinds == [("s1", "summarizer", "chat"), ("s1", "memory_fold", "chat")]
    fold = sink.calls[-1][1]
    assert fold.usage == fold_usage and fold.model == "gpt-4o" and fold.status == 200

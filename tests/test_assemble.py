"""Stream assembly: SSE chat.completion.chunk bytes in, the assistant message out."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.formats.chat.answer import StreamAssembler, message_from_completion

from .conftest import examples

FAST = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- hand-written streams, byte for byte as api.openai.com sends them ----------------------

TEXT_STREAM = (
    b'data: {"id":"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT","object":"chat.completion.chunk",'
    b'"created":1741570283,"model":"gpt-4o-2024-08-06","service_tier":"default",'
    b'"system_fingerprint":"fp_eb9dce56a8","choices":[{"index":0,"delta":{"role":"assistant",'
    b'"content":"","refusal":null},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    b'data: {"id":"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT","object":"chat.completion.chunk",'
    b'"created":1741570283,"model":"gpt-4o-2024-08-06","service_tier":"default",'
    b'"system_fingerprint":"fp_eb9dce56a8","choices":[{"index":0,"delta":{"content":"Hello"},'
    b'"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    b'data: {"id":"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT","object":"chat.completion.chunk",'
    b'"created":1741570283,"model":"gpt-4o-2024-08-06","service_tier":"default",'
    b'"system_fingerprint":"fp_eb9dce56a8","choices":[{"index":0,"delta":{"content":"! \\u4f60\\u597d'
    b' \xf0\x9f\x98\x80\\n"},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    b'data: {"id":"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT","object":"chat.completion.chunk",'
    b'"created":1741570283,"model":"gpt-4o-2024-08-06","service_tier":"default",'
    b'"system_fingerprint":"fp_eb9dce56a8","choices":[{"index":0,"delta":{"content":"How can I'
    b' help?"},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    b'data: {"id":"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT","object":"chat.completion.chunk",'
    b'"created":1741570283,"model":"gpt-4o-2024-08-06","service_tier":"default",'
    b'"system_fingerprint":"fp_eb9dce56a8","choices":[{"index":0,"delta":{},"logprobs":null,'
    b'"finish_reason":"stop"}],"usage":null}\n\n'
    b'data: {"id":"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT","object":"chat.completion.chunk",'
    b'"created":1741570283,"model":"gpt-4o-2024-08-06","service_tier":"default",'
    b'"system_fingerprint":"fp_eb9dce56a8","choices":[],"usage":{"prompt_tokens":19,'
    b'"completion_tokens":10,"total_tokens":29,"prompt_tokens_details":{"cached_tokens":0,'
    b'"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,'
    b'"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}\n\n'
    b"data: [DONE]\n\n"
)
TEXT_USAGE = {
    "prompt_tokens": 19,
    "completion_tokens": 10,
    "total_tokens": 29,
    "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
    "completion_tokens_details": {
        "reasoning_tokens": 0,
        "audio_tokens": 0,
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    },
}
TEXT_MESSAGE = {"role": "assistant", "content": "Hello! 你好 😀\nHow can I help?"}

_H = (
    b'data: {"id":"chatcmpl-B9N4ZdLcIOsb2tYhtXHT8rCeXhZXD","object":"chat.completion.chunk",'
    b'"created":1741573667,"model":"gpt-4o-mini-2024-07-18","system_fingerprint":"fp_06737a9306",'
    b'"choices":[{"index":0,"delta":'
)
_T = b',"logprobs":null,"finish_reason":null}]}\n\n'
# fmt: off
TOOL_STREAM = (
    _H + b'{"role":"assistant","content":null,"tool_calls":[{"index":0,'
    b'"id":"call_DdmO9pD3xa9XTPNJ32zg2hcA","type":"function","function":{"name":"get_weather",'
    b'"arguments":""}}],"refusal":null}' + _T
    + _H + b'{"tool_calls":[{"index":0,"function":{"arguments":"{\\"lo"}}]}' + _T
    + _H + b'{"tool_calls":[{"index":0,"function":{"arguments":"cation\\": \\"Par"}}]}' + _T
    + _H + b'{"tool_calls":[{"index":0,"function":{"arguments":"is, France\\"}"}}]}' + _T
    + _H + b'{"tool_calls":[{"index":1,"id":"call_hr2wIAi4mZsq1t8PBIrGCmRt","type":"function",'
    b'"function":{"name":"read_file","arguments":""}}]}' + _T
    + _H + b'{"tool_calls":[{"index":1,"function":{"arguments":"{\\"path\\": \\"/tmp/\\u00e9'
    b'\xe4\xb8\xad.txt\\",\\n"}}]}' + _T
    + _H + b'{"tool_calls":[{"index":1,"function":{"arguments":" \\"limit\\": 10}"}}]}' + _T
    + _H + b'{},"logprobs":null,"finish_reason":"tool_calls"}]}\n\n'
    + b"data: [DONE]\n\n"
)
# fmt: on
TOOL_MESSAGE = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_DdmO9pD3xa9XTPNJ32zg2hcA",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"location": "Paris, France"}'},
        },
        {
            "id": "call_hr2wIAi4mZsq1t8PBIrGCmRt",
            "type": "function",
            "function": {
                "name": "read_file",
                "arguments": '{"path": "/tmp/é中.txt",\n "limit": 10}',
            },
        },
    ],
}


def feed_all(chunks: list[bytes], **kw: Any) -> StreamAssembler:
    a = StreamAssembler(**kw)
    for c in chunks:
        a.feed(c)
    return a


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(set(cuts)), len(data)]
    return [data[i:j] for i, j in zip(points, points[1:], strict=False)]


def sse(obj: Any, eol: bytes = b"\n") -> bytes:
    return b"data: " + orjson.dumps(obj) + eol + eol


def with_eol(stream: bytes, eol: bytes) -> bytes:
    # orjson never writes a raw newline, so every b"\n" in these streams is SSE framing.
    return stream.replace(b"\n", eol)


# --- the OpenAI streams ---------------------------------------------------------------------


def test_text_stream() -> None:
    a = feed_all([TEXT_STREAM])
    assert a.message() == TEXT_MESSAGE
    assert a.finish_reason() == "stop"
    assert a.usage == TEXT_USAGE
    assert a.done and a.error is None and a.malformed == 0
    assert a.events == 7
    assert a.buffered == 0
    assert a.completion() == {
        "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
        "object": "chat.completion",
        "created": 1741570283,
        "model": "gpt-4o-2024-08-06",
        "choices": [
            {"index": 0, "message": TEXT_MESSAGE, "logprobs": None, "finish_reason": "stop"}
        ],
        "usage": TEXT_USAGE,
        "system_fingerprint": "fp_eb9dce56a8",
        "service_tier": "default",
    }


def test_parallel_tool_calls() -> None:
    a = feed_all([TOOL_STREAM])
    assert a.message() == TOOL_MESSAGE
    assert a.finish_reason() == "tool_calls"
    assert a.usage is None  # no include_usage
    assert a.done and a.events == 9 and a.malformed == 0
    comp = a.completion()
    assert comp["choices"] == [
        {"index": 0, "message": TOOL_MESSAGE, "logprobs": None, "finish_reason": "tool_calls"}
    ]
    assert comp["usage"] is None and comp["model"] == "gpt-4o-mini-2024-07-18"
    assert message_from_completion(orjson.dumps(comp)) == TOOL_MESSAGE


def test_message_mid_stream_and_fresh_dicts() -> None:
    # The read-tool loop looks at tool calls while the stream is still running.
    a = StreamAssembler()
    events = TOOL_STREAM.split(b"\n\n")
    for ev in events[:3]:
        a.feed(ev + b"\n\n")
    partial = a.message()
    assert partial is not None
    assert partial["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"location": "Par',
    }
    assert a.finish_reason() is None and not a.done
    partial["tool_calls"].clear()  # the caller owns what it gets
    for ev in events[3:]:
        if ev:
            a.feed(ev + b"\n\n")
    assert a.message() == TOOL_MESSAGE


@pytest.mark.parametrize(
    "stream,expected", [(TEXT_STREAM, TEXT_MESSAGE), (TOOL_STREAM, TOOL_MESSAGE)]
)
@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_every_split_point(stream: bytes, expected: dict[str, Any], eol: bytes) -> None:
    # Exhaustive: one cut at each byte, so through every UTF-8 character, every "data: "
    # prefix, every \r\n pair and every blank line.
    data = with_eol(stream, eol)
    for i in range(len(data) + 1):
        a = feed_all([data[:i], data[i:]])
        assert a.message() == expected, i
        assert a.done and a.malformed == 0 and a.buffered == 0, i


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_every_pair_of_split_points(eol: bytes) -> None:
    base = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    stream = (
        sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "é😀"}}]}, eol)
        + b": ka" + eol + eol
        + sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, eol)
        + b"data: [DONE]" + eol + eol
    )  # fmt: skip
    n = len(stream)
    for i in range(n + 1):
        for j in range(i, n + 1):
            a = feed_all([stream[:i], stream[i:j], stream[j:]])
            assert a.message() == {"role": "assistant", "content": "é😀"}, (i, j)
            assert a.finish_reason() == "stop" and a.done and a.events == 3, (i, j)


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_byte_by_byte(eol: bytes) -> None:
    data = with_eol(TOOL_STREAM, eol)
    a = feed_all([data[i : i + 1] for i in range(len(data))])
    assert a.message() == TOOL_MESSAGE and a.done and a.events == 9


def test_random_chunk_sizes_1b_to_4kb() -> None:
    rnd = random.Random(7)
    data = TEXT_STREAM * 3 + TOOL_STREAM
    for _ in range(200):
        cuts, pos = [], 0
        while pos < len(data):
            pos += rnd.randint(1, 4096)
            cuts.append(min(pos, len(data)))
        a = feed_all(split_at(data, cuts))
        # Same choice index across both streams: the tool calls join the text's choice.
        assert a.message() == {
            "role": "assistant",
            "content": TEXT_MESSAGE["content"] * 3,
            "tool_calls": TOOL_MESSAGE["tool_calls"],
        }
        assert a.events == 30


# --- random streams -------------------------------------------------------------------------

PIECES = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        [
            "😀",
            "中文",
            "é",
            "\n",
            "\r\n",
            "\r",
            "\n\n",
            "data: [DONE]\n\n",
            ": x",
            '"',
            "\\",
            "\u2028",
        ]
    ),
)


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, dict[str, Any], str]:
    """An OpenAI-shaped stream with random text and tool calls, and the message it encodes."""
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    content = draw(st.lists(PIECES, max_size=8))
    calls = draw(
        st.lists(
            st.tuples(st.text(min_size=1, max_size=8), st.lists(PIECES, max_size=5)),
            max_size=3,
        )
    )
    finish = "tool_calls" if calls else draw(st.sampled_from(["stop", "length"]))
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}

    def chunk(delta: dict[str, Any], fr: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": fr}
        return sse({**base, "choices": [choice]}, eol)

    events = [chunk({"role": "assistant", "content": None if calls else "", "refusal": None})]
    events += [chunk({"content": p}) for p in content]
    for i, (name, args) in enumerate(calls):
        head = {"index": i, "id": f"call_{i}", "type": "function"}
        events.append(
            chunk({"tool_calls": [{**head, "function": {"name": name, "arguments": ""}}]})
        )
        events += [
            chunk({"tool_calls": [{"index": i, "function": {"arguments": a}}]}) for a in args
        ]
    events.append(chunk({}, finish))
    events.append(sse({**base, "choices": [], "usage": {"total_tokens": 3}}, eol))
    events.append(b"data: [DONE]" + eol + eol)
    # Keep-alive comments between any events.
    for _ in range(draw(st.integers(0, 3))):
        events.insert(draw(st.integers(0, len(events))), b": keep-alive" + eol + eol)

    text = "".join(content)
    expected: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        expected["tool_calls"] = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": name, "arguments": "".join(args)},
            }
            for i, (name, args) in enumerate(calls)
        ]
    return b"".join(events), expected, finish


@FAST
@given(streams(), st.data())
def test_random_streams_random_chunking(
    case: tuple[bytes, dict[str, Any], str], data: st.DataObject
) -> None:
    stream, expected, finish = case
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=40))
    a = feed_all(split_at(stream, cuts))
    assert a.message() == expected
    assert a.finish_reason() == finish
    assert a.usage == {"total_tokens": 3}
    assert a.done and a.malformed == 0 and a.error is None and a.buffered == 0
    comp = a.completion()
    assert message_from_completion(orjson.dumps(comp)) == expected
    assert comp["choices"][0]["finish_reason"] == finish


def feed_strict(chunks: list[bytes]) -> StreamAssembler:
    """Like feed_all but bypassing feed()'s safety net, so that a bug surfaces here."""
    a = StreamAssembler()
    for c in chunks:
        a._feed(c)
    return a


@FAST
@given(st.lists(st.binary(max_size=64), max_size=20))
def test_arbitrary_bytes_never_raise(chunks: list[bytes]) -> None:
    a = feed_strict(chunks)
    a.message()
    a.completion()
    a.finish_reason(3)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda kids: st.lists(kids, max_size=3)
    | st.dictionaries(
        st.sampled_from(
            ["choices", "delta", "index", "content", "tool_calls", "function", "arguments",
             "name", "id", "usage", "error", "role", "finish_reason", "logprobs", "refusal",
             "function_call", "model", "created", "reasoning_content", "type"]
        ),
        kids,
        max_size=5,
    ),
    max_leaves=20,
)  # fmt: skip


@FAST
@given(st.lists(JSON, max_size=8))
def test_arbitrary_json_shapes_never_raise(objs: list[Any]) -> None:
    a = feed_strict([b"".join(sse(o) for o in objs)])
    for i in a.indices():
        msg = a.message(i)
        assert msg is not None and msg["role"]
        assert msg["content"] is None or isinstance(msg["content"], str)
    orjson.dumps(a.completion())


def _near(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The valid value mostly, any JSON value sometimes."""
    return st.one_of(valid, valid, JSON)


TOOL_DELTA = st.fixed_dictionaries(
    {},
    optional={
        "index": _near(st.integers(0, 2)),
        "id": _near(st.sampled_from(["a", "b"])),
        "type": _near(st.just("function")),
        "function": _near(
            st.fixed_dictionaries(
                {}, optional={"name": _near(st.text(max_size=3)), "arguments": _near(st.text())}
            )
        ),
    },
)
DELTA = st.fixed_dictionaries(
    {},
    optional={
        k: _near(v)
        for k, v in {
            "role": st.just("assistant"),
            "content": st.text(max_size=4),
            "refusal": st.text(max_size=4),
            "reasoning_content": st.text(max_size=4),
            "tool_calls": st.lists(TOOL_DELTA, max_size=2),
            "function_call": st.fixed_dictionaries(
                {}, optional={"name": _near(st.text()), "arguments": _near(st.text())}
            ),
        }.items()
    },
)
CHOICE = st.fixed_dictionaries(
    {},
    optional={
        "index": _near(st.integers(0, 2)),
        "delta": _near(DELTA),
        "finish_reason": _near(st.sampled_from(["stop", "tool_calls"])),
        "logprobs": _near(st.fixed_dictionaries({"content": _near(st.lists(JSON, max_size=2))})),
    },
)
CHUNK = st.fixed_dictionaries(
    {},
    optional={
        "id": _near(st.just("c")),
        "created": _near(st.integers(0, 9)),
        "model": _near(st.just("m")),
        "usage": _near(st.just({"total_tokens": 1})),
        "choices": _near(st.lists(CHOICE, max_size=3)),
        "error": st.none() | JSON,
    },
)


@FAST
@given(st.lists(CHUNK, max_size=10))
def test_almost_valid_chunks_never_raise(objs: list[Any]) -> None:
    a = feed_strict([b"".join(sse(o) for o in objs)])
    for i in a.indices():
        msg = a.message(i)
        assert msg is not None
        assert msg["content"] is None or isinstance(msg["content"], str)
        for call in msg.get("tool_calls", ()):
            assert isinstance(call["function"]["arguments"], str)
    orjson.dumps(a.completion())


# --- framing ----------------------------------------------------------------------------------


def test_multiple_data_lines_are_joined_with_newline() -> None:
    # A JSON chunk spread over three data lines (legal: the newline is JSON whitespace).
    stream = (
        b'data: {"choices": [{"index": 0,\n'
        b'data: "delta": {"content": "a"}}],\n'
        b'data:"id": "c1"}\n\n'
        b'event: message\nid: 7\nretry: 1000\ndata: {"choices": [{"index": 0, '
        b'"delta": {"content": "b"}}]}\n\n'
        b"data\n\n"  # a field without colon: empty data, a keep-alive
        b"data: [DONE]\n\n"
    )
    a = feed_all(split_at(stream, [5, 40, 41]))
    assert a.message() == {"role": "assistant", "content": "ab"}
    assert a.id == "c1" and a.done and a.malformed == 0 and a.events == 4


def test_comments_and_keep_alives() -> None:
    stream = (
        b": OPENROUTER PROCESSING\n\n"
        b":\n\n"
        b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "x"}}]}\n'
        b": a comment inside the event\n\n"
        b"\n\n\n"  # stray blank lines
        b'data: {"choices": [{"index": 0, "delta": {"content": "y"}}]}\n\n\n'
        b"data: [DONE]\n\n"
    )
    for eol in (b"\n", b"\r\n", b"\r"):
        a = feed_all([with_eol(stream, eol)])
        assert a.message() == {"role": "assistant", "content": "xy"}
        assert a.events == 3 and a.done and a.malformed == 0


def test_crlf_split_inside_pair_is_one_line_end() -> None:
    ev = b'data: {"choices": [{"index": 0, "delta": {"content": "z"}}]}'
    a = feed_all([ev + b"\r", b"\n\r", b"\n"])
    assert a.message() == {"role": "assistant", "content": "z"} and a.events == 1
    # A lone \r ends the line at once: the event is dispatched without waiting for more bytes.
    b = feed_all([ev + b"\r\r"])
    assert b.events == 1 and b.buffered == 0


def test_bom_is_dropped_even_when_split() -> None:
    stream = b"\xef\xbb\xbf" + TEXT_STREAM
    assert feed_all([stream]).message() == TEXT_MESSAGE
    assert feed_all([stream[:1], stream[1:2], stream[2:]]).message() == TEXT_MESSAGE


def test_stream_cut_without_done_keeps_what_arrived() -> None:
    events = TOOL_STREAM.split(b"\n\n")
    no_done = b"\n\n".join(events[:-2]) + b"\n\n"  # through the finish chunk
    a = feed_all([no_done])
    assert a.message() == TOOL_MESSAGE and a.finish_reason() == "tool_calls" and not a.done

    # Cut inside the 4th event: its half is never dispatched, the three before are kept.
    cut = TOOL_STREAM.index(b"is, France")
    b = feed_all([TOOL_STREAM[:cut]])
    assert not b.done and b.events == 3 and b.buffered > 0 and b.finish_reason() is None
    assert b.message() == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_DdmO9pD3xa9XTPNJ32zg2hcA",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"location": "Par'},
            }
        ],
    }
    # An event missing only its blank line is not dispatched either (as the SDK would not).
    c = feed_all([b'data: {"choices": [{"index": 0, "delta": {"content": "q"}}]}\n'])
    assert c.message() is None and c.events == 0


def test_oversized_event_is_dropped() -> None:
    good = sse({"choices": [{"index": 0, "delta": {"content": "ok"}}]})
    huge = sse({"choices": [{"index": 0, "delta": {"content": "x" * 5000}}]})
    stream = good + huge + good + b"data: [DONE]\n\n"
    for size in (1, 7, 1000, len(stream)):
        a = feed_all(split_at(stream, list(range(0, len(stream), size))), max_event_bytes=1024)
        assert a.message() == {"role": "assistant", "content": "okok"}, size
        assert a.malformed == 1 and a.done, size


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"])
def test_size_cap_does_not_depend_on_chunking(eol: bytes) -> None:
    event = b'data: {"choices": [{"index": 0, "delta": {"content": "' + b"y" * 40 + b'"}}]}'
    stream = sse({"choices": [{"delta": {"content": "a"}}]}, eol) + event + eol + eol
    stream += sse({"choices": [{"delta": {"content": "b"}}]}, eol)
    for cap, content in ((len(event), "a" + "y" * 40 + "b"), (len(event) - 1, "ab")):
        for i in range(len(stream) + 1):
            a = feed_all([stream[:i], stream[i:]], max_event_bytes=cap)
            assert a.message() == {"role": "assistant", "content": content}, (cap, i)
            assert a.malformed == (cap < len(event)), (cap, i)
        a = feed_all([stream[i : i + 1] for i in range(len(stream))], max_event_bytes=cap)
        assert a.message() == {"role": "assistant", "content": content}, cap


# --- bad events -------------------------------------------------------------------------------


def test_malformed_event_skipped_and_counted() -> None:
    stream = (
        sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}}]})
        + b'data: {"choices": [{"index": 0, "delta": {"content": "LOST"\n\n'
        + b"data: 42\n\n"
        + b"data: not json\n\n"
        + sse({"choices": [{"index": 0, "delta": {"content": "b"}}]})
        + b"data: [DONE]\n\n"
    )
    a = feed_all([stream])
    assert a.message() == {"role": "assistant", "content": "ab"}
    assert a.malformed == 3 and a.events == 6 and a.done and a.error is None


def test_invalid_utf8_is_replaced_as_an_sse_client_would() -> None:
    a = feed_all([b'data: {"choices": [{"delta": {"content": "a\xffb"}}]}\n\n'])
    assert a.message() == {"role": "assistant", "content": "a\ufffdb"} and a.malformed == 0


def test_wrong_shapes_are_ignored() -> None:
    stream = b"".join(
        sse(o)
        for o in [
            {"choices": {"index": 0}},
            {"choices": [1, None, {"index": "0", "delta": {"content": "no"}}]},
            {"choices": [{"index": 0, "delta": ["content"], "finish_reason": 5}]},
            {"choices": [{"index": 0, "delta": {"content": 5, "tool_calls": {"index": 0}}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [None, {"function": "f"}]}}]},
            {"usage": [1], "created": "today", "model": 3},
        ]
    )
    a = feed_all([stream])
    assert a.message() == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "", "type": "function", "function": {"name": "", "arguments": ""}}],
    }
    assert a.usage is None and a.created is None and a.model is None and a.malformed == 0


def test_feed_never_raises_on_wrong_type() -> None:
    a = StreamAssembler()
    a.feed("data: {}\n\n")  # type: ignore[arg-type]
    a.feed(TEXT_STREAM)
    assert a.malformed == 1 and a.message() == TEXT_MESSAGE


def test_error_events_are_recorded() -> None:
    err = {"message": "The server had an error", "type": "server_error", "code": None}
    stream = (
        sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "par"}}]})
        + b"event: error\ndata: " + orjson.dumps({"error": err}) + b"\n\n"
        + sse({"error": {"message": "second"}})
    )  # fmt: skip
    a = feed_all([stream])
    assert a.error == err  # the first one: the cause
    assert a.message() == {"role": "assistant", "content": "par"} and not a.done
    assert a.malformed == 0

    # litellm_route ends a failed stream with a bare data: {"error": ...} event.
    b = feed_all([sse({"error": {"message": "boom", "type": "upstream_error"}})])
    assert b.error == {"message": "boom", "type": "upstream_error"} and b.message() is None

    c = feed_all([b"event: error\ndata: upstream exploded\n\n"])
    assert c.error == "upstream exploded" and c.malformed == 0

    d = feed_all(
        [b'event: error\ndata: {"detail": "x", "choices": [{"delta": {"content": "n"}}]}\n\n']
    )
    assert d.error == {"detail": "x", "choices": [{"delta": {"content": "n"}}]}
    assert d.message() is None  # an error event is not accumulated

    e = feed_all([sse({"error": None, "choices": [{"index": 0, "delta": {"content": "fine"}}]})])
    assert e.error is None and e.message() == {"role": "assistant", "content": "fine"}


# --- choices and message fields ---------------------------------------------------------------


def test_n_greater_than_one() -> None:
    def ch(i: int, delta: dict[str, Any], fr: str | None = None) -> bytes:
        return sse({"id": "c", "choices": [{"index": i, "delta": delta, "finish_reason": fr}]})

    stream = (
        ch(0, {"role": "assistant", "content": ""})
        + ch(1, {"role": "assistant", "content": ""})
        + ch(1, {"content": "B1"})
        + ch(0, {"content": "A1"})
        + sse({"choices": [
            {"index": 0, "delta": {"content": "A2"}},
            {"index": 1, "delta": {"tool_calls": [
                {"index": 0, "id": "t", "type": "function",
                 "function": {"name": "f", "arguments": "{}"}}]}},
        ]})
        + ch(1, {}, "tool_calls")
        + ch(0, {}, "length")
        + sse({"id": "c", "choices": [], "usage": {"total_tokens": 9}})
        + b"data: [DONE]\n\n"
    )  # fmt: skip
    a = feed_all(split_at(stream, [3, 100, 101, 333]))
    assert a.indices() == [0, 1]
    assert a.message(0) == {"role": "assistant", "content": "A1A2"}
    assert a.message(1) == {
        "role": "assistant",
        "content": "B1",
        "tool_calls": [
            {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    assert a.message(2) is None and a.finish_reason(2) is None
    assert (a.finish_reason(0), a.finish_reason(1)) == ("length", "tool_calls")
    comp = a.completion()
    assert [c["index"] for c in comp["choices"]] == [0, 1]
    assert [c["finish_reason"] for c in comp["choices"]] == ["length", "tool_calls"]
    assert comp["usage"] == {"total_tokens": 9}
    assert message_from_completion(orjson.dumps(comp), index=1) == a.message(1)


def test_interleaved_parallel_tool_calls() -> None:
    def tc(*calls: dict[str, Any]) -> bytes:
        return sse({"choices": [{"index": 0, "delta": {"tool_calls": list(calls)}}]})

    stream = (
        tc({"index": 1, "id": "b", "type": "function", "function": {"name": "g", "arguments": ""}})
        + tc({"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": "["}})
        + tc({"index": 1, "function": {"arguments": "{"}}, {"index": 0, "function": {"arguments": "1"}})
        + tc({"index": 0, "function": {"arguments": "]"}}, {"index": 1, "function": {"arguments": "}"}})
    )  # fmt: skip
    msg = feed_all([stream]).message()
    assert msg is not None
    assert [(c["id"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("a", "[1]"),
        ("b", "{}"),
    ]


def test_tool_calls_without_index() -> None:
    # Not OpenAI, but seen from compatible servers: a new id starts a call.
    def tc(call: dict[str, Any]) -> bytes:
        return sse({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})

    stream = (
        tc({"id": "x", "type": "function", "function": {"name": "f", "arguments": "{"}})
        + tc({"function": {"arguments": "}"}})
        + tc({"id": "y", "type": "function", "function": {"name": "g", "arguments": "[]"}})
        + tc({"id": "y", "function": {"name": "g", "arguments": ""}})
    )
    msg = feed_all([stream]).message()
    assert msg is not None
    assert [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]
    ] == [
        ("x", "f", "{}"),
        ("y", "g", "[]"),
    ]


def test_refusal_reasoning_function_call_logprobs() -> None:
    lp1 = {"token": "I", "logprob": -0.1, "bytes": [73], "top_logprobs": []}
    lp2 = {"token": "'m", "logprob": -0.2, "bytes": [39, 109], "top_logprobs": []}
    stream = b"".join(
        sse(o)
        for o in [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None, "refusal": ""}}]},
            {"choices": [{"index": 0, "delta": {"refusal": "I"}, "logprobs": {"content": None, "refusal": [lp1]}}]},
            {"choices": [{"index": 0, "delta": {"refusal": "'m sorry"}, "logprobs": {"refusal": [lp2]}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        ]
    )  # fmt: skip
    a = feed_all([stream])
    assert a.message() == {"role": "assistant", "content": None, "refusal": "I'm sorry"}
    assert a.completion()["choices"][0]["logprobs"] == {"content": None, "refusal": [lp1, lp2]}

    think = b"".join(
        sse({"choices": [{"index": 0, "delta": d}]})
        for d in [
            {"role": "assistant", "content": "", "reasoning_content": "Let me"},
            {"reasoning_content": " think."},
            {"reasoning": "r"},
            {"content": "42"},
        ]
    )
    assert feed_all([think]).message() == {
        "role": "assistant",
        "content": "42",
        "reasoning_content": "Let me think.",
        "reasoning": "r",
    }

    legacy = b"".join(
        sse({"choices": [{"index": 0, "delta": d}]})
        for d in [
            {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": ""}},
            {"function_call": {"arguments": '{"a"'}},
            {"function_call": {"arguments": ": 1}"}},
        ]
    )
    assert feed_all([legacy]).message() == {
        "role": "assistant",
        "content": None,
        "function_call": {"name": "f", "arguments": '{"a": 1}'},
    }


def test_content_none_or_empty() -> None:
    role_only = sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    assert feed_all([role_only]).message() == {"role": "assistant", "content": None}
    empty = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    assert feed_all([empty]).message() == {"role": "assistant", "content": ""}
    assert feed_all([b"data: [DONE]\n\n"]).message() is None
    nothing = StreamAssembler()
    assert nothing.completion() == {
        "id": "",
        "object": "chat.completion",
        "created": 0,
        "model": "",
        "choices": [],
        "usage": None,
    }


def test_last_non_null_usage_wins() -> None:
    stream = (
        sse({"choices": [], "usage": {"total_tokens": 1}})
        + sse({"choices": [{"index": 0, "delta": {"content": "x"}}], "usage": None})
        + sse({"choices": [], "usage": {"total_tokens": 2}})
    )
    assert feed_all([stream]).usage == {"total_tokens": 2}


# --- non-stream bodies ------------------------------------------------------------------------


def test_message_from_completion() -> None:
    msg: dict[str, Any] = {"role": "assistant", "content": "hi", "refusal": None, "annotations": []}
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "gpt-4o",
        "choices": [
            {"index": 0, "message": msg, "logprobs": None, "finish_reason": "stop"},
            {
                "index": 1,
                "message": {"role": "assistant", "content": "two"},
                "finish_reason": "stop",
            },
        ],
        "usage": {"total_tokens": 3},
    }
    raw = orjson.dumps(body)
    assert message_from_completion(raw) == msg
    assert message_from_completion(bytearray(raw)) == msg
    assert message_from_completion(raw.decode()) == msg
    assert message_from_completion(raw, index=1) == {"role": "assistant", "content": "two"}
    assert message_from_completion(raw, index=5) is None
    # choices without their index field: by position
    no_idx = orjson.dumps({"choices": [{"message": {"role": "assistant", "content": "p"}}]})
    assert message_from_completion(no_idx) == {"role": "assistant", "content": "p"}


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b'{"choices": [{"message": ',
        b"[1, 2]",
        b"null",
        b"{}",
        b'{"choices": []}',
        b'{"choices": {"0": {}}}',
        b'{"choices": [null]}',
        b'{"choices": [{"index": 0}]}',
        b'{"choices": [{"index": 0, "message": "hi"}]}',
        b'{"error": {"message": "nope"}}',
        b"\xff\xfe",
        TEXT_STREAM,
        None,
        12,
    ],
)
def test_message_from_completion_bad_bodies(body: Any) -> None:
    assert message_from_completion(body) is None

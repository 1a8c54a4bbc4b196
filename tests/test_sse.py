"""The SSE decoder: WHATWG "interpreting an event stream", fed in chunks cut anywhere."""

from __future__ import annotations

import sys
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.retrieval.loop import StreamOut
from proxy.sse import DEFAULT_MAX_EVENT_BYTES, Event, SSEDecoder

from .conftest import examples


def decode(*chunks: bytes, **kw: Any) -> list[Event]:
    d = SSEDecoder(**kw)
    return [ev for c in chunks for ev in d.feed(c)]


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


# --- the rules, one by one ------------------------------------------------------------------


def test_one_data_line() -> None:
    d = SSEDecoder()
    assert d.feed(b'data: {"a": 1}\n\n') == [Event(b'{"a": 1}', "", None, None)]
    assert d.buffered == 0 and d.malformed == 0


def test_data_is_bytes() -> None:
    for stream in (b"data: x\n\n", b"data: x\ndata: y\n\n", b"event: e\ndata: x\n\n"):
        for chunks in ([stream], bytewise(stream)):
            (ev,) = decode(*chunks)
            assert type(ev.data) is bytes, (stream, chunks)
    (ev,) = decode(bytearray(b"data: x\n\n"))
    assert type(ev.data) is bytes


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_line_ends(eol: bytes) -> None:
    stream = b"data: a" + eol + b"data: b" + eol + eol + b"data: c" + eol + eol
    for chunks in ([stream], bytewise(stream)):
        assert [ev.data for ev in decode(*chunks)] == [b"a\nb", b"c"]


def test_mixed_line_ends() -> None:
    stream = b"data: a\r\ndata: b\rdata: c\n\r\ndata: d\r\r"
    assert [ev.data for ev in decode(stream)] == [b"a\nb\nc", b"d"]


def test_crlf_split_across_chunks_is_one_line_end() -> None:
    assert decode(b"data: a\r\n\r", b"\ndata: b\r\n\r\n") == [Event(b"a"), Event(b"b")]
    # A \r ending a chunk is a line end at once, not held back for the next chunk.
    d = SSEDecoder()
    assert d.feed(b"data: a\r\r") == [Event(b"a")]
    assert d.feed(b"\ndata: b\r") == []  # that \n is the second half of a \r\n: no blank line
    assert d.feed(b"\r") == [Event(b"b")]


@pytest.mark.parametrize(
    "chunks",
    [
        # The read loop's old framer replaced b"\r\n" chunk by chunk, so a \r\n split across
        # chunks left a stray \r: here the two events ran together into one ...
        [b'data: {"a": 1}\r\n\r', b'\ndata: {"b": 2}\r\n\r\n'],
        # ... and here no blank line was ever seen, so neither event came out.
        [b'data: {"a": 1}\r\n\r', b'\ndata: {"b": 2}\r\n\r', b"\n"],
    ],
)
async def test_read_loop_events_crlf_split_across_chunks(chunks: list[bytes]) -> None:
    class Content:
        async def iter_any(self) -> Any:
            for chunk in chunks:
                yield chunk

    class Response:
        status = 200
        content_type = "text/event-stream"
        raw_headers: list[tuple[bytes, bytes]] = []
        content = Content()

    async def send(message: Any) -> None:
        return None

    got: list[bytes] = []

    def feed(name: str, data: bytes) -> list[bytes]:
        got.append(data)
        return []

    out = StreamOut(send, lambda chunk: None, [], lambda status, body: body)
    assert await out.relay(cast(Any, Response()), feed)
    assert got == [b'{"a": 1}', b'{"b": 2}']


def test_bom_is_dropped_once_even_when_split() -> None:
    stream = b"\xef\xbb\xbfdata: x\n\n"
    for chunks in ([stream], bytewise(stream), [stream[:2], stream[2:]]):
        assert decode(*chunks) == [Event(b"x")]
    # Only a leading one: a second BOM makes "\ufeffdata" an unknown field.
    assert decode(b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\n") == []
    # Bytes that only start like a BOM are kept.
    assert decode(b"\xef\xbb", b"\ndata: x\n\n") == [Event(b"x")]


def test_comments() -> None:
    stream = b": keep-alive\n\n:\n\ndata: a\n: inside an event\ndata: b\n\n:x\n\n"
    assert decode(stream) == [Event(b"a\nb")]


def test_one_space_after_the_colon_is_removed() -> None:
    stream = b"data:x\n\ndata: x\n\ndata:  x\n\ndata: \n\ndata:\n\ndata:x y \n\n"
    assert [ev.data for ev in decode(stream)] == [b"x", b"x", b" x", b"", b"", b"x y "]


def test_only_the_first_colon_splits() -> None:
    assert decode(b"data: a: b:c\n\n") == [Event(b"a: b:c")]
    assert decode(b"event: x:y\ndata\n\n") == [Event(b"", "x:y")]


def test_line_without_colon_is_a_field_with_empty_value() -> None:
    assert decode(b"data\n\n") == [Event(b"")]
    assert decode(b"data\ndata\ndata: x\n\n") == [Event(b"\n\nx")]
    assert decode(b"event: e\nevent\ndata: x\n\n") == [Event(b"x", "")]


def test_data_lines_are_joined_with_newline() -> None:
    stream = b'data: {"a":\ndata: 1}\n\ndata:\ndata:\n\n'
    assert [ev.data for ev in decode(stream)] == [b'{"a":\n1}', b"\n"]


def test_empty_data_is_an_event_but_no_data_is_none() -> None:
    # `data:` appends "" + LF: the buffer is not empty, the event is dispatched with b"".
    assert decode(b"data:\n\n") == [Event(b"")]
    # No data line at all: nothing is dispatched, and the type does not leak into the next event.
    assert decode(b"event: ping\n\n", b"id: 1\nretry: 5\n\n", b": c\n\n", b"x: y\n\n") == []
    assert decode(b"event: ping\n\ndata: x\n\n") == [Event(b"x")]


def test_event_field_names_the_event() -> None:
    stream = (
        b"event: response.output_text.delta\n"
        b'data: {"type":"response.output_text.delta","delta":"Hi"}\n\n'
        b"event: content_block_delta\nevent: message_stop\ndata: {}\n\n"  # the last one wins
        b"data: plain\n\n"
    )
    got = decode(stream)
    assert [ev.event for ev in got] == ["response.output_text.delta", "message_stop", ""]
    assert got[0].data == b'{"type":"response.output_text.delta","delta":"Hi"}'
    assert decode(b"data: x\nevent: error\n\n") == [Event(b"x", "error")]  # any field order
    assert decode(b"event: caf\xc3\xa9 \xff\ndata\n\n")[0].event == "café \ufffd"


@pytest.mark.parametrize(
    "block,expected",
    [
        (b"event: e\ndata: d", Event(b"d", "e")),
        (b"event:  e\ndata:  d", Event(b" d", " e")),
        (b"event:e\ndata:d", Event(b"d", "e")),
        (b"event: \ndata: ", Event(b"", "")),
        (b"event: a:b\ndata: c:d", Event(b"c:d", "a:b")),
        (b"event: e\ndata: d\ndata: f", Event(b"d\nf", "e")),
        (b"event: e\ndata: d\nevent: g", Event(b"d", "g")),
        (b"event: e\ndatum: d", None),
        (b"event: e\n: c", None),
        (b"data: d\n: c", Event(b"d")),
        (b"data: d\ndata: e", Event(b"d\ne")),
    ],
)
def test_two_line_shapes(block: bytes, expected: Event | None) -> None:
    # The shapes the fast paths take, and their near misses, alone and between other events.
    want = [] if expected is None else [expected]
    assert decode(block + b"\n\n") == want
    stream = b"data: 1\n\n" + block + b"\n\ndata: 2\n\n"
    for chunks in ([stream], bytewise(stream), [stream[:9], stream[9:]]):
        assert decode(*chunks) == [Event(b"1"), *want, Event(b"2")], chunks


def test_id_persists_from_event_to_event() -> None:
    stream = (
        b"data: a\n\n"
        b"id: 1\ndata: b\n\n"
        b"data: c\n\n"  # no id field: the last one still holds
        b"id: 2\n\n"  # not dispatched, but the id is set
        b"data: d\n\n"
        b"id: x\x00y\ndata: e\n\n"  # an id with NUL is ignored
        b"id\ndata: f\n\n"  # an empty id resets it
        b"data: g\nid: 3\n\n"  # any field order
    )
    d = SSEDecoder()
    got = d.feed(stream)
    assert [(ev.data, ev.id) for ev in got] == [
        (b"a", None), (b"b", "1"), (b"c", "1"), (b"d", "2"), (b"e", "2"), (b"f", ""), (b"g", "3")
    ]  # fmt: skip
    assert d.last_event_id == "3"


def test_retry() -> None:
    d = SSEDecoder()
    got = d.feed(
        b"retry: 3000\ndata: a\n\n"
        b"data: b\n\n"  # per event: this one set none
        b"retry: 1.5\ndata: c\n\n"  # not ASCII digits: ignored
        b"retry: -1\ndata: d\n\n"
        b"retry:\ndata: e\n\n"
        b"retry: \xd9\xa1\ndata: f\n\n"  # a non-ASCII digit
        b"retry: 10\nretry: x\ndata: g\n\n"
        b"retry: 007\n\n"  # not dispatched, but the reconnection time is set
    )
    assert [(ev.data, ev.retry) for ev in got] == [
        (b"a", 3000), (b"b", None), (b"c", None), (b"d", None), (b"e", None), (b"f", None),
        (b"g", 10),
    ]  # fmt: skip
    assert d.retry == 7


def test_retry_too_long_for_int_is_ignored() -> None:
    digits = sys.get_int_max_str_digits()
    if not digits:
        pytest.skip("int() parses any number of digits here")
    d = SSEDecoder()
    assert d.feed(b"retry: " + b"9" * (digits + 1) + b"\ndata: x\n\n") == [Event(b"x")]
    assert d.retry is None


def test_unknown_fields_are_ignored() -> None:
    assert decode(b"foo: bar\nData: no\ndata : no\n data: no\ndata: yes\n\n") == [Event(b"yes")]


def test_stray_blank_lines_dispatch_nothing() -> None:
    d = SSEDecoder()
    assert d.feed(b"\n\n\ndata: a\n\n\n\n\ndata: b\n\n\n") == [Event(b"a"), Event(b"b")]
    assert d.buffered == 0
    assert d.feed(b"\r\n\r\n") == [] and d.buffered == 0


def test_unterminated_event_is_never_dispatched() -> None:
    d = SSEDecoder()
    assert d.feed(b"data: a\n\ndata: b\n") == [Event(b"a")]
    assert d.buffered == len(b"data: b\n")
    assert d.feed(b"data: c") == [] and d.buffered == len(b"data: b\ndata: c")
    assert d.feed(b"\n\n") == [Event(b"b\nc")] and d.buffered == 0


def test_oversized_event_is_dropped_and_counted() -> None:
    event = b"data: " + b"y" * 20  # 26 bytes
    stream = b"data: a\n\n" + event + b"\n\n" + b"data: b\n\n"
    for cap, data in ((26, [b"a", b"y" * 20, b"b"]), (25, [b"a", b"b"])):
        for chunks in ([stream], bytewise(stream), [stream[:20], stream[20:]]):
            d = SSEDecoder(max_event_bytes=cap)
            assert [ev.data for c in chunks for ev in d.feed(c)] == data, (cap, chunks)
            assert d.malformed == (cap < 26) and d.buffered == 0, (cap, chunks)
    assert SSEDecoder().max_event_bytes == DEFAULT_MAX_EVENT_BYTES == 16 * 1024 * 1024


def test_endless_event_keeps_memory_bounded() -> None:
    d = SSEDecoder(max_event_bytes=100)
    for _ in range(1000):
        assert d.feed(b"data: " + b"z" * 50) == []
        assert d.buffered <= 101
    assert d.malformed == 1  # one event, however many chunks it came in
    assert d.feed(b"\n\ndata: ok\n\n") == [Event(b"ok")]


def test_event_is_a_frozen_value() -> None:
    ev = Event(b"x", "e", "1", 5)
    assert ev == Event(b"x", "e", "1", 5) and hash(ev) == hash(Event(b"x", "e", "1", 5))
    assert Event(b"x") == Event(b"x", "", None, None)
    with pytest.raises(AttributeError):
        ev.data = b"y"  # type: ignore[misc]
    assert not hasattr(ev, "__dict__")


def test_empty_chunks_are_harmless() -> None:
    assert decode(b"", b"data: x", b"", b"\r", b"", b"\n", b"\n") == [Event(b"x")]


def test_wrong_chunk_type_raises_and_leaves_the_decoder_usable() -> None:
    d = SSEDecoder()
    with pytest.raises(TypeError):
        d.feed(cast(Any, "data: x\n\n"))
    assert d.feed(b"data: x\n\n") == [Event(b"x")]


# --- properties -------------------------------------------------------------------------------

PROPERTY = settings(
    max_examples=examples(120),
    # No time limit per example: the suite runs on small shared machines, where a deadline
    # would measure the neighbours rather than the decoder.
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

VALUE = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=8
) | st.sampled_from(["", " ", "  x", "[DONE]", '{"a": "é😀"}', "a:b", "\x00", "\ufeff"])
LINE = st.one_of(
    st.tuples(st.just("data"), VALUE),
    st.tuples(st.just("event"), VALUE),
    st.tuples(st.just("id"), VALUE),
    st.tuples(st.just("retry"), st.from_regex(r"[0-9]{1,6}", fullmatch=True) | VALUE),
    st.tuples(st.sampled_from(["foo", "Data", "ids"]), VALUE),
    st.tuples(st.just(":"), VALUE),  # a comment
)
EOLS = [b"\n", b"\r\n", b"\r"]


def _ascii_digits(value: str) -> bool:
    return value != "" and all("0" <= c <= "9" for c in value)


@st.composite
def event_streams(draw: st.DrawFn) -> tuple[bytes, list[Event], bool]:
    """A valid event stream, the events it encodes, and whether it ends inside an event."""
    blocks = draw(st.lists(st.lists(LINE, max_size=5), max_size=8))
    unterminated = draw(st.lists(LINE, min_size=1, max_size=3) | st.none())
    out = [b"\xef\xbb\xbf"] if draw(st.booleans()) else []
    prev_eol = b""

    def line(text: bytes) -> None:
        nonlocal prev_eol
        eol = draw(st.sampled_from(EOLS))
        if not text and prev_eol == b"\r" and eol == b"\n":
            eol = b"\r\n"  # "\r" then "\n" would read as one \r\n line end, not a blank line
        out.append(text + eol)
        prev_eol = eol

    def field_line(name: str, value: str) -> bytes:
        raw_name, raw = name.encode(), value.encode()
        if name == ":":
            return b":" + raw
        if not value and draw(st.booleans()):
            return raw_name  # no colon: a field with an empty value
        if value.startswith(" ") or draw(st.booleans()):
            return raw_name + b": " + raw  # the one space is removed, the rest is value
        return raw_name + b":" + raw

    events: list[Event] = []
    last_id: str | None = None
    for block in blocks:
        data: list[str] = []
        kind, retry = "", None
        for name, value in block:
            line(field_line(name, value))
            if name == "data":
                data.append(value)
            elif name == "event":
                kind = value
            elif name == "id" and "\x00" not in value:
                last_id = value
            elif name == "retry" and _ascii_digits(value):
                retry = int(value)
        for _ in range(draw(st.integers(1, 2))):  # a blank line, sometimes a stray one more
            line(b"")
        if data:
            events.append(Event("\n".join(data).encode(), kind, last_id, retry))
    for name, value in unterminated or []:
        line(field_line(name, value))
    if unterminated and draw(st.booleans()):
        out[-1] = out[-1].rstrip(b"\r\n")  # the last line cut before its line end
    return b"".join(out), events, unterminated is not None


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(set(cuts)), len(data)]
    return [data[i:j] for i, j in zip(points, points[1:], strict=False)]


@PROPERTY
@given(event_streams(), st.data())
def test_any_split_gives_the_intended_events(
    case: tuple[bytes, list[Event], bool], data: st.DataObject
) -> None:
    stream, expected, unterminated = case
    whole = SSEDecoder()
    assert whole.feed(stream) == expected
    assert (whole.buffered > 0) == unterminated and whole.malformed == 0

    after_each_cr = [i + 1 for i, b in enumerate(stream) if b == 0x0D]
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    for chunks in (bytewise(stream), split_at(stream, after_each_cr), split_at(stream, cuts)):
        d = SSEDecoder()
        assert [ev for c in chunks for ev in d.feed(c)] == expected, chunks
        assert d.buffered == whole.buffered and d.malformed == 0


NOISE = st.lists(
    st.sampled_from(
        [b"\n", b"\r", b"\r\n", b"\n\n", b"data", b"event", b"id", b"retry", b":", b" ", b"x",
         b"12", b"\xef\xbb\xbf", b"\xef", b"\x00", b"\xff", b"error"]
    ),
    max_size=60,
).map(b"".join)  # fmt: skip


@PROPERTY
@given(NOISE, st.sampled_from([1, 2, 5, 16, DEFAULT_MAX_EVENT_BYTES]), st.data())
def test_any_bytes_any_split_same_events(stream: bytes, cap: int, data: st.DataObject) -> None:
    # Not only valid streams: whatever the bytes, how they are cut never changes what comes
    # out, the size cap included, and nothing raises.
    whole = SSEDecoder(max_event_bytes=cap)
    expected = whole.feed(stream)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    for chunks in (bytewise(stream), split_at(stream, cuts)):
        d = SSEDecoder(max_event_bytes=cap)
        assert [ev for c in chunks for ev in d.feed(c)] == expected, chunks
        assert d.malformed == whole.malformed, chunks
        assert d.buffered <= max(cap + 1, 2)  # 2: what may still become a BOM

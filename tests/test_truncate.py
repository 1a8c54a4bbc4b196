"""Pure truncation: cut, notice, read-on, stage-2 recut (docs/offload.md#cutting)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.truncation.cut import (
    MIN_BUDGET,
    Notice,
    count_lines,
    cut,
    parse_notice,
    read_chunk,
    recut,
    split_notice,
    truncate,
    utf8_len,
)

from .conftest import examples

FAST = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOOL = "read_file"
PATH = "/data/tool_result/0f3c.txt"

PIECES = [
    "a",
    "word ",
    "é",
    "中文",
    "😀",
    "\n",
    "\r\n",
    "\r",
    "\n\n",
    "Traceback (most recent call last):\n",
    "ValueError: bad\n",
    "x" * 40,
    "<<<TRUNCATED>>>\n",
    "\ud800",  # lone surrogate, as lenient JSON decoding can produce
]
mixed = st.lists(st.sampled_from(PIECES), max_size=60).map("".join)
one_line = st.text(alphabet=st.sampled_from("ab中😀é\r"), min_size=0, max_size=300)
many_lines = st.lists(
    st.tuples(
        st.text(alphabet=st.sampled_from("ab é中😀"), max_size=12), st.sampled_from(["\n", "\r\n"])
    ),
    min_size=1,
    max_size=40,
).map(lambda ls: "".join(a + b for a, b in ls))
texts = st.one_of(st.text(max_size=300), mixed, many_lines, many_lines, one_line, st.just(""))
budgets = st.one_of(st.integers(0, 24), st.integers(25, 400))


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, int]:
    """A text and a budget mostly below its size, so most examples really cut."""
    text = draw(texts)
    size = utf8_len(text)
    return text, draw(st.integers(0, max(size - 1, 0)) | st.integers(0, 12) | budgets)


def read_all(original: str, budget: int, line: int = 1, byte: int = 0) -> str:
    """Follow the hints chunk after chunk; return the concatenated excerpts."""
    parts: list[str] = []
    for _ in range(utf8_len(original) + 2):
        out = read_chunk(original, line, byte, budget, file_path=PATH, tool=TOOL)
        split = split_notice(out)
        if split is None:
            parts.append(out)
            return "".join(parts)
        excerpt, notice = split
        assert excerpt, "every chunk must make progress"
        assert (notice.start_line, notice.start_byte) == (line, byte)
        parts.append(excerpt)
        line, byte = notice.next_line, notice.next_byte
    raise AssertionError("no progress")


def person_lines(text: str) -> int:
    return len([piece for piece in re.split(r"(?<=\n)", text) if piece])


def check_excerpt(original: str, excerpt: str, budget: int) -> None:
    """(d) size, (f) character boundaries and line boundaries, for a chunk from the start."""
    size = utf8_len(excerpt)
    assert 0 < size <= max(budget, MIN_BUDGET)
    assert original.startswith(excerpt)
    encoded = excerpt.encode("utf-8", "surrogatepass")
    assert encoded.decode("utf-8", "surrogatepass") == excerpt
    first_line = original[: original.find("\n") + 1] if "\n" in original else original
    if utf8_len(first_line) <= max(budget, MIN_BUDGET):
        assert excerpt.endswith("\n")
        # maximal: the next whole line would not have fitted
        rest = original[len(excerpt) :]
        nxt = rest[: rest.find("\n") + 1] if "\n" in rest else rest
        assert size + utf8_len(nxt) > max(budget, MIN_BUDGET)
    else:
        assert "\n" not in excerpt


# (a) read from the start, hint after hint
@FAST
@given(cases())
@example(("", 0))
@example(("\n", 1))
@example(("😀😀😀", 0))
@example(("a\r\nb", 2))
def test_read_chunks_reconstruct(case: tuple[str, int]) -> None:
    original, budget = case
    assert read_all(original, budget) == original


# (b) start from truncate(), continue with read_chunk from next_line/next_byte
@FAST
@given(cases())
def test_truncate_then_read_reconstructs(case: tuple[str, int]) -> None:
    original, budget = case
    t = truncate(original, budget, file_path=PATH, tool=TOOL)
    if t is None:
        assert utf8_len(original) <= max(budget, MIN_BUDGET)
        return
    check_excerpt(original, t.excerpt, budget)
    assert t.notice.next_line == t.next_line and t.notice.next_byte == t.next_byte
    assert t.excerpt + read_all(original, budget, t.next_line, t.next_byte) == original


# (c) recut is idempotent, parses, still reconstructs, and equals a direct harder cut
@FAST
@given(cases(), st.floats(0, 1.2))
def test_recut(case: tuple[str, int], ratio: float) -> None:
    original, b1 = case
    b2 = int(b1 * ratio)
    t = truncate(original, b1, file_path=PATH, tool=TOOL)
    if t is None:
        return
    r = recut(t.text, b2)
    if r is None:
        assert t.notice.excerpt_bytes <= max(b2, MIN_BUDGET)
        return
    assert recut(r, b2) is None
    split = split_notice(r)
    assert split is not None
    excerpt, notice = split
    assert t.excerpt.startswith(excerpt)
    assert utf8_len(excerpt) == notice.excerpt_bytes <= max(b2, MIN_BUDGET)
    for field in ("file_path", "tool", "total_lines", "start_line", "start_byte"):
        assert getattr(notice, field) == getattr(t.notice, field)
    assert excerpt + read_all(original, b2, notice.next_line, notice.next_byte) == original
    direct = truncate(original, b2, file_path=PATH, tool=TOOL)
    assert direct is not None and direct.excerpt == excerpt
    # error lines may differ only if a marker straddles the old cut; all else is identical
    assert direct.notice == replace(notice, error_lines=direct.notice.error_lines)


# recut of a read_chunk that started mid-line keeps the continuation exact
@FAST
@given(one_line, st.integers(4, 40), st.integers(0, 12))
def test_recut_mid_line_start(original: str, b1: int, b2: int) -> None:
    t = truncate(original, b1, file_path=PATH, tool=TOOL)
    if t is None:
        return
    chunk = read_chunk(original, t.next_line, t.next_byte, b1, file_path=PATH, tool=TOOL)
    if split_notice(chunk) is None:
        return
    r = recut(chunk, b2) or chunk
    excerpt, notice = split_notice(r) or ("", None)
    assert notice is not None and notice.start_byte == t.next_byte
    tail = read_all(original, b2, notice.next_line, notice.next_byte)
    assert t.excerpt + excerpt + tail == original


# (e) the notice parses back with exactly the fields used to build it
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,8}", fullmatch=True)
paths = st.text(alphabet=st.characters(blacklist_characters="\n"), max_size=40) | st.sampled_from(
    ["/a b=5.txt", "x=1 y=2", "/p start_line=3 start_byte=4", "<<<TRUNCATED>>>", ""]
)


@st.composite
def notices(draw: st.DrawFn) -> Notice:
    start = draw(st.integers(1, 10**6))
    nxt = start + draw(st.integers(0, 10**4))
    next_byte = draw(st.integers(0, 10**5))
    errors = sorted(set(draw(st.lists(st.integers(nxt, nxt + 10**4), max_size=5))))
    byte_arg = draw(st.none() | names) if next_byte else "start_byte"
    return Notice(
        total_lines=draw(st.integers(0, 10**7)),
        start_line=start,
        excerpt_bytes=draw(st.integers(0, 10**6)),
        tool=draw(st.text(alphabet=st.characters(blacklist_characters="\n`"), max_size=20)),
        file_path=draw(paths),
        next_line=nxt,
        next_byte=next_byte,
        start_byte=draw(st.integers(0, 10**5)),
        error_lines=tuple(errors),
        path_arg=draw(names),
        line_arg=draw(names),
        byte_arg=byte_arg,
    )


@settings(max_examples=examples(300), deadline=None)
@given(notices(), st.sampled_from(["", "abc", "abc\n", "x\n\n", "中"]))
def test_notice_roundtrip(notice: Notice, prefix: str) -> None:
    from proxy.truncation.notice import attach

    if notice.excerpt_bytes != utf8_len(prefix):
        notice = replace(notice, excerpt_bytes=utf8_len(prefix))
    text = attach(prefix, notice)
    assert parse_notice(notice.render()) == (notice if notice.excerpt_bytes == 0 else None)
    assert split_notice(text) == (prefix, notice)
    assert split_notice(text + "\n") is None
    assert split_notice(text + " ") is None


@FAST
@given(cases(), st.integers(0, 5000))
def test_truncate_notice_roundtrip(case: tuple[str, int], offset: int) -> None:
    original, budget = case
    t = truncate(
        original,
        budget,
        file_path="/abs/x.py",
        tool="Read",
        line_arg="offset",
        line_offset=offset,
    )
    if t is None:
        return
    assert split_notice(t.text) == (t.excerpt, t.notice)
    assert t.notice.start_line == offset + 1
    assert t.notice.next_line == offset + t.next_line
    assert t.notice.total_lines == count_lines(original)
    assert t.notice.excerpt_bytes == utf8_len(t.excerpt)


# (g)
@FAST
@given(texts)
@example("")
@example("\n")
@example("a\nb")
@example("a\nb\n")
def test_count_lines(text: str) -> None:
    assert count_lines(text) == person_lines(text)


@FAST
@given(cases())
def test_cut_primitive(case: tuple[str, int]) -> None:
    text, budget = case
    excerpt, rest = cut(text, budget)
    assert text[:rest] == excerpt
    if utf8_len(text) <= max(budget, MIN_BUDGET):
        assert excerpt == text
    else:
        check_excerpt(text, excerpt, budget)


# exact examples with the literal notice text


def test_literal_notice() -> None:
    original = "".join(f"line {i}\n" for i in range(1, 11)) + "ValueError: boom\nend"
    t = truncate(original, 20, file_path=PATH, tool=TOOL)
    assert t is not None
    assert t.text == (
        "line 1\nline 2\n"
        "<<<TRUNCATED>>>\n"
        "The output above was truncated.\n"
        "The full content is saved to the file and contains 12 lines in total.\n"
        "This excerpt starts at line 1 and covers the next 14 bytes.\n"
        f"If the current content is not enough, call `read_file` with file_path={PATH}"
        " start_line=3 to read more.\n"
        "Lines that look like errors: 11."
    )
    assert (t.next_line, t.next_byte) == (3, 0)


def test_literal_mid_line() -> None:
    original = "é" * 10 + "\nnext\n"  # first line is 21 bytes
    t = truncate(original, 9, file_path="/f", tool=TOOL)
    assert t is not None
    assert t.excerpt == "éééé"
    assert t.text == (
        "éééé\n"
        "<<<TRUNCATED>>>\n"
        "The output above was truncated.\n"
        "The full content is saved to the file and contains 2 lines in total.\n"
        "This excerpt starts at line 1 and covers the next 8 bytes.\n"
        "If the current content is not enough, call `read_file` with file_path=/f"
        " start_line=1 start_byte=8 to read more.\n"
        "Line 1 continues past this excerpt; the next part starts at byte 8 of that line."
    )
    out = read_chunk(original, 1, 8, 9, file_path="/f", tool=TOOL)
    assert out.startswith("éééé\n<<<TRUNCATED>>>\n")
    assert "This excerpt starts at line 1 and covers the next 8 bytes." in out
    assert "Line 1 begins before this excerpt, which starts at byte 8 of it." in out
    assert out.splitlines()[5].endswith("start_line=1 start_byte=16 to read more.")


def test_client_read_tool_hint() -> None:
    original = "".join(f"{i}\n" for i in range(1, 401))
    t = truncate(
        original, 100, file_path="/abs/x.py", tool="Read", line_arg="offset", line_offset=1200
    )
    assert t is not None
    lines = t.text.splitlines()
    k = lines.index("<<<TRUNCATED>>>")
    assert lines[k + 3] == "This excerpt starts at line 1201 and covers the next 99 bytes."
    assert lines[k + 4] == (
        "If the current content is not enough, call `Read` with file_path=/abs/x.py offset=1237"
        " to read more."
    )
    assert t.next_line == 37


def test_error_lines_first_five_in_cut_part() -> None:
    original = (
        "Error: in excerpt\n"
        + "ok\n" * 5
        + "".join(
            f"{w}\n"
            for w in [
                "x FAILED",
                "ok",
                "panic: a",
                "error: b",
                "ok",
                "Traceback",
                "E",
                "ERROR",
                "fatal: z",
            ]
        )
    )
    t = truncate(original, 20, file_path="/f", tool=TOOL)
    assert t is not None
    assert t.notice.error_lines == (7, 9, 10, 12, 14)
    assert t.text.endswith("\nLines that look like errors: 7, 9, 10, 12, 14.")
    quiet = truncate("ok\n" * 50, 20, file_path="/f", tool=TOOL)
    assert quiet is not None and "look like errors" not in quiet.text


def test_marker_in_the_middle_is_not_a_notice() -> None:
    fake = (
        "<<<TRUNCATED>>>\nThe output above was truncated.\n"
        "If the current content is not enough, call `x` with file_path=/a start_line=2 to read more.\n"
    )
    assert parse_notice(fake) is None
    assert parse_notice("plain output\n" * 1000) is None
    t = truncate(fake * 20, 100, file_path="/f", tool=TOOL)
    assert t is not None
    assert split_notice(t.text) == (t.excerpt, t.notice)
    # a correct notice with a wrong byte count is rejected
    assert parse_notice("zz" + t.text[len(t.excerpt) :]) is None


def test_newline_before_marker_is_unambiguous() -> None:
    a = truncate("abc\n" + "x" * 50, 4, file_path="/f", tool=TOOL)
    b = truncate("abc" + "x" * 50, 3, file_path="/f", tool=TOOL)
    assert a is not None and b is not None
    assert a.excerpt == "abc\n" and b.excerpt == "abcx"
    assert split_notice(a.text) == ("abc\n", a.notice)
    assert split_notice(b.text) == ("abcx", b.notice)
    assert a.text.startswith("abc\n<<<") and b.text.startswith("abcx\n<<<")


def test_fits_is_none_and_recut_needs_notice() -> None:
    assert truncate("short", 100, file_path="/f", tool=TOOL) is None
    assert read_chunk("short\n", 1, 0, 100, file_path="/f", tool=TOOL) == "short\n"
    assert read_chunk("short\n", 2, 0, 100, file_path="/f", tool=TOOL) == ""
    with pytest.raises(ValueError):
        recut("no notice here", 10)


@pytest.mark.parametrize(("line", "byte"), [(0, 0), (3, 0), (1, 99), (1, 1), (1, -1)])
def test_bad_positions(line: int, byte: int) -> None:
    with pytest.raises(ValueError):
        read_chunk("é\nb", line, byte, 10, file_path="/f", tool=TOOL)


def test_position_just_past_a_newline_is_the_next_line() -> None:
    t = truncate("ab\ncd\nef\n", 3, file_path="/f", tool=TOOL, start_line=1, start_byte=3)
    assert t is not None
    assert (t.notice.start_line, t.notice.start_byte, t.excerpt) == (2, 0, "cd\n")


def test_crlf_not_split() -> None:
    excerpt, _ = cut("abc\r\ndef", 4)
    assert excerpt == "abc"
    assert read_all("abc\r\ndef\r\n", 4) == "abc\r\ndef\r\n"


def test_client_tool_without_byte_argument() -> None:
    original = "x" * 50 + "\nend\n"
    t = truncate(
        original,
        10,
        file_path="/abs/min.js",
        tool="view",
        path_arg="path",
        line_arg="line",
        byte_arg=None,
        line_offset=99,
    )
    assert t is not None
    assert "call `view` with path=/abs/min.js line=100 to read more.\n" in t.text
    assert t.text.endswith(
        "\nLine 100 continues past this excerpt; the next part starts at byte 10 of that line."
    )
    assert split_notice(t.text) == (t.excerpt, t.notice)
    r = recut(t.text, 4)
    assert r is not None and "line=100 to read more." in r
    assert parse_notice(r) == replace(t.notice, excerpt_bytes=4, next_byte=4)


def test_recut_byte_arg_for_a_new_mid_line_cut() -> None:
    original = "y" * 30 + "\n" + "z" * 30 + "\n"
    t = truncate(original, 40, file_path="/f", tool="Read", line_arg="offset")
    assert t is not None and t.next_byte == 0
    default = recut(t.text, 10)
    assert default is not None and "offset=1 start_byte=10 to read more." in default
    none = recut(t.text, 10, byte_arg=None)
    assert none is not None and "offset=1 to read more." in none
    assert parse_notice(none) == replace(
        t.notice, excerpt_bytes=10, next_line=1, next_byte=10, byte_arg=None
    )


def test_error_scan_stops_after_a_mebibyte() -> None:
    from proxy.truncation.cut import ERROR_SCAN_BYTES

    filler = ("." * 63 + "\n") * (ERROR_SCAN_BYTES // 64 + 10)
    t = truncate("head\n" + filler + "Traceback\n", 5, file_path="/f", tool=TOOL)
    assert t is not None and t.notice.error_lines == ()
    t = truncate("head\n" + "Traceback\n" + filler, 5, file_path="/f", tool=TOOL)
    assert t is not None and t.notice.error_lines == (2,)


def test_lone_surrogates_survive() -> None:
    original = "\ud800" * 10 + "\n"
    assert read_all(original, 7) == original


@FAST
@given(
    st.binary(max_size=200)
    | st.lists(st.sampled_from([b"E", b"Er", b"Error", b"x", b"\n"])).map(b"".join),
    st.sampled_from([b"Error", b"E", b"Traceback", b"EE"]),
    st.integers(0, 220),
    st.integers(0, 220),
)
def test_fast_find_is_find(data: bytes, needle: bytes, start: int, end: int) -> None:
    from proxy.truncation.cut import _find

    assert _find(data, needle, start, end) == data.find(needle, start, end)

"""Duplicate tool outputs as references (proxy.filewise.dedupe): pure functions."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.filewise.dedupe import (
    CANDIDATES,
    Dedup,
    Earlier,
    Span,
    _span_line,
    duplicate,
    expand,
    parse_reference,
)
from proxy.filewise.markers import Pointer
from proxy.truncation.notice import utf8_len

from .conftest import examples

FAST = settings(max_examples=examples(200), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def log(tag: str, n: int, start: int = 0) -> str:
    return "".join(f"{tag} test_{i} PASSED in {i * 7 % 13} ms ....................\n"
                   for i in range(start, start + n))


def test_identical_output_is_one_line() -> None:
    out = log("a", 300)
    earlier = [Earlier(3, "call_a", 2, out), Earlier(9, "call_b", 5, log("b", 10))]
    d = duplicate(out, earlier, min_bytes=4096, saved="tool_result/x.txt")
    assert d is not None and d.identical == earlier[0] and d.spans == ()
    assert d.text == ("[ctxproxy: identical to the output of call call_a in turn 2 (300 lines); "
                      "this copy: read_offloaded file_path=tool_result/x.txt]")
    assert d.refs == {3}
    assert expand(d.text, earlier) == out
    # The newest identical copy is named.
    d = duplicate(out, earlier + [Earlier(12, "call_c", 7, out)], min_bytes=4096)
    assert d is not None and d.identical is not None and d.identical.call_id == "call_c"


def test_long_repeated_spans_become_references() -> None:
    first = log("x", 300)
    lines = first.splitlines(keepends=True)
    new = "again\n" + "".join(lines[:150]) + "test_150 FAILED\n" + "".join(lines[151:]) + "done"
    earlier = [Earlier(4, "toolu_01", 3, first)]
    d = duplicate(new, earlier, min_bytes=2048, saved="tool_result/y.txt")
    assert d is not None
    assert d.spans == (Span(2, 151, 4, "toolu_01", 3, 1, 150),
                       Span(153, 301, 4, "toolu_01", 3, 152, 300))
    assert d.text == (
        "again\n"
        "[ctxproxy: lines 2-151 here repeat lines 1-150 of the output of call toolu_01 in turn "
        "3; this copy: read_offloaded file_path=tool_result/y.txt start_line=2]\n"
        "test_150 FAILED\n"
        "[ctxproxy: lines 153-301 here repeat lines 152-300 of the output of call toolu_01 in "
        "turn 3; this copy: read_offloaded file_path=tool_result/y.txt start_line=153]\n"
        "done")
    assert expand(d.text, earlier) == new
    # The saved copy's line numbers are the text's own: line 153 is what the reference says.
    assert new.split("\n")[152] == lines[151].rstrip("\n")
    for line in d.text.splitlines():
        if line.startswith("[ctxproxy: "):
            parsed = parse_reference(line)
            assert parsed is not None and parsed[1] == Pointer("tool_result/y.txt")


def test_short_repeats_and_short_texts_stay() -> None:
    first = log("x", 300)
    earlier = [Earlier(4, "c1", 3, first)]
    # Repeats of under min_bytes: every 20th line changed.
    new = "".join(line if i % 20 else "changed\n"
                  for i, line in enumerate(first.splitlines(keepends=True)))
    assert duplicate(new, earlier, min_bytes=4096) is None
    assert duplicate(first[:1000], earlier, min_bytes=4096) is None  # under min_bytes
    assert duplicate(first, [], min_bytes=4096) is None


def test_leftmost_longest_across_outputs() -> None:
    a, b = log("a", 100), log("b", 100)
    earlier = [Earlier(1, "c1", 1, a + b), Earlier(2, "c2", 2, a), Earlier(3, "c3", 3, b)]
    new = a + "mid\n" + b
    d = duplicate(new, earlier, min_bytes=1024)
    assert d is not None
    # a: in c1 and c2, the newest (c2) named; b: in c1 and c3, newest c3.
    assert [(s.call_id, s.start, s.end, s.from_start, s.from_end) for s in d.spans] == [
        ("c2", 1, 100, 1, 100), ("c3", 102, 201, 1, 100)]
    # Without the mid line, c1 holds it all in one span: longest wins over newest.
    d = duplicate(a + b + "end\n", earlier, min_bytes=1024)
    assert d is not None and [(s.call_id, s.start, s.end) for s in d.spans] == [("c1", 1, 200)]
    assert d.refs == {1}
    assert expand(d.text, earlier) == a + b + "end\n"


def test_texts_that_look_like_references_are_left_alone() -> None:
    first = log("x", 300)
    new = first + "[ctxproxy: lines 1-2 here repeat lines 1-2 of the output of call c in turn 1]\n"
    assert duplicate(new, [Earlier(1, "c", 1, first)], min_bytes=1024) is None


def test_expand_refuses_what_does_not_fit() -> None:
    first = log("x", 300)
    earlier = [Earlier(4, "c1", 3, first)]
    d = duplicate("head\n" + first, earlier, min_bytes=1024)
    assert d is not None
    with pytest.raises(ValueError):
        expand(d.text, [])
    with pytest.raises(ValueError):
        expand(d.text, [Earlier(4, "c1", 3, log("x", 10))])
    with pytest.raises(ValueError):
        expand(d.text.replace("lines 2-301", "lines 3-302"), earlier)
    with pytest.raises(ValueError):
        expand("[ctxproxy: something else]\n", earlier)


def test_cost_is_linear_on_repetitive_input() -> None:
    """A log repeating one block thousands of times: each window keeps CANDIDATES positions,
    so the scan does not compare every pair."""
    block = log("r", 40)
    big = block * 400  # ~2.3 MB, 16,000 lines
    earlier = [Earlier(1, "c1", 1, big)]
    t0 = time.process_time()
    d = duplicate(big[: len(big) // 2] + "x\n" + big[len(big) // 2:], earlier, min_bytes=4096)
    spent = time.process_time() - t0
    assert d is not None and len(d.spans) <= 2 and CANDIDATES == 4
    assert spent < 5.0, spent  # ~0.2 s here; quadratic would be minutes


# -- properties -----------------------------------------------------------------------------

LINES = ["alpha\n", "beta\n", "\n", "\r\n", "é中😀\n", "\ud800\n", "x" * 40 + "\n",
         "\u2028\n", "no newline", "[ctxproxy: x]\n",
         "FAILED tests/test_app.py::test_one - AssertionError: 1 != 2\r\n",
         "    return self._handle(request, *args, **kwargs)  # 中文\n",
         "src/app.py:12:5: E501 line too long (120 > 100 characters)\n"]
blocks = st.lists(st.sampled_from(LINES), min_size=1, max_size=12).map("".join)


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, list[Earlier], int]:
    """Earlier outputs made of shared blocks, and a new text mixing them with new lines."""
    pool = draw(st.lists(blocks, min_size=1, max_size=5))
    earlier = [Earlier(i, draw(st.sampled_from([f"c{i}", "dup"])), i // 2,
                       "".join(draw(st.lists(st.sampled_from(pool), max_size=6))))
               for i in range(draw(st.integers(0, 4) | st.integers(1, 4)))]
    parts = draw(st.lists(st.sampled_from(pool) | st.sampled_from(pool) | st.text(max_size=30),
                          max_size=8))
    text = "".join(parts)
    pick = draw(st.integers(0, 4))
    if earlier and pick == 0:
        text = draw(st.sampled_from(earlier)).text
    elif earlier and pick < 3:  # a slice of an earlier output between new lines
        lines = _lines(draw(st.sampled_from(earlier)).text)
        a = draw(st.integers(0, len(lines)))
        b = draw(st.integers(a, len(lines)))
        text = draw(st.text(max_size=20)) + "\n" + "".join(lines[a:b]) + text
    return text, earlier, draw(st.integers(1, 40) | st.integers(1, 160))


@st.composite
def long_cases(draw: st.DrawFn) -> tuple[str, list[Earlier], int]:
    """Longer earlier outputs, and a text stitched from slices of them and new lines: spans."""
    line = st.sampled_from([x for x in LINES if not x.startswith("[ctxproxy: ")])
    earlier = [Earlier(i, f"c{i}", i, "".join(draw(st.lists(line, min_size=5, max_size=40))))
               for i in range(draw(st.integers(1, 3)))]
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        lines = _lines(draw(st.sampled_from(earlier)).text)
        a = draw(st.integers(0, len(lines)))
        parts.append("".join(lines[a:draw(st.integers(a, len(lines)))]))
        parts.append(draw(st.sampled_from(["", "new line\n", "\n", draw(st.text(max_size=10))])))
    return "".join(parts), earlier, draw(st.integers(1, 200))


def _lines(text: str) -> list[str]:
    pieces = text.split("\n")
    return [p + "\n" for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])


@FAST
@given(cases() | long_cases(), st.one_of(st.none(), st.just("tool_result/a b.txt"),
                          st.builds(Pointer, st.text(max_size=10))))
@example(("", [], 1), None)
@example(("a\n", [Earlier(0, "c", 1, "a\n")], 1), None)
@example(("a", [Earlier(0, "c", 1, "a\n")], 1), None)
def test_duplicate_properties(case: tuple[str, list[Earlier], int],
                              saved: str | Pointer | None) -> None:
    text, earlier, min_bytes = case
    d = duplicate(text, earlier, min_bytes=min_bytes, saved=saved)
    assert d == duplicate(text, list(earlier), min_bytes=min_bytes, saved=saved)
    if d is None:
        return
    assert expand(d.text, earlier) == text  # the original back, byte for byte
    assert utf8_len(d.text) < utf8_len(text)
    assert utf8_len(text) >= min_bytes
    firsts = {}
    for e in earlier:
        firsts.setdefault(e.call_id, e)
    if d.identical is not None:
        assert d.identical.text == text and "\n" not in d.text and d.spans == ()
        return
    own = _lines(text)
    at = 0
    for s in d.spans:  # non-overlapping, in order, each at least min_bytes, truly repeated
        assert at < s.start <= s.end and s.end - s.start == s.from_end - s.from_start
        e = firsts[s.call_id]
        assert e.index == s.index and e.turn == s.turn
        span = "".join(own[s.start - 1:s.end])
        assert span == "".join(_lines(e.text)[s.from_start - 1:s.from_end])
        assert utf8_len(span) >= min_bytes
        at = s.end


@FAST
@given(st.text(max_size=300), st.lists(st.text(max_size=300), max_size=3), st.integers(1, 64))
def test_duplicate_never_raises(text: str, others: list[str], min_bytes: int) -> None:
    earlier = [Earlier(i, f"c{i}", i, t) for i, t in enumerate(others)]
    d = duplicate(text, earlier, min_bytes=min_bytes)
    assert d is None or expand(d.text, earlier) == text


def test_dedup_value() -> None:
    d = Dedup("x", (Span(1, 2, 7, "c", 1, 1, 2), Span(4, 5, 9, "d", 2, 1, 2)))
    assert d.refs == {7, 9}
    assert replace(d, spans=()).refs == frozenset()


def _brute(text: str, earlier: list[Earlier], min_bytes: int) -> list[tuple[int, int, str, int]]:
    """Leftmost-longest by brute force: (start, end, call, its start) per span, 1-based; ties:
    the newest output, then its latest position."""
    firsts: list[Earlier] = []
    for e in earlier:
        if e.call_id not in {f.call_id for f in firsts}:
            firsts.append(e)
    own = [line.encode("utf-8", "surrogatepass") for line in _lines(text)]
    outs = [(e, [x.encode("utf-8", "surrogatepass") for x in _lines(e.text)]) for e in firsts
            if 4 * len(e.text) >= min_bytes]
    spans = []
    i = 0
    while i < len(own):
        best = None
        for n in range(len(outs) - 1, -1, -1):
            e, theirs = outs[n]
            for k in range(len(theirs) - 1, -1, -1):
                t = 0
                while i + t < len(own) and k + t < len(theirs) and own[i + t] == theirs[k + t]:
                    t += 1
                if sum(map(len, own[i:i + t])) >= min_bytes and (best is None or t > best[0]):
                    best = (t, e, k)
        if best is not None:
            t, e, k = best
            ref = _span_line(Span(i + 1, i + t, e.index, e.call_id, e.turn, k + 1, k + t), None)
            if len(ref.encode("utf-8", "surrogatepass")) + 1 < sum(map(len, own[i:i + t])):
                spans.append((i + 1, i + t, e.call_id, k + 1))
                i += t
                continue
        i += 1
    return spans


def _crowded(earlier: list[Earlier], min_bytes: int) -> bool:
    """Whether some window occurs more often than the index keeps."""
    counts: dict[bytes, int] = {}
    for e in earlier:
        lines = [x.encode("utf-8", "surrogatepass") for x in _lines(e.text)]
        for k in range(len(lines)):
            end = k
            while end < len(lines) and sum(map(len, lines[k:end])) < min_bytes:
                end += 1
            if sum(map(len, lines[k:end])) >= min_bytes:
                key = b"".join(lines[k:end])
                counts[key] = counts.get(key, 0) + 1
    return any(c > CANDIDATES for c in counts.values())


@FAST
@given(cases() | long_cases())
def test_leftmost_longest_matches_brute_force(case: tuple[str, list[Earlier], int]) -> None:
    text, earlier, min_bytes = case
    if text.startswith("[ctxproxy: ") or "\n[ctxproxy: " in text or _crowded(earlier, min_bytes):
        return
    d = duplicate(text, earlier, min_bytes=min_bytes)
    want = _brute(text, earlier, min_bytes)
    if d is None or d.identical is not None:
        assert d is not None or not want
        return
    assert [(s.start, s.end, s.call_id, s.from_start) for s in d.spans] == want


def test_budget_limits_the_outputs_looked_at() -> None:
    old, recent = log("a", 200), log("b", 200)
    earlier = [Earlier(1, "c1", 1, old), Earlier(2, "c2", 2, recent)]
    new = "x\n" + old + recent
    d = duplicate(new, earlier, min_bytes=1024)
    assert d is not None and {s.call_id for s in d.spans} == {"c1", "c2"}
    d = duplicate(new, earlier, min_bytes=1024, budget_bytes=len(recent) + 10)
    assert d is not None and {s.call_id for s in d.spans} == {"c2"}
    assert expand(d.text, earlier) == new

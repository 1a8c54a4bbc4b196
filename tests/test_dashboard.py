"""The dashboard's pure pieces: the chart, summaries as markdown, a cut's diff, the ledger's
payloads and the templates (tests/test_files_dashboard.py has them over HTTP)."""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2 import UndefinedError

from proxy.store.ledger_entry import Change, LedgerEntry, LedgerTotals
from proxy.usage import Usage
from proxy.web import ledger as ledger_view
from proxy.web.chart import MAX_POINTS, Point, tokens_chart
from proxy.web.diff import CONTEXT, cut_diff, head_bytes
from proxy.web.markdown import Markdown
from proxy.web.render import Pages

from .conftest import examples

HOSTILE = "<script>alert('x')</script>"
SVG = "{http://www.w3.org/2000/svg}"
ROOT = Path(__file__).resolve().parent.parent

# --- the chart --------------------------------------------------------------------------------

points = st.builds(
    Point,
    sent=st.integers(0, 10**12), forwarded=st.integers(0, 10**12),
    cached=st.integers(0, 10**12), written=st.integers(0, 10**9),
    compaction=st.booleans(),
    cache_reason=st.none() | st.sampled_from(["ttl", "client", "compaction", "unknown"]) | st.text(),
)


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)  # raises on anything that is not well-formed XML
    assert root.tag == SVG + "svg"
    return root


def groups(root: ET.Element, cls: str) -> list[ET.Element]:
    return [e for e in root.iter() if e.get("class") == cls]


def texts(root: ET.Element) -> list[str]:
    return [e.text or "" for e in root.iter(SVG + "text")]


@settings(max_examples=examples(150), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(points, max_size=80))
def test_the_chart_is_well_formed_svg_for_any_data(data: list[Point]) -> None:
    root = parse(tokens_chart(data))
    hover = groups(root, "hover")[0]
    assert len(hover) == len(data)  # one column per request below MAX_POINTS
    assert len(groups(root, "compaction")) == sum(p.compaction for p in data)
    assert len(groups(root, "break")) == sum(1 for p in data if p.cache_reason)
    assert not list(root.iter("script")) and not list(root.iter(SVG + "script"))
    for attr in ("x", "y", "x1", "x2", "y1", "y2", "cx", "cy", "width", "height"):
        for e in root.iter():
            if e.get(attr) is not None and e is not root:
                assert math.isfinite(float(e.get(attr, ""))), (attr, e.get(attr))
    # Every point is inside the plot: the y axis reaches the highest value.
    plot = root.find(SVG + "rect")
    assert plot is not None
    y0, height = float(plot.get("y", "")), float(plot.get("height", ""))
    for series in groups(root, "series"):
        for e in series:
            ys = ([float(xy.split(",")[1]) for xy in e.get("points", "").split()]
                  if e.tag == SVG + "polyline" else [float(e.get("cy", y0))])
            assert all(y0 - 0.05 <= y <= y0 + height + 0.05 for y in ys)
    labels = texts(groups(root, "legend")[0])
    assert labels[:3] == ["sent by the client", "forwarded", "cached"]
    assert ("compaction" in labels) == any(p.compaction for p in data)


@pytest.mark.parametrize("n", [0, 1, 2, MAX_POINTS, MAX_POINTS + 1, 5000])
def test_the_chart_for_none_one_and_thousands_of_points(n: int) -> None:
    data = [Point(sent=1000 + i, forwarded=500, cached=i % 7, compaction=i == n // 2,
                  cache_reason="ttl" if i == n - 1 else None) for i in range(n)]
    if n > 10:
        data[n // 3] = Point(sent=9_999_999, forwarded=1, cached=0)  # a spike survives merging
    svg = tokens_chart(data)
    root = parse(svg)
    columns = len(groups(root, "hover")[0])
    assert columns == min(n, MAX_POINTS) or (n > MAX_POINTS and columns <= MAX_POINTS)
    assert len(groups(root, "compaction")) == (1 if n else 0)
    if n == 0:
        assert "no requests recorded" in texts(root)
    if n > 10:
        assert "10M" in texts(root)  # the y axis reaches the spike
        assert any("9,999,999" in (t.text or "") for t in root.iter(SVG + "title"))
    if n > MAX_POINTS:
        assert f"{n:,} requests in {columns} columns" in svg
    assert len(svg) < 400_000


def test_the_chart_escapes_its_text() -> None:
    svg = tokens_chart([Point(1, 1, 1, cache_reason=HOSTILE + "\x00\x1f\ud800")])
    root = parse(svg)
    assert "<script" not in svg and HOSTILE in "".join(root.itertext())


def test_the_compaction_marker_sits_on_its_request() -> None:
    data = [Point(10, 5, 0, compaction=i == 3) for i in range(10)]
    root = parse(tokens_chart(data, width=1000))
    [marker] = groups(root, "compaction")
    line = marker.find(SVG + "line")
    assert line is not None
    rects = list(groups(root, "hover")[0])
    x, w = float(rects[3].get("x", "")), float(rects[3].get("width", ""))
    assert x < float(line.get("x1", "")) < x + w
    assert "request 4" in (marker.findtext(SVG + "title") or "")


# --- markdown ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def md() -> Markdown:
    return Markdown()


def test_raw_html_in_a_summary_is_text(md: Markdown) -> None:
    out = md.render(f"# Goal\n\n{HOSTILE}\n\nsome <img src=x onerror=alert(1)> inline\n")
    assert "<script" not in out and "<img" not in out
    assert "&lt;script&gt;" in out and "&lt;img src=x onerror=alert(1)&gt;" in out
    assert "<h3>Goal</h3>" in out  # moved under the page's own headings


@pytest.mark.parametrize("link", [
    "[x](javascript:alert(1))", "[x](JaVaScRiPt:alert(1))", "[x](javascript&#58;alert(1))",
    "[x]( javascript:alert(1))", "<javascript:alert(1)>", "[x](vbscript:msgbox(1))",
    "[x](data:text/html;base64,PHNjcmlwdD4=)", "[x](data:image/png;base64,iVBORw0KGgo=)",
    "[x](file:///etc/passwd)", "[x]: javascript:alert(1)\n\n[x]",
])
def test_dangerous_links_are_not_links(md: Markdown, link: str) -> None:
    out = md.render(link)
    assert "<a " not in out, out
    assert "href" not in out


def test_web_links_stay_and_images_are_not_fetched(md: Markdown) -> None:
    out = md.render("[docs](https://example.com/a?b=1&c=2) ![pixel](https://tracker.example/p.png)")
    assert '<a href="https://example.com/a?b=1&amp;c=2" rel="nofollow noopener noreferrer">' in out
    assert "<img" not in out and "tracker.example" in out  # shown as a link, never loaded


ALLOWED_TAGS = {"p", "h3", "h4", "h5", "h6", "ul", "ol", "li", "em", "strong", "code", "pre",
                "blockquote", "a", "hr", "br", "table", "thead", "tbody", "tr", "th", "td", "s"}


@settings(max_examples=examples(300), deadline=None)
@given(st.text(alphabet=st.sampled_from(list("<>&\"'/:=()[]!#*`-_ \n\tjavscriptdatJAVSCR1x"))
               | st.characters(), max_size=200))
def test_no_markdown_makes_a_script_or_a_dangerous_link(text: str) -> None:
    out = Markdown().render(text)
    tags = {m.lower() for m in re.findall(r"<\s*/?\s*([A-Za-z][A-Za-z0-9]*)", out)}
    assert tags <= ALLOWED_TAGS, tags
    for href in re.findall(r'href="([^"]*)"', out):
        assert not re.match(r"\s*(javascript|vbscript|file|data):", href, re.I), href


# --- a cut's diff -----------------------------------------------------------------------------


def split_lines(data: bytes) -> list[bytes]:
    lines = data.split(b"\n")
    return lines[:-1] if data.endswith(b"\n") else lines


def person_lines(data: bytes) -> int:
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


line_text = st.text(alphabet=st.characters(blacklist_characters="\n", blacklist_categories=["Cs"]),
                    max_size=30)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(line_text, max_size=60), st.booleans(), st.data())
def test_the_diff_agrees_with_the_whole_original(lines: list[str], trailing: bool,
                                                 data: st.DataObject) -> None:
    text = "\n".join(lines) + ("\n" if trailing and lines else "")
    original = text.encode()
    kept = data.draw(st.integers(0, len(original)))
    notice = "<<<TRUNCATED>>>\nThe output above was truncated."
    whole = cut_diff(original, kept, notice, total_bytes=len(original),
                     total_lines=person_lines(original))
    head = cut_diff(original[:head_bytes(kept)], kept, notice, total_bytes=len(original),
                    total_lines=person_lines(original))
    every = split_lines(original)
    excerpt = original[:kept]
    assert whole.kept_lines == excerpt.count(b"\n") == head.kept_lines
    assert whole.kept_bytes == kept and whole.removed_bytes == len(original) - kept
    if kept < len(original):
        assert whole.removed_from == whole.kept_lines + 1 == head.removed_from
        assert whole.removed_lines == person_lines(original) - whole.kept_lines
    else:
        assert whole.removed_from is None and whole.removed_lines == 0
        assert whole.removed_context == ()
    # Context lines are the original's lines, numbered as the file page numbers them.
    assert [c.number for c in whole.kept_context] == list(
        range(whole.kept_lines - len(whole.kept_context) + 1, whole.kept_lines + 1))
    assert len(whole.kept_context) == min(CONTEXT, whole.kept_lines)
    for diff in (whole, head):
        for line in (*diff.kept_context, *diff.removed_context):
            raw = every[line.number - 1].decode("utf-8", "replace").removesuffix("\r")
            assert raw.startswith(line.text) and (line.text == raw or line.clipped)
    assert head.kept_context == whole.kept_context and head.partial == whole.partial
    assert [c.number for c in head.removed_context] == [c.number for c in whole.removed_context]
    tail = excerpt[excerpt.rfind(b"\n") + 1:]
    # As every line shown: a CR before the newline is no part of its text.
    assert whole.partial == (tail.decode("utf-8", "replace").removesuffix("\r")
                             if tail and kept < len(original) else None)
    assert whole.notice == tuple(notice.split("\n"))


def test_a_mid_line_cut_shows_the_split_line() -> None:
    original = b"one\ntwo\nthree is long\nfour\n"
    d = cut_diff(original, len(b"one\ntwo\nthree"), "N", total_bytes=len(original),
                 total_lines=4)
    assert (d.kept_lines, d.removed_from, d.removed_lines, d.partial) == (2, 3, 2, "three")
    assert [(c.number, c.text) for c in d.removed_context] == [(3, "three is long"), (4, "four")]
    assert [c.text for c in d.kept_context] == ["one", "two"]


def test_a_head_that_ends_inside_a_line_marks_it_clipped() -> None:
    original = b"a\n" + b"b" * 10 + b"\n" + b"c" * 5000 + b"\n"
    d = cut_diff(original[:20], 2, "N", total_bytes=len(original), total_lines=3)
    assert [(c.number, c.clipped) for c in d.removed_context] == [(2, False), (3, True)]


# --- the ledger's payloads --------------------------------------------------------------------

entries = st.lists(st.builds(
    LedgerEntry,
    tenant=st.just("t1"), session=st.sampled_from(["s1", "s2", "s3"]),
    id=st.uuids().map(lambda u: u.hex), request=st.just("r"),
    ts=st.floats(1, 2e9), kind=st.sampled_from(["request", "read_round", "summarizer",
                                                "memory_fold"]),
    api=st.just("chat"), model=st.just("m"),
    usage=st.none() | st.builds(Usage, input=st.integers(0, 10**6), cache_read=st.integers(0, 10**6)),
    estimate=st.none() | st.builds(Usage, output=st.integers(0, 10**5)),
    cost=st.none() | st.floats(0, 100), tokens_sent=st.integers(0, 10**6),
    tokens_forwarded=st.integers(0, 10**6), direct=st.none() | st.builds(Usage, input=st.integers(0, 10**6)),
    direct_cost=st.none() | st.floats(0, 100),
    cache_reason=st.none() | st.sampled_from(["ttl", "client", "compaction", "unknown"]),
), max_size=30)


@settings(max_examples=examples(100), deadline=None)
@given(entries)
def test_a_tenants_totals_are_its_sessions_totals_added_up(found: list[LedgerEntry]) -> None:
    sessions = [LedgerTotals.of("t1", s, [e for e in found if e.session == s])
                for s in ("s1", "s2", "s3") if any(e.session == s for e in found)]
    summed = ledger_view.sum_totals("t1", sessions)
    direct = LedgerTotals.of("t1", "", found)
    for name in ("requests", "calls", "estimated", "unpriced", "tokens_sent",
                 "tokens_forwarded", "billed", "direct", "first_ts", "last_ts"):
        assert getattr(summed, name) == getattr(direct, name), name
    assert dict(summed.breaks) == dict(direct.breaks)
    assert summed.cost == pytest.approx(direct.cost)
    assert summed.saved == pytest.approx(direct.saved)
    [row] = ledger_view.tenant_rows(sessions) or [None]
    if found:
        assert row is not None and row["sessions"] == len(sessions)
        assert row["saved"] == pytest.approx(direct.direct_cost - direct.cost)


def test_the_session_ledger_keeps_the_newest_rows_and_numbers_requests() -> None:
    made = [LedgerEntry("t", "s", f"{i:032x}", f"{i:032x}", 1000.0 + i,
                        "request" if i % 3 else "read_round", "chat", "m", cost=0.01)
            for i in range(10)]
    totals = LedgerTotals.of("t", "s", made)
    out = ledger_view.session_ledger(made[-4:], totals, "/files/t/s", limit=4)
    assert [r["id"] for r in out["entries"]] == [e.id for e in made[-4:]]
    assert [r["number"] for r in out["entries"]] == [None, 1, 2, None]
    assert out["truncated"] and out["calls"] == 10 and out["shown"] == 4
    assert out["entries"][0]["url"] == f"/files/t/s/requests/{made[6].id}"
    dear = LedgerTotals.of("t", "s", [LedgerEntry("t", "s", "a", "a", 1.0, "request", "chat",
                                                  "m", cost=2.0, direct_cost=0.5)])
    assert ledger_view.totals_json(dear)["saved"] == pytest.approx(-1.5)


# --- the templates ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pages() -> Pages:
    return Pages()


def usage(**kw: int) -> dict[str, int]:
    return ledger_view.usage_json(Usage(**kw))


def hostile_session() -> dict[str, Any]:
    entry = LedgerEntry("t<1>", HOSTILE, "e1", "e1", 1.7e9, "request", "chat", HOSTILE,
                        usage=Usage(input=5), cost=0.5, direct_cost=0.25, tokens_sent=10,
                        tokens_forwarded=5, compaction=True, cache_reason=HOSTILE)
    totals = LedgerTotals.of("t<1>", HOSTILE, [entry])
    return {
        "tenant": "t<1>", "session": HOSTILE, "url": "/files/t/s",
        "stats": {"tenant": "t", "session": HOSTILE, "url": "/files/t/s", "turns": 1,
                  "messages": 2, "tokens_in": 3, "tokens_out": 2, "saved_ratio": 0.33,
                  "compactions": 1, "offloads": 0, "first_seen": "2026-12-02T10:15:30+00:00",
                  "last_seen": "2026-12-02T10:15:30+00:00"},
        "summaries": [{"name": "x.md", "url": "/files/t/s/summaries/x.md",
                       "created_at": "2026-12-02T10:15:30+00:00", "source": "model",
                       "model": HOSTILE, "head": 1, "upto": 5, "tokens_before": 100,
                       "tokens_after": 0, "dialog": HOSTILE,
                       "text": f"## Goal\n{HOSTILE}\n[a](javascript:alert(1))\n"}],
        "dialog_files": [{"name": HOSTILE, "url": "/x", "size": 1, "mtime": "x"}],
        "tool_results": [],
        "ledger": ledger_view.session_ledger([entry], totals, "/files/t/s"),
    }


def test_every_value_is_escaped_on_the_session_page(pages: Pages) -> None:
    page = pages.render("session.html", hostile_session())
    assert "<script" not in page.lower()
    assert "<h1>&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;</h1>" in page
    assert page.count("&lt;script&gt;") >= 7  # name, model, summary, dialog, cache reason...
    assert 'href="javascript' not in page and "<h4>Goal</h4>" in page
    assert "ctxproxy cost more by" in page and "-$0.2500" in page


def test_the_request_page_escapes_changes_and_diffs(pages: Pages) -> None:
    entry = LedgerEntry("t", "s", "e1", "e1", 1.7e9, "request", "chat", HOSTILE,
                        changes=(Change("cut", HOSTILE, kept_bytes=4, notice=HOSTILE,
                                        file="tool_result/x.txt"),
                                 Change(HOSTILE, HOSTILE, role=HOSTILE, call_id=HOSTILE)))
    original = f"{HOSTILE}\nmore {HOSTILE}\n".encode()
    d = cut_diff(original, 4, HOSTILE, total_bytes=len(original), total_lines=2)
    changes = [{**ledger_view.change_json(c), "cut": None, "evicted": None}
               for c in entry.changes]
    changes[0]["cut"] = {"url": "/x", "diff": dataclasses.asdict(d), "missing": None,
                         "notice": [HOSTILE], "removed_url": "/x?start_line=1#L1"}
    page = pages.render("request.html", {
        "tenant": "t", "session": "s", "id": "e1", "url": "/files/t/s/requests/e1",
        "session_url": "/files/t/s", "request_url": None,
        "entry": ledger_view.entry_row(entry, "/files/t/s"), "calls": [], "changes": changes})
    assert "<script" not in page.lower() and page.count("&lt;script&gt;") >= 6
    assert '<td class="s">+</td><td>&lt;scr</td>' in page  # the split line's kept start


def test_a_payload_missing_a_field_fails_loudly(pages: Pages) -> None:
    payload = hostile_session()
    del payload["summaries"][0]["model"]
    with pytest.raises(UndefinedError):
        pages.render("session.html", payload)


def test_the_error_page_and_the_index_escape(pages: Pages) -> None:
    assert "&lt;script&gt;" in pages.error(404, HOSTILE, "/files")
    index = pages.render("index.html", {
        "url": "/files", "tenant": HOSTILE, "master": False, "database": True, "q": HOSTILE,
        "ledger": True, "tenants": [], "memory": [], "sessions": [{
            **hostile_session()["stats"], "ledger": None}]})
    assert "<script" not in index.lower() and 'value="&lt;script&gt;' in index


def test_the_templates_are_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["proxy.web"]
    templates = ROOT / "proxy" / "web"
    shipped = {p for g in globs for p in templates.glob(g)}
    present = set((templates / "templates").iterdir())
    assert present and present <= shipped, present - shipped

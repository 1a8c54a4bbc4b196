"""/files as the dashboard, over HTTP: the ledger's parts of the session, request and index pages
(JSON and HTML), for sessions made through a real proxy with ledger entries written into the
store the proxy uses. The pure pieces (chart, markdown, diff, templates) are in
tests/test_dashboard.py.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from html import unescape
from typing import Any

import httpx
import orjson
import pytest

from proxy.app import create_app
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread, serve_in_thread
from proxy.store.interfaces import LedgerStore
from proxy.store.ledger_entry import Change, LedgerEntry, LedgerTotals
from proxy.truncation.notice import split_notice
from proxy.usage import Usage
from proxy.web import ledger as ledger_view
from proxy.web import routes

from .conftest import proxy_config
from .test_files_web import (
    CONFIG,
    HTML,
    JSON,
    KEY_A,
    KEY_B,
    MASTER,
    SUMMARY,
    TENANT_A,
    TENANT_B,
    Corpus,
    bearer,
    chat,
    populate,
)

HOSTILE = "<script>alert('x')</script>"
# What the summarizer answers for the dashboard's session: markdown with hostile parts.
DASH_SUMMARY = SUMMARY.replace(
    "- ValueError in x.py\n",
    "- ValueError in x.py <script>alert('s')</script>\n"
    "- see [the docs](javascript:alert(1)) and [inline](data:text/html,hi) or "
    "[the wiki](https://example.com/wiki)\n",
)
TOOL_LINES = 3000


def tool_output() -> str:
    return "".join(f"line {i}: step {i} <script>alert({i})</script>\n"
                   for i in range(1, TOOL_LINES + 1))


def dash_history() -> list[dict[str, Any]]:
    """Forty turns and a long tool output, for a model with a small window: compacted and
    offloaded in one request."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "Agent."}]
    for t in range(40):
        history += [{"role": "user", "content": f"request {t}: " + "please do the thing " * 15},
                    {"role": "assistant", "content": f"answer {t}: " + "done with it " * 20}]
    history += [
        {"role": "user", "content": "run the build"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function",
             "function": {"name": "run_shell", "arguments": '{"cmd": "make"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": tool_output()},
    ]
    return history


def dash_responder(body: dict[str, Any]) -> Reply:
    first = body["messages"][0].get("content") or ""
    if isinstance(first, str) and "summar" in first.lower():
        return Reply(content=DASH_SUMMARY)
    return Reply(content="ok, looking at it")


def hex_id(prefix: str, n: int) -> str:
    return f"{prefix}{n:031x}"


@dataclass
class Dash:
    corpus: Corpus
    ledger: LedgerStore
    tool: str  # the offloaded file's name in dash-1
    excerpt: str  # the cut result as forwarded: excerpt + notice
    notice: str
    summary: dict[str, Any]  # dash-1's summary, as its session JSON lists it
    ids: dict[str, str]  # label -> entry id (dash-1 unless named otherwise)

    @property
    def url(self) -> str:
        return self.corpus.url

    def get(self, path: str, headers: dict[str, str], **params: Any) -> httpx.Response:
        return self.corpus.get(path, headers, **params)

    def session(self, session: str = "dash-1", key: str = KEY_A,
                tenant: str = TENANT_A) -> dict[str, Any]:
        return self.corpus.session_json(key, tenant, session)

    def request_path(self, label: str, session: str = "dash-1") -> str:
        return f"/files/{TENANT_A}/{session}/requests/{self.ids[label]}"


def dash_entries(tool: str, excerpt: str, notice: str, original: bytes, forwarded: str,
                 summary: dict[str, Any], now: float) -> dict[str, LedgerEntry]:
    """dash-1's calls: a compacting request whose tool result was cut (with a read round and
    the summarizer's call), a TTL break, a request that cost more than going direct, an
    unpriced memory fold without provider usage."""
    base = now - 3600
    first = hex_id("a", 1)
    cut = Change(what="cut", reason="the tool result was over the offload threshold: its start "
                 "was forwarded with a notice, the whole output saved to a file", at=84,
                 role="tool", call_id="call_9", tool="run_shell", bytes_before=len(original),
                 bytes_after=len(forwarded.encode()), kept_bytes=len(excerpt.encode()),
                 notice=notice, file=f"tool_result/{tool}")
    evicted = Change(what="evicted", reason="the oldest turns no longer fit the window: they "
                     "went into the summary", at=summary["head"], upto=summary["upto"],
                     bytes_before=40_000, bytes_after=1_500)
    inserted = Change(what="summary", reason="the summary was inserted in place of the turns",
                      at=1)
    strange = Change(what=HOSTILE, reason="a change of a newer kind " + HOSTILE, role=HOSTILE)
    entries = [
        LedgerEntry(TENANT_A, "dash-1", first, first, base, "request", "chat", "tiny",
                    usage=Usage(input=1200, cache_write_5m=200, output=40), cost=0.0021,
                    tokens_sent=66_559, tokens_forwarded=1_443,
                    direct=Usage(input=60_000, cache_write_5m=6_000, output=40),
                    direct_cost=0.25, compaction=True, compacted=True, offloaded=1, rounds=1,
                    epoch="e1", changes=(cut, evicted, inserted, strange)),
        LedgerEntry(TENANT_A, "dash-1", hex_id("a", 2), first, base + 1, "summarizer", "chat",
                    "tiny", usage=Usage(input=5_000, output=300), cost=0.004),
        LedgerEntry(TENANT_A, "dash-1", hex_id("a", 3), first, base + 2, "read_round", "chat",
                    "tiny", usage=Usage(input=300, cache_read=1_200, output=30), cost=0.001),
        LedgerEntry(TENANT_A, "dash-1", hex_id("a", 4), hex_id("a", 4), base + 400, "request",
                    "chat", "tiny", usage=Usage(input=1_600, output=20), cost=0.002,
                    tokens_sent=67_000, tokens_forwarded=1_500, direct=Usage(input=67_000),
                    direct_cost=0.02, cache_reason="ttl", gap_s=398.0, compacted=True),
        LedgerEntry(TENANT_A, "dash-1", hex_id("a", 5), hex_id("a", 5), base + 460, "request",
                    "chat", HOSTILE, usage=Usage(input=100, cache_read=1_500, output=10),
                    cost=0.05, tokens_sent=67_100, tokens_forwarded=1_600,
                    direct=Usage(cache_read=67_000), direct_cost=0.01, cache_reason="client",
                    gap_s=60.0, compacted=True),
        LedgerEntry(TENANT_A, "dash-1", hex_id("a", 6), hex_id("a", 6), base + 500,
                    "memory_fold", "chat", "tiny", estimate=Usage(input=800, output=100)),
        # Calls made for no request in particular (``request`` empty).
        LedgerEntry(TENANT_A, "dash-1", hex_id("a", 7), "", base + 510, "summarizer", "chat",
                    "tiny", usage=Usage(input=700, output=70), cost=0.0007),
        LedgerEntry(TENANT_A, "dash-1", hex_id("a", 8), "", base + 520, "memory_fold", "chat",
                    "tiny", usage=Usage(input=800, output=80), cost=0.0008),
    ]
    labels = ["first", "summarizer", "round", "ttl", "dearer", "fold", "lone", "lone-fold"]
    return dict(zip(labels, entries, strict=True))


def make_dash(corpus: Corpus, fake: FakeUpstream) -> Dash:
    """dash-1 made through the proxy (compacted, its tool output cut), and ledger entries for
    it and for the other sessions, written into the proxy's ledger store."""
    fake.reset()
    fake.responder = dash_responder
    r = chat(corpus, dash_history(), {**bearer(KEY_A), "x-session-id": "dash-1"}, model="tiny")
    assert r.headers["x-ctxproxy-offloaded"] == "1" and r.headers["x-ctxproxy-compacted"] == "1"
    forwarded = next(m["content"] for rec in fake.received
                     for m in orjson.loads(rec.body).get("messages", [])
                     if m.get("role") == "tool" and "<<<TRUNCATED>>>" in m["content"])
    split = split_notice(forwarded)
    assert split is not None
    excerpt, notice = split[0], split[1].render()
    fake.reset()
    corpus.srv.drain()
    session = corpus.session_json(KEY_A, TENANT_A, "dash-1")
    [tool] = session["tool_results"]
    [summary] = session["summaries"]
    original = (corpus.data / TENANT_A / "dash-1" / "tool_result" / tool["name"]).read_bytes()
    assert original.decode() == tool_output()
    entries = dash_entries(tool["name"], excerpt, notice, original, forwarded, summary,
                           time.time())
    ids = {label: e.id for label, e in entries.items()}
    # build-1: ctxproxy cost more than going direct; other-1: tenant B's own.
    now = time.time()
    dear = LedgerEntry(TENANT_A, "build-1", hex_id("c", 1), hex_id("c", 1), now - 3000,
                       "request", "chat", "gpt-4o", usage=Usage(input=1000), cost=50.0,
                       tokens_sent=100, tokens_forwarded=100, direct_cost=10.0)
    theirs = LedgerEntry(TENANT_B, "other-1", hex_id("b", 1), hex_id("b", 1), now - 3000,
                         "request", "chat", "gpt-4o", usage=Usage(input=10), cost=0.5,
                         tokens_sent=10, tokens_forwarded=10, direct_cost=0.75,
                         changes=(Change("cut", "BRAVO-REASON-only"),))
    ids.update(dear=dear.id, theirs=theirs.id)
    ledger = corpus.srv.app.services.store.ledger  # type: ignore[attr-defined]
    ledger.add([*entries.values(), dear, theirs])
    return Dash(corpus, ledger, tool["name"], forwarded, notice, summary, ids)


@pytest.fixture(scope="module")
def dash(
    _fake_server: tuple[FakeUpstream, ServerThread], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Dash]:
    fake, upstream = _fake_server
    root = tmp_path_factory.mktemp("dash")
    config = proxy_config(upstream.url + "/v1", root / "data",
                          {**CONFIG, "auth": {"master_key": MASTER}})
    with serve_in_thread(create_app(config), lifespan="on") as srv, \
            httpx.Client(timeout=30) as client:
        corpus = populate(Corpus(srv, root / "data", root / "outside", client), fake)
        made = make_dash(corpus, fake)
        fake.reset()
        yield made


def expected_totals(dash: Dash, tenant: str, session: str) -> LedgerTotals:
    """What the store holds for the session, summed (the proxy may have recorded its own
    entries for the real requests next to the test's)."""
    return LedgerTotals.of(tenant, session, dash.ledger.entries(tenant, session))


# --- the session page ---------------------------------------------------------------------------


def test_session_json_has_the_ledger_next_to_every_old_field(dash: Dash) -> None:
    body = dash.session()
    assert {"stats", "summaries", "dialog_files", "tool_results", "ledger"} <= set(body)
    ledger = body["ledger"]
    want = expected_totals(dash, TENANT_A, "dash-1")
    assert ledger["totals"] == orjson.loads(orjson.dumps(ledger_view.totals_json(want)))
    totals = ledger["totals"]
    assert totals["calls"] >= 8 and totals["requests"] >= 3
    assert totals["estimated"] >= 1 and totals["unpriced"] >= 1  # the memory fold
    assert totals["breaks"]["ttl"] >= 1 and totals["breaks"]["client"] >= 1
    assert totals["saved"] == pytest.approx(totals["direct_cost"] - totals["cost"])
    rows = {r["id"]: r for r in ledger["entries"]}
    assert set(dash.ids.values()) - {dash.ids["dear"], dash.ids["theirs"]} <= set(rows)
    assert [r["ts"] for r in ledger["entries"]] == sorted(r["ts"] for r in ledger["entries"])
    first = rows[dash.ids["first"]]
    assert first["url"] == f"/files/{TENANT_A}/dash-1/requests/{dash.ids['first']}"
    assert first["number"] == 1 and first["compaction"] and first["changes"] == 4
    assert first["billed"] == {"input": 1200, "cache_read": 0, "cache_write_5m": 200,
                               "cache_write_1h": 0, "cache_write": 200, "output": 40,
                               "reasoning": 0, "prompt": 1400}
    assert first["saved"] == pytest.approx(0.25 - 0.0021)
    kinds = {rows[dash.ids[k]]["kind"] for k in ("round", "summarizer", "fold")}
    assert kinds == {"read_round", "summarizer", "memory_fold"}  # costs of their own
    fold = rows[dash.ids["fold"]]
    assert fold["estimated"] and fold["cost"] is None and fold["usage"] is None
    assert fold["billed"]["input"] == 800 and fold["number"] is None
    assert rows[dash.ids["dearer"]]["saved"] == pytest.approx(0.01 - 0.05)
    assert ledger["shown"] == len(ledger["entries"]) and ledger["truncated"] is False


def test_session_html_has_the_chart_costs_markdown_and_calls(dash: Dash) -> None:
    r = dash.get(f"/files/{TENANT_A}/dash-1", {**bearer(KEY_A), **HTML})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    svg = re.search(r"<svg .*?</svg>", page, re.S)
    assert svg is not None and 'class="chart"' in svg[0]
    for label in ("sent by the client", "forwarded", "cached", "compaction", "cache break: ttl",
                  "cache break: client", "tokens", "requests, oldest first"):
        assert f">{label}<" in svg[0], label
    # A marker per compaction, a triangle per cache break (the proxy records the real request
    # next to the test's entries).
    requests = dash.ledger.entries(TENANT_A, "dash-1", kind="request")
    assert svg[0].count('class="compaction"') == sum(e.compaction for e in requests) >= 1
    assert svg[0].count('class="break"') == sum(bool(e.cache_reason) for e in requests) >= 2
    # Totals, with the estimated and unpriced calls counted.
    totals = dash.session()["ledger"]["totals"]
    assert f"${totals['cost']:,.4f}" in page and f"${totals['direct_cost']:,.4f}" in page
    assert "calls estimated (no provider usage)" in page and "calls unpriced" in page
    # The summary as markdown (its headings moved under the page's own), the source a click away.
    assert "<h4>Goal</h4>" in page and "<h5>Done</h5>" in page
    assert "<summary>markdown source</summary><pre>## Goal" in page
    assert dash.summary["url"] in page
    # The calls, each linked to its page; read rounds, summarizer and fold as rows.
    for label in ("first", "round", "summarizer", "fold"):
        assert f'href="/files/{TENANT_A}/dash-1/requests/{dash.ids[label]}"' in page
    assert "<td>read_round</td>" in page and "<td>memory_fold" in page
    # Hostile text (the summary's, a model name) is text; links go nowhere dangerous.
    assert "<script" not in page.lower() and "&lt;script&gt;alert(&#39;s&#39;)" in page
    assert "<code>&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;</code>" in page
    hrefs = re.findall(r'href="([^"]*)"', page)
    assert not [h for h in hrefs if h.lower().startswith(("javascript:", "data:"))]
    assert "[the docs](javascript:alert(1))" in unescape(page)
    assert 'href="https://example.com/wiki" rel="nofollow noopener noreferrer"' in page
    assert "<img" not in page


def test_a_session_without_a_ledger_has_no_ledger_parts(
    dash: Dash, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(routes, "_ledger", lambda rt: None)
    assert dash.session()["ledger"] is None
    page = dash.get(f"/files/{TENANT_A}/dash-1", {**bearer(KEY_A), **HTML}).text
    assert "<svg" not in page and "Summaries (1)" in page and "<h4>Goal</h4>" in page
    index = dash.get("/files", {**bearer(KEY_A), **JSON}).json()
    assert index["ledger"] is False and index["tenants"] == []
    assert all(s["ledger"] is None for s in index["sessions"])
    assert dash.get(dash.request_path("first"), {**bearer(KEY_A), **JSON}).status_code == 404


def test_the_session_page_lists_the_newest_calls_only(dash: Dash) -> None:
    chat(dash.corpus, [{"role": "user", "content": "hi"}],
         {**bearer(KEY_A), "x-session-id": "many-1"})
    base = time.time() - 10_000
    dash.ledger.add([
        LedgerEntry(TENANT_A, "many-1", hex_id("e", i), hex_id("e", i), base + i, "request",
                    "chat", "gpt-4o", usage=Usage(input=100 + i, cache_read=i), cost=0.001,
                    tokens_sent=1000 + i, tokens_forwarded=500 + i, direct_cost=0.002,
                    compaction=i % 500 == 0)
        for i in range(ledger_view.LEDGER_ROWS + 150)
    ])
    ledger = dash.session("many-1")["ledger"]
    assert ledger["shown"] == ledger_view.LEDGER_ROWS and ledger["truncated"]
    assert ledger["totals"]["calls"] >= ledger_view.LEDGER_ROWS + 150
    ids = [r["id"] for r in ledger["entries"]]
    assert hex_id("e", ledger_view.LEDGER_ROWS + 149) in ids and hex_id("e", 149) not in ids
    started = time.monotonic()
    page = dash.get(f"/files/{TENANT_A}/many-1", {**bearer(KEY_A), **HTML}).text
    took = time.monotonic() - started
    assert f"The newest {ledger_view.LEDGER_ROWS:,} of" in page
    svg = re.search(r"<svg .*?</svg>", page, re.S)
    assert svg is not None and svg[0].count('<rect x=') <= 601  # downsampled
    assert took < 10, took


# --- a request's page ---------------------------------------------------------------------------


def test_request_json_has_the_entry_and_the_cut_as_a_diff(dash: Dash) -> None:
    r = dash.get(dash.request_path("first"), {**bearer(KEY_A), **JSON})
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == dash.ids["first"] and body["entry"]["kind"] == "request"
    assert body["entry"]["tokens_sent"] == 66_559 and body["request_url"] is None
    calls = {c["id"] for c in body["calls"]}
    assert {dash.ids["round"], dash.ids["summarizer"]} <= calls
    whats = [c["what"] for c in body["changes"]]
    assert whats == ["cut", "evicted", "summary", HOSTILE]
    cut = body["changes"][0]
    assert cut["reason"].startswith("the tool result was over the offload threshold")
    diff = cut["cut"]["diff"]
    lines = tool_output().split("\n")
    kept = tool_output().encode()[: cut["kept_bytes"]]
    assert diff["kept_bytes"] == cut["kept_bytes"] and diff["total_lines"] == TOOL_LINES
    assert diff["kept_lines"] == kept.count(b"\n") > 10
    assert diff["removed_from"] == diff["kept_lines"] + 1
    assert diff["removed_lines"] == TOOL_LINES - diff["kept_lines"]
    assert diff["kept_context"][-1]["text"] == lines[diff["kept_lines"] - 1]
    assert diff["removed_context"][0]["number"] == diff["removed_from"]
    assert diff["removed_context"][0]["text"] == lines[diff["removed_from"] - 1]
    assert diff["notice"] == dash.notice.split("\n") == cut["cut"]["notice"]
    # What the diff says was forwarded is what the upstream received.
    kept_text = tool_output().encode()[: diff["kept_bytes"]].decode()
    sep = "\n" if kept_text and not kept_text.endswith("\n") else ""
    assert kept_text + sep + "\n".join(diff["notice"]) == dash.excerpt
    n = diff["removed_from"]
    assert cut["cut"]["removed_url"] == (
        f"/files/{TENANT_A}/dash-1/tool_result/{dash.tool}?start_line={n}#L{n}")
    evicted = body["changes"][1]["evicted"]
    assert evicted["summary_url"] == f"/files/{TENANT_A}/dash-1#summary-1"
    assert evicted["summary_file"] == dash.summary["url"]
    assert re.fullmatch(rf"/files/{TENANT_A}/dash-1/dialog/\d{{4}}-\d\d-\d\d\.jsonl"
                        r"\?start_line=\d+#L\d+", evicted["dialog_url"])
    dialog = dash.get(evicted["dialog_url"].split("#")[0], {**bearer(KEY_A), **HTML})
    assert dialog.status_code == 200 and "please do the thing" in dialog.text


def test_request_html_shows_the_diff_with_its_reason(dash: Dash) -> None:
    page = dash.get(dash.request_path("first"), {**bearer(KEY_A), **HTML}).text
    diff = dash.get(dash.request_path("first"), {**bearer(KEY_A), **JSON}).json()[
        "changes"][0]["cut"]["diff"]
    n = diff["removed_from"]
    assert 'class="diff"' in page and "the tool result was over the offload threshold" in page
    assert f"lines {n:,}–{TOOL_LINES:,} cut ({diff['removed_lines']:,} lines" in page
    assert (f'href="/files/{TENANT_A}/dash-1/tool_result/{dash.tool}?start_line={n}#L{n}"'
            in page)
    assert ('<tr class="add"><td class="n"></td><td class="s">+</td>'
            "<td>&lt;&lt;&lt;TRUNCATED&gt;&gt;&gt;</td></tr>") in page
    assert f"<td>line {n}: step {n} &lt;script&gt;alert({n})&lt;/script&gt;" in page
    assert "<script" not in page.lower()
    # The eviction links its summary and the dialog; an unknown change is shown as it came.
    assert f'href="/files/{TENANT_A}/dash-1#summary-1">The summary</a>' in page
    assert "The evicted messages in the dialog archive" in page
    assert "a change of a newer kind &lt;script&gt;" in page
    # The removed lines' link opens the offloaded file at them.
    shown = dash.get(f"/files/{TENANT_A}/dash-1/tool_result/{dash.tool}",
                     {**bearer(KEY_A), **HTML}, start_line=n)
    assert f'<tr id="L{n}">' in shown.text


def test_a_further_call_links_its_request(dash: Dash) -> None:
    body = dash.get(dash.request_path("round"), {**bearer(KEY_A), **JSON}).json()
    assert body["entry"]["kind"] == "read_round" and body["changes"] == []
    assert body["request_url"] == dash.request_path("first")
    page = dash.get(dash.request_path("round"), {**bearer(KEY_A), **HTML}).text
    assert f'part of <a href="{dash.request_path("first")}">' in page
    fold = dash.get(dash.request_path("fold"), {**bearer(KEY_A), **HTML}).text
    assert "the proxy&#39;s estimate" in fold and "(no price for this model)" in fold
    # A call made for no request in particular links none and lists no others.
    lone = dash.get(dash.request_path("lone"), {**bearer(KEY_A), **JSON}).json()
    assert lone["entry"]["kind"] == "summarizer" and lone["entry"]["request"] == ""
    assert lone["request_url"] is None and lone["calls"] == []


def test_a_request_of_another_tenant_or_session_is_not_found_like_nothing(dash: Dash) -> None:
    me = {**bearer(KEY_A), **JSON}
    missing = dash.get(f"/files/{TENANT_A}/dash-1/requests/{hex_id('f', 1)}", me)
    assert missing.status_code == 404
    for path in (f"/files/{TENANT_B}/other-1/requests/{dash.ids['theirs']}",
                 f"/files/{TENANT_A}/other-1/requests/{dash.ids['theirs']}",
                 f"/files/{TENANT_A}/dash-1/requests/{dash.ids['theirs']}",
                 f"/files/{TENANT_A}/build-1/requests/{dash.ids['first']}",
                 f"/files/{TENANT_A}/dash-1/requests/..%2f{dash.ids['first']}",
                 f"/files/{TENANT_A}/dash-1/requests/{dash.ids['first']}/x",
                 f"/files/{TENANT_A}/dash-1/requests"):
        r = dash.get(path, me)
        assert r.status_code == 404 and r.content == missing.content, path
        assert "BRAVO-REASON-only" not in r.text
    theirs = dash.get(f"/files/{TENANT_B}/other-1/requests/{dash.ids['theirs']}",
                      {**bearer(KEY_B), **JSON})
    assert theirs.status_code == 200 and "BRAVO-REASON-only" in theirs.text
    master = dash.get(f"/files/{TENANT_B}/other-1/requests/{dash.ids['theirs']}",
                      {**bearer(MASTER), **JSON})
    assert master.status_code == 200


# --- the index ----------------------------------------------------------------------------------


def test_index_has_the_tenants_totals_and_each_sessions_cost(dash: Dash) -> None:
    body = dash.get("/files", {**bearer(KEY_A), **JSON}).json()
    assert body["ledger"] is True and body["q"] is None
    [tenant] = body["tenants"]
    sessions = dash.ledger.totals(TENANT_A)
    want = ledger_view.sum_totals(TENANT_A, sessions)
    assert tenant["tenant"] == TENANT_A and tenant["sessions"] == len(sessions)
    assert tenant["cost"] == pytest.approx(want.cost) and tenant["calls"] == want.calls
    assert tenant["saved"] == pytest.approx(want.direct_cost - want.cost)
    assert tenant["breaks"] == dict(want.breaks) and tenant["breaks"]["ttl"] >= 1
    rows = {s["session"]: s for s in body["sessions"]}
    build = expected_totals(dash, TENANT_A, "build-1")
    assert rows["build-1"]["ledger"]["cost"] == pytest.approx(build.cost)
    assert rows["build-1"]["ledger"]["saved"] < 0  # ctxproxy cost more there
    assert rows["build-1"]["turns"] == 2  # the counters are still there
    page = dash.get("/files", {**bearer(KEY_A), **HTML}).text
    assert "<th>Saved (under caching)</th>" in page and '<td class="num neg">-$' in page
    assert "<th>Tokens cut</th>" in page  # tokens, never called a saving
    assert '<form class="search" method="get" action="/files"' in page


def test_the_master_key_sees_a_totals_row_per_tenant(dash: Dash) -> None:
    body = dash.get("/files", {**bearer(MASTER), **JSON}).json()
    tenants = {t["tenant"]: t for t in body["tenants"]}
    assert {TENANT_A, TENANT_B} <= set(tenants)
    assert tenants[TENANT_B]["cost"] == pytest.approx(
        ledger_view.sum_totals(TENANT_B, dash.ledger.totals(TENANT_B)).cost)
    page = dash.get("/files", {**bearer(MASTER), **HTML}).text
    assert f"<td><code>{TENANT_B}</code></td>" in page
    other = dash.get("/files", {**bearer(KEY_B), **JSON}).json()
    assert [t["tenant"] for t in other["tenants"]] == [TENANT_B]
    assert "dash-1" not in str(other)


@pytest.mark.parametrize(("q", "found"), [
    ("dash", {"dash-1"}), ("DASH-1", {"dash-1"}), ("-1", {"build-1", "compact-1", "dash-1",
                                                          "many-1"}),
    ("nothing-like-it", set()), ("", None),
])
def test_search_filters_sessions_by_name(dash: Dash, q: str, found: set[str] | None) -> None:
    body = dash.get("/files", {**bearer(KEY_A), **JSON}, q=q).json()
    names = {s["session"] for s in body["sessions"]}
    if found is None:
        assert {"build-1", "compact-1", "dash-1"} <= names and body["q"] is None
    else:
        assert names == found or (q == "-1" and {"build-1", "dash-1"} <= names <= found)
        assert body["q"] == q
    # The tenant's totals count every session, whatever the search shows.
    assert body["tenants"][0]["sessions"] == len(dash.ledger.totals(TENANT_A))
    r = dash.get("/files", {**bearer(KEY_A), **HTML}, q=q)
    assert "form-action 'self'" in r.headers["content-security-policy"]
    assert r.headers["content-security-policy"].startswith("default-src 'none'")
    if q == "nothing-like-it":
        assert "No session matches." in r.text and 'value="nothing-like-it"' in r.text


def test_a_hostile_search_is_shown_as_text(dash: Dash) -> None:
    r = dash.get("/files", {**bearer(KEY_A), **HTML}, q=HOSTILE)
    assert r.status_code == 200 and "<script" not in r.text.lower()
    assert "matching <code>&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;</code>" in r.text
    assert 'value="&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;"' in r.text

"""/files in a real browser: what a person sees, clicking from the list to an offloaded file, and
the dashboard: search, a session's chart and summary, a request's diff."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from proxy.demo.fake.upstream import FakeUpstream

from .conftest import ProxyFactory
from .test_files_dashboard import make_dash
from .test_files_web import KEY_A, TENANT_A, USER_ASK, Corpus, built

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]

if TYPE_CHECKING:
    from playwright.sync_api import Browser

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a dev dependency")


@pytest.fixture
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: install Debian's chromium (CI's .ci/run does)")
    with sync_api.sync_playwright() as pw:
        instance = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            yield instance
        finally:
            instance.close()


@pytest.fixture
def corpus(make_proxy: ProxyFactory, fake: FakeUpstream, tmp_path: Path) -> Iterator[Corpus]:
    with built(make_proxy, fake, tmp_path) as corpus:
        yield corpus


def test_a_person_browses_sessions_dialog_and_an_offloaded_file(
    browser: Browser, corpus: Corpus, tmp_path: Path
) -> None:
    context = browser.new_context(
        extra_http_headers={"Authorization": f"Bearer {KEY_A}"},
        viewport={"width": 1280, "height": 900},
    )
    try:
        page = context.new_page()
        page.set_default_timeout(15_000)
        page.goto(corpus.url + "/files")
        expect = sync_api.expect
        expect(page.locator("h1")).to_have_text("Sessions")
        expect(page.get_by_role("link", name="build-1")).to_be_visible()
        expect(page.get_by_role("link", name="compact-1")).to_be_visible()
        expect(page.get_by_text("other-1")).to_have_count(0)  # another tenant's session
        page.screenshot(path=str(tmp_path / "index.png"), full_page=True)

        page.get_by_role("link", name="build-1").click()
        expect(page).to_have_url(f"{corpus.url}/files/{TENANT_A}/build-1")
        expect(page.locator("h1")).to_have_text("build-1")
        expect(page.get_by_role("heading", name="Offloaded tool results (1)")).to_be_visible()
        session_shot = tmp_path / "session.png"
        page.screenshot(path=str(session_shot), full_page=True)

        page.locator("a[href*='/dialog/']").first.click()
        expect(page.locator(".msg.user").first).to_contain_text(USER_ASK)
        expect(page.locator(".msg.user .tag").first).to_have_text("[image]")
        expect(page.locator(".msg.assistant .call").first).to_contain_text("run_shell")
        result = page.locator(".msg.tool details").first
        expect(result.locator("pre")).not_to_be_visible()  # a long result starts collapsed
        result.locator("summary").click()
        expect(result.locator("pre")).to_be_visible()
        page.screenshot(path=str(tmp_path / "dialog.png"))

        page.go_back()
        page.locator("a[href*='/tool_result/']").first.click()
        row = page.locator("tr#L712")
        expect(row.locator("td.n")).to_have_text("712")
        expect(row.locator("td.t")).to_have_text("line 712: output of the build step 712 " + "x" * 40)
        expect(page.get_by_role("link", name="next →").first).to_be_visible()
        row.locator("td.n a").click()  # a line number is a link to itself, highlighted
        expect(page).to_have_url(re.compile(r"#L712$"))
        shot = tmp_path / "tool_result.png"
        page.screenshot(path=str(shot))
        page.get_by_role("link", name="next →").first.click()
        expect(page.locator("tr#L2001 td.n")).to_have_text("2001")
    finally:
        context.close()
    for png in (shot, session_shot):
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def is_png(path: Path) -> bool:
    data = path.read_bytes()
    return data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_a_person_reads_the_dashboard(
    browser: Browser, corpus: Corpus, fake: FakeUpstream, tmp_path: Path
) -> None:
    dash = make_dash(corpus, fake)
    context = browser.new_context(
        extra_http_headers={"Authorization": f"Bearer {KEY_A}"},
        viewport={"width": 1280, "height": 900},
    )
    shots = []
    try:
        page = context.new_page()
        page.set_default_timeout(15_000)
        blocked: list[str] = []  # CSP violations and errors the page reports
        page.on("console", lambda m: blocked.append(m.text) if m.type == "error" else None)
        page.goto(corpus.url + "/files")
        expect = sync_api.expect
        expect(page.get_by_role("heading", name="Cost")).to_be_visible()
        shots.append(tmp_path / "dashboard-index.png")
        page.screenshot(path=str(shots[-1]), full_page=True)

        # Search: a plain GET form (the CSP's form-action allows /files itself).
        page.get_by_role("searchbox", name="search sessions").fill("dash")
        page.get_by_role("button", name="Search").click()
        expect(page).to_have_url(f"{corpus.url}/files?q=dash")
        expect(page.get_by_role("link", name="dash-1")).to_be_visible()
        expect(page.get_by_role("link", name="build-1")).to_have_count(0)
        expect(page.locator("p.meta").first).to_contain_text("matching dash")

        page.get_by_role("link", name="dash-1").click()
        expect(page).to_have_url(f"{corpus.url}/files/{TENANT_A}/dash-1")
        chart = page.locator("svg.chart")
        expect(chart).to_be_visible()
        legend = chart.locator("g.legend-item text")
        for label in ("sent by the client", "forwarded", "cached", "compaction",
                      "cache break: ttl"):
            expect(legend.filter(has_text=label).first).to_be_visible()
        compactions = sum(e.compaction for e in dash.ledger.entries(TENANT_A, "dash-1"))
        expect(chart.locator("g.compaction line")).to_have_count(compactions)
        expect(chart.locator("g.compactions text").first).to_have_text("compaction")
        box = chart.bounding_box()
        assert box is not None and box["width"] > 600 and box["height"] > 150
        # The summary's markdown: its headings are headings, its source one click away.
        summary = page.locator("section.summary .md").first
        expect(summary.get_by_role("heading", name="Goal", level=4)).to_be_visible()
        expect(summary.get_by_role("heading", name="Next Steps", level=4)).to_be_visible()
        expect(summary.locator("script")).to_have_count(0)
        source = page.locator("section.summary details").first
        expect(source.locator("pre")).not_to_be_visible()
        source.locator("summary").click()
        expect(source.locator("pre")).to_contain_text("## Goal")
        shots.append(tmp_path / "dashboard-session.png")
        page.screenshot(path=str(shots[-1]), full_page=True)

        # The first call's page: the cut as a diff, with its reason.
        page.locator(f"table.calls a[href$='/requests/{dash.ids['first']}']").click()
        expect(page).to_have_url(f"{corpus.url}/files/{TENANT_A}/dash-1/requests/"
                                 f"{dash.ids['first']}")
        cut = page.locator("section.change").first
        expect(cut.locator(".what")).to_have_text("cut")
        expect(cut.locator("p.reason")).to_contain_text("over the offload threshold")
        expect(cut.locator("table.diff tr.del").first).to_contain_text("<script>alert(")
        expect(cut.locator("table.diff tr.add").first).to_contain_text("<<<TRUNCATED>>>")
        folded = cut.locator("table.diff tr.fold.del")
        expect(folded).to_contain_text("cut (")
        shots.append(tmp_path / "dashboard-request.png")
        page.screenshot(path=str(shots[-1]), full_page=True)
        line = int(page.locator("table.diff tr.del td.n").first.inner_text())
        folded.get_by_role("link").click()
        expect(page).to_have_url(re.compile(rf"start_line={line}#L{line}$"))
        expect(page.locator(f"tr#L{line} td.n")).to_have_text(str(line))
        assert not [m for m in blocked if "Content Security Policy" in m], blocked
    finally:
        context.close()
    assert all(is_png(p) for p in shots), shots

"""/files end to end: data made by real chat requests through the proxy, read back over HTTP.

Real servers: the corpora are module-scoped (one proxy serves every read-only test) and the
traversal corpus is sent as raw request targets.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy.app import create_app
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread, serve_in_thread
from proxy.session import tenant_of
from proxy.store.db import Database
from proxy.store.fs import Hidden, open_file
from proxy.web.access import ask_of, read_window

from .conftest import ProxyFactory, proxy_config, raw_get

KEY_A = "sk-alpha-very-secret-0001"
KEY_B = "sk-beta-very-secret-0002"
MASTER = "master-very-secret-0003"
TENANT_A, TENANT_B = tenant_of(KEY_A), tenant_of(KEY_B)
SECRET = "TOP-SECRET-OUTSIDE-DATA-DIR-7f3a"
JSON = {"accept": "application/json"}
HTML = {"accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
USER_ASK = "please run the test suite and show me the failures"
PIXEL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNg"
         "YPj/HwADAgH/pUPIZwAAAABJRU5ErkJggg==")
SUMMARY = """## Goal
Make the suite pass.
## Constraints & Preferences
- none
## Progress
### Done
- ran it
### In Progress
- reading failures
### Blocked
- none
## Key Decisions
- pytest
## Next Steps
- fix test_x
## Critical Context
- ValueError in x.py
"""
CONFIG = {"compaction": {"context_windows": {"tiny": 4000}}}


def log_lines(n: int) -> str:
    return "".join(f"line {i}: output of the build step {i} " + "x" * 40 + "\n" for i in range(1, n + 1))


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def basic(key: str, user: str = "me") -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:{key}".encode()).decode()}


def responder(body: dict[str, Any]) -> Reply:
    first = body["messages"][0].get("content") or ""
    if isinstance(first, str) and "summar" in first.lower():
        return Reply(content=SUMMARY)
    return Reply(content="ok, looking at it")


@dataclass
class Corpus:
    srv: ServerThread
    data: Path
    outside: Path
    client: httpx.Client  # one pooled client: a crawl is hundreds of requests

    @property
    def url(self) -> str:
        return self.srv.url

    def get(self, path: str, headers: dict[str, str] | None = None, **params: Any) -> httpx.Response:
        return self.client.get(self.url + path, headers=headers or {}, params=params)

    def session_json(self, key: str, tenant: str, session: str) -> dict[str, Any]:
        r = self.get(f"/files/{tenant}/{session}", {**bearer(key), **JSON})
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def tool_result_url(self) -> str:
        [entry] = self.session_json(KEY_A, TENANT_A, "build-1")["tool_results"]
        return str(entry["url"])

    def dialog_url(self) -> str:
        [entry] = self.session_json(KEY_A, TENANT_A, "build-1")["dialog_files"]
        return str(entry["url"])


def chat(corpus: Corpus, messages: list[dict[str, Any]], headers: dict[str, str],
         model: str = "gpt-4o") -> httpx.Response:
    body = orjson.dumps({"model": model, "messages": messages})
    r = corpus.client.post(corpus.url + "/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == 200, r.text
    return r


def shared(fake_server: tuple[FakeUpstream, ServerThread], root: Path,
           overrides: dict[str, Any]) -> Iterator[Corpus]:
    """One proxy and corpus for a whole module of read-only tests: populating it (offload,
    compaction, two tenants) would otherwise dominate these tests' run time."""
    fake, upstream = fake_server
    config = proxy_config(upstream.url + "/v1", root / "data", {**CONFIG, **overrides})
    with serve_in_thread(create_app(config), lifespan="on") as srv, \
            httpx.Client(timeout=30) as client:
        corpus = populate(Corpus(srv, root / "data", root / "outside", client), fake)
        fake.reset()  # later tests get the fake as the `fake` fixture leaves it
        yield corpus


def populate(corpus: Corpus, fake: FakeUpstream) -> Corpus:
    """Two tenants and anon, an offloaded tool output, a compaction, an image part."""
    fake.responder = responder
    build_msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": [{"type": "text", "text": USER_ASK},
                                     {"type": "image_url", "image_url": {"url": PIXEL}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "run_shell", "arguments": '{"cmd": "pytest -q"}'}}]},
        {"role": "tool", "tool_call_id": "call_1",
         "content": log_lines(5000) + "<script>alert('x')</script>\n"},
    ]
    a = {**bearer(KEY_A), "x-session-id": "build-1"}
    r = chat(corpus, build_msgs, a)
    assert r.headers["x-ctxproxy-offloaded"] == "1"
    chat(corpus, [*build_msgs, {"role": "assistant", "content": "ok, looking at it"},
                  {"role": "user", "content": "now fix it <b>please</b>"}], a)
    history: list[dict[str, Any]] = [{"role": "system", "content": "Agent."}]
    for t in range(40):
        history += [{"role": "user", "content": f"request {t}: " + "please do the thing " * 15},
                    {"role": "assistant", "content": f"answer {t}: " + "done with it " * 20}]
    assert chat(corpus, history, {**bearer(KEY_A), "x-session-id": "compact-1"},
                model="tiny").headers["x-ctxproxy-compacted"] == "1"
    chat(corpus, [{"role": "user", "content": "hello from beta"}],
         {**bearer(KEY_B), "x-session-id": "other-1"})
    chat(corpus, [{"role": "user", "content": "hello from nobody"}], {"x-session-id": "anon-1"})
    corpus.srv.drain()  # the answers and the turn counters are recorded after each response
    with Database.in_dir(corpus.data) as db:
        turns = {(r.tenant, r.session): r.turns for r in db.sessions(None)}
    assert turns == {(TENANT_A, "build-1"): 2, (TENANT_A, "compact-1"): 1,
                     (TENANT_B, "other-1"): 1, ("anon", "anon-1"): 1}, turns
    corpus.outside.mkdir()
    (corpus.outside / "secret.txt").write_text(SECRET + "\n")
    return corpus


@pytest.fixture(scope="module")
def corpus(
    _fake_server: tuple[FakeUpstream, ServerThread], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Corpus]:
    """Read-only tests share this one; tests that change files use ``fresh``."""
    yield from shared(_fake_server, tmp_path_factory.mktemp("files"), {})


@contextlib.contextmanager
def built(make_proxy: ProxyFactory, fake: FakeUpstream, tmp_path: Path) -> Iterator[Corpus]:
    """A proxy of this test (``make_proxy``: data under ``tmp_path/data``) with the corpus."""
    with httpx.Client(timeout=30) as client:
        yield populate(Corpus(make_proxy(CONFIG), tmp_path / "data", tmp_path / "outside",
                              client), fake)


@pytest.fixture
def fresh(make_proxy: ProxyFactory, fake: FakeUpstream, tmp_path: Path) -> Iterator[Corpus]:
    """A corpus of this test's own, for tests that change it."""
    with built(make_proxy, fake, tmp_path) as corpus:
        yield corpus


# --- listing and tenants -----------------------------------------------------------------------


def test_index_lists_only_the_callers_sessions(corpus: Corpus) -> None:
    r = corpus.get("/files", {**bearer(KEY_A), **JSON})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["tenant"] == TENANT_A and body["master"] is False
    rows = {s["session"]: s for s in body["sessions"]}
    assert set(rows) == {"build-1", "compact-1"}
    build = rows["build-1"]
    assert build["tenant"] == TENANT_A and build["url"] == f"/files/{TENANT_A}/build-1"
    assert build["turns"] == 2 and build["offloads"] >= 1 and build["messages"] >= 6
    assert build["tokens_in"] > build["tokens_out"] > 0
    assert build["saved_ratio"] == pytest.approx(1 - build["tokens_out"] / build["tokens_in"], abs=1e-3)
    assert rows["compact-1"]["compactions"] == 1
    assert [s["session"] for s in corpus.get("/files", {**bearer(KEY_B), **JSON}).json()["sessions"]] == ["other-1"]
    anon = corpus.get("/files", JSON).json()
    assert anon["tenant"] == "anon" and [s["session"] for s in anon["sessions"]] == ["anon-1"]


@pytest.mark.parametrize("headers", [
    basic(KEY_A), basic(KEY_A, user=""), {"x-api-key": KEY_A}, {"api-key": KEY_A}, bearer(KEY_A),
])
def test_every_key_header_names_the_same_tenant(corpus: Corpus, headers: dict[str, str]) -> None:
    body = corpus.get("/files", {**headers, **JSON}).json()
    assert body["tenant"] == TENANT_A
    assert {s["session"] for s in body["sessions"]} == {"build-1", "compact-1"}


def test_index_html_is_a_table_with_links(corpus: Corpus) -> None:
    r = corpus.get("/files", {**bearer(KEY_A), **HTML})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert f'href="/files/{TENANT_A}/build-1"' in page and "Tokens forwarded" in page
    assert "<th>Tenant</th>" not in page and "<script" not in page
    assert r.headers["content-security-policy"].startswith("default-src 'none'")
    assert r.headers["cache-control"] == "no-store"


def test_other_tenants_data_is_not_found_like_nothing(corpus: Corpus) -> None:
    tool = corpus.tool_result_url()
    dialog = corpus.dialog_url()
    [summary] = corpus.session_json(KEY_A, TENANT_A, "compact-1")["summaries"]
    missing = corpus.get(f"/files/{TENANT_B}/no-such-session", {**bearer(KEY_B), **JSON})
    assert missing.status_code == 404
    for path in (f"/files/{TENANT_A}/build-1", tool, dialog, summary["url"]):
        for headers in (bearer(KEY_B), {}):
            r = corpus.get(path, {**headers, **JSON})
            assert r.status_code == 404 and r.json() == missing.json(), path
            assert r.json()["error"]["code"] == "not_found"


# --- one session ---------------------------------------------------------------------------------


def test_session_json_has_summaries_dialogs_and_offloaded_files(corpus: Corpus) -> None:
    build = corpus.session_json(KEY_A, TENANT_A, "build-1")
    assert build["stats"]["turns"] == 2 and build["summaries"] == []
    [dialog] = build["dialog_files"]
    assert dialog["name"].endswith(".jsonl") and dialog["size"] > 300_000
    [tool] = build["tool_results"]
    on_disk = corpus.data / TENANT_A / "build-1" / "tool_result" / tool["name"]
    assert tool["size"] == on_disk.stat().st_size and tool["url"].endswith("/tool_result/" + tool["name"])
    compact = corpus.session_json(KEY_A, TENANT_A, "compact-1")
    [s] = compact["summaries"]
    assert s["source"] == "model" and s["model"] == "tiny" and "## Goal" in s["text"]
    assert 0 < s["head"] < s["upto"] and s["tokens_before"] > 3000
    assert s["dialog"].startswith("dialog/") and s["url"].endswith(".md")
    page = corpus.get(f"/files/{TENANT_A}/compact-1", bearer(KEY_A)).text
    assert "Summaries (1)" in page and "## Goal" in page and s["name"] in page


def test_summary_markdown_is_served_as_text(corpus: Corpus) -> None:
    [s] = corpus.session_json(KEY_A, TENANT_A, "compact-1")["summaries"]
    r = corpus.get(s["url"], {**bearer(KEY_A), **HTML})
    assert r.status_code == 200 and r.headers["content-type"] == "text/plain; charset=utf-8"
    on_disk = corpus.data / TENANT_A / "compact-1" / "summaries" / s["name"]
    assert r.content == on_disk.read_bytes() and "## Next Steps" in r.text
    assert corpus.get(s["url"], {**bearer(KEY_A), **JSON}).json()["text"] == on_disk.read_text()


# --- offloaded files -----------------------------------------------------------------------------


def test_tool_result_html_has_numbered_lines_and_pages(corpus: Corpus) -> None:
    url = corpus.tool_result_url()
    page = corpus.get(url, {**bearer(KEY_A), **HTML}).text
    assert '<tr id="L712"><td class="n"><a href="#L712">712</a></td>' in page
    assert "line 712: output of the build step 712" in page
    assert 'id="L2000"' in page and 'id="L2001"' not in page  # 2,000 lines per page
    assert "start_line=2001&amp;lines=2000" in page and "next →" in page
    last = corpus.get(url, {**bearer(KEY_A), **HTML}, start_line=4001, lines=2000).text
    assert 'id="L5001"' in last and "next →" not in last and "start_line=2001" in last
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in last and "<script>" not in last


def test_tool_result_raw_and_json_windows(corpus: Corpus) -> None:
    url = corpus.tool_result_url()
    on_disk = next((corpus.data / TENANT_A / "build-1" / "tool_result").iterdir()).read_bytes()
    whole = corpus.get(url, bearer(KEY_A), raw=1)
    assert whole.content == on_disk and whole.headers["content-type"] == "text/plain; charset=utf-8"
    assert whole.headers["x-content-type-options"] == "nosniff"
    # No stated preference plus a window: raw text, as a model's fetch tool expects.
    window = corpus.get(url, bearer(KEY_A), start_line=712, lines=3)
    assert window.text == "".join(log_lines(714).splitlines(keepends=True)[711:])
    assert corpus.get(url, {**bearer(KEY_A), "accept": "text/plain"}, start_line=5001).text.startswith("<script>")
    body = corpus.get(url, {**bearer(KEY_A), **JSON}, start_line=4999, lines=10).json()
    assert body["total_lines"] == 5001 and body["start_line"] == 4999
    assert body["lines"] == ["line 4999: output of the build step 4999 " + "x" * 40,
                             "line 5000: output of the build step 5000 " + "x" * 40,
                             "<script>alert('x')</script>"]
    assert body["next_start_line"] is None
    first = corpus.get(url, {**bearer(KEY_A), **JSON}).json()
    assert len(first["lines"]) == 2000 and first["next_start_line"] == 2001


@pytest.mark.parametrize(("params", "param"), [
    ({"start_line": "0"}, "start_line"), ({"start_line": "-3"}, "start_line"),
    ({"start_line": "abc"}, "start_line"), ({"lines": "0"}, "lines"), ({"lines": "1e3"}, "lines"),
    ({"start_line": "9999"}, "start_line"), ({"lines": "99999999"}, "lines"),
])
def test_bad_windows_are_clear_400s(corpus: Corpus, params: dict[str, str], param: str) -> None:
    r = corpus.get(corpus.tool_result_url(), bearer(KEY_A), **params)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert param in r.json()["error"]["message"]
    html = corpus.get(corpus.tool_result_url(), {**bearer(KEY_A), **HTML}, **params)
    assert html.status_code == 400 and html.headers["content-type"].startswith("text/html")


def test_expired_tool_result_explains_itself(fresh: Corpus) -> None:
    url = fresh.tool_result_url()
    for f in (fresh.data / TENANT_A / "build-1" / "tool_result").iterdir():
        f.unlink()
    r = fresh.get(url, {**bearer(KEY_A), **JSON})
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert "no longer available" in message and "dialog archive" in message
    assert fresh.get(url, {**bearer(KEY_B), **JSON}).json()["error"]["message"] == "no such session or file"


# --- the dialog ---------------------------------------------------------------------------------


def test_dialog_html_reads_as_a_chat(corpus: Corpus) -> None:
    page = corpus.get(corpus.dialog_url(), {**bearer(KEY_A), **HTML}).text
    assert USER_ASK in page and '<span class="tag">[image]</span>' in page
    assert "run_shell" in page and "pytest -q" in page  # the call's name and arguments
    assert "<details><summary>tool output · 5,002 lines" in page  # long result starts collapsed
    assert "result of <code>call_1</code>" in page
    assert "ok, looking at it" in page  # the model's answer was archived too
    assert "now fix it &lt;b&gt;please&lt;/b&gt;" in page and "<b>please" not in page
    assert "<script" not in page
    assert 'class="card msg user" id="L2"' in page


def test_dialog_raw_and_json(corpus: Corpus) -> None:
    url = corpus.dialog_url()
    [path] = (corpus.data / TENANT_A / "build-1" / "dialog").iterdir()
    assert corpus.get(url, bearer(KEY_A), raw=1).content == path.read_bytes()
    assert corpus.get(url, {**bearer(KEY_A), "accept": "text/plain"}).content == path.read_bytes()
    body = corpus.get(url, {**bearer(KEY_A), **JSON}).json()
    roles = [r["role"] for r in body["records"]]
    assert roles[:4] == ["system", "user", "assistant", "tool"] and "user" in roles[4:]
    first = body["records"][1]
    assert first["line"] == 2 and first["pos"] == 1 and first["ts"] and first["message"]["content"][0]["text"] == USER_ASK
    assert body["total_lines"] == len(path.read_bytes().splitlines())
    one = corpus.get(url, bearer(KEY_A), start_line=2, lines=1)
    assert orjson.loads(one.content)["message"]["content"][0]["text"] == USER_ASK


# --- master key ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(
    _fake_server: tuple[FakeUpstream, ServerThread], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Corpus]:
    yield from shared(_fake_server, tmp_path_factory.mktemp("guarded"),
                      {"auth": {"master_key": MASTER}})


def test_master_key_guards_every_route_and_sees_all(guarded: Corpus) -> None:
    tool = guarded.tool_result_url()
    for path in ("/files", f"/files/{TENANT_A}/build-1", tool, "/files/anon/anon-1", "/files/x/y/z"):
        r = guarded.get(path, JSON)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"].startswith('Basic realm="ctxproxy"')
        page = guarded.get(path, HTML)
        assert page.status_code == 401 and "www-authenticate" in page.headers and "<h1>401</h1>" in page.text
    own = guarded.get("/files", {**bearer(KEY_A), **JSON}).json()
    assert {s["session"] for s in own["sessions"]} == {"build-1", "compact-1"}
    for headers in (bearer(MASTER), basic(MASTER)):
        every = guarded.get("/files", {**headers, **JSON}).json()
        assert every["master"] is True and every["tenant"] is None
        assert {(s["tenant"], s["session"]) for s in every["sessions"]} == {
            (TENANT_A, "build-1"), (TENANT_A, "compact-1"), (TENANT_B, "other-1"), ("anon", "anon-1")}
    assert "<th>Tenant</th>" in guarded.get("/files", {**bearer(MASTER), **HTML}).text
    assert guarded.get(tool, bearer(MASTER), raw=1).status_code == 200
    assert guarded.get(tool, bearer(KEY_B), raw=1).status_code == 404
    assert guarded.get("/files", {"authorization": "Basic !!!"}).status_code == 401


def test_login_asks_the_browser_for_a_key(corpus: Corpus) -> None:
    r = corpus.get("/files", HTML, login=1)
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
    ok = corpus.get("/files", {**basic(KEY_A), **HTML}, login=1)
    assert ok.status_code == 200 and "build-1" in ok.text


def test_keys_never_appear_in_pages_errors_or_logs(
    guarded: Corpus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []
    for key in (KEY_A, KEY_B, MASTER):
        for fmt in (JSON, HTML):
            headers = {**bearer(key), **fmt}
            for r in crawl(guarded, headers):
                seen.append(r.text + str(r.headers) + str(r.url))
        r = guarded.get("/files/nope/nope", basic(key))
        seen.append(r.text + str(r.headers))
        seen.append(guarded.get(guarded.tool_result_url(), basic(key), lines="x").text)
    text = "\n".join(seen) + caplog.text
    assert len(seen) > 20
    for key in (KEY_A, KEY_B, MASTER):
        assert key not in text and key[:12] not in text


def crawl(corpus: Corpus, headers: dict[str, str]) -> Iterator[httpx.Response]:
    index = corpus.get("/files", {**headers, **JSON})
    yield index
    yield corpus.get("/files", headers)
    for s in index.json()["sessions"]:
        yield corpus.get(s["url"], headers)
        detail = corpus.get(s["url"], {**headers, **JSON})
        yield detail
        links = detail.json()["dialog_files"] + detail.json()["tool_results"] + detail.json()["summaries"]
        for link in links:
            yield corpus.get(link["url"], headers)


# --- safety -------------------------------------------------------------------------------------


def plant(corpus: Corpus) -> None:
    """Symlinks inside the data dir pointing outside it, at every level."""
    session = corpus.data / TENANT_A / "build-1"
    secret = corpus.outside / "secret.txt"
    (session / "tool_result" / "evil.txt").symlink_to(secret)
    (session / "dialog" / "2020-01-01.jsonl").symlink_to(secret)
    (session / "summaries").mkdir(exist_ok=True)
    (session / "summaries" / "evil.md").symlink_to(secret)
    (corpus.outside / "tool_result").mkdir()
    (corpus.outside / "tool_result" / "x.txt").write_text(SECRET)
    (corpus.outside / "dialog").mkdir()
    (corpus.outside / "dialog" / "2020-01-02.jsonl").write_text(SECRET)
    (corpus.data / TENANT_A / "linked").symlink_to(corpus.outside)  # a whole session
    (corpus.data / "t-linkedtenant").symlink_to(corpus.data / TENANT_A)  # a whole tenant
    other = corpus.data / TENANT_A / "other"
    other.mkdir()
    (other / "tool_result").symlink_to(corpus.outside / "tool_result")  # a sub-directory
    (session / "tool_result" / ".hidden.txt").write_text(SECRET)


def traversal_targets() -> list[str]:
    s = f"/files/{TENANT_A}/build-1"
    up = "../" * 6
    return [
        "/files/../../../../etc/passwd",
        f"{s}/tool_result/{up}outside/secret.txt",
        f"{s}/tool_result/..%2f..%2f..%2f..%2foutside%2fsecret.txt",
        f"{s}/tool_result/%2e%2e%2f%2e%2e%2f%2e%2e%2f%2e%2e%2foutside%2fsecret.txt",
        f"{s}/tool_result/%252e%252e%252f%252e%252e%252f%252e%252e%252foutside%252fsecret.txt",
        f"{s}/dialog/..%2f..%2f..%2f..%2foutside%2fsecret.txt",
        f"{s}/%2e%2e/%2e%2e/%2e%2e/outside/secret.txt",
        "/files/%2fetc%2fpasswd",
        "/files//etc/passwd",
        f"/files/{TENANT_A}//etc/passwd",
        f"{s}/tool_result//etc/passwd",
        f"{s}/tool_result/%2fetc%2fpasswd",
        "/files/%2e%2e/%2e%2e/outside/secret.txt",
        f"{s}/tool_result/..\\..\\..\\..\\outside\\secret.txt",
        f"{s}/tool_result/..%5c..%5c..%5c..%5coutside%5csecret.txt",
        f"{s}/tool_result/evil.txt%00.txt",
        f"{s}/tool_result/%00",
        f"{s}/summaries/x.md%00",
        f"{s}/tool_result/evil.txt",
        f"{s}/dialog/2020-01-01.jsonl",
        f"{s}/summaries/evil.md",
        f"{s}/tool_result/.hidden.txt",
        f"/files/{TENANT_A}/linked/tool_result/x.txt",
        f"/files/{TENANT_A}/linked/dialog/2020-01-02.jsonl",
        f"/files/{TENANT_A}/linked",
        "/files/t-linkedtenant/build-1",
        f"/files/{TENANT_A}/other/tool_result/x.txt",
        f"{s}/tool_result/{'a' * 300}.txt",
        f"/files/{TENANT_A}/{'s' * 500}",
        f"/files/{'t' * 200}/build-1",
        f"{s}/tool_result/secret.txt/..",
        f"{s}/dialog/2020-01-01.jsonl/../../../../outside/secret.txt",
        f"{s}/../../../outside/secret.txt",
        f"{s}/tool_result/~/secret.txt",
    ]


def test_traversal_corpus_is_refused(fresh: Corpus) -> None:
    plant(fresh)
    tried = 0
    for key in (KEY_A, KEY_B):
        for suffix in ("", "?raw=1", "?format=json&start_line=1"):
            for target in traversal_targets():
                status, body = raw_get(fresh.url, target + suffix, bearer(key))
                assert status in (400, 404), (target, status)
                assert SECRET.encode() not in body, target
                assert b"root:" not in body, target
                tried += 1
    assert tried > 150
    # ... and the planted links are not listed either.
    build = fresh.session_json(KEY_A, TENANT_A, "build-1")
    names = [f["name"] for f in build["tool_results"] + build["dialog_files"]]
    assert "evil.txt" not in names and "2020-01-01.jsonl" not in names and ".hidden.txt" not in names
    assert len(build["tool_results"]) == 1
    assert fresh.session_json(KEY_A, TENANT_A, "other")["tool_results"] == []
    sessions = fresh.get("/files", {**bearer(KEY_A), **JSON}).json()["sessions"]
    assert "linked" not in {s["session"] for s in sessions}


def test_open_file_refuses_a_symlink_at_every_level(tmp_path: Path) -> None:
    data = tmp_path / "data"
    outside = tmp_path / "outside"
    (outside / "s" / "tool_result").mkdir(parents=True)
    (outside / "s" / "tool_result" / "f.txt").write_text(SECRET)
    real = data / "t" / "s" / "tool_result"
    real.mkdir(parents=True)
    (real / "ok.txt").write_text("fine\n")
    fd, _ = open_file(data, ["t", "s", "tool_result", "ok.txt"])
    os.close(fd)
    (data / "t2").symlink_to(outside)
    (data / "t" / "s2").symlink_to(outside / "s")
    (data / "t" / "s3").mkdir()
    (data / "t" / "s3" / "tool_result").symlink_to(outside / "s" / "tool_result")
    (real / "f.txt").symlink_to(outside / "s" / "tool_result" / "f.txt")
    os.mkfifo(real / "fifo.txt")
    for parts in (["t2", "s", "tool_result", "f.txt"], ["t", "s2", "tool_result", "f.txt"],
                  ["t", "s3", "tool_result", "f.txt"], ["t", "s", "tool_result", "f.txt"],
                  ["t", "s", "tool_result", "fifo.txt"], ["t", "s", "tool_result", ".."],
                  ["t", "s", "tool_result", "../../../outside/s/tool_result/f.txt"]):
        with pytest.raises(Hidden):
            open_file(data, parts)
    with pytest.raises(Hidden) as missing:
        open_file(data, ["t", "s", "tool_result", "gone.txt"])
    assert missing.value.absent


def test_read_window_pages_by_lines_and_bytes(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_bytes(b"a\nbb\nccc\ndddd")
    fd = os.open(path, os.O_RDONLY)
    try:
        w = read_window(fd, 2, 2, 1 << 20)
        assert (w.total_lines, w.lines, w.next_start) == (4, [b"bb\n", b"ccc\n"], 4)
        w = read_window(fd, 1, None, 6)  # the byte budget ends the page early
        assert w.lines == [b"a\n", b"bb\n"] and w.truncated and w.next_start == 3
        w = read_window(fd, 4, 10, 1)  # one line always fits
        assert w.lines == [b"dddd"] and w.total_lines == 4 and w.next_start is None
    finally:
        os.close(fd)


def test_unknown_pages_and_head(corpus: Corpus) -> None:
    for path in (f"/files/{TENANT_A}", f"/files/{TENANT_A}/build-1/tool_result",
                 f"/files/{TENANT_A}/build-1/other/x.txt", f"/files/{TENANT_A}/build-1/dialog/today.jsonl"):
        assert corpus.get(path, {**bearer(KEY_A), **JSON}).status_code == 404, path
    assert corpus.get("/files/", {**bearer(KEY_A), **JSON}).json()["tenant"] == TENANT_A
    head = corpus.client.head(corpus.url + corpus.tool_result_url(), headers=bearer(KEY_A),
                              params={"raw": 1})
    assert head.status_code == 200 and head.content == b""


@pytest.mark.parametrize(("accept", "query", "fmt", "file_fmt"), [
    (HTML["accept"], {}, "html", "html"),
    (HTML["accept"], {"start_line": "3"}, "html", "html"),  # a browser following a pager link
    ("application/json", {}, "json", "json"),
    ("*/*", {}, "html", "html"),
    ("*/*", {"start_line": "3"}, "html", "text"),  # curl or a model's fetch tool
    ("", {"lines": "3"}, "html", "text"),
    ("text/plain", {}, "text", "text"),
    ("application/json;q=0.5, text/html;q=0.9", {}, "html", "html"),
    ("text/html;q=0, application/json", {}, "json", "json"),
    (HTML["accept"], {"format": "json"}, "json", "json"),
    (HTML["accept"], {"raw": "1"}, "text", "text"),
])
def test_format_negotiation(accept: str, query: dict[str, str], fmt: str, file_fmt: str) -> None:
    ask = ask_of({"accept": accept}, query)
    assert (ask.fmt, ask.file_fmt()) == (fmt, file_fmt)

"""Tenant isolation: tenant A cannot list, read or guess tenant B's sessions or files, through any
``/files`` route or the proxy's read tool; the master key guards every ``/files`` route.

The routes (proxy/web/routes.py ``_dispatch``): ``/files`` (the index), ``/files/<t>/<s>`` (a
session), ``/files/<t>/<s>/dialog/<YYYY-MM-DD>.jsonl``, ``.../tool_result/<id>.txt``,
``.../summaries/<name>.md`` and ``.../requests/<id>`` (a ledger entry); each as HTML, JSON (``Accept`` or ``?format=json``), raw text
(``?raw=1``, ``?format=text``, ``Accept: text/plain``), windowed (``?start_line=&lines=``, raw or
JSON or HTML), ``HEAD``, with a trailing slash and with ``?login=1``.

Another tenant's existing path answers 404, byte for byte the answer for a path that does not
exist (404, not 403: existence is not revealed; docs/sessions.md,
docs/dashboard.md#isolation-tested-route-by-route). Every test also reads the caller's *own*
path the same way, so a route that answered 404 to everything could not pass.

(tests/test_files_web.py has the traversal corpus against planted symlinks and the basic tenant
and master-key checks; this file aims every route and traversal form at another tenant's real
files.)
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy.app import create_app
from proxy.auth import Gate
from proxy.config import config_from_mapping
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread, serve_in_thread
from proxy.session import tenant_of
from proxy.store.db import Database
from proxy.store.ledger_entry import Change, LedgerEntry
from proxy.usage import Usage

from .conftest import proxy_config, raw_get

KEY_A = "sk-iso-alpha-4f1c9e"
KEY_B = "sk-iso-bravo-8d2a7b"
MASTER = "mk-iso-master-6e3d0f"
TA, TB = tenant_of(KEY_A), tenant_of(KEY_B)
MARK = {KEY_A: "ALPHA-ONLY-7d1e", KEY_B: "BRAVO-ONLY-3c9f"}
ONLY_B = "bravo-only-5e2"  # a session name only tenant B has
JSON = {"accept": "application/json"}
HTML = {"accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
GHOST_ID = "00000000-0000-0000-0000-000000000000"
GHOST_REQUEST = "0" * 32
REQUEST = {KEY_A: "a17e" * 8, KEY_B: "b0b5" * 8}  # each tenant's ledger entry in build-1
SUMMARY = """## Goal
Finish the build for {mark}.
## Constraints & Preferences
- keep the current toolchain
## Progress
### Done
- ran the build for {mark}
### In Progress
- reading the failures
### Blocked
- nothing at the moment
## Key Decisions
- fix the linker step first
## Next Steps
- rerun the build
## Critical Context
- error in core.o for {mark}
"""


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def basic(key: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"u:{key}".encode()).decode()}


def responder(body: dict[str, Any]) -> Reply:
    first = body["messages"][0].get("content")
    if isinstance(first, str) and "summar" in first.lower() and "Agent of" not in first:
        mark = next((m for m in MARK.values() if m in orjson.dumps(body).decode()), "nobody")
        return Reply(content=SUMMARY.format(mark=mark))
    return Reply(content="ok")


def output(mark: str, lines: int = 1200) -> str:
    return "".join(f"line {i} of {mark}: " + "x" * 40 + "\n" for i in range(1, lines + 1))


def build_messages(mark: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": f"Agent of {mark}."},
        {"role": "user", "content": f"run the build, {mark}"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": output(mark)},
        {"role": "user", "content": f"what failed, {mark}?"},
    ]


def long_history(mark: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": f"Agent of {mark}."}]
    for t in range(40):
        out += [{"role": "user", "content": f"request {t} of {mark}: " + "please do it " * 15},
                {"role": "assistant", "content": f"answer {t}: " + "did it " * 20}]
    return out


# --- the corpus ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Files:
    """One tenant's real names, read from disk."""

    tool_result: str
    dialog: str
    summary: str
    request: str  # a ledger entry's id


@dataclass
class Corpus:
    srv: ServerThread
    data: Path
    files: dict[str, Files]  # tenant -> its names in session build-1 / compact-1
    client: httpx.Client  # one pooled client: hundreds of requests

    @property
    def url(self) -> str:
        return self.srv.url

    def get(self, path: str, headers: dict[str, str], method: str = "GET") -> httpx.Response:
        return self.client.request(method, self.url + path, headers=headers)

    def chat(self, headers: dict[str, str], messages: list[dict[str, Any]],
             model: str = "gpt-4o") -> httpx.Response:
        return self.client.post(self.url + "/v1/chat/completions", headers=headers,
                                content=orjson.dumps({"model": model, "messages": messages}))


def populate(srv: ServerThread, fake: FakeUpstream, data: Path,
             client: httpx.Client) -> Corpus:
    fake.responder = responder
    corpus = Corpus(srv, data, {}, client)

    def chat(key: str | None, session: str, messages: list[dict[str, Any]],
             model: str = "gpt-4o") -> httpx.Response:
        r = corpus.chat({"x-session-id": session, **(bearer(key) if key else {})}, messages, model)
        assert r.status_code == 200, r.text
        return r

    for key in (KEY_A, KEY_B):
        mark = MARK[key]
        assert chat(key, "build-1", build_messages(mark)).headers["x-ctxproxy-offloaded"] == "1"
        r = chat(key, "compact-1", long_history(mark), model="tiny")
        assert r.headers["x-ctxproxy-compacted"] == "1"
    chat(KEY_B, ONLY_B, [{"role": "user", "content": f"hello from {MARK[KEY_B]}"}])
    chat(None, "anon-1", [{"role": "user", "content": "hello from nobody"}])
    srv.drain()  # the answers and the turn counters are recorded after each response
    with Database.in_dir(data) as db:
        assert len([r for r in db.sessions(None) if r.turns]) == 6
    files = corpus.files
    for tenant in (TA, TB):
        session = data / tenant
        [tool] = (session / "build-1" / "tool_result").iterdir()
        [dialog] = (session / "build-1" / "dialog").iterdir()
        [summary] = (session / "compact-1" / "summaries").iterdir()
        files[tenant] = Files(tool.name, dialog.name, summary.name,
                              REQUEST[KEY_A if tenant == TA else KEY_B])
    # Each tenant's build-1 gets a ledger entry, its reason carrying the tenant's mark.
    ledger = srv.app.services.store.ledger  # type: ignore[attr-defined]
    for key, tenant in ((KEY_A, TA), (KEY_B, TB)):
        rid = REQUEST[key]
        ledger.add([LedgerEntry(
            tenant, "build-1", rid, rid, 1.7e9, "request", "chat", "gpt-4o",
            usage=Usage(input=100), cost=0.01, tokens_sent=1000, tokens_forwarded=100,
            changes=(Change("cut", f"cut for {MARK[key]}", kept_bytes=10, notice="N",
                            file=f"tool_result/{files[tenant].tool_result}"),))])
    assert files[TA].tool_result != files[TB].tool_result
    assert files[TA].summary != files[TB].summary
    return corpus


def serve(fake_server: tuple[FakeUpstream, ServerThread], root: Path,
          overrides: dict[str, Any]) -> Iterator[Corpus]:
    fake, upstream = fake_server
    config = proxy_config(upstream.url + "/v1", root / "data",
                          {"compaction": {"context_windows": {"tiny": 4000}}, **overrides})
    with serve_in_thread(create_app(config), lifespan="on") as srv, \
            httpx.Client(timeout=30) as client:
        corpus = populate(srv, fake, root / "data", client)
        fake.reset()
        yield corpus


@pytest.fixture(scope="module")
def corpus(_fake_server: tuple[FakeUpstream, ServerThread],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corpus]:
    yield from serve(_fake_server, tmp_path_factory.mktemp("iso"), {})


@pytest.fixture(scope="module")
def guarded(_fake_server: tuple[FakeUpstream, ServerThread],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corpus]:
    yield from serve(_fake_server, tmp_path_factory.mktemp("iso-guarded"),
                     {"auth": {"master_key": MASTER}})


# --- every route, every variant -----------------------------------------------------------------

KINDS = ["session", "dialog", "tool_result", "summary", "request"]
# (name, method, suffix appended to the path, headers)
VARIANTS: list[tuple[str, str, str, dict[str, str]]] = [
    ("html", "GET", "", HTML),
    ("json", "GET", "", JSON),
    ("format-json", "GET", "?format=json", {}),
    ("format-html", "GET", "?format=html", {}),
    ("format-text", "GET", "?format=text", {}),
    ("raw", "GET", "?raw=1", {}),
    ("accept-text", "GET", "", {"accept": "text/plain"}),
    ("no-accept", "GET", "", {}),
    ("window-raw", "GET", "?start_line=1&lines=3", {}),
    ("window-json", "GET", "?start_line=2&lines=2", JSON),
    ("window-html", "GET", "?start_line=1&lines=2", HTML),
    ("trailing-slash", "GET", "/", JSON),
    ("login", "GET", "?login=1", JSON),
    ("head", "HEAD", "", {}),
    ("head-raw", "HEAD", "?raw=1", {}),
]


def path_of(corpus: Corpus, kind: str, tenant: str, *, ghost: bool = False,
            name: str | None = None) -> str:
    """The path of ``tenant``'s real item of ``kind``; ``ghost``: the same shape, not existing."""
    files = corpus.files[tenant]
    if kind == "session":
        return f"/files/{tenant}/{'no-such-session' if ghost else 'build-1'}"
    session = "no-such-session" if ghost else "build-1"
    if kind == "dialog":
        return f"/files/{tenant}/{session}/dialog/{name or files.dialog}"
    if kind == "tool_result":
        return f"/files/{tenant}/{session}/tool_result/{name or files.tool_result}"
    if kind == "request":
        return f"/files/{tenant}/{session}/requests/{name or files.request}"
    session = "no-such-session" if ghost else "compact-1"
    return f"/files/{tenant}/{session}/summaries/{name or files.summary}"


def ids_of(corpus: Corpus, tenant: str) -> list[str]:
    f = corpus.files[tenant]
    return [tenant, f.tool_result.removesuffix(".txt"), f.summary.removesuffix(".md"), f.request]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("variant", "method", "suffix", "headers"), VARIANTS,
                         ids=[v[0] for v in VARIANTS])
def test_another_tenants_item_is_exactly_like_a_missing_one(
    corpus: Corpus, kind: str, variant: str, method: str, suffix: str, headers: dict[str, str]
) -> None:
    me = {**bearer(KEY_A), **headers}
    own = corpus.get(path_of(corpus, kind, TA) + suffix, me, method)
    assert own.status_code == 200, (variant, own.text[:200])
    if method == "GET" and kind != "session":
        assert MARK[KEY_A] in own.text
    theirs = corpus.get(path_of(corpus, kind, TB) + suffix, me, method)
    # The same shape, missing: in B's tenant, and in A's own.
    for ghost in (corpus.get(path_of(corpus, kind, TB, ghost=True) + suffix, me, method),
                  corpus.get(path_of(corpus, kind, TA, ghost=True) + suffix, me, method)):
        assert theirs.status_code == ghost.status_code == 404, (variant, theirs.text[:200])
        assert theirs.content == ghost.content
        assert theirs.headers.get("content-type") == ghost.headers.get("content-type")
    assert MARK[KEY_B] not in theirs.text and not any(i in theirs.text for i in ids_of(corpus, TB)[1:])
    # Anonymous callers are refused the same way (``?login=1`` asks them for a key first).
    anon = corpus.get(path_of(corpus, kind, TB) + suffix, headers, method)
    anon_ghost = corpus.get(path_of(corpus, kind, TB, ghost=True) + suffix, headers, method)
    assert anon.status_code == anon_ghost.status_code == (401 if variant == "login" else 404)
    assert anon.content == anon_ghost.content


@pytest.mark.parametrize("kind", ["tool_result", "summary", "request"])
@pytest.mark.parametrize(("variant", "method", "suffix", "headers"), VARIANTS[:6],
                         ids=[v[0] for v in VARIANTS[:6]])
def test_guessing_another_tenants_name_in_ones_own_session_reveals_nothing(
    corpus: Corpus, kind: str, variant: str, method: str, suffix: str, headers: dict[str, str]
) -> None:
    """B's real file name tried under A's own session answers like any name A never had.
    (Dialog files are named by the day, the same for everyone: there is nothing to guess.)"""
    me = {**bearer(KEY_A), **headers}
    theirs = getattr(corpus.files[TB], kind)
    made_up = {"tool_result": f"{GHOST_ID}.txt", "summary": "20000101T000000Z-000000000000.md",
               "request": GHOST_REQUEST}[kind]
    guess = corpus.get(path_of(corpus, kind, TA, name=theirs) + suffix, me, method)
    ghost = corpus.get(path_of(corpus, kind, TA, name=made_up) + suffix, me, method)
    assert guess.status_code == ghost.status_code == 404
    norm = guess.content.replace(theirs.removesuffix(".txt").encode(), b"NAME")
    assert norm == ghost.content.replace(made_up.removesuffix(".txt").encode(), b"NAME")
    assert MARK[KEY_B].encode() not in guess.content


def crawl(corpus: Corpus, headers: dict[str, str]) -> Iterator[httpx.Response]:
    """Every page reachable from the index, JSON and HTML, files raw too."""
    index = corpus.get("/files", {**headers, **JSON})
    yield index
    yield corpus.get("/files", {**headers, **HTML})
    for s in index.json()["sessions"]:
        detail = corpus.get(s["url"], {**headers, **JSON})
        yield detail
        yield corpus.get(s["url"], {**headers, **HTML})
        d = detail.json()
        calls = d["ledger"]["entries"] if d["ledger"] is not None else []
        for link in d["dialog_files"] + d["tool_results"] + d["summaries"] + calls:
            for extra in (JSON, HTML, {}):
                yield corpus.get(link["url"], {**headers, **extra})


@pytest.mark.parametrize("who", ["A", "anon"])
def test_listings_never_mention_another_tenant(corpus: Corpus, who: str) -> None:
    headers = bearer(KEY_A) if who == "A" else {}
    pages = list(crawl(corpus, headers))
    assert all(p.status_code == 200 for p in pages)
    text = "\n".join(p.text for p in pages)
    own = {"A": ["build-1", "compact-1", MARK[KEY_A], corpus.files[TA].tool_result],
           "anon": ["anon-1", "hello from nobody"]}[who]
    assert all(o in text for o in own) and len(pages) > (15 if who == "A" else 5)
    for other in [MARK[KEY_B], ONLY_B, *ids_of(corpus, TB)] + (
            [MARK[KEY_A], TA] if who == "anon" else []):
        assert other not in text, other
    # No query parameter widens the view.
    for query in (f"?tenant={TB}", "?master=1", f"?tenant={TB}&format=json", "?scope="):
        r = corpus.get("/files" + query, {**headers, **JSON})
        assert r.status_code == 200 and TB not in r.text and ONLY_B not in r.text, query


def traversals(corpus: Corpus) -> list[str]:
    """Paths from A's own namespace (or from nowhere) aimed at B's real files."""
    b = corpus.files[TB]
    a_session = f"/files/{TA}/build-1"
    b_tool = f"{TB}/build-1/tool_result/{b.tool_result}"
    b_dialog = f"{TB}/build-1/dialog/{b.dialog}"
    absolute = str(corpus.data / TB / "build-1" / "tool_result" / b.tool_result)
    enc = b_tool.replace("/", "%2f")
    return [
        f"{a_session}/../../{TB}/build-1",
        f"/files/{TA}/../{TB}/build-1",
        f"/files/{TA}/..%2f{TB}/build-1",
        f"/files/{TA}/%2e%2e/{TB}/build-1/tool_result/{b.tool_result}",
        f"{a_session}/tool_result/..%2f..%2f..%2f{enc}",
        f"{a_session}/tool_result/%2e%2e%2f%2e%2e%2f%2e%2e%2f{enc}",
        f"{a_session}/tool_result/%252e%252e%252f%252e%252e%252f%252e%252e%252f{enc}",
        f"{a_session}/dialog/..%2f..%2f..%2f{b_dialog.replace('/', '%2f')}",
        f"{a_session}/tool_result/{absolute}",
        f"{a_session}/tool_result/{absolute.replace('/', '%2f')}",
        f"/files/{corpus.data}/{TB}/build-1",
        f"/files/{str(corpus.data).replace('/', '%2f')}%2f{b_tool.replace('/', '%2f')}",
        f"/files//{TB}/build-1",
        f"/files/./{TB}/build-1",
        f"/files/{TA}/./../{TB}/build-1",
        f"/files/{TA}%00/../{TB}/build-1",
        f"/files/{TB}%00/build-1",
        f"/files/{TB}%00{TA}/build-1",
        f"/files/{TA}/build-1%00/../../{b_tool}",
        f"/files/{TB.upper()}/build-1",
        f"/files/{TB}./build-1",
        f"/files/{TB}%20/build-1",
        f"/files/%20{TB}/build-1",
        f"/files/{TB};{TA}/build-1",
        f"/files/{TA}/%EF%BC%8E%EF%BC%8E/{TB}/build-1",
        f"/files/{TA}/%c0%ae%c0%ae/{TB}/build-1",
        f"/files/{TA}/%c0%af{TB}/build-1",
        f"/files/{TA}\\..\\{TB}\\build-1",
        f"/files/{TA}/..%5c{TB}%5cbuild-1",
        f"/files/{TA}/build-1/tool_result/{b.tool_result}/../../../../{b_tool}",
        f"/files/{TA}/{'a' * 5000}/../../{b_tool}",
        f"/files/{TA}/build-1/tool_result/{'b' * 20000}.txt",
        f"/files/{'t' * 129}/build-1",
        f"/files/{TA}/build-1/tool_result/{b.tool_result}?tenant={TB}",
        f"/files/{TB}/build-1?tenant={TA}",
        f"/files/{b_tool}?login=1",
        f"/files/{TB}/{ONLY_B}",
        f"/files/{TA}/{ONLY_B}",
        f"{a_session}/requests/{b.request}",
        f"{a_session}/requests/..%2f..%2f..%2f{TB}%2fbuild-1%2frequests%2f{b.request}",
        f"/files/{TA}/..%2f{TB}/build-1/requests/{b.request}",
        f"/files/{TA}/build-1/../../{TB}/build-1/requests/{b.request}",
        f"/files/{TB}",
        f"/files/{TB}/",
        f"/files/{TB}/build-1/tool_result",
        f"/files/{TB}/build-1/tool_result/",
        f"/files/{TB}/build-1/dialog/{b.dialog}/",
    ]


def test_traversal_towards_another_tenant_never_escapes(corpus: Corpus) -> None:
    tried = 0
    for key in (KEY_A, None):
        for target in traversals(corpus):
            for suffix in ("", "?raw=1" if "?" not in target else "&raw=1",
                           "?format=json&start_line=1" if "?" not in target else ""):
                for method in ("GET", "HEAD"):
                    status, body = raw_get(corpus.url, target + suffix,
                                           bearer(key) if key else {}, method)
                    assert status in ((400, 404) if key else (400, 401, 404)), (target, status)
                    assert MARK[KEY_B].encode() not in body, target
                    # No name of B's that the request did not itself carry.
                    assert not any(i.encode() in body for i in ids_of(corpus, TB)[1:]
                                   if i not in target), target
                    tried += 1
    assert tried > 400
    # The same requests with B's own key do reach B's files: the paths above were real targets.
    b = corpus.files[TB]
    status, body = raw_get(corpus.url, f"/files/{TB}/build-1/tool_result/{b.tool_result}?raw=1",
                           bearer(KEY_B))
    assert status == 200 and MARK[KEY_B].encode() in body


# --- the read tool --------------------------------------------------------------------------------


def test_the_read_tool_cannot_reach_another_tenants_files(corpus: Corpus, fake: FakeUpstream) -> None:
    """Tenant A's model asks the proxy's read tool for B's file ids and paths, in the session
    name both tenants use: every answer is an error or A's own data, never B's."""
    b = corpus.files[TB]
    b_tool = f"{TB}/build-1/tool_result/{b.tool_result}"
    absolute = str(corpus.data / b_tool)
    paths = [
        f"tool_result/{b.tool_result}", f"tool_result/{corpus.files[TA].tool_result}",
        f"dialog/{b.dialog}", f"../../{b_tool}", f"tool_result/../../../{b_tool}", absolute,
        f"tool_result/{b.tool_result}\x00", f"tool_result/%2e%2e/{b.tool_result}",
        f"tool_result\\..\\..\\{b_tool}", f"{TB}/build-1/dialog/{b.dialog}",
        f"TOOL_RESULT/{b.tool_result}", f"tool_result/{b.tool_result.upper()}",
        f"summaries/{b.summary}", f"../{TB}/compact-1/summaries/{b.summary}",
        "tool_result/" + "a" * 5000 + ".txt", "_index.sqlite3", "../../_index.sqlite3",
    ]
    calls = [{"id": f"r{i}", "name": "read_offloaded", "arguments": {"file_path": p, "start_line": 1}}
             for i, p in enumerate(paths)]

    def model(body: dict[str, Any]) -> Reply:
        if body["messages"][-1].get("role") == "tool":
            return Reply(content="done")
        return Reply(content=None, tool_calls=calls)

    fake.responder = model
    r = corpus.chat({**bearer(KEY_A), "x-session-id": "build-1"}, build_messages(MARK[KEY_A]))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "done"
    assert r.headers["x-ctxproxy-read-rounds"] == "1"
    results = {m["tool_call_id"]: m["content"] for m in fake.received[-1].json()["messages"]
               if m.get("role") == "tool" and str(m.get("tool_call_id", "")).startswith("r")}
    assert len(results) == len(paths)
    for i, path in enumerate(paths):
        text = results[f"r{i}"]
        assert MARK[KEY_B] not in text, (path, text[:200])  # B's files have it on every line
        if i == 1:  # A's own file reads fine: the tool works
            assert MARK[KEY_A] in text
        elif i == 2:  # today's dialog name is A's own dialog too: A's own lines
            assert MARK[KEY_A] in text
        else:
            assert text.startswith("error:"), (path, text[:200])
    # B's guessed id answers like an id A never had.
    ghost = results["r0"].replace(b.tool_result, "NAME")
    assert "no longer available" in ghost and "NAME" in ghost


def test_identical_conversations_of_two_tenants_are_two_sessions(
    corpus: Corpus, fake: FakeUpstream
) -> None:
    """No session header: the derived session includes the tenant, and neither tenant's
    chat touches the other's files, even when one names the other's session and tenant."""
    messages = [{"role": "user", "content": "the very same first message"}]
    sessions = set()
    for key in (KEY_A, KEY_B):
        r = corpus.chat(bearer(key), messages)
        sessions.add(r.headers["x-ctxproxy-session"])
    assert len(sessions) == 2
    # B's answer is archived just after it is sent: wait for it before taking B's snapshot.
    corpus.srv.drain()
    b_dialogs = corpus.data / TB / r.headers["x-ctxproxy-session"] / "dialog"
    assert b'"role":"assistant"' in b"".join(p.read_bytes() for p in b_dialogs.glob("*"))
    before = {p: p.read_bytes() for p in (corpus.data / TB).rglob("*") if p.is_file()}
    for sid in ("build-1", f"../{TB}/build-1", f"../../{TB}/build-1", f"{TB}/build-1", ONLY_B):
        r = corpus.chat({**bearer(KEY_A), "x-session-id": sid}, build_messages("intruder"))
        assert r.status_code == 200
    after = {p: p.read_bytes() for p in (corpus.data / TB).rglob("*") if p.is_file()}
    assert after == before
    assert not list(corpus.data.glob(f"*/{TB}*")) and not (corpus.data / TA / TB).exists()


# --- the master key -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["index", *KINDS])
@pytest.mark.parametrize(("variant", "method", "suffix", "headers"), VARIANTS,
                         ids=[v[0] for v in VARIANTS])
def test_master_key_guards_every_route(
    guarded: Corpus, kind: str, variant: str, method: str, suffix: str, headers: dict[str, str]
) -> None:
    path = "/files" if kind == "index" else path_of(guarded, kind, TB)
    for creds in ({}, {"authorization": "Basic !!!"}, {"authorization": "Basic " + base64.b64encode(
            b"\xff\xfe").decode()}):
        r = guarded.get(path + suffix, {**headers, **creds}, method)
        assert r.status_code == 401, (variant, creds, r.status_code)
        assert r.headers["www-authenticate"].startswith('Basic realm="ctxproxy"')
        assert r.headers["cache-control"] == "no-store"
        if method == "GET" and r.headers["content-type"].startswith("application/json"):
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        elif method == "GET":
            assert r.headers["content-type"].startswith("text/html") and "<h1>401</h1>" in r.text
        assert MARK[KEY_B] not in r.text and MARK[KEY_A] not in r.text
    # The master key opens it; B's own key too; A's key gets the 404 of a missing item.
    for creds, status in ((bearer(MASTER), 200), (basic(MASTER), 200), ({"x-api-key": MASTER}, 200),
                          (bearer(KEY_B), 200), (bearer(KEY_A), 200 if kind == "index" else 404)):
        r = guarded.get(path + suffix, {**headers, **creds}, method)
        assert r.status_code == status, (variant, creds, r.text[:200])


@pytest.mark.parametrize("near", [MASTER + "x", MASTER[:-1], MASTER.upper(), MASTER + " x",
                                  "x" + MASTER, MASTER.replace("-", "_"), "Bearer " + MASTER])
def test_a_near_miss_of_the_master_key_is_just_another_tenant(guarded: Corpus, near: str) -> None:
    r = guarded.get("/files", {"authorization": f"Bearer {near}", **JSON})
    if r.status_code == 401:  # no key at all (an empty or blank Bearer)
        assert r.json()["error"]["code"] == "invalid_api_key"
        return
    body = r.json()
    assert r.status_code == 200 and body["master"] is False and body["sessions"] == []
    for kind in KINDS:
        assert guarded.get(path_of(guarded, kind, TB), {"authorization": f"Bearer {near}"}).status_code == 404


def test_master_key_sees_every_tenant(guarded: Corpus) -> None:
    pages = list(crawl(guarded, bearer(MASTER)))
    text = "\n".join(p.text for p in pages)
    assert all(p.status_code == 200 for p in pages)
    for needle in (TA, TB, ONLY_B, MARK[KEY_A], MARK[KEY_B], "anon-1"):
        assert needle in text
    assert MASTER not in text


def test_health_and_metrics_are_open_and_carry_no_names(guarded: Corpus) -> None:
    """Documented: /healthz and /metrics are not behind auth.master_key (a scraper has no
    key); /metrics has no tenant, session or key in it."""
    assert guarded.get("/healthz", {}).status_code == 200
    metrics = guarded.get("/metrics", {})
    assert metrics.status_code == 200 and "ctxproxy_requests_total" in metrics.text
    for needle in (TA, TB, "build-1", ONLY_B, MASTER, KEY_A, KEY_B, MARK[KEY_A]):
        assert needle not in metrics.text
    # Chat is not gated by the master key: the upstream judges the client's own key.
    r = guarded.chat(bearer(KEY_A), [{"role": "user", "content": "hi"}])
    assert r.status_code == 200


def test_master_key_is_compared_in_constant_time(
    guarded: Corpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decision is hmac.compare_digest's alone, over SHA-256 digests (only those are kept):
    with it forced to False the real master key is just a tenant, with it forced to True any
    key is master (so no `==` decides first)."""
    seen: list[tuple[bytes, bytes]] = []
    verdict: dict[str, bool | None] = {"force": None}
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        force = verdict["force"]
        return real(a, b) if force is None else force

    monkeypatch.setattr(hmac, "compare_digest", spy)  # the module proxy.auth calls
    digest = hashlib.sha256(MASTER.encode()).digest()
    gate = Gate(config_from_mapping({"auth": {"master_key": MASTER}}).auth)
    assert gate.caller(bearer(MASTER), files=True).master
    assert seen == [(digest, digest)]
    verdict["force"] = False
    assert not gate.caller(bearer(MASTER), files=True).master
    verdict["force"] = True
    assert gate.caller(bearer("sk-anything"), files=True).master
    # ... and a real request goes through it too.
    verdict["force"] = None
    seen.clear()
    r = guarded.get("/files", {**basic(MASTER), **JSON})
    assert r.json()["master"] is True and (digest, digest) in seen

"""Keys never leak: not into logs (the proxy's, uvicorn's, its access log, litellm's), not into
any file under ``data_dir`` (the SQLite database included, read as bytes), not into any answer.

Real traffic through one proxy with a distinctive key at every place one can be: the client's
key, the proxy's own upstream key (``upstream.api_key``), a litellm route's key and the master
key. The traffic: offload, the read-tool loop, compaction, streaming, upstream errors that echo a
key, a litellm route (success and an echoed error), raw pass-through, bad requests, and a crawl of
``/files`` with every key and credential form.

Upstream error bodies are the provider's and pass through byte for byte
(docs/errors.md#error-envelopes), so a client can get *its own* key back when the provider
echoes it. The exception is a key the client never had: the proxy's ``upstream.api_key`` (and a
route's key, which litellm's errors carry) is replaced by ``[redacted]`` in what the client gets.
Whatever passes through, the proxy neither logs nor stores it.
"""

from __future__ import annotations

import base64
import contextlib
import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy.app import create_app
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread, serve_in_thread
from proxy.session import tenant_of

from .conftest import InProcessFactory, proxy_config

CLIENT_KEY = "sk-client-Q7v3Lm9XwT2p-SECRET"
OTHER_KEY = "sk-other-Z5n8Bc1RkD4s-SECRET"
UPSTREAM_KEY = "sk-upstream-H2j6Fq0PyW8e-SECRET"
ROUTE_KEY = "sk-route-M4t1Gx7VaN3u-SECRET"
MASTER_KEY = "mk-master-C9r2Ke5JsU6b-SECRET"
PROXY_HELD = (UPSTREAM_KEY, ROUTE_KEY, MASTER_KEY)  # keys a client never has
CLIENT_HELD = (CLIENT_KEY, OTHER_KEY)
LOGGERS = ("", "proxy", "uvicorn", "uvicorn.error", "uvicorn.access", "aiohttp", "asyncio",
           "httpx", "httpcore", "LiteLLM", "LiteLLM Router", "LiteLLM Proxy", "litellm")
SUMMARY = """## Goal
Ship the release build of the service.
## Constraints & Preferences
- keep the public API unchanged
## Progress
### Done
- ran the build, found the failing step
### In Progress
- fixing the linker error in module core
### Blocked
- nothing is blocked right now
## Key Decisions
- stay on the current toolchain version
## Next Steps
- rerun the build after the fix
## Critical Context
- error: undefined reference to `init_core` in core.o
"""

def forms(secret: str) -> list[bytes]:
    """A key as it could turn up: itself, its distinctive middle, inside Basic credentials."""
    middle = secret.split("-")[2]
    out = [secret.encode(), middle.encode()]
    for user in ("", "me", "x"):
        out.append(base64.b64encode(f"{user}:{secret}".encode()))
    out.append(base64.b64encode(f"{secret}:".encode()))
    return out


def leaks(blob: bytes, secrets: tuple[str, ...]) -> list[str]:
    return [secret for secret in secrets if any(f in blob for f in forms(secret))]


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def basic(key: str, user: str = "me") -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:{key}".encode()).decode()}


def is_summarizer(body: dict[str, Any]) -> bool:
    first = body["messages"][0].get("content") if body.get("messages") else None
    return isinstance(first, str) and "summar" in first.lower() and "Agent." not in first


def big_output(lines: int = 3000) -> str:
    return "".join(f"line {i}: build output " + "x" * 40 + "\n" for i in range(1, lines + 1))


def echo(status: int, *keys: str) -> Reply:
    message = "Incorrect API key provided: " + ", ".join(keys) + ". You can find your key at ..."
    return Reply.error(status, message, code="invalid_api_key")


class Capture(logging.Handler):
    """Every record of every logger of interest, formatted with its traceback."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@dataclass
class Answer:
    """What the client got: status, headers, body."""

    status: int
    headers: httpx.Headers
    body: bytes
    url: str

    @classmethod
    def of(cls, r: httpx.Response, body: bytes | None = None) -> Answer:
        return cls(r.status_code, r.headers, r.content if body is None else body, str(r.url))

    def blob(self) -> bytes:
        """What the proxy sent (the URL is what the client asked for)."""
        return self.body + str(list(self.headers.items())).encode()


@dataclass
class Run:
    srv: ServerThread
    fake: FakeUpstream
    data: Path
    client: httpx.Client
    answers: list[Answer] = field(default_factory=list)
    # Upstream errors echoing the client's own key, which pass through intact, and the body
    # each must arrive with.
    echoed: list[tuple[Answer, bytes]] = field(default_factory=list)

    def post(self, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
        r = self.client.post(self.srv.url + path, content=orjson.dumps(body), headers=headers)
        self.answers.append(Answer.of(r))
        return r

    def get(self, path: str, headers: dict[str, str], **params: Any) -> httpx.Response:
        r = self.client.get(self.srv.url + path, headers=headers, params=params)
        self.answers.append(Answer.of(r))
        return r

    def stream(self, body: dict[str, Any], headers: dict[str, str]) -> bytes:
        with self.client.stream("POST", self.srv.url + "/v1/chat/completions", headers=headers,
                                content=orjson.dumps({**body, "stream": True})) as r:
            raw = b"".join(r.iter_raw())
        self.answers.append(Answer.of(r, raw))
        return raw

    def expect_echo(self, body: bytes) -> None:
        self.echoed.append((self.answers[-1], body))


@dataclass
class Recorded:
    run: Run
    logs: bytes  # every log record, and what went to stdout and stderr


@pytest.fixture(scope="module")
def recorded(
    _fake_server: tuple[FakeUpstream, ServerThread], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Recorded]:
    """One proxy, all the traffic, every log line; the proxy is stopped (its database closed)
    before the tests look."""
    fake, upstream = _fake_server
    fake.reset()
    data = tmp_path_factory.mktemp("secrets") / "data"
    fake_url = upstream.url + "/v1"
    config = proxy_config(fake_url, data, {
        "upstream": {"api_key": UPSTREAM_KEY},
        "auth": {"master_key": MASTER_KEY},
        "compaction": {"context_windows": {"tiny": 4000}},
        "model_list": [{"model_name": "routed", "litellm_params": {
            "model": "openai/gpt-4o-mini", "api_base": fake_url, "api_key": ROUTE_KEY}}],
    })
    # uvicorn's own access log on, at debug level: it too must not see a key.
    srv = serve_in_thread(create_app(config), lifespan="on", access_log=True, log_level="debug")
    srv.start()
    out, err = io.StringIO(), io.StringIO()
    try:
        with httpx.Client(timeout=60) as client:
            run = Run(srv, fake, data, client)
            with capture() as handler, contextlib.redirect_stdout(out), \
                    contextlib.redirect_stderr(err):
                traffic(run)
                srv.stop()
        logs = "\n".join([*handler.lines, out.getvalue(), err.getvalue()]).encode()
        yield Recorded(run, logs)
    finally:
        srv.stop()
        fake.reset()


@contextlib.contextmanager
def capture() -> Iterator[Capture]:
    handler = Capture()
    saved = []
    for name in LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger, level in saved:
            logger.removeHandler(handler)
            logger.setLevel(level)


def responder(body: dict[str, Any]) -> Reply:
    if is_summarizer(body):
        return Reply(content=SUMMARY)
    tools = [t.get("function", {}).get("name") for t in body.get("tools") or []]
    last = body["messages"][-1]
    paths = [m["content"].split("file_path=")[1].split()[0] for m in body["messages"]
             if m.get("role") == "tool" and "file_path=" in str(m.get("content"))]
    if "read_offloaded" in tools and last.get("role") != "tool" and paths:
        return Reply(content=None, tool_calls=[{"name": "read_offloaded", "arguments": {
            "file_path": paths[0], "start_line": 5}}])
    return Reply(content="done")


def conversation(session: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Agent."},
        {"role": "user", "content": f"run the build for {session}"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": big_output()},
        {"role": "user", "content": "what failed?"},
    ]


def history(turns: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "Agent."}]
    for t in range(turns):
        out += [{"role": "user", "content": f"request {t}: " + "please do it " * 20},
                {"role": "assistant", "content": f"answer {t}: " + "did it " * 25}]
    return out


def traffic(run: Run) -> None:
    """Everything a client does, with keys everywhere."""
    fake = run.fake
    fake.responder = responder
    chat = "/v1/chat/completions"
    me = {**bearer(CLIENT_KEY), "x-session-id": "secrets-1"}

    # Offload and the read-tool loop, non-streaming and streaming.
    r = run.post(chat, {"model": "gpt-4o", "messages": conversation("a")}, me)
    assert r.status_code == 200 and r.headers["x-ctxproxy-offloaded"] == "1", r.text
    assert r.headers["x-ctxproxy-read-rounds"] == "1"
    raw = run.stream({"model": "gpt-4o", "messages": conversation("a"),
                      "stream_options": {"include_usage": True}}, me)
    assert raw.endswith(b"data: [DONE]\n\n")
    # Compaction (a summarizer call made with the proxy's own key).
    r = run.post(chat, {"model": "tiny", "messages": history(40)},
                 {"x-api-key": CLIENT_KEY, "x-session-id": "secrets-2"})
    assert r.headers["x-ctxproxy-compacted"] == "1", r.text
    # A second tenant, with the key in the other header forms.
    run.post(chat, {"model": "gpt-4o", "messages": conversation("b")},
             {"api-key": OTHER_KEY, "x-session-id": "other-1"})

    # Upstream errors echoing keys: non-streaming, streaming, a 429 and a 500.
    for status in (401, 429, 500):
        fake.script(echo(status, UPSTREAM_KEY, CLIENT_KEY))
        r = run.post(chat, {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, me)
        assert r.status_code == status
        run.expect_echo(echo(status, "[redacted]", CLIENT_KEY).body or b"")
    fake.script(echo(401, UPSTREAM_KEY, CLIENT_KEY))
    run.stream({"model": "gpt-4o", "messages": [{"role": "user", "content": "y"}]}, me)
    run.expect_echo(echo(401, "[redacted]", CLIENT_KEY).body or b"")
    # ... through the read-tool loop too (the request carries an offload notice), both ways.
    fake.script(echo(401, UPSTREAM_KEY, CLIENT_KEY))
    assert run.post(chat, {"model": "gpt-4o", "messages": conversation("a")}, me).status_code == 401
    run.expect_echo(echo(401, "[redacted]", CLIENT_KEY).body or b"")
    fake.script(echo(401, UPSTREAM_KEY, CLIENT_KEY))
    run.stream({"model": "gpt-4o", "messages": conversation("a")}, me)
    run.expect_echo(echo(401, "[redacted]", CLIENT_KEY).body or b"")

    # A litellm route: an answer, a stream, and a provider error echoing the route's key.
    r = run.post(chat, {"model": "routed", "messages": [{"role": "user", "content": "hi"}]}, me)
    assert r.status_code == 200, r.text
    run.stream({"model": "routed", "messages": [{"role": "user", "content": "hi"}]}, me)
    fake.script(echo(401, ROUTE_KEY))
    r = run.post(chat, {"model": "routed", "messages": [{"role": "user", "content": "z"}]}, me)
    assert r.status_code == 401 and "Incorrect API key" in r.text

    # Raw pass-through, bad requests.
    assert run.get("/v1/models", me).status_code == 200
    assert run.post("/v1/embeddings", {"model": "e", "input": "hi"}, me).status_code == 200
    assert run.post(chat, {"model": 5}, me).status_code == 400
    bad = run.client.post(run.srv.url + chat, content=b"{" + CLIENT_KEY.encode(), headers=me)
    assert bad.status_code == 400 and CLIENT_KEY not in bad.text  # not even its own key back
    assert run.get("/metrics", {}).status_code == 200
    assert run.get("/healthz", {}).status_code == 200

    # /files with every credential form, and the refusals.
    run.srv.drain()  # session counters reach the database once a second
    r = run.client.get(run.srv.url + "/files",
                       headers={**bearer(MASTER_KEY), "accept": "application/json"})
    turns = [s["turns"] for s in r.json()["sessions"]]
    assert len(turns) >= 3 and all(turns), r.text
    for headers, deep in ((bearer(CLIENT_KEY), True), (basic(CLIENT_KEY), False),
                          ({"x-api-key": OTHER_KEY}, True), (bearer(MASTER_KEY), True),
                          (basic(MASTER_KEY), False), (basic(MASTER_KEY, user=""), False)):
        crawl(run, headers, deep)
    for headers in ({}, {"authorization": "Basic !!!" + CLIENT_KEY},
                    {"authorization": "Basic " + base64.b64encode(b"\xff" + CLIENT_KEY.encode()).decode()}):
        assert run.get("/files", headers).status_code == 401
    tool = files_json(run, bearer(CLIENT_KEY), f"/files/{tenant_of(CLIENT_KEY)}/secrets-1")
    url = tool["tool_results"][0]["url"]
    assert run.get(url, bearer(CLIENT_KEY), start_line=CLIENT_KEY).status_code == 400
    assert run.get(url, bearer(OTHER_KEY)).status_code == 404


def files_json(run: Run, headers: dict[str, str], path: str) -> dict[str, Any]:
    r = run.get(path, {**headers, "accept": "application/json"})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def crawl(run: Run, headers: dict[str, str], deep: bool) -> None:
    """Every page the key may see as JSON; with ``deep`` each file as HTML and raw too."""
    index = files_json(run, headers, "/files")
    run.get("/files", headers)
    assert index["sessions"], headers
    for s in index["sessions"]:
        detail = files_json(run, headers, s["url"])
        run.get(s["url"], headers)
        for link in detail["dialog_files"] + detail["tool_results"] + detail["summaries"]:
            files_json(run, headers, link["url"])
            if deep:
                run.get(link["url"], headers)
                run.get(link["url"], headers, raw=1)


def test_no_key_in_the_logs(recorded: Recorded) -> None:
    logs = recorded.logs
    assert logs.count(b"\n") > 100 and b"proxy.server.access INFO POST /v1/chat/completions 200" in logs
    assert b"uvicorn.access" in logs and b"LiteLLM" in logs  # they ran, and were looked at
    assert b"Incorrect API key provided" not in logs  # the upstream's error bodies are not logged
    assert not leaks(logs, PROXY_HELD + CLIENT_HELD), leaks(logs, PROXY_HELD + CLIENT_HELD)


def test_no_key_in_any_file_under_data_dir(recorded: Recorded) -> None:
    files = [p for p in recorded.run.data.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert "_index.sqlite3" in names and any(n.endswith(".jsonl") for n in names)
    assert any(n.endswith(".txt") for n in names) and any(n.endswith(".md") for n in names)
    for path in files:
        found = leaks(path.read_bytes(), PROXY_HELD + CLIENT_HELD)
        assert not found, (path, found)


def test_no_key_in_any_answer(recorded: Recorded) -> None:
    """No answer carries a key the client did not send; upstream errors that echo the client's
    own key are the one exception (checked exactly in the next test)."""
    run = recorded.run
    echoed = {id(a) for a, _ in run.echoed}
    assert len(run.answers) > 60 and {a.status for a in run.answers} >= {200, 400, 401, 404, 429}
    for a in run.answers:
        allowed = CLIENT_HELD if id(a) in echoed else ()
        found = leaks(a.blob(), tuple(s for s in PROXY_HELD + CLIENT_HELD if s not in allowed))
        assert not found, (a.status, a.url, found, a.body[:300])


def test_upstream_error_bodies_pass_through_with_only_the_proxys_key_redacted(
    recorded: Recorded,
) -> None:
    run = recorded.run
    assert len(run.echoed) == 6
    for a, want in run.echoed:
        assert a.status in (401, 429, 500) and a.body == want, (a.status, a.body[:300])
        assert CLIENT_KEY.encode() in a.body  # the client's own key: the provider's message intact
    # What the upstream got: the proxy's key (or the route's, through litellm), never the client's.
    sent = {rec.headers.get("authorization") for rec in run.fake.received}
    assert sent == {f"Bearer {UPSTREAM_KEY}", f"Bearer {ROUTE_KEY}"}
    assert not any(CLIENT_KEY in str(rec.headers) for rec in run.fake.received)


async def test_a_summarizer_error_echoing_the_key_is_not_logged(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    app = await make_inproc({"upstream": {"api_key": UPSTREAM_KEY},
                             "compaction": {"context_windows": {"tiny": 4000}}})

    def answer(body: dict[str, Any]) -> Reply:
        return echo(401, UPSTREAM_KEY, CLIENT_KEY) if is_summarizer(body) else Reply(content="ok")

    fake.responder = answer
    with capture() as handler:
        r = await app.client.post("/v1/chat/completions", headers=bearer(CLIENT_KEY),
                                  content=orjson.dumps({"model": "tiny", "messages": history(40)}))
        assert r.status_code == 200 and r.headers["x-ctxproxy-compacted"] == "1"
    logs = "\n".join(handler.lines).encode()
    assert b"summarizer failed" in logs
    assert not leaks(logs, (UPSTREAM_KEY, CLIENT_KEY)), leaks(logs, (UPSTREAM_KEY, CLIENT_KEY))


def test_the_leak_check_finds_keys() -> None:
    """The checks above can fail: each form of a key is found."""
    for secret in PROXY_HELD + CLIENT_HELD:
        for form in forms(secret):
            assert leaks(b"..." + form + b"...", (secret,)) == [secret]
    assert leaks(b"Bearer " + CLIENT_KEY.encode()[:-3], (CLIENT_KEY,)) == [CLIENT_KEY]  # middle
    assert leaks(b"nothing here", PROXY_HELD) == []

"""The calls the proxy makes of its own on a request's behalf (the compaction summarizer, the
memory fold, the read-tool rounds) and the ones it passes through (count_tokens, /v1/models):
each goes through the request's own wire format to that format's provider, carries no
parameter the model refuses, and no credential ever reaches the other provider.

Two fake providers, one per upstream, each behind :class:`the strict fake` (the refusals that
matter here: ``temperature`` != 1 on OpenAI's reasoning models, sampling parameters on the Claude
models whose catalogue entry refuses them, a ``-codex`` model on chat completions). A session of
each format (and each Anthropic credential form) is driven through offload, compaction, a read
round, the memory fold, count_tokens and a passthrough path; every request either fake
received is searched for the other provider's credentials.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.inprocess import InProcess
from proxy.app import create_app
from proxy.compaction.client import SummarizerClient
from proxy.config import config_from_mapping
from proxy.demo.fake.own_calls import instructions_of, last_text, own_call
from proxy.demo.fake.replies import Received
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread, serve_in_thread
from proxy.services import Services, capabilities_of
from proxy.session import tenant_of
from proxy.store.summaries import SummaryRecord
from proxy.truncation.notice import parse_notice
from proxy.upstream.http import Upstream
from proxy.upstream.litellm_route import LitellmRouter
from proxy.upstream.providers import Upstreams

OPENAI_KEY = "sk-proj-openai-CLIENT-7f3a9c"
OPENAI_ORG = "org-client-4411"
ANTHROPIC_KEY = "sk-ant-api03-CLIENT-2b8e1d"
OAUTH_TOKEN = "sk-ant-oat01-CLIENT-oauth-9c4f"
CONFIGURED_ANTHROPIC_KEY = "sk-ant-api03-CONFIGURED-5d2a"

SUMMARY = """## Goal
Fix the checkout build and keep it green.
## Constraints & Preferences
- keep the public API unchanged
## Progress
### Done
- ran the build steps
### In Progress
- reading the build output
### Blocked
- nothing
## Key Decisions
- fix the rounding helper first
## Next Steps
- rerun the build
## Critical Context
- tests/test_checkout.py::test_total fails
"""
FACTS = """## Durable Facts
- Preference: "never push to main without a green build"
- Lesson: `make` failed with `missing header`; fixed by `apt-get install libfoo-dev`
"""
MODELS = {"chat": "gpt-5.2", "responses": "gpt-5.1-codex", "messages": "claude-sonnet-5"}
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses",
         "messages": "/v1/messages"}


# --- the two providers ------------------------------------------------------------------------


def _tool_result(body: dict[str, Any]) -> tuple[str, str] | None:
    """The last item's tool result (call id, text), in any format."""
    turns = body.get("messages") if body.get("messages") is not None else body.get("input")
    if not isinstance(turns, list) or not turns:
        return None
    last = turns[-1]
    if last.get("role") == "tool":
        return str(last.get("tool_call_id")), str(last.get("content"))
    if last.get("type") == "function_call_output":
        return str(last.get("call_id")), str(last.get("output"))
    content = last.get("content")
    if last.get("role") == "user" and isinstance(content, list):
        for block in reversed(content):
            if block.get("type") == "tool_result":
                text = block.get("content")
                if isinstance(text, list):
                    text = "".join(str(p.get("text") or "") for p in text)
                return str(block.get("tool_use_id")), str(text)
    return None


def _fold_answer(body: dict[str, Any]) -> str:
    notes = last_text(body).split("<notes>", 1)[1].split("</notes>", 1)[0]
    bullets = [line for line in notes.split("\n") if line.startswith("- [")]
    return ("## Preferences & Standing Instructions\n"
            + "\n".join(b for b in bullets if "Preference:" in b)
            + "\n## Lessons\n" + "\n".join(b for b in bullets if "Lesson:" in b) + "\n")


class Model:
    """One provider's model: summarizes, folds, and reads an offloaded output once."""

    def __init__(self, fake: FakeUpstream) -> None:
        self.read = False
        fake.responder = self

    def __call__(self, body: dict[str, Any]) -> Reply:
        kind = own_call(body)
        if kind == "summarizer":
            return Reply(content=SUMMARY + FACTS)
        if kind == "fold":
            return Reply(content=_fold_answer(body))
        result = _tool_result(body)
        if result is not None and result[0].startswith("read_"):
            return Reply(content="I read it.")
        notice = parse_notice(result[1]) if result is not None else None
        if notice is not None and not self.read:
            self.read = True
            args = {"file_path": notice.file_path, "start_line": notice.next_line}
            return Reply(content=None, tool_calls=[{"id": "read_1", "name": "read_offloaded",
                                                    "arguments": args}])
        return Reply(content="ok")


@dataclass
class Provider:
    fake: FakeUpstream  # strict: it refuses what the provider refuses (fake.invalid)
    server: ServerThread

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def received(self) -> list[Received]:
        return self.fake.received


@pytest.fixture(scope="module")
def _providers() -> Iterator[dict[str, Provider]]:
    out: dict[str, Provider] = {}
    servers = []
    for name in ("openai", "anthropic"):
        fake = FakeUpstream()
        srv = serve_in_thread(fake)
        srv.start()
        servers.append(srv)
        out[name] = Provider(fake, srv)
    yield out
    for srv in servers:
        srv.stop()


@pytest.fixture
def providers(_providers: dict[str, Provider]) -> Iterator[dict[str, Provider]]:
    for p in _providers.values():
        p.fake.reset()
        Model(p.fake)
    yield _providers
    for p in _providers.values():
        p.fake.reset()


def config(providers: dict[str, Provider], data: Path, **sections: Any) -> Any:
    base: dict[str, Any] = {
        "upstream": {"base_url": providers["openai"].url + "/v1"},
        "anthropic": {"base_url": providers["anthropic"].url},
        "storage": {"data_dir": str(data)},
        "compaction": {"context_windows": {m: 16000 for m in MODELS.values()}},
        "memory": {"enabled": True},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return config_from_mapping(base)


@pytest.fixture
async def proxy_for(providers: dict[str, Provider], tmp_path: Path) -> AsyncIterator[Any]:
    started: list[InProcess] = []

    async def start(**sections: Any) -> InProcess:
        app = InProcess(create_app(config(providers, tmp_path / "data", **sections)))
        started.append(await app.start())
        return app

    yield start
    for app in started:
        await app.stop()


# --- the sessions -----------------------------------------------------------------------------


def output(n: int) -> str:
    """A ~55 KB tool output: cut on arrival (over offload.recent_max_bytes)."""
    return "".join(f"step {n} line {i}: " + "build output " * 5 + "\n" for i in range(1, 700))


@dataclass
class Session:
    fmt: str
    headers: dict[str, str]
    items: list[dict[str, Any]] = field(default_factory=list)

    def turn(self, n: int) -> None:
        fmt, text = self.fmt, output(n)
        if fmt == "chat":
            self.items += [
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"call_{n}", "type": "function",
                     "function": {"name": "bash", "arguments": '{"cmd": "make"}'}}]},
                {"role": "tool", "tool_call_id": f"call_{n}", "content": text}]
        elif fmt == "responses":
            self.items += [
                {"type": "function_call", "call_id": f"call_{n}", "name": "bash",
                 "arguments": '{"cmd": "make"}'},
                {"type": "function_call_output", "call_id": f"call_{n}", "output": text}]
        else:
            self.items += [
                {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{n}",
                                                   "name": "bash", "input": {"cmd": "make"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{n}",
                                              "content": text}]}]

    def body(self) -> dict[str, Any]:
        model = MODELS[self.fmt]
        first = "fix the checkout build"
        if self.fmt == "chat":
            return {"model": model, "messages": [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": first}, *self.items],
                "tools": [{"type": "function", "function": {
                    "name": "bash", "parameters": {"type": "object", "properties": {}}}}]}
        if self.fmt == "responses":
            return {"model": model, "instructions": "You are a coding agent.", "store": False,
                    "input": [{"type": "message", "role": "user",
                               "content": [{"type": "input_text", "text": first}]}, *self.items],
                    "tools": [{"type": "function", "name": "bash",
                               "parameters": {"type": "object", "properties": {}}}]}
        return {"model": model, "max_tokens": 4096, "system": "You are a coding agent.",
                "messages": [{"role": "user", "content": first}, *self.items],
                "tools": [{"name": "bash", "input_schema": {"type": "object"}}]}


CREDENTIALS: dict[str, dict[str, str]] = {
    "openai": {"authorization": f"Bearer {OPENAI_KEY}", "openai-organization": OPENAI_ORG},
    "api-key": {"x-api-key": ANTHROPIC_KEY, "anthropic-version": "2023-06-01",
                "anthropic-beta": "interleaved-thinking-2025-05-14"},
    "oauth": {"authorization": f"Bearer {OAUTH_TOKEN}", "anthropic-version": "2023-06-01",
              "anthropic-beta": "oauth-2025-04-20,interleaved-thinking-2025-05-14"},
}


async def drive(app: InProcess, session: Session, sid: str) -> None:
    """Four growing requests (offload, compaction with facts, one read round), one more (the
    fold, in the background), count_tokens and a passthrough path."""
    headers = {**session.headers, "x-session-id": sid}
    for n in range(1, 5):
        session.turn(n)
        r = await app.client.post(PATHS[session.fmt], json=session.body(), headers=headers)
        assert r.status_code == 200, r.text[:300]
        await app.drain()
    r = await app.client.post(PATHS[session.fmt], json=session.body(),
                              headers={**headers, "x-session-id": sid + "-next"})
    assert r.status_code == 200, r.text[:300]
    await app.drain()
    count = ("/v1/messages/count_tokens" if session.fmt == "messages"
             else "/v1/responses/input_tokens")
    r = await app.client.post(count, json={"model": MODELS[session.fmt], "messages": [
        {"role": "user", "content": "hello"}]}, headers=headers)
    assert r.status_code == 200, r.text[:300]
    r = await app.client.get("/v1/models", headers=headers)
    assert r.status_code == 200, r.text[:300]


def _anthropic_header(name: str) -> bool:
    return name == "x-api-key" or name.startswith("anthropic-")


def _openai_header(name: str) -> bool:
    return name == "api-key" or name.startswith("openai-")


def crossings(received: list[Received], header: Any, secrets: list[str]) -> list[str]:
    """What in ``received`` belongs to the other provider: a header of its, or one of its
    credentials anywhere (headers or body)."""
    found = []
    for rec in received:
        for name, value in rec.raw_headers:
            if header(name):
                found.append(f"{rec.method} {rec.path}: header {name}")
            found += [f"{rec.method} {rec.path}: {name} carries a foreign credential"
                      for s in secrets if s in value]
        found += [f"{rec.method} {rec.path}: the body carries a foreign credential"
                  for s in secrets if s.encode() in rec.body]
    return found


def summaries_of(app: InProcess, sid: str) -> list[SummaryRecord]:
    services: Services = app.state["services"]
    rows = [row for row in services.sessions.sessions() if row.session == sid]
    assert len(rows) == 1
    return services.summaries.history(rows[0].tenant, sid)


@pytest.mark.parametrize(("fmt", "credential", "configured"), [
    ("chat", "openai", False),
    ("responses", "openai", False),
    ("messages", "api-key", False),
    ("messages", "oauth", False),
    ("messages", "api-key", True),  # anthropic.api_key set: the fold leaked the client's anyway
])
async def test_no_call_carries_a_credential_to_another_provider(
    providers: dict[str, Provider], proxy_for: Any, fmt: str, credential: str, configured: bool,
) -> None:
    sections: dict[str, Any] = {"compaction": {
        "context_windows": {m: 16000 for m in MODELS.values()}, "temperature": 0.0}}
    if configured:
        sections["anthropic"] = {"base_url": providers["anthropic"].url,
                                 "api_key": CONFIGURED_ANTHROPIC_KEY}
    app = await proxy_for(**sections)
    sid = f"own-{fmt}-{credential}"
    await drive(app, Session(fmt, CREDENTIALS[credential]), sid)

    openai, anthropic = providers["openai"].received, providers["anthropic"].received
    assert crossings(openai, _anthropic_header,
                     [ANTHROPIC_KEY, OAUTH_TOKEN, CONFIGURED_ANTHROPIC_KEY]) == []
    assert crossings(anthropic, _openai_header, [OPENAI_KEY, OPENAI_ORG]) == []
    # Stronger: a session talks to its own provider only.
    own, other = (anthropic, openai) if fmt == "messages" else (openai, anthropic)
    assert other == []

    # Each kind of call happened, on the format's own API, and none was refused.
    path = PATHS[fmt]
    kinds = [(rec.path, own_call(rec.json())) for rec in own if rec.method == "POST"
             and rec.path == path]
    assert (path, "summarizer") in kinds and (path, "fold") in kinds
    assert any(_tool_result(rec.json()) is not None and _tool_result(rec.json())[0] == "read_1"  # type: ignore[index]
               for rec in own if rec.path == path)
    paths = {rec.path for rec in own}
    assert {"/v1/models"} <= paths
    assert ("/v1/messages/count_tokens" if fmt == "messages" else "/v1/responses/input_tokens") in paths
    assert providers["openai"].fake.invalid == [] and providers["anthropic"].fake.invalid == []
    if configured:
        assert all(rec.headers.get("x-api-key") == CONFIGURED_ANTHROPIC_KEY for rec in own)

    # The summaries are the model's, not the fallback, and the fold stored a version.
    records = summaries_of(app, sid)
    assert records and all(r.source == "model" and r.error is None for r in records)
    services: Services = app.state["services"]
    assert services.memory.folds == 1 and services.memory.fold_failures == 0
    # Not one sampling parameter: none is configured but 0 for models that take none.
    for rec in own:
        if rec.method == "POST" and rec.path == path and own_call(rec.json()):
            assert not {"temperature", "top_p", "top_k"} & set(rec.json())


# --- where each format's own calls go, and what they carry ------------------------------------


def client(providers: dict[str, Provider], **knobs: Any) -> tuple[SummarizerClient, Upstreams]:
    cfg = config(providers, Path("/nonexistent"), **knobs.pop("sections", {}))
    upstreams = Upstreams(Upstream(cfg.upstream), Upstream(cfg.anthropic, key_header="x-api-key"))
    return SummarizerClient(upstreams, LitellmRouter([], timeout_s=5), capabilities_of(cfg),
                            timeout_s=10, **knobs), upstreams


PROMPT = [{"role": "system", "content": "You summarize a long-running conversation. Be brief."},
          {"role": "user", "content": "the turns"}]


@pytest.mark.parametrize(("api", "request_model", "knobs", "version", "path", "sent"), [
    # No knob: no sampling parameter, whatever the model.
    ("chat", "gpt-4o", {}, None, "/v1/chat/completions", None),
    ("messages", "claude-sonnet-4-5", {}, None, "/v1/messages", None),
    # The knob, for models that take it.
    ("chat", "gpt-4o", {"temperature": 0.3}, None, "/v1/chat/completions", 0.3),
    ("responses", "gpt-4.1", {"temperature": 0.3}, None, "/v1/responses", 0.3),
    ("messages", "claude-sonnet-4-5", {"temperature": 0.2}, None, "/v1/messages", 0.2),
    # ... and left out for models (or an API version) that refuse it.
    ("chat", "gpt-5.2", {"temperature": 0.0}, None, "/v1/chat/completions", None),
    ("chat", "o3", {"temperature": 0.0}, None, "/v1/chat/completions", None),
    ("responses", "gpt-5.1-codex", {"temperature": 0.0}, None, "/v1/responses", None),
    ("messages", "claude-sonnet-5", {"temperature": 0.0}, None, "/v1/messages", None),
    ("messages", "claude-sonnet-4-5", {"temperature": 0.0}, "2026-10-21", "/v1/messages", None),
    # A model served on Responses only is summarized there, even for a chat client.
    ("chat", "gpt-5.1-codex", {"temperature": 0.0}, None, "/v1/responses", None),
    ("chat", "gpt-4o", {"model": "gpt-5.1-codex-max"}, None, "/v1/responses", None),
    # anthropic.summarizer_model names the Messages sessions' summarizer.
    ("messages", "claude-opus-4-5", {"anthropic_model": "claude-sonnet-5"}, None,
     "/v1/messages", None),
])
async def test_each_format_summarizes_through_its_own_api_with_what_the_model_accepts(
    providers: dict[str, Provider], api: str, request_model: str, knobs: dict[str, Any],
    version: str | None, path: str, sent: float | None,
) -> None:
    knobs = dict(knobs)
    expected = knobs.get("anthropic_model") or knobs.get("model") or request_model
    summarizer, upstreams = client(providers, model=knobs.pop("model", None), **knobs)
    await upstreams.start()
    try:
        headers = [(b"authorization", f"Bearer {OPENAI_KEY}".encode())]
        if api == "messages":
            headers = [(b"x-api-key", ANTHROPIC_KEY.encode()),
                       (b"anthropic-version", (version or "2023-06-01").encode())]
        text = await summarizer.completer(request_model, headers, api=api)(PROMPT)
    finally:
        await upstreams.close()
    assert text.startswith("## Goal")  # the model's answer, parsed from the format's own shape
    provider = providers["anthropic" if api == "messages" else "openai"]
    assert provider.fake.invalid == []
    (rec,) = provider.received
    body = rec.json()
    assert rec.path == path
    assert body.get("temperature") == sent and "top_p" not in body and "top_k" not in body
    assert body["model"] == expected
    if path == "/v1/responses":
        assert body["instructions"].startswith("You summarize") and body["store"] is False
        assert body["input"] == [{"role": "user", "content": "the turns"}]
    assert instructions_of(body).startswith("You summarize")


async def test_the_gate_refuses_what_the_providers_refuse(providers: dict[str, Provider]) -> None:
    """The fake's rules can fail a test: each refusal as the provider sends it."""
    cases = [
        ("openai", "/v1/chat/completions", {"model": "gpt-5.2", "temperature": 0}, 400,
         "Unsupported value: 'temperature' does not support 0 with this model."),
        ("openai", "/v1/responses", {"model": "o4-mini", "temperature": 0.5}, 400,
         "Unsupported value: 'temperature' does not support 0.5"),
        ("openai", "/v1/chat/completions", {"model": "gpt-5.1-codex"}, 404,
         "only supported in v1/responses"),
        ("anthropic", "/v1/messages", {"model": "claude-sonnet-5", "temperature": 0}, 400,
         "temperature"),
    ]
    async with httpx.AsyncClient() as http:
        for name, path, body, status, message in cases:
            payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body}
            r = await http.post(providers[name].url + path, json=payload)
            assert r.status_code == status and message in r.json()["error"]["message"], r.text
        # What they accept passes on to the fake.
        r = await http.post(providers["openai"].url + "/v1/chat/completions", json={
            "model": "gpt-5.2", "temperature": 1, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200


# --- a failed call is never a silent fallback -------------------------------------------------


async def test_a_refused_summarizer_call_is_logged_counted_and_shown_with_its_reason(
    providers: dict[str, Provider], proxy_for: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    """A catalogue entry wrongly saying gpt-5.2 takes sampling parameters: the provider's 400
    is the summary's recorded reason, on /files and in the metric, and in one log line."""
    app = await proxy_for(compaction={"temperature": 0.0},
                          catalog={"models": {"gpt-5.2": {"sampling_params": True}}})
    sid = "own-refused"
    session = Session("chat", CREDENTIALS["openai"])
    with caplog.at_level(logging.INFO, logger="proxy"):
        for n in range(1, 5):
            session.turn(n)
            r = await app.client.post(PATHS["chat"], json=session.body(),
                                      headers={**session.headers, "x-session-id": sid})
            assert r.status_code == 200
            await app.drain()
    refused = providers["openai"].fake.invalid
    assert refused and all(r.violation.status == 400 for r in refused)
    records = summaries_of(app, sid)
    assert records and all(r.source == "fallback" for r in records)
    reason = ("summarizer HTTP 400: Unsupported value: 'temperature' does not support 0.0 with "
              "this model. Only the default (1) value is supported.")
    assert all(r.error is not None and r.error.startswith(reason) for r in records)
    assert "code=unsupported_value" in (records[0].error or "")

    # Logged once per failed call, with the provider's message.
    lines = [r.getMessage() for r in caplog.records if "using a deterministic summary" in r.getMessage()]
    assert len(lines) == len(records) and all(reason in line for line in lines)
    # Counted by status.
    metrics = (await app.client.get("/metrics")).text
    assert re.search(r'ctxproxy_summarizer_errors_total\{call="summarizer",status="400"\} '
                     + f"{len(refused)}.0", metrics), metrics
    # Shown on the session's page, in JSON and in HTML, and in the .md copy.
    tenant = tenant_of(OPENAI_KEY)
    page = (await app.client.get(f"/files/{tenant}/{sid}?format=json",
                                 headers=session.headers)).json()
    assert [s["source"] for s in page["summaries"]] == ["fallback"] * len(records)
    assert page["summaries"][0]["error"].startswith(reason)
    html = (await app.client.get(f"/files/{tenant}/{sid}", headers=session.headers)).text
    assert "deterministic fallback" in html and "summarizer HTTP 400: Unsupported value:" in html
    md = (await app.client.get(page["summaries"][0]["url"].split("testserver", 1)[-1],
                               headers=session.headers)).text
    assert "- source: fallback, the summarizer failed: summarizer HTTP 400" in md


async def test_an_error_echoing_a_key_is_redacted_everywhere(
    providers: dict[str, Provider], proxy_for: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    fake = providers["openai"].fake

    def refuse(body: dict[str, Any]) -> Reply:
        if own_call(body) == "summarizer":
            return Reply.error(401, f"Incorrect API key provided: {OPENAI_KEY}. Bearer {OPENAI_KEY}",
                               code="invalid_api_key")
        return Reply(content="ok")

    fake.responder = refuse
    app = await proxy_for()
    sid = "own-echo"
    session = Session("chat", CREDENTIALS["openai"])
    with caplog.at_level(logging.DEBUG):
        for n in range(1, 5):
            session.turn(n)
            r = await app.client.post(PATHS["chat"], json=session.body(),
                                      headers={**session.headers, "x-session-id": sid})
            assert r.status_code == 200
            await app.drain()
    records = summaries_of(app, sid)
    assert records and all(r.error is not None and r.error.startswith(
        "summarizer HTTP 401: Incorrect API key provided: [redacted]") for r in records)
    assert all(OPENAI_KEY not in (r.error or "") for r in records)
    assert OPENAI_KEY not in caplog.text and "Incorrect API key provided: [redacted]" in caplog.text
    metrics = (await app.client.get("/metrics")).text
    assert 'ctxproxy_summarizer_errors_total{call="summarizer",status="401"}' in metrics


async def test_a_temperature_left_out_is_logged_once_per_model(
    providers: dict[str, Provider], caplog: pytest.LogCaptureFixture,
) -> None:
    summarizer, upstreams = client(providers, model=None, temperature=0.0)
    headers = [(b"authorization", f"Bearer {OPENAI_KEY}".encode())]
    await upstreams.start()
    try:
        with caplog.at_level(logging.INFO, logger="proxy.pipeline"):
            for model in ("gpt-5.2", "gpt-5.2", "o3"):
                await summarizer.completer(model, headers, api="chat")(PROMPT)
    finally:
        await upstreams.close()
    lines = [r.getMessage() for r in caplog.records if "not sent" in r.getMessage()]
    assert lines == [
        "compaction.temperature not sent to gpt-5.2 for the summarizer: the catalogue says "
        "gpt-5.2 accepts no sampling parameters",
        "compaction.temperature not sent to o3 for the summarizer: the catalogue says o3 "
        "accepts no sampling parameters"]
    assert providers["openai"].fake.invalid == []

"""Claude Code (``claude -p``) in front of ctxproxy and the fake upstream: a scripted agent loop
that reads big files with Claude Code's own ``Read`` tool, so its results age and the session
gets compacted. Used by ``tests/test_claude_code.py`` and ``bench/claude_code.py``.

Claude Code runs headless: ``ANTHROPIC_BASE_URL`` at the proxy, a fake key, a temporary
``HOME``, ``IS_SANDBOX=1`` (``--dangerously-skip-permissions`` as root), stdin closed. The fake
answers every model request that offers tools with a ``Read`` of the next file (with a thinking
block and its signature) until ``reads`` files are read, then with a final text; side requests
(no tools) get a short text; the proxy's summarizer calls get a summary.

:func:`run_prefix_checked_session` is the same session on a model with preserved thinking
(``claude-opus-5-5``) in front of the prefix-checking fake (:mod:`.prefix_check`): every
forwarded request whose thinking blocks no longer match their prefix is refused with
Anthropic's 400, and the :class:`Session` says which.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.app import App, create_app
from proxy.config import Config
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.fake.wire import reasoning_token
from proxy.demo.servers import serve_in_thread
from proxy.formats.messages.request import cache_markers

__all__ = ["FINAL", "MODEL", "PRESERVED_THINKING_MODEL", "Session", "claude_binary", "markers",
           "run_claude", "run_prefix_checked_session", "run_session", "summarizer_request"]

MODEL = "claude-sonnet-4-5"
#: a model that binds thinking blocks to their prefix
PRESERVED_THINKING_MODEL = "claude-opus-5-5"
FINAL = "All files are read; the totals match."
SUMMARY = """## Goal
Read every data file and check the totals.
## Constraints & Preferences
- use the Read tool
## Progress
### Done
- read the first files
### In Progress
- reading the next file
### Blocked
- nothing
## Key Decisions
- totals are summed per file
## Next Steps
- read the remaining files
## Critical Context
- amounts repeat every 1000 records
"""


def claude_binary(root: Path) -> Path | None:
    """The pinned Claude Code (``npm ci`` puts it under node_modules), if installed."""
    found = root / "node_modules" / ".bin" / "claude"
    return found if found.exists() else None


def summarizer_request(req: dict[str, Any]) -> bool:
    return "summar" in str(req.get("system", "")).lower() and not req.get("tools")


def _file(n: int, lines: int) -> str:
    return "".join(f"record {n}.{i}: amount={i * 7 % 1000} account=acct-{i % 97} "
                   f"note=settled in batch {i // 50}\n" for i in range(1, lines + 1))


@dataclass
class Session:
    """What happened: Claude Code's exit and output, every forwarded model request (the main
    ones: with tools, not the summarizer's; refused ones included), and the proxy's per-turn
    token headers (the client's tokens in, the forwarded tokens out)."""

    returncode: int
    stdout: str
    stderr: str
    forwarded: list[dict[str, Any]] = field(default_factory=list)
    raw_forwarded: list[bytes] = field(default_factory=list)
    turns: list[dict[str, str]] = field(default_factory=list)  # x-ctxproxy-* of each answer
    signatures: set[str] = field(default_factory=set)  # the thinking signatures the fake issued
    #: main requests the prefix check refused: (index in ``forwarded``, the 400's message)
    refused: list[tuple[int, str]] = field(default_factory=list)
    #: the 400 messages of other refused requests (the summarizer's, side requests)
    refused_other: list[str] = field(default_factory=list)
    #: (index in ``forwarded``, first part changed) of each refused main request, as the
    #: fake's binder diagnoses it ("system", "messages.4", ...)
    refused_changes: list[tuple[int, str | None]] = field(default_factory=list)
    #: the bodies Claude Code itself sent to /v1/messages (every request, main or not), to
    #: tell what the proxy changed from what the client changed
    sent: list[bytes] = field(default_factory=list)


class _Recorder:
    """The proxy app, noting the body of each /v1/messages request and the x-ctxproxy-*
    headers of each answer."""

    def __init__(self, app: App, turns: list[dict[str, str]], sent: list[bytes]) -> None:
        self.app = app
        self.turns = turns
        self.sent = sent

    @property
    def services(self) -> Any:
        return self.app.services

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("path") != "/v1/messages":
            await self.app(scope, receive, send)
            return

        chunks: list[bytes] = []

        async def reading() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.sent.append(b"".join(chunks))
            return message

        async def noting(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.turns.append({k.decode(): v.decode() for k, v in message["headers"]
                                   if k.startswith(b"x-ctxproxy-")})
            await send(message)

        await self.app(scope, reading, noting)


@contextmanager
def _workdir(files: int, lines: int) -> Iterator[tuple[Path, Path]]:
    root = Path(tempfile.mkdtemp(prefix="ctxproxy-cc-"))
    try:
        work, home = root / "work", root / "home"
        work.mkdir()
        home.mkdir()
        for n in range(files):
            (work / f"data{n}.txt").write_text(_file(n, lines))
        yield work, home
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_claude(
    binary: Path, work: Path, home: Path, base_url: str, prompt: str, *, model: str = MODEL,
    timeout_s: float = 240,
) -> subprocess.CompletedProcess[str]:
    """``claude -p prompt`` in ``work`` against the Messages API at ``base_url``: a fake key,
    ``home`` as its ``HOME``, no telemetry or updates, stdin closed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
    env.update({
        "HOME": str(home), "IS_SANDBOX": "1", "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "sk-ant-fake-e2e", "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model, "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    })
    return subprocess.run(
        [str(binary), "-p", prompt, "--dangerously-skip-permissions"], cwd=work, env=env,
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s, check=False,
    )


def run_session(
    binary: Path, config: Config | None, fake: FakeUpstream, fake_url: str, *, reads: int = 6,
    lines: int = 1200, timeout_s: float = 240, model: str = MODEL,
    answer: Callable[[dict[str, Any]], Reply | None] | None = None,
) -> Session:
    """One ``claude -p`` session through a proxy built from ``config`` (its anthropic upstream
    pointed at ``fake_url``) in front of ``fake``, with ``model`` as Claude Code's model.
    ``config`` None: Claude Code talks to the fake itself (a control: what the client alone
    sends; no ``turns``, no ``sent``). ``answer`` answers a request first when it returns a
    reply (the proxy's read tool, say); the scripted reads otherwise."""
    done = {"reads": 0}

    def responder(req: dict[str, Any]) -> Reply:
        if summarizer_request(req):
            return Reply(content=SUMMARY)
        if not req.get("tools"):
            return Reply(content="ok")
        own = answer(req) if answer is not None else None
        if own is not None:
            return own
        if done["reads"] >= reads:
            return Reply(content=FINAL, reasoning="every file is read")
        n = done["reads"]
        done["reads"] += 1
        return Reply(content=None, reasoning=f"next I read data{n}.txt", tool_calls=[
            {"name": "Read", "id": f"toolu_read_{n}",
             "arguments": {"file_path": str(work / f"data{n}.txt")}}])

    fake.responder = responder
    turns: list[dict[str, str]] = []
    sent: list[bytes] = []
    with _workdir(reads, lines) as (work, home), ExitStack() as stack:
        base_url = fake_url
        if config is not None:
            anthropic = config.anthropic.model_copy(update={"base_url": fake_url})
            config = config.model_copy(update={"anthropic": anthropic})
            app = _Recorder(create_app(config), turns, sent)
            srv = stack.enter_context(serve_in_thread(app, lifespan="on"))
            base_url = srv.url
        prompt = (f"Read each of the files data0.txt to data{reads - 1}.txt in this "
                  "directory with the Read tool, then tell me whether the totals match.")
        proc = run_claude(binary, work, home, base_url, prompt, model=model, timeout_s=timeout_s)
        if config is not None:
            srv.drain()
    session = Session(proc.returncode, proc.stdout, proc.stderr, turns=turns, sent=sent)
    # What the fake actually sent as each thinking block's signature (bound ones included).
    session.signatures = {reasoning_token(rec.reply) for rec in fake.received
                          if rec.reply is not None and rec.reply.reasoning is not None}
    refusals = {id(r.received): r for r in fake.refused}
    for rec in fake.received:
        if rec.path != "/v1/messages":
            continue
        body = rec.json()
        refusal = refusals.get(id(rec))
        if summarizer_request(body) or not body.get("tools"):
            if refusal is not None:
                session.refused_other.append(refusal.message)
            continue
        if refusal is not None:
            session.refused.append((len(session.forwarded), refusal.message))
            first = refusal.failures[0].changed if refusal.failures else None
            session.refused_changes.append((len(session.forwarded), first))
        session.forwarded.append(body)
        session.raw_forwarded.append(rec.body)
    return session


def run_prefix_checked_session(
    binary: Path, config: Config | None, fake: FakeUpstream, fake_url: str, *, reads: int = 9,
    lines: int = 1200, timeout_s: float = 240,
) -> Session:
    """:func:`run_session` on :data:`PRESERVED_THINKING_MODEL` with ``fake`` checking every
    thinking block's prefix (switched on here; ``fake.reset()`` switches it back). ``config``
    should give that model a small ``compaction.context_windows`` entry, so the session
    compacts; 1,200-line files are cut at stage 1. ``config`` None: no proxy (the control)."""
    fake.prefix_check = True
    return run_session(binary, config, fake, fake_url, reads=reads, lines=lines,
                       timeout_s=timeout_s, model=PRESERVED_THINKING_MODEL)


def markers(session: Session) -> list[int]:
    return [cache_markers(b) for b in session.forwarded]

"""Claude Code (``claude -p``) in front of ctxproxy and the fake upstream: a scripted agent loop
that reads big files with Claude Code's own ``Read`` tool, so its results age and the session
gets compacted. Used by ``tests/test_claude_code.py`` and ``bench/claude_code.py``.

Claude Code runs headless: ``ANTHROPIC_BASE_URL`` at the proxy, a fake key, a temporary
``HOME``, ``IS_SANDBOX=1`` (``--dangerously-skip-permissions`` as root), stdin closed. The fake
answers every model request that offers tools with a ``Read`` of the next file (with a thinking
block and its signature) until ``reads`` files are read, then with a final text; side requests
(no tools) get a short text; the proxy's summarizer calls get a summary.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..app import App, create_app
from ..config import Config
from ..formats.messages import cache_markers
from .fake_upstream import FakeUpstream, Reply
from .fake_wire import reasoning_token
from .servers import serve_in_thread

__all__ = ["FINAL", "MODEL", "Session", "claude_binary", "markers", "run_session",
           "summarizer_request"]

MODEL = "claude-sonnet-4-5"
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
    """What happened: Claude Code's exit and output, every forwarded model request, and the
    proxy's per-turn token headers (the client's tokens in, the forwarded tokens out)."""

    returncode: int
    stdout: str
    stderr: str
    forwarded: list[dict[str, Any]] = field(default_factory=list)
    raw_forwarded: list[bytes] = field(default_factory=list)
    turns: list[dict[str, str]] = field(default_factory=list)  # x-ctxproxy-* of each answer
    signatures: set[str] = field(default_factory=set)  # the thinking signatures the fake issued


class _Recorder:
    """The proxy app, noting the x-ctxproxy-* headers of each /v1/messages answer."""

    def __init__(self, app: App, turns: list[dict[str, str]]) -> None:
        self.app = app
        self.turns = turns

    @property
    def services(self) -> Any:
        return self.app.services

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("path") != "/v1/messages":
            await self.app(scope, receive, send)
            return

        async def noting(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.turns.append({k.decode(): v.decode() for k, v in message["headers"]
                                   if k.startswith(b"x-ctxproxy-")})
            await send(message)

        await self.app(scope, receive, noting)


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


def run_session(
    binary: Path, config: Config, fake: FakeUpstream, fake_url: str, *, reads: int = 6,
    lines: int = 1200, timeout_s: float = 240,
    model: Callable[[dict[str, Any]], Reply | None] | None = None,
) -> Session:
    """One ``claude -p`` session through a proxy built from ``config`` (its anthropic upstream
    pointed at ``fake_url``) in front of ``fake``. ``model`` answers a request first when it
    returns a reply (the proxy's read tool, say); the scripted reads otherwise."""
    issued: set[str] = set()
    done = {"reads": 0}

    def responder(req: dict[str, Any]) -> Reply:
        if summarizer_request(req):
            return Reply(content=SUMMARY)
        if not req.get("tools"):
            return Reply(content="ok")
        own = model(req) if model is not None else None
        if own is not None:
            issued.add(reasoning_token(own))
            return own
        if done["reads"] >= reads:
            reply = Reply(content=FINAL, reasoning="every file is read")
        else:
            n = done["reads"]
            done["reads"] += 1
            reply = Reply(content=None, reasoning=f"next I read data{n}.txt", tool_calls=[
                {"name": "Read", "id": f"toolu_read_{n}",
                 "arguments": {"file_path": str(work / f"data{n}.txt")}}])
        issued.add(reasoning_token(reply))
        return reply

    fake.responder = responder
    anthropic = config.anthropic.model_copy(update={"base_url": fake_url})
    config = config.model_copy(update={"anthropic": anthropic})
    turns: list[dict[str, str]] = []
    with _workdir(reads, lines) as (work, home):
        app = _Recorder(create_app(config), turns)
        with serve_in_thread(app, lifespan="on") as srv:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
            env.update({
                "HOME": str(home), "IS_SANDBOX": "1", "ANTHROPIC_BASE_URL": srv.url,
                "ANTHROPIC_API_KEY": "sk-ant-fake-e2e", "ANTHROPIC_MODEL": MODEL,
                "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "DISABLE_TELEMETRY": "1",
                "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            })
            prompt = (f"Read each of the files data0.txt to data{reads - 1}.txt in this "
                      "directory with the Read tool, then tell me whether the totals match.")
            proc = subprocess.run(
                [str(binary), "-p", prompt, "--dangerously-skip-permissions"], cwd=work, env=env,
                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s,
                check=False,
            )
            srv.drain()
    session = Session(proc.returncode, proc.stdout, proc.stderr, turns=turns, signatures=issued)
    for rec in fake.received:
        if rec.path == "/v1/messages" and not summarizer_request(rec.json()):
            if rec.json().get("tools"):
                session.forwarded.append(rec.json())
                session.raw_forwarded.append(rec.body)
    return session


def markers(session: Session) -> list[int]:
    return [cache_markers(b) for b in session.forwarded]

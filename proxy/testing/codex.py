"""The real Codex CLI (npm ``@openai/codex``, pinned in package.json) run headless against a
proxy: what the end-to-end test and ``bench/codex_session.py`` share.

:class:`ShellScript` is the fake model (it asks Codex to run shell commands one after another,
then answers), :class:`Recording` wraps the proxy's ASGI app to keep what Codex sent and what the
proxy answered it, and :func:`run_codex` runs ``codex exec`` with its own ``CODEX_HOME``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from starlette.types import Message, Receive, Scope, Send

from .fake_upstream import Reply
from .servers import ASGIApp

__all__ = ["Recording", "ShellScript", "Turn", "codex_binary", "run_codex", "write_codex_home"]

RESPONSES_PATH = "/v1/responses"


def codex_binary() -> Path | None:
    """The Codex CLI that ``npm ci`` put under the project's node_modules (or ``$CODEX_BIN``)."""
    given = os.environ.get("CODEX_BIN")
    if given:
        return Path(given)
    here = Path(__file__).resolve().parents[2] / "node_modules" / ".bin" / "codex"
    if here.exists():
        return here
    found = shutil.which("codex")
    return Path(found) if found else None


@dataclass
class ShellScript:
    """A model that asks for ``commands`` in order through Codex's ``exec_command`` tool, then
    says ``final``. The next command follows the newest output's call id, so a compaction that
    drops old turns cannot confuse it. Chat-completions calls are the proxy's summarizer."""

    commands: Sequence[str]
    summary: str
    final: str = "All steps done."
    summaries: int = 0

    def __call__(self, body: dict[str, Any]) -> Reply:
        if "input" not in body:
            self.summaries += 1
            return Reply(content=self.summary)
        done = [i for i in body["input"]
                if isinstance(i, dict) and i.get("type") == "function_call_output"]
        step = int(str(done[-1]["call_id"]).rsplit("_", 1)[1]) + 1 if done else 0
        if step >= len(self.commands):
            return Reply(content=self.final, reasoning="every step ran")
        args = {"cmd": self.commands[step], "max_output_tokens": 100_000, "yield_time_ms": 10_000}
        return Reply(content=None, reasoning=f"step {step} next",
                     tool_calls=[{"name": "exec_command", "id": f"call_step_{step}", "arguments": args}])


@dataclass
class Turn:
    """One ``POST /v1/responses`` as Codex sent it, and the proxy's ``x-ctxproxy-*`` answer."""

    body: dict[str, Any]
    headers: dict[str, str]

    def tokens(self) -> tuple[int, int]:
        return int(self.headers["x-ctxproxy-tokens-in"]), int(self.headers["x-ctxproxy-tokens-out"])


@dataclass
class Recording:
    """An ASGI wrapper around the proxy's app: keeps each Responses request's body and answer
    headers, and counts WebSocket attempts. ``services`` is the app's (for ``drain()``)."""

    app: ASGIApp
    turns: list[Turn] = field(default_factory=list)
    websocket_attempts: int = 0

    @property
    def services(self) -> Any:
        return getattr(self.app, "services", None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            self.websocket_attempts += 1
        if scope["type"] != "http" or scope["path"] != RESPONSES_PATH:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def receiving() -> Message:
            message = await receive()
            chunks.append(message.get("body", b""))
            return message

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = {k.decode(): v.decode() for k, v in message["headers"]
                           if k.startswith(b"x-ctxproxy-")}
                self.turns.append(Turn(orjson.loads(b"".join(chunks)), headers))
            await send(message)

        await self.app(scope, receiving, sending)


def write_codex_home(home: Path, proxy_url: str, model: str, *, websockets: bool = True) -> None:
    """A ``config.toml`` with one provider: the proxy, Responses wire API. ``websockets`` makes
    Codex try a WebSocket first, as it does against OpenAI itself."""
    home.mkdir(parents=True, exist_ok=True)
    lines = [
        f'model = "{model}"', 'model_provider = "proxy"', 'approval_policy = "never"',
        'sandbox_mode = "danger-full-access"', "", "[model_providers.proxy]", 'name = "proxy"',
        f'base_url = "{proxy_url}/v1"', 'wire_api = "responses"', 'env_key = "CTXPROXY_TEST_KEY"',
    ]
    if websockets:
        lines.append("supports_websockets = true")
    (home / "config.toml").write_text("\n".join(lines) + "\n")


def run_codex(
    binary: Path, home: Path, workdir: Path, prompt: str, *, key: str = "sk-codex-test",
    timeout: float = 240,
) -> subprocess.CompletedProcess[str]:
    """``codex exec`` headless: stdin closed, its own home, the key in the provider's env var."""
    env = {**os.environ, "CODEX_HOME": str(home), "CTXPROXY_TEST_KEY": key, "NO_COLOR": "1"}
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [str(binary), "exec", "--skip-git-repo-check", prompt], cwd=workdir, env=env,
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, check=False)

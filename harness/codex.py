"""The real Codex CLI (npm ``@openai/codex``, pinned in package.json) run headless against a
proxy: what the end-to-end test and ``bench/codex_session.py`` share.

:class:`ShellScript` is the fake model (it asks Codex to run shell commands one after another,
then answers), :class:`RemoteCompaction` a fake provider compacting remotely in front of it,
:class:`Recording` wraps the proxy's ASGI app to keep what Codex sent and what the proxy answered
it, and :func:`run_codex` runs ``codex exec`` with its own ``CODEX_HOME``.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import orjson
from starlette.types import Message, Receive, Scope, Send

from proxy.demo.fake.own_calls import own_call
from proxy.demo.fake.upstream import Reply
from proxy.demo.servers import ASGIApp

__all__ = ["Recording", "RemoteCompaction", "ShellScript", "Turn", "codex_binary", "next_step",
           "run_codex", "write_codex_home"]

RESPONSES_PATH = "/v1/responses"


def codex_binary() -> Path | None:
    """The Codex CLI that ``npm ci`` put under the project's node_modules (or ``$CODEX_BIN``)."""
    given = os.environ.get("CODEX_BIN")
    if given:
        return Path(given)
    here = Path(__file__).resolve().parents[1] / "node_modules" / ".bin" / "codex"
    if here.exists():
        return here
    found = shutil.which("codex")
    return Path(found) if found else None


@dataclass
class ShellScript:
    """A model that asks for ``commands`` in order through Codex's ``exec_command`` tool, then
    says ``final``. The next command follows the newest output's call id, so a compaction that
    drops old turns cannot confuse it. The proxy's summarizer calls (in Responses format, as
    the session's) get ``summary``."""

    commands: Sequence[str]
    summary: str
    final: str = "All steps done."
    summaries: int = 0

    def __call__(self, body: dict[str, Any]) -> Reply:
        if own_call(body) is not None or "input" not in body:
            self.summaries += 1
            return Reply(content=self.summary)
        step = next_step(body["input"])
        if step >= len(self.commands):
            return Reply(content=self.final, reasoning="every step ran")
        args = {"cmd": self.commands[step], "max_output_tokens": 100_000, "yield_time_ms": 10_000}
        return Reply(content=None, reasoning=f"step {step} next",
                     tool_calls=[{"name": "exec_command", "id": f"call_step_{step}", "arguments": args}])


def next_step(items: Sequence[Any]) -> int:
    """The step after the newest output (or the one a :class:`RemoteCompaction` item of the
    fake provider recorded, when no output follows it: the compaction replaced them)."""
    for item in reversed(items):
        if not isinstance(item, dict):
            continue
        if item.get("type") == "function_call_output":
            return int(str(item["call_id"]).rsplit("_", 1)[1]) + 1
        if item.get("type") == "compaction":
            return RemoteCompaction.step_of(str(item.get("encrypted_content", "")))
    return 0


@dataclass
class RemoteCompaction:
    """A provider that compacts remotely in front of ``script``: a request ending with Codex's
    ``compaction_trigger`` item gets exactly one ``compaction`` output item, whose
    ``encrypted_content`` is opaque (base64 of a record only this fake reads: which compaction,
    and the step the script had reached, so the session goes on from there)."""

    script: ShellScript
    # The answers asking for these steps report a full context (``FULL`` input tokens), so that
    # Codex compacts before the next request (its model_auto_compact_token_limit set below it).
    full_at: Sequence[int] = ()
    blobs: list[str] = field(default_factory=list)
    triggers: int = 0

    FULL: ClassVar[int] = 10_000_000
    _MAGIC: ClassVar[bytes] = b"fake-compaction"

    def __call__(self, body: dict[str, Any]) -> Reply:
        items = body.get("input")
        if not isinstance(items, list) or own_call(body) is not None:
            return self.script(body)  # the proxy's summarizer
        if items and isinstance(items[-1], dict) and items[-1].get("type") == "compaction_trigger":
            self.triggers += 1
            record = b"%s:%d:%d:" % (self._MAGIC, len(self.blobs), next_step(items))
            blob = base64.b64encode(record + os.urandom(96)).decode()
            self.blobs.append(blob)
            return Reply(content=None, compaction=blob)
        reply = self.script(body)
        step = next_step(items)
        if step in self.full_at and not any(self.step_of(b) > step for b in self.blobs):
            reply.usage = {"input_tokens": self.FULL, "output_tokens": 10}
        return reply

    @classmethod
    def step_of(cls, blob: str) -> int:
        try:
            magic, _, step, _ = base64.b64decode(blob).split(b":", 3)
        except ValueError:
            return 0
        return int(step) if magic == cls._MAGIC else 0


@dataclass
class Turn:
    """One ``POST /v1/responses`` as Codex sent it, and the proxy's ``x-ctxproxy-*`` answer."""

    body: dict[str, Any]
    headers: dict[str, str]
    raw: bytes = b""  # the body as Codex sent it

    def tokens(self) -> tuple[int, int]:
        return int(self.headers["x-ctxproxy-tokens-in"]), int(self.headers["x-ctxproxy-tokens-out"])


@dataclass
class Recording:
    """An ASGI wrapper around the proxy's app: keeps each Responses request's body and answer
    headers, and counts WebSocket attempts. ``services`` is the app's (for ``drain()``).
    ``path``: the route recorded (``/v1/messages`` records Claude Code's requests)."""

    app: ASGIApp
    turns: list[Turn] = field(default_factory=list)
    websocket_attempts: int = 0
    path: str = RESPONSES_PATH

    @property
    def services(self) -> Any:
        return getattr(self.app, "services", None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            self.websocket_attempts += 1
        if scope["type"] != "http" or scope["path"] != self.path:
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
                raw = b"".join(chunks)
                self.turns.append(Turn(orjson.loads(raw), headers, raw))
            await send(message)

        await self.app(scope, receiving, sending)


def write_codex_home(
    home: Path, proxy_url: str, model: str, *, websockets: bool = True,
    remote_compaction_at: int | None = None,
) -> None:
    """A ``config.toml`` with one provider: the proxy, Responses wire API. ``websockets`` makes
    Codex try a WebSocket first, as it does against OpenAI itself. ``remote_compaction_at``:
    Codex compacts once the provider's reported usage reaches that many tokens, remotely (its
    remote compaction v2: a ``compaction_trigger`` item), which Codex 0.171.0 does only for a
    provider named ``OpenAI`` (``ModelProviderInfo::supports_remote_compaction``; any other name
    compacts locally, with a summarization prompt)."""
    home.mkdir(parents=True, exist_ok=True)
    name = "proxy"
    limit: list[str] = []
    if remote_compaction_at is not None:
        name = "OpenAI"
        limit = [f"model_auto_compact_token_limit = {remote_compaction_at}"]
    lines = [
        f'model = "{model}"', 'model_provider = "proxy"', 'approval_policy = "never"',
        'sandbox_mode = "danger-full-access"', *limit, "", "[model_providers.proxy]",
        f'name = "{name}"', f'base_url = "{proxy_url}/v1"', 'wire_api = "responses"',
        'env_key = "CTXPROXY_TEST_KEY"',
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

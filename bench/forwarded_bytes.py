"""What ctxproxy forwards for real Claude Code and Codex sessions, as digests: proof that a
change moved no byte.

``record OUT`` runs a real Claude Code session (Messages, compacting at a 60k window) and a
real Codex session (Responses, the shell session of ``tests/test_codex.py``) through ctxproxy
in front of the fake upstream and keeps what each client sent (bodies and headers, in order).
``replay IN`` sends those requests again, one after the other, to a fresh in-process ctxproxy
in front of a fake that answers deterministically, and prints a SHA-256 of every body the fake
received (the forwarded requests and the proxy's own calls) and one digest of them all. Two
trees that print the same digests forward the same bytes::

    python -m bench.forwarded_bytes record /tmp/sessions.json
    python -m bench.forwarded_bytes replay /tmp/sessions.json   # on each tree
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.claude_code import claude_binary, run_session
from harness.codex import Recording, ShellScript, codex_binary, run_codex, write_codex_home
from harness.inprocess import InProcess
from proxy.app import create_app
from proxy.config import Config, config_from_mapping
from proxy.demo.fake.own_calls import own_call
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import serve_in_thread

ROOT = Path(__file__).resolve().parent.parent
CLAUDE_MODEL = "claude-sonnet-4-5"
CODEX_MODEL = "gpt-5.1-codex"
COMMANDS = ["seq 1 40000", "seq 100000 140000", "yes codex-line | head -n 30000",
            "seq 200000 230000", "seq 300000 330000", "echo done"]
SUMMARY = """## Goal
Run every step.
## Constraints & Preferences
- none
## Progress
### Done
- the first steps
### In Progress
- the next step
### Blocked
- nothing
## Key Decisions
- one step at a time
## Next Steps
- the remaining steps
## Critical Context
- outputs are long
"""
KEPT_HEADERS = ("authorization", "x-api-key", "anthropic-version", "anthropic-beta",
                "x-claude-code-session-id", "content-type")


def config(upstream: str, data: Path) -> Config:
    return config_from_mapping({
        "upstream": {"base_url": upstream + "/v1"}, "anthropic": {"base_url": upstream},
        "storage": {"data_dir": str(data)},
        "compaction": {"context_windows": {CLAUDE_MODEL: 60_000, CODEX_MODEL: 24_000}},
        "offload": {"recent_max_bytes": 8000, "old_max_bytes": 1500},
    })


def _requests(bodies: list[bytes], headers: list[dict[str, str]], path: str) -> list[dict[str, Any]]:
    return [{"path": path, "body": base64.b64encode(b).decode(), "headers": h}
            for b, h in zip(bodies, headers, strict=True)]


def record(out: Path) -> None:
    claude, codex = claude_binary(ROOT), codex_binary()
    if claude is None or codex is None:
        sys.exit("the real CLIs are needed: npm ci")
    sessions: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        fake = FakeUpstream()
        with serve_in_thread(fake) as up:
            cc = run_session(claude, config(up.url, Path(tmp) / "cc"), fake, up.url, reads=9,
                             model=CLAUDE_MODEL)
            if cc.returncode != 0:
                sys.exit(f"Claude Code failed: {cc.stderr[-2000:]}")
            sessions["claude_code"] = _requests(
                cc.sent, [{"content-type": "application/json", "x-api-key": "sk-ant-fake-e2e",
                           "anthropic-version": "2023-06-01"}] * len(cc.sent), "/v1/messages")
            fake.reset()
            fake.responder = ShellScript(COMMANDS, SUMMARY)
            app = Recording(create_app(config(up.url, Path(tmp) / "codex")))
            with serve_in_thread(app, lifespan="on") as srv:
                write_codex_home(Path(tmp) / "home", srv.url, CODEX_MODEL)
                done = run_codex(codex, Path(tmp) / "home", Path(tmp) / "work", "run the steps")
                srv.drain()
            if done.returncode != 0:
                sys.exit(f"Codex failed: {done.stderr[-2000:]}")
            sessions["codex"] = _requests(
                [t.raw for t in app.turns],
                [{"content-type": "application/json", "authorization": "Bearer sk-codex-test"}]
                * len(app.turns), "/v1/responses")
    out.write_text(json.dumps(sessions))
    print(f"recorded {', '.join(f'{k}: {len(v)} requests' for k, v in sessions.items())}")


def _answer(req: dict[str, Any]) -> Reply:
    return Reply(content=SUMMARY if own_call(req) == "summarizer" else "ok")


async def _replay(requests: list[dict[str, Any]], fake: FakeUpstream, url: str,
                  data: Path) -> list[bytes]:
    async with InProcess(create_app(config(url, data))) as app:
        for r in requests:
            body = base64.b64decode(r["body"])
            headers = {k: v for k, v in r["headers"].items() if k in KEPT_HEADERS}
            answer = await app.client.post(r["path"], content=body, headers=headers)
            if answer.status_code != 200:
                print(f"  {r['path']} -> {answer.status_code}: {answer.text[:200]}")
            await app.drain()
    return [rec.body for rec in fake.received]


def replay(path: Path) -> None:
    sessions = json.loads(path.read_text())
    everything = hashlib.sha256()
    for name, requests in sessions.items():
        fake = FakeUpstream(responder=_answer)
        with tempfile.TemporaryDirectory() as tmp, serve_in_thread(fake) as up:
            bodies = asyncio.run(_replay(requests, fake, up.url, Path(tmp)))
        digests = [hashlib.sha256(b).hexdigest()[:16] for b in bodies]
        for d in digests:
            everything.update(d.encode())
        one = hashlib.sha256("".join(digests).encode()).hexdigest()[:16]
        print(f"{name}: {len(requests)} client requests, {len(bodies)} upstream bodies, "
              f"{sum(map(len, bodies)):,} bytes, digest {one}")
        for i, d in enumerate(digests):
            print(f"  {i:3d} {d}")
    print(f"all: {everything.hexdigest()[:16]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("record", "replay"))
    ap.add_argument("file", type=Path)
    args = ap.parse_args()
    (record if args.action == "record" else replay)(args.file)


if __name__ == "__main__":
    main()

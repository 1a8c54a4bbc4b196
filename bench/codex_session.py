"""The real Codex CLI through ctxproxy: per-turn tokens in (what Codex sent) and out (what was
forwarded), with offloads and compactions, and the WebSocket fallback (426 vs the 403 a
refused handshake gives). Prints a table; see bench/README.md.

    python -m bench.codex_session [--window 24000] [--steps 8]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.codex import Recording, ShellScript, codex_binary, run_codex, write_codex_home
from proxy.app import create_app
from proxy.config import config_from_mapping
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import serve_in_thread

SUMMARY = """## Goal
Run the numbered shell steps and report.
## Constraints & Preferences
- none stated
## Progress
### Done
- ran the earlier steps; their outputs are offloaded
### In Progress
- the next step
### Blocked
- nothing
## Key Decisions
- run the steps in order
## Next Steps
- run the remaining steps
## Critical Context
- outputs are long number listings
"""
MODEL = "gpt-5.1-codex"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--window", type=int, default=24_000, help="the model's context window")
    parser.add_argument("--steps", type=int, default=8, help="shell commands in the session")
    args = parser.parse_args()
    binary = codex_binary()
    if binary is None:
        raise SystemExit("Codex CLI not found: run npm ci at the repository root")
    commands = [f"seq {n * 100_000} {n * 100_000 + 30_000}" for n in range(args.steps)]
    script = ShellScript(commands, SUMMARY)
    with serve_in_thread(FakeUpstream(responder=script)) as up, \
            tempfile.TemporaryDirectory() as tmp:
        config = config_from_mapping({
            "upstream": {"base_url": up.url + "/v1"}, "storage": {"data_dir": tmp + "/data"},
            "compaction": {"context_windows": {MODEL: args.window}}})
        app = Recording(create_app(config))
        with serve_in_thread(app, lifespan="on") as srv:
            home = Path(tmp) / "home"
            write_codex_home(home, srv.url, MODEL)
            started = time.perf_counter()
            done = run_codex(binary, home, Path(tmp) / "work", "run the steps", timeout=600)
            elapsed = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(done.stderr[-2000:])
        print(f"codex exec: {elapsed:.1f} s, {len(app.turns)} turns, window {args.window}, "
              f"{script.summaries} summarizer calls, websocket attempts {app.websocket_attempts}")
        print(f"{'turn':>4} {'tokens in':>10} {'tokens out':>10} {'offloaded':>9} compacted")
        total_in = total_out = 0
        for n, turn in enumerate(app.turns):
            tin, tout = turn.tokens()
            total_in, total_out = total_in + tin, total_out + tout
            h: dict[str, Any] = turn.headers
            print(f"{n:>4} {tin:>10} {tout:>10} {h['x-ctxproxy-offloaded']:>9} "
                  f"{h['x-ctxproxy-compacted']}")
        print(f"total {total_in} in, {total_out} out: {total_out / total_in:.1%} forwarded")


if __name__ == "__main__":
    main()

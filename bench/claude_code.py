"""A Claude Code session through ctxproxy: tokens in and out per turn (issue 14).

    python -m bench.claude_code [--reads 10] [--lines 500] [--window 120000]

Runs the pinned Claude Code (``npm ci``) headless, ``claude -p``, through a real ctxproxy in
front of the fake upstream, which scripts one ``Read`` of a data file per turn (``--lines``
lines of ~75 bytes each) and then a final answer (harness/claude_code.py). Prints, per
model request Claude Code made, the tokens it sent (``x-ctxproxy-tokens-in``), the tokens
forwarded (``x-ctxproxy-tokens-out``), the results cut and whether a summary was in use.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from harness.claude_code import MODEL, claude_binary, run_session
from proxy.config import config_from_mapping
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import serve_in_thread

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reads", type=int, default=10)
    ap.add_argument("--lines", type=int, default=500, help="lines per file read")
    ap.add_argument("--window", type=int, default=120_000, help="context window of the model")
    args = ap.parse_args()
    binary = claude_binary(ROOT)
    if binary is None:
        sys.exit("Claude Code is not installed: npm ci")
    fake = FakeUpstream()
    with tempfile.TemporaryDirectory() as tmp, serve_in_thread(fake) as upstream:
        config = config_from_mapping({
            "upstream": {"base_url": upstream.url + "/v1"},
            "storage": {"data_dir": tmp},
            "compaction": {"context_windows": {MODEL: args.window}},
        })
        session = run_session(binary, config, fake, upstream.url, reads=args.reads,
                              lines=args.lines)
    print(f"# claude -p, {args.reads} Reads of {args.lines}-line files, window {args.window:,}; "
          f"exit {session.returncode}")
    print(f"{'turn':>4} {'tokens in':>10} {'tokens out':>10} {'cut':>4} summary")
    total_in = total_out = 0
    for n, turn in enumerate(session.turns, 1):
        tin, tout = int(turn["x-ctxproxy-tokens-in"]), int(turn["x-ctxproxy-tokens-out"])
        total_in, total_out = total_in + tin, total_out + tout
        print(f"{n:4} {tin:10,} {tout:10,} {turn['x-ctxproxy-offloaded']:>4} "
              f"{'yes' if turn['x-ctxproxy-compacted'] == '1' else ''}")
    print(f"total {total_in:,} in, {total_out:,} out ({total_out / max(total_in, 1) * 100:.0f}%)")


if __name__ == "__main__":
    main()

"""File-aware slimming (issue 22): what the file-aware rules save, off vs on in one run.

    python -m bench.file_sessions [--sessions claude,codex,chat,responses,messages]
                                  [--steps 64] [--window 128000] [--seed 7] [--no-fidelity]

Plays each session twice, through a fresh ctxproxy each time, in front of the fake upstream
caching prompts as the providers do (``FakeUpstream(prompt_cache=True)``: Anthropic's explicit
markers, OpenAI's automatic 1,024-token prefixes) and reporting it in each answer's usage:

- **off**: ``offload: {supersede_reads: false, reread_deltas: false, dedupe: false}`` (ctxproxy
  as before issue 22);
- **on**: the defaults (the three rules on).

Sessions:

- ``claude``, ``codex``: the real Claude Code and Codex CLIs headless, re-reading and editing a
  project of real files (harness/file_sessions.py: ~50 model turns, reads of whole files
  and ranges, re-reads unchanged and changed, edits quoting what was read, a new file, an
  overwrite, a grep and a test log run three times each). Claude Code at Anthropic Sonnet's
  prices, Codex at OpenAI gpt-4.1's (as bench/ledger.py); windows 90k / 60k tokens.
- ``chat``, ``responses``, ``messages``: bench/ledger.py's scripted coding-agent session
  (``--steps`` tool calls, ``--window``), its prices.

Per session it prints, from the proxy's own ledger (every billed call with the usage the caching
fake reported; summarizer calls included): tokens the client sent and tokens forwarded
(ctxproxy's o200k count), the billed prompt split into cache reads, cache writes and uncached
input, output, the cost through ctxproxy and the ledger's counterfactual (the client's own
requests sent directly under the same caching rules; the formula is
docs/ledger.md#the-counterfactual), cache breaks by reason, compactions, summarizer calls, what
ctxproxy changed (the ledger's change kinds) and, for the CLI sessions, edits landed / refused
and forced re-reads (an edit whose line the model was no longer shown, so it read the file again
first).

Then bench/fidelity.py's replay (guard on, both summarizer modes, three formats) off vs on:
the share of ``Edit`` quotes byte-exact in the request the edit answers, and the canaries
kept. Takes about a minute; the CLIs need ``npm ci`` (a missing one is skipped, said so).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import session_messages  # bench/session_messages.py
from ledger import PRICES, _model, _session  # bench/ledger.py

from harness.claude_code import claude_binary
from harness.codex import codex_binary
from harness.fidelity import MODES, Run, build_script, replay_all
from harness.file_sessions import (
    CLAUDE_MODEL,
    CODEX_MODEL,
    FileSession,
    run_claude_session,
    run_codex_session,
    session_config,
)
from proxy.app import create_app
from proxy.config import Config
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.run import MODEL
from proxy.demo.servers import serve_in_thread
from proxy.store.backend import open_backend
from proxy.store.ledger_entry import LedgerEntry
from proxy.usage import Usage

ROOT = Path(__file__).resolve().parent.parent
SETTINGS: dict[str, dict[str, Any]] = {
    "off": {"supersede_reads": False, "reread_deltas": False, "dedupe": False},
    "on": {},
}
SESSIONS = ("claude", "codex", "chat", "responses", "messages")


@dataclass
class Figures:
    """One session under one setting, from the proxy's ledger."""

    requests: int = 0
    calls: int = 0
    sent: int = 0
    forwarded: int = 0
    billed: Usage = field(default_factory=Usage)
    cost: float = 0.0
    direct_cost: float = 0.0
    breaks: collections.Counter[str] = field(default_factory=collections.Counter)
    compactions: int = 0
    summarizer_calls: int = 0
    estimated: int = 0
    changes: collections.Counter[str] = field(default_factory=collections.Counter)
    edits: str = ""  # CLI sessions: landed/total, refused, forced re-reads
    note: str = ""


def from_ledger(config: Config) -> Figures:
    """Sum the ledger the proxy (now stopped) wrote under ``config``'s storage."""
    store = open_backend(config.storage, digest_cache_bytes=1 << 20)
    try:
        assert store.ledger is not None
        figures = Figures()
        for totals in store.ledger.totals():
            figures.requests += totals.requests
            figures.calls += totals.calls
            figures.sent += totals.tokens_sent
            figures.forwarded += totals.tokens_forwarded
            figures.billed = figures.billed + totals.billed
            figures.cost += totals.cost
            figures.direct_cost += totals.direct_cost
            figures.estimated += totals.estimated
            figures.breaks.update(totals.breaks)
            entries: list[LedgerEntry] = store.ledger.entries(totals.tenant, totals.session)
            for e in entries:
                figures.compactions += e.compaction
                figures.summarizer_calls += e.kind == "summarizer"
                if e.kind == "request":
                    # changes_from: what this request added (the rest was counted before).
                    figures.changes.update(c.what for c in e.changes
                                           if c.at is None or c.at >= e.changes_from)
        return figures
    finally:
        store.close()


def cli_session(client: str, setting: str) -> Figures:
    binary = claude_binary(ROOT) if client == "claude" else codex_binary()
    if binary is None:
        return Figures(note=f"{client} CLI not installed (npm ci): skipped")
    model, prices = (CLAUDE_MODEL, PRICES["messages"]) if client == "claude" else \
        (CODEX_MODEL, PRICES["responses"])
    fake = FakeUpstream(prompt_cache=True)
    with tempfile.TemporaryDirectory() as tmp, serve_in_thread(fake) as upstream:
        config = session_config(Path(tmp) / "data", upstream.url, {
            "offload": SETTINGS[setting], "ledger": {"prices": {model: prices}}})
        run: Callable[..., FileSession] = \
            run_claude_session if client == "claude" else run_codex_session
        session = run(binary, config, fake, timeout_s=600)
        figures = from_ledger(config)
    if not session.finished:
        figures.note = f"the session did not finish (exit {session.returncode})"
    edits = [e for e in session.edits if session.plan[e.step].kind == "edit"]
    figures.edits = (f"{sum(e.landed for e in session.edits)}/{len(session.edits)} edits and "
                     "writes landed, "
                     f"{sum(e.refused for e in session.edits)} refused, "
                     f"{sum(e.forced_reread for e in edits)} forced re-reads, "
                     f"{sum(e.blind for e in edits)} blind")
    return figures


def scripted_session(fmt: str, setting: str, args: argparse.Namespace) -> Figures:
    """bench/ledger.py's session through a proxy with the offload switches of ``setting``."""
    model, responder = _model(fmt, args)
    fake = FakeUpstream(responder=responder, models=(MODEL,), prompt_cache=True)
    with tempfile.TemporaryDirectory() as tmp, serve_in_thread(fake) as upstream:
        config = session_messages.bench_config(
            upstream.url, tmp, args.window, ledger={"prices": {MODEL: PRICES[fmt]}},
            offload=SETTINGS[setting])
        with serve_in_thread(create_app(config), lifespan="on") as server:
            asyncio.run(_session(fmt, server.url, model))
            server.drain()
        return from_ledger(config)


def _pct(part: float, whole: float) -> str:
    return f"{part / whole * 100:.1f}%" if whole else "-"


def report(name: str, off: Figures, on: Figures) -> None:
    print(f"\n# {name}" + "".join(f"  [{k}: {f.note}]" for k, f in (("off", off), ("on", on))
                                  if f.note))
    if not off.requests and not on.requests:
        return
    print(f"{'':38}{'off':>16}{'on':>16}{'on / off':>10}")

    def row(label: str, a: float | int, b: float | int, fmt: str = ",.0f",
            ratio: bool = True) -> None:
        r = f"{b / a:.3f}" if ratio and a else ""
        print(f"{label:38}{a:>16{fmt}}{b:>16{fmt}}{r:>10}")

    def text(label: str, a: str, b: str) -> None:
        print(f"{label:38}{a:>16}{b:>16}")

    row("requests (billed calls)", off.requests, on.requests, ratio=False)
    row("tokens sent by the client", off.sent, on.sent)
    row("tokens forwarded", off.forwarded, on.forwarded)
    text("  % of sent", _pct(off.forwarded, off.sent), _pct(on.forwarded, on.sent))
    row("billed prompt, all", off.billed.prompt, on.billed.prompt)
    row("  cache read", off.billed.cache_read, on.billed.cache_read)
    row("  cache write", off.billed.cache_write, on.billed.cache_write)
    row("  uncached input", off.billed.input, on.billed.input)
    row("billed output", off.billed.output, on.billed.output)
    row("cost through ctxproxy, USD", off.cost, on.cost, ",.4f")
    row("counterfactual (direct), USD", off.direct_cost, on.direct_cost, ",.4f")
    text("saved vs the counterfactual", _pct(off.direct_cost - off.cost, off.direct_cost),
         _pct(on.direct_cost - on.cost, on.direct_cost))
    text("cache breaks by reason", _counts(off.breaks), _counts(on.breaks))
    row("compactions", off.compactions, on.compactions, ratio=False)
    row("summarizer calls", off.summarizer_calls, on.summarizer_calls, ratio=False)
    row("estimated (no provider usage)", off.estimated, on.estimated, ratio=False)
    kinds = sorted(set(off.changes) | set(on.changes))
    for kind in kinds:
        row(f"changes: {kind}", off.changes[kind], on.changes[kind], ratio=False)
    if off.edits or on.edits:
        print(f"edits, off: {off.edits}")
        print(f"edits, on:  {on.edits}")


def _counts(counter: collections.Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items())) or "none"


def fidelity() -> None:
    """bench/fidelity.py's replay, guard on, off vs on: the edit-quote row and what is kept."""
    logging.getLogger("proxy").setLevel(logging.ERROR)  # every fallback summary warns
    script = build_script()
    runs = {setting: asyncio.run(replay_all(script, modes=MODES, guards=(True,),
                                            offload=SETTINGS[setting]))
            for setting in SETTINGS}
    print(f"\n# fidelity (bench/fidelity.py: {len(script.steps)} steps, window 24,000, guard on):"
          " Edit quotes byte-exact in the request the edit answers; canaries kept (not lost)")
    print(f"{'format':10}{'summarizer':11}{'quotes off':>12}{'quotes on':>12}{'kept off':>10}"
          f"{'kept on':>10}{'compactions off/on':>20}")
    for off, on in zip(runs["off"], runs["on"], strict=True):
        print(f"{off.format:10}{off.mode:11}{_quotes(off):>12}{_quotes(on):>12}"
              f"{_kept(off):>10}{_kept(on):>10}{f'{off.compactions}/{on.compactions}':>20}")
    for setting, group in runs.items():
        present = sum(q.present for r in group for q in r.quotes)
        total = sum(len(r.quotes) for r in group)
        print(f"all, {setting}: edit quotes in the request {present}/{total}")


def _quotes(run: Run) -> str:
    return f"{sum(q.present for q in run.quotes)}/{len(run.quotes)}"


def _kept(run: Run) -> str:
    return _pct(sum(o.where != "lost" for o in run.outcomes), len(run.outcomes))


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--sessions", default=",".join(SESSIONS))
    ap.add_argument("--steps", type=int, default=64, help="the scripted sessions' tool calls")
    ap.add_argument("--window", type=int, default=128_000, help="the scripted sessions' window")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--no-fidelity", action="store_true")
    args = ap.parse_args(argv)
    chosen = [s for s in args.sessions.split(",") if s]
    if unknown := set(chosen) - set(SESSIONS):
        ap.error(f"unknown sessions: {', '.join(sorted(unknown))}")
    print("# file-aware slimming off vs on (issue 22); the fake caches prompts as providers "
          "do; figures from ctxproxy's ledger")
    for name in chosen:
        figures = {setting: cli_session(name, setting) if name in ("claude", "codex")
                   else scripted_session(name, setting, args) for setting in SETTINGS}
        title = {"claude": "Claude Code session (claude -p, real CLI)",
                 "codex": "Codex session (codex exec, real CLI)"}.get(
            name, f"scripted session, {name} ({args.steps} tool calls, window {args.window:,})")
        report(title, figures["off"], figures["on"])
    if not args.no_fidelity:
        fidelity()


if __name__ == "__main__":
    main()

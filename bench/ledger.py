"""What the session benchmark cost, from the ledger: sent vs forwarded vs billed, and the direct
counterfactual vs through ctxproxy (issue 21).

    python -m bench.ledger [--steps 64] [--window 128000] [--seed 7]
                           [--formats chat,responses,messages]

Plays the scripted coding-agent session of bench/cache_cost.py (bench/session.py's script; the
Messages form of bench/session_messages.py) once through a real ctxproxy and once straight at
the fake upstream, with the fake caching prompts as the providers do
(``FakeUpstream(prompt_cache=True)``, :mod:`proxy.demo.fake.prompt_cache`: Anthropic's explicit
markers with 5-minute writes, OpenAI's automatic 1,024-token prefixes read in 128-token steps)
and reporting that in each answer's ``usage``. Then it reads:

- **through ctxproxy**: the proxy's own ledger (the store under its data dir): every billed call
  (the client's requests, read-tool rounds, summarizer calls) with the usage the fake reported,
  and the ledger's counterfactual (what the client's own history would have cost directly,
  estimated under the same caching rules, :mod:`proxy.ledger.cache`);
- **direct, measured**: the usage the caching fake reported for the client's own requests sent
  straight to it (no proxy), priced the same way: the ground truth the counterfactual
  estimates.

Prices (``ledger.prices`` of the bench's proxy, USD per million tokens): chat and Responses at
OpenAI gpt-4.1's (input 2, cached 0.5, no write premium, output 8), Messages at Anthropic
Sonnet's (input 3, cache read 0.3, 5-minute write 3.75, output 15). The fake counts a token per
4 bytes of canonical JSON; the ledger counts with o200k_base and calibrates its counterfactual by
the provider's own count of each forwarded request.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import session_messages  # bench/session_messages.py: the Messages client and model
from cache_cost import FORMATS  # bench/cache_cost.py
from session import CONSTRAINTS  # bench/session.py

from proxy.app import create_app
from proxy.catalog.prices import Price
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.run import MODEL, ScriptedModel, drive, script
from proxy.demo.servers import serve_in_thread
from proxy.services import prices_of
from proxy.store.backend import open_backend
from proxy.store.ledger_entry import LedgerTotals
from proxy.usage import Usage

PRICES = {
    "chat": {"input": 2.0, "cache_read": 0.5, "output": 8.0},
    "responses": {"input": 2.0, "cache_read": 0.5, "output": 8.0},
    "messages": {"input": 3.0, "cache_read": 0.3, "cache_write": 3.75, "output": 15.0},
}


@dataclass
class Direct:
    """The client's own requests straight at the caching fake, as it billed them."""

    requests: int
    billed: Usage
    cost: float


def _model(fmt: str, args: argparse.Namespace) -> tuple[ScriptedModel, Any]:
    if fmt == "messages":
        both = session_messages.Model(args.steps, seed=args.seed)
        return both.messages, both
    model = ScriptedModel(script(args.seed, args.steps), summary_delay_s=0.0, model_delay_s=0.0,
                          text_every=4)
    return model, model


async def _session(fmt: str, url: str, model: ScriptedModel) -> int:
    if fmt == "messages":
        return len(await session_messages.drive_messages(url, model))
    return len(await drive(url, model, follow_ups=CONSTRAINTS, max_turns=500, wire=fmt))


def _output(rec: Any) -> int:
    """The output tokens the fake reported for a request (its estimate: 4 characters a token)."""
    reply = rec.reply
    if reply is None:
        return 0
    chars = len(reply.content or "") + len(reply.reasoning or "")
    for call in reply.tool_calls or ():
        fn = call.get("function", call)
        args = fn.get("arguments", fn.get("input", ""))
        chars += len(str(fn.get("name", ""))) + len(args if isinstance(args, str) else str(args))
    return max(1, chars // 4)


def through_proxy(fmt: str, args: argparse.Namespace) -> tuple[LedgerTotals, int]:
    model, responder = _model(fmt, args)
    fake = FakeUpstream(responder=responder, models=(MODEL,), prompt_cache=True)
    with tempfile.TemporaryDirectory() as tmp, serve_in_thread(fake) as upstream:
        config = session_messages.bench_config(
            upstream.url, tmp, args.window, ledger={"prices": {MODEL: PRICES[fmt]}})
        with serve_in_thread(create_app(config), lifespan="on") as server:
            turns = asyncio.run(_session(fmt, server.url, model))
            server.drain()
        store = open_backend(config.storage, digest_cache_bytes=1 << 20)
        try:
            assert store.ledger is not None
            [totals] = store.ledger.totals()
        finally:
            store.close()
    return totals, turns


def direct(fmt: str, args: argparse.Namespace, price: Price) -> Direct:
    model, responder = _model(fmt, args)
    fake = FakeUpstream(responder=responder, models=(MODEL,), prompt_cache=True)
    with serve_in_thread(fake) as upstream:
        asyncio.run(_session(fmt, upstream.url, model))
    billed = Usage()
    requests = 0
    for rec in fake.received:
        p = rec.prompt
        if p is None:
            continue
        requests += 1
        billed = billed + Usage(input=p.tokens - p.read - p.write, cache_read=p.read,
                                cache_write_5m=p.write_5m, cache_write_1h=p.write_1h,
                                output=_output(rec))
    return Direct(requests, billed, price.cost(billed))


def report(fmt: str, totals: LedgerTotals, turns: int, measured: Direct) -> None:
    b, d = totals.billed, totals.direct
    print(f"\n# {fmt}: {turns} client turns, {totals.requests} requests, {totals.calls} billed "
          f"calls through ctxproxy ({totals.calls - totals.requests} read rounds and summarizer "
          f"calls), {totals.estimated} estimated, {totals.unpriced} unpriced")
    print(f"{'':34}{'through ctxproxy':>18}{'direct (ledger)':>18}{'direct (measured)':>19}")

    def row(label: str, *cells: str) -> None:
        print(f"{label:34}" + "".join(f"{c:>18}" for c in cells))

    row("tokens sent by the client", f"{totals.tokens_sent:,}", "", "")
    row("tokens forwarded (proxy's count)", f"{totals.tokens_forwarded:,}", "", "")
    row("  % of sent", f"{totals.tokens_forwarded / max(1, totals.tokens_sent) * 100:.1f}%",
        "", "")
    row("billed input (uncached)", f"{b.input:,}", f"{d.input:,}", f"{measured.billed.input:,}")
    row("billed cache read", f"{b.cache_read:,}", f"{d.cache_read:,}",
        f"{measured.billed.cache_read:,}")
    row("billed cache write", f"{b.cache_write:,}", f"{d.cache_write:,}",
        f"{measured.billed.cache_write:,}")
    row("billed output", f"{b.output:,}", f"{d.output:,}", f"{measured.billed.output:,}")
    row("billed prompt, all", f"{b.prompt:,}", f"{d.prompt:,}", f"{measured.billed.prompt:,}")
    row("cost, USD", f"{totals.cost:.4f}", f"{totals.direct_cost:.4f}", f"{measured.cost:.4f}")
    row("cost / direct measured", f"{totals.cost / measured.cost:.3f}",
        f"{totals.direct_cost / measured.cost:.3f}", "1.000")
    saved = totals.direct_cost - totals.cost
    print(f"saved (ledger, net of read rounds and summarizer calls): {saved:.4f} USD "
          f"({saved / totals.direct_cost * 100:.1f}% of the counterfactual); against the "
          f"measured direct run: {measured.cost - totals.cost:.4f} USD "
          f"({(measured.cost - totals.cost) / measured.cost * 100:.1f}%)")
    breaks = ", ".join(f"{k} {v}" for k, v in sorted(totals.breaks.items())) or "none"
    print(f"cache breaks by reason: {breaks}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--window", type=int, default=128_000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    if unknown := set(formats) - set(FORMATS):
        sys.exit(f"unknown formats: {', '.join(sorted(unknown))}")
    print(f"# the scripted session: {args.steps} tool calls, window {args.window:,}, seed "
          f"{args.seed}; the fake caches prompts as providers do and reports it in usage")
    for fmt in formats:
        config = session_messages.bench_config("http://unused", "/tmp/unused", args.window,
                                               ledger={"prices": {MODEL: PRICES[fmt]}})
        price = prices_of(config.ledger).price(MODEL)
        assert price is not None
        totals, turns = through_proxy(fmt, args)
        report(fmt, totals, turns, direct(fmt, args, price))


if __name__ == "__main__":
    main()

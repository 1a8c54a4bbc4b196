"""What a session costs under prompt caching: this tree against a baseline commit, same run
(issue 19).

    python -m bench.cache_cost [--steps 64] [--window 128000] [--seed 7] [--baseline aa22c7b]
                               [--formats chat,responses,messages] [--json]

Plays the scripted coding-agent session of bench/session.py (chat completions, Responses) and
bench/session_messages.py (Anthropic Messages) through a real ctxproxy on loopback in front of
the fake upstream (model and summarizer), once per format, and prices every forwarded model
request as a provider with prompt caching would:

    T_i = input tokens of request i; P_i = tokens of the longest whole-unit common prefix of
          request i with the session's previous model request (units in the order the provider
          renders them: tools, system/instructions, then the conversation items; canonical JSON,
          cache_control markers stripped, since the provider's cache ignores them)
    cost_i = 0.1 * P_i + 1.25 * (T_i - P_i)        (the first request: 1.25 * T_1)
    summarizer call = 1.0 * input + 5.0 * output   (uncached; output is 5x the input price)

Prices are Anthropic's with the 5-minute TTL, relative to the base input price: cache read 0.1,
cache write 1.25. A cache breakpoint sits at the end of every request (Claude Code's moving
marker on the last block), so everything after the cached prefix is written; the turns are
back to back, well within the TTL, so the previous request's prefix is always still cached.
Output tokens of model calls are the same script whatever the proxy does and are left out.
Tokens are the units' canonical JSON counted with o200k_base through the project's own counter
(proxy.pipeline.tokens.TokenCounter.count_text).

"direct" is the counterfactual without a proxy: the client's own requests (its whole history
every turn, played against the fake upstream directly), priced the same way.

The baseline (``--baseline REF``, default aa22c7b: main before the epoch change) runs in a
temporary detached git worktree of REF, in a subprocess with that tree's ``proxy`` package
(cwd and PYTHONPATH) and this tree's bench modules (copied to a temp dir, so both sides are
measured by the same code); its figures come back as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
import session_messages  # bench/session_messages.py: the Messages client and model
from session import CONSTRAINTS, canonical_units, is_internal, stability  # bench/session.py

import proxy
from proxy.app import create_app
from proxy.compaction.message import SUMMARY_HEADING
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.run import MODEL, WIRES, ScriptedModel, drive, script
from proxy.demo.servers import serve_in_thread
from proxy.tokens.counter import TokenCounter

READ, WRITE, UNCACHED, OUTPUT = 0.1, 1.25, 1.0, 5.0
FORMULA = ("cost_i = 0.1 * P_i + 1.25 * (T_i - P_i) per model request (first: 1.25 * T_1); "
           "summarizer = 1.0 * input + 5.0 * output; relative to the base input price")
FORMATS = ("chat", "responses", "messages")
BENCH = Path(__file__).resolve().parent
# What this file imports from bench/ (copied next to it for the baseline run).
BENCH_MODULES = ("cache_cost.py", "session.py", "session_messages.py")


@dataclass
class Figures:
    """One session in one format, priced."""

    turns: int = 0
    requests: int = 0  # model requests (client turns plus read-tool rounds)
    tokens: int = 0  # sum of T_i
    cache_read: int = 0  # sum of P_i
    cache_write: int = 0  # sum of T_i - P_i
    breaks: int = 0  # requests that do not open with the whole previous one
    compactions: int = 0
    summarizer_calls: int = 0
    summarizer_in: int = 0
    summarizer_out: int = 0
    stability: float = 1.0
    per_request: list[tuple[int, int]] = field(default_factory=list)  # (T_i, P_i)
    # Each break: (request index, first differing unit, tokens of the previous request lost).
    break_at: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def model_cost(self) -> float:
        return READ * self.cache_read + WRITE * self.cache_write

    @property
    def summarizer_cost(self) -> float:
        return UNCACHED * self.summarizer_in + OUTPUT * self.summarizer_out

    @property
    def total(self) -> float:
        return self.model_cost + self.summarizer_cost


class Tokens:
    """o200k_base counts of canonical JSON units, each distinct unit tokenized once."""

    def __init__(self) -> None:
        self.counter = TokenCounter()
        self.encoding = self.counter.encoding_name("gpt-4o")
        self._memo: dict[bytes, int] = {}

    def unit(self, unit: bytes) -> int:
        n = self._memo.get(unit)
        if n is None:
            n = self._memo[unit] = self.counter.count_text(unit.decode(), "gpt-4o")
        return n

    def text(self, text: str) -> int:
        return self.counter.count_text(text, "gpt-4o")


def provider_units(fmt: str, body: dict[str, Any]) -> list[bytes]:
    """The request as the provider renders (and caches) it, in whole units."""
    if fmt == "messages":
        return session_messages.units(body)  # tools, system blocks, messages; markers stripped
    units = canonical_units(body)  # tools, then messages / input items
    if body.get("instructions") is not None:
        units.insert(1, orjson.dumps(body["instructions"], option=orjson.OPT_SORT_KEYS))
    return units


def is_summarizer(path: str, body: dict[str, Any]) -> bool:
    """A proxy's own call (summarizer, fold), which goes in the session's own format."""
    return is_internal(body)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def summary_in(body: dict[str, Any]) -> str | None:
    """The summary a model request carries, wherever the format puts it (a message, a
    developer item, or, before the epoch change, inside Messages' ``system``)."""
    for text in _strings({k: v for k, v in body.items() if k != "tools"}):
        at = text.find(SUMMARY_HEADING)
        if at >= 0:
            return text[at:]
    return None


def price(fmt: str, fake: FakeUpstream, start: int, tokens: Tokens, turns: int) -> Figures:
    fig = Figures(turns=turns)
    path = WIRES[fmt]().path if fmt != "messages" else "/v1/messages"
    previous: list[bytes] | None = None
    units_seen: list[list[bytes]] = []
    summaries: list[str | None] = []
    for rec in fake.received[start:]:
        body = rec.json()
        if is_summarizer(rec.path, body):
            fig.summarizer_calls += 1
            fig.summarizer_in += sum(tokens.unit(u) for u in provider_units(fmt, body))
            fig.summarizer_out += tokens.text(rec.reply.content or "") if rec.reply else 0
            continue
        if rec.path != path:
            continue
        units = provider_units(fmt, body)
        t = sum(tokens.unit(u) for u in units)
        p = k = 0
        if previous is not None:
            for a, b in zip(previous, units, strict=False):
                if a != b:
                    break
                p += tokens.unit(b)
                k += 1
            if units[:len(previous)] != previous:
                fig.breaks += 1
                lost = sum(tokens.unit(u) for u in previous) - p
                fig.break_at.append((fig.requests, k, lost))
        fig.requests += 1
        fig.tokens += t
        fig.cache_read += p
        fig.cache_write += t - p
        fig.per_request.append((t, p))
        units_seen.append(units)
        summaries.append(summary_in(body))
        previous = units
    fig.compactions = sum(1 for a, b in zip([None, *summaries], summaries, strict=False)
                          if b is not None and a != b)
    stab = [stability(a, b) for a, b in zip(units_seen, units_seen[1:], strict=False)]
    fig.stability = statistics.mean(stab) if stab else 1.0
    return fig


def play(fmt: str, args: argparse.Namespace, tokens: Tokens, *, direct: bool) -> Figures:
    """The session in ``fmt``, through a fresh proxy (or straight to the fake: ``direct``)."""
    if fmt == "messages":
        both = session_messages.Model(args.steps, seed=args.seed)
        model: ScriptedModel = both.messages
        responder: Any = both
    else:
        model = responder = ScriptedModel(script(args.seed, args.steps), summary_delay_s=0.0,
                                          model_delay_s=0.0, text_every=4)
    fake = FakeUpstream(responder=responder, models=(MODEL,))
    with tempfile.TemporaryDirectory() as tmp, serve_in_thread(fake) as upstream:
        config = session_messages.bench_config(
            upstream.url, tmp, args.window,
            **({"offload": {"age_policy": args.age_policy}} if args.age_policy else {}))

        async def session(url: str) -> int:
            if fmt == "messages":
                return len(await session_messages.drive_messages(url, model))
            return len(await drive(url, model, follow_ups=CONSTRAINTS, max_turns=500, wire=fmt))

        if direct:
            turns = asyncio.run(session(upstream.url))
        else:
            with serve_in_thread(create_app(config), lifespan="on") as server:
                turns = asyncio.run(session(server.url))
                server.drain()  # background preparations finish before the records are read
    return price(fmt, fake, 0, tokens, turns)


def measure(args: argparse.Namespace, formats: list[str], *, direct: bool) -> dict[str, Any]:
    tokens = Tokens()
    out: dict[str, Any] = {"proxy": proxy.__file__, "encoding": tokens.encoding, "formats": {}}
    for fmt in formats:
        entry = {"proxied": asdict(play(fmt, args, tokens, direct=False))}
        if direct:
            entry["direct"] = asdict(play(fmt, args, tokens, direct=True))
        out["formats"][fmt] = entry
    return out


def run_baseline(ref: str, argv: list[str]) -> dict[str, Any]:
    """This bench under a detached worktree of ``ref``, in a subprocess; its JSON figures."""
    repo = BENCH.parent
    tmp = Path(tempfile.mkdtemp(prefix="cache-cost-"))
    tree = tmp / "tree"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "--quiet", str(tree),
                    ref], check=True)
    try:
        bench = tmp / "bench"
        bench.mkdir()
        for name in BENCH_MODULES:
            shutil.copy(BENCH / name, bench / name)
        env = {**os.environ, "PYTHONPATH": str(tree)}
        done = subprocess.run([sys.executable, str(bench / "cache_cost.py"), *argv, "--json",
                               "--no-baseline", "--no-direct"], cwd=tree, env=env, check=True,
                              stdout=subprocess.PIPE)
        result: dict[str, Any] = json.loads(done.stdout)
        if not Path(result["proxy"]).resolve().is_relative_to(tree.resolve()):
            raise RuntimeError(f"the baseline imported {result['proxy']}, not {tree}'s proxy")
        return result
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
                       check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def head(repo: Path) -> str:
    """The last commit of this tree's ``proxy`` package (what is measured), +changes if edited."""
    done = subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%h", "--", "proxy"],
                          stdout=subprocess.PIPE, text=True, check=False)
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--", "proxy"],
                           stdout=subprocess.PIPE, text=True, check=False).stdout.strip()
    return done.stdout.strip() + ("+changes" if dirty else "")


def table(fmt: str, columns: list[tuple[str, Figures]], direct: Figures) -> None:
    names = [name for name, _ in columns] + ["direct"]
    figs = [f for _, f in columns] + [direct]
    width = max(14, *(len(n) + 2 for n in names))
    print(f"\n# {fmt}: {direct.turns} client turns")
    print(f"{'':28}" + "".join(f"{n:>{width}}" for n in names))

    def row(label: str, cells: list[str]) -> None:
        print(f"{label:28}" + "".join(f"{c:>{width}}" for c in cells))

    sent = direct.tokens
    row("model requests", [f"{f.requests:,}" for f in figs])
    row("tokens sent by the client", [f"{sent:,}" for _ in figs])
    row("tokens forwarded", [f"{f.tokens:,}" for f in figs])
    row("  % of sent", [f"{f.tokens / sent * 100:.1f}%" for f in figs])
    row("compactions", [str(f.compactions) for f in figs])
    row("summarizer calls", [str(f.summarizer_calls) for f in figs])
    row("prefix breaks", [str(f.breaks) for f in figs])
    row("cache-read tokens", [f"{f.cache_read:,}" for f in figs])
    row("cache-write tokens", [f"{f.cache_write:,}" for f in figs])
    row("model-call cost", [f"{f.model_cost:,.0f}" for f in figs])
    row("summarizer cost", [f"{f.summarizer_cost:,.0f}" for f in figs])
    row("total cost", [f"{f.total:,.0f}" for f in figs])
    row("total / direct", [f"{f.total / direct.total:.3f}" for f in figs])
    if len(columns) == 2:
        base, new = columns[0][1], columns[1][1]
        row("total / baseline", ["", f"{new.total / base.total:.3f}", ""])
    row("prefix stability (mean)", [f"{f.stability:.3f}" for f in figs])


def figures(raw: dict[str, Any]) -> Figures:
    raw = {**raw, "per_request": [tuple(p) for p in raw["per_request"]],
           "break_at": [tuple(b) for b in raw["break_at"]]}
    return Figures(**raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--steps", type=int, default=64, help="tool calls in the session")
    ap.add_argument("--window", type=int, default=128_000)
    ap.add_argument("--seed", type=int, default=7, help="the script's seed (tool output sizes)")
    ap.add_argument("--age-policy", choices=("batched", "eager"), default=None,
                    help="offload.age_policy for both trees (default: the config default)")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help="comma-separated, of: " + ", ".join(FORMATS))
    ap.add_argument("--baseline", default="aa22c7b", help="the git ref to compare against")
    ap.add_argument("--no-baseline", dest="with_baseline", action="store_false")
    ap.add_argument("--no-direct", dest="direct", action="store_false")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON only")
    ap.add_argument("--per-request", action="store_true",
                    help="also print T_i/P_i of every request and where each prefix broke")
    args = ap.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    if unknown := set(formats) - set(FORMATS):
        ap.error(f"unknown formats: {', '.join(sorted(unknown))}")
    here = measure(args, formats, direct=args.direct)
    if args.json:
        sys.stdout.write(json.dumps(here))
        return
    columns: list[tuple[str, dict[str, Any]]] = []
    if args.with_baseline:
        argv = ["--steps", str(args.steps), "--window", str(args.window), "--seed",
                str(args.seed), "--formats", ",".join(formats),
                *(["--age-policy", args.age_policy] if args.age_policy else [])]
        columns.append((f"base {args.baseline}", run_baseline(args.baseline, argv)))
    columns.append((f"this {head(BENCH.parent)}", here))
    print(f"# the scripted session of bench/session.py: {args.steps} tool calls (1-300 KB "
          f"outputs), window {args.window:,}, seed {args.seed}"
          f"{f', age_policy {args.age_policy}' if args.age_policy else ''}; tokens: canonical "
          f"JSON units, {here['encoding']}")
    print(f"# {FORMULA}")
    print("# cache read 0.1, write 1.25 (Anthropic, 5-minute TTL; turns back to back, within "
          "it); output tokens of model calls are the same script either way and left out")
    for fmt in formats:
        direct = figures(here["formats"][fmt]["direct"]) if args.direct else None
        cols = [(name, figures(res["formats"][fmt]["proxied"])) for name, res in columns]
        if direct is None:
            direct = cols[-1][1]
        table(fmt, cols, direct)
        if args.per_request:
            for name, f in cols:
                print(f"  {name} T/P: " + " ".join(f"{t // 1000}k/{p // 1000}k"
                                                  for t, p in f.per_request))
                print(f"  {name} breaks (request, first changed unit, tokens lost): " + ", ".join(
                    f"{i} u{k} {lost:,}" for i, k, lost in f.break_at))


if __name__ == "__main__":
    main()

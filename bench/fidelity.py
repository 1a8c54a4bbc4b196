"""What an agent still knows after ctxproxy slims its context (issue 20).

    python -m bench.fidelity [--guard on|off|both] [--mode fallback|weak|both]
                             [--format chat|responses|messages|all] [--window 24000]
                             [--scale 2] [--fillers 3] [--checkpoints]

A long synthetic coding-agent session with typed canaries (harness/fidelity.py: the goal,
constraints, a preference, requests, a to-do, a path, an identifier, a number, an error and its
fix, a decision and its reason, a file created then deleted, files edited after they were read)
is replayed in the three wire formats through the real app in process, in front of the fake
upstream, with a window small enough for many compactions, in two summarizer modes: ``fallback``
(every summarizer call fails: the proxy's deterministic summary) and ``weak`` (a scripted
summarizer that returns the required sections but drops half of what it is given). For every
canary after every compaction it reports where the canary is: verbatim in the forwarded context,
in the summary, reachable by one read call, or lost; per kind, per format; and the share of
``Edit`` quotes (``old_string``) present byte-exact in the request the edit answers.

``--guard on`` sets ``compaction.guard.enabled`` (pinned goal, constraints and file-state ledgers
carried into every summary); a tree whose config has no such key replays the same proxy for
both settings and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import sys

from harness.fidelity import (
    FORMATS,
    GUARDED,
    KINDS,
    MODES,
    OUTCOMES,
    Run,
    build_script,
    guard_supported,
    replay_all,
)

SHORT = {"context": "ctx", "summary": "sum", "reachable": "read", "lost": "lost"}


def table(runs: list[Run], *, final_only: bool) -> None:
    """Per kind x per format: the four outcomes as percentages of (canary, checkpoint) pairs."""
    fmts = sorted({r.format for r in runs}, key=FORMATS.index)
    print(f"{'kind':13}" + "".join(f" | {f:^23}" for f in fmts))
    print(f"{'':13}" + " | ctx  sum read lost   n" * len(fmts))
    for kind in [*KINDS, "ALL"]:
        row = f"{kind + ('*' if kind in GUARDED else ''):13}"
        for f in fmts:
            counts = collections.Counter(
                o.where for r in runs if r.format == f for o in r.outcomes
                if (kind == "ALL" or o.canary.kind == kind) and (o.final or not final_only))
            n = sum(counts.values())
            row += " | " + (" ".join(f"{counts[w] * 100 // n:3d}%" if n else "   -"
                                     for w in OUTCOMES) + f" {n:3d}")
        print(row)


def kept(runs: list[Run], fmt: str, kind: str) -> str:
    """Share of checks (every checkpoint) where the canary was not lost, and at the end."""
    every = [o for r in runs if r.format == fmt for o in r.outcomes
             if kind == "ALL" or o.canary.kind == kind]
    end = [o for o in every if o.final]
    if not every:
        return "      -"
    k = sum(o.where != "lost" for o in every) * 100 // len(every)
    e = sum(o.where != "lost" for o in end) * 100 // len(end)
    return f"{k:3d}/{e:3d}"


def before_after(runs: list[Run]) -> None:
    """Kept (not lost) per kind x format x mode, guard off vs on."""
    fmts = sorted({r.format for r in runs}, key=FORMATS.index)
    modes = [m for m in MODES if any(r.mode == m for r in runs)]
    guards = sorted({r.guard for r in runs})
    cols = [(f, m) for f in fmts for m in modes]
    labels = [f"{f[:4]} {m}" for f, m in cols]
    width = max(len(max(labels, key=len)), 8 * len(guards) + len(guards) - 1)
    print(f"{'kind':13}" + "".join(f" | {label:^{width}}" for label in labels))
    sub = " ".join(f"{'on' if g else 'off':>8}" for g in guards)
    print(f"{'':13}" + f" | {sub:>{width}}" * len(cols))
    for kind in [*KINDS, "ALL"]:
        row = f"{kind + ('*' if kind in GUARDED else ''):13}"
        for f, m in cols:
            cells = " ".join(
                f"{kept([r for r in runs if r.mode == m and r.guard == g], f, kind):>8}"
                for g in guards)
            row += f" | {cells:>{width}}"
        print(row)


def summary_line(run: Run) -> str:
    counts = collections.Counter(o.where for o in run.outcomes)
    final = collections.Counter(o.where for o in run.outcomes if o.final)
    n, nf = sum(counts.values()), sum(final.values())
    guarded_lost = sum(1 for o in run.outcomes if o.canary.kind in GUARDED and o.where == "lost")
    quotes = sum(q.present for q in run.quotes)
    why = collections.Counter(q.why for q in run.quotes if not q.present)
    misses = f" ({', '.join(f'{v} {k}' for k, v in sorted(why.items()))})" if why else ""
    return (f"{run.format:9} {run.mode:8} guard {'on ' if run.guard else 'off'}: "
            f"{run.compactions} compactions, {run.summarizer_calls} summarizer calls; kept "
            f"(ctx+sum+read) {(n - counts['lost']) * 100 / n:5.1f}% of {n} checks, at the end "
            f"{(nf - final['lost']) * 100 / nf:5.1f}% of {nf}; guarded kinds lost {guarded_lost}; "
            f"edit quotes in the request {quotes}/{len(run.quotes)}{misses}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--guard", choices=("on", "off", "both"), default="both")
    ap.add_argument("--mode", choices=(*MODES, "both"), default="both")
    ap.add_argument("--format", choices=(*FORMATS, "all"), default="all")
    ap.add_argument("--window", type=int, default=24_000, help="context window (tokens)")
    ap.add_argument("--scale", type=int, default=2, help="file-read size factor (2: 4-30 KB)")
    ap.add_argument("--fillers", type=int, default=3, help="ordinary steps between plants")
    ap.add_argument("--checkpoints", action="store_true",
                    help="also print every canary's outcome at every checkpoint")
    args = ap.parse_args()
    # Every fallback summary logs a warning: expected here, and it would bury the tables.
    logging.getLogger("proxy").setLevel(logging.ERROR)
    if args.guard != "off" and not guard_supported():
        print("# NOTE: this tree's config has no compaction.guard: 'guard on' replays the same "
              "proxy as 'guard off' (the figures are equal by construction)")
    script = build_script(scale=args.scale, fillers=args.fillers)
    runs = asyncio.run(replay_all(
        script, formats=FORMATS if args.format == "all" else (args.format,),
        modes=MODES if args.mode == "both" else (args.mode,),
        guards={"on": (True,), "off": (False,), "both": (False, True)}[args.guard],
        window=args.window))
    print(f"# {len(script.steps)} steps, {len(script.canaries)} canaries, window "
          f"{args.window:,} tokens; a check = one canary at one checkpoint (after each "
          "compaction, and the last request); * = a kind the guard carries")
    print("# ctx: verbatim in the forwarded context; sum: in the summary; read: one read call "
          "returns it; lost: none of these")
    by: dict[tuple[str, bool], list[Run]] = collections.defaultdict(list)
    for r in runs:
        by[(r.mode, r.guard)].append(r)
    for (mode, guard), group in by.items():
        for final in (False, True):
            print(f"\n## summarizer {mode}, guard {'on' if guard else 'off'}"
                  f"{'' if guard_supported() else ' (= on: no guard in this tree)'}: "
                  f"{'the last request only' if final else 'every checkpoint'}")
            table(group, final_only=final)
    print("\n## kept (not lost): % of checks at every checkpoint / % at the last request, "
          f"guard {'off vs on' if len({r.guard for r in runs}) > 1 else 'off only'}")
    before_after(runs)
    print()
    for r in runs:
        print(summary_line(r))
    if args.checkpoints:
        for r in runs:
            print(f"\n# {r.format} {r.mode} guard {r.guard}")
            for o in r.outcomes:
                print(f"  turn {o.turn:3} c{o.compaction} {o.canary.kind:12} "
                      f"{SHORT[o.where]:4} {o.canary.text[:60]}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

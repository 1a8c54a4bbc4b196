"""Hostile requests in volume, per wire format: how many the proxy refuses, how many it breaks
on (must be 0), and what a request costs it.

    python -m bench.fuzz [--cases 10240] [--seed 4] [--formats chat,responses,messages,chat-bytes]

The proxy runs in process (its lifespan and an httpx client calling it directly, as
``tests/test_fuzz.py`` runs it) in front of a non-recording fake upstream that plays the
hostile read-tool model (:func:`proxy.testing.fuzz.responder`), with a 3,000-token ``tiny``
model so compaction runs too. Each format gets ``--cases`` mutated realistic bodies
(:class:`proxy.testing.fuzz.Mutator`: Claude Code's and Codex's recorded requests, a chat
conversation of the same calls); ``chat-bytes`` is the chat byte generator
(:class:`proxy.testing.fuzz.Gen`, the bodies of the chat stress run). Requests go one at a
time, so the latency is the proxy's own plus the fake's, unqueued.

Prints per format: cases, 2xx, 4xx, 5xx (all proxy-made: the fake never answers one), errors
outside the route's envelope, unterminated streams, errors the proxy logged, and the latency's
p50 / p99 / max in ms (refused and answered cases apart, and all together), then the worst
cases' indices (rerun one with ``Mutator(seed * 1_000_003 + i, seeds(fmt)).body()``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from harness.fuzz import FORMATS, MAX_BODY_MB, TINY, Case, Crashes, Gen, cases, judge, responder
from harness.inprocess import InProcess
from proxy.app import create_app
from proxy.config import config_from_mapping
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import serve_in_thread


@dataclass
class Tally:
    statuses: Counter[int] = field(default_factory=Counter)
    envelope: int = 0
    unterminated: int = 0
    logged: int = 0
    refused_ms: list[float] = field(default_factory=list)
    answered_ms: list[float] = field(default_factory=list)
    worst: list[tuple[float, int, int]] = field(default_factory=list)  # ms, case, status
    failures: list[str] = field(default_factory=list)

    def of(self, low: int, high: int) -> int:
        return sum(n for s, n in self.statuses.items() if low <= s < high)


def byte_cases(count: int, seed: int) -> Iterator[Case]:
    """The chat byte generator's cases (the chat stress run's bodies)."""
    for i in range(count):
        yield Case(i, Gen(seed * 1_000_003 + i).body())


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_format(app: InProcess, crashes: Crashes, fmt: str, count: int, seed: int) -> Tally:
    tally = Tally()
    judged = "chat" if fmt == "chat-bytes" else fmt
    path = FORMATS[judged]
    source = byte_cases(count, seed) if fmt == "chat-bytes" else cases(fmt, count, seed)
    for case in source:
        logged = len(crashes.records)
        started = time.perf_counter()
        r = await app.client.post(path, content=case.raw,
                                  headers={"content-type": "application/json"})
        ms = (time.perf_counter() - started) * 1000
        tally.statuses[r.status_code] += 1
        (tally.refused_ms if 400 <= r.status_code < 500 else tally.answered_ms).append(ms)
        tally.worst.append((ms, case.index, r.status_code))
        verdict = judge(judged, r.status_code, r.headers.get("content-type", ""), r.content,
                        case.stream)
        tally.envelope += verdict.envelope
        tally.unterminated += verdict.unterminated
        if len(crashes.records) > logged:
            tally.logged += len(crashes.records) - logged
            tally.failures.append(f"#{case.index}: {crashes.records[logged]}")
        if verdict.proxy_5xx:
            tally.failures.append(f"#{case.index}: {r.status_code} {r.content[:160]!r}")
    await app.drain()
    tally.worst = sorted(tally.worst, reverse=True)[:5]
    return tally


def report(fmt: str, tally: Tally, seconds: float) -> str:
    every = tally.refused_ms + tally.answered_ms

    def figures(values: list[float]) -> str:
        return (f"p50 {percentile(values, 0.5):6.2f}  p99 {percentile(values, 0.99):7.2f}  "
                f"max {max(values, default=0.0):7.1f}")

    lines = [
        f"{fmt:<10} cases {sum(tally.statuses.values()):>6}  2xx {tally.of(200, 300):>6}  "
        f"4xx {tally.of(400, 500):>6}  5xx {tally.of(500, 600):>3}  envelope {tally.envelope}  "
        f"unterminated {tally.unterminated}  logged {tally.logged}  ({seconds:.1f} s, "
        f"{statistics.fmean(every) if every else 0.0:.2f} ms mean)",
        f"{'':<10} all      {figures(every)}",
        f"{'':<10} refused  {figures(tally.refused_ms)}",
        f"{'':<10} answered {figures(tally.answered_ms)}",
        f"{'':<10} slowest  " + ", ".join(f"#{i} {s} {ms:.0f} ms" for ms, i, s in tally.worst),
    ]
    lines += [f"{'':<10} ! {failure}" for failure in tally.failures[:5]]
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> int:
    fake = FakeUpstream(responder=responder, record=False)
    crashes = Crashes()
    loggers = [logging.getLogger(n) for n in ("proxy", "asyncio")]
    for logger in loggers:
        logger.addHandler(crashes)
    broken = 0
    with serve_in_thread(fake) as upstream, tempfile.TemporaryDirectory() as tmp:
        config = config_from_mapping({
            "upstream": {"base_url": upstream.url + "/v1", "timeout_s": 30},
            "anthropic": {"base_url": upstream.url}, "storage": {"data_dir": str(Path(tmp))},
            "server": {"max_body_mb": MAX_BODY_MB},
            "compaction": {"context_windows": {TINY: 3000}},
        })
        async with InProcess(create_app(config)) as app:
            for fmt in args.formats.split(","):
                started = time.monotonic()
                tally = await run_format(app, crashes, fmt, args.cases, args.seed)
                print(report(fmt, tally, time.monotonic() - started), flush=True)
                broken += tally.of(500, 600) + tally.envelope + tally.unterminated + tally.logged
            alive = (await app.client.get("/healthz")).status_code == 200
    print(f"proxy alive afterwards: {alive}")
    return 0 if broken == 0 and alive else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=10_240, help="cases per format")
    parser.add_argument("--seed", type=int, default=4)
    parser.add_argument("--formats", default="chat,responses,messages,chat-bytes")
    # The proxy's errors are counted (and the first ones printed), not logged to the terminal.
    raise SystemExit(asyncio.run(main(parser.parse_args())))

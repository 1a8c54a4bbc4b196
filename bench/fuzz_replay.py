"""The seeded fuzz corpus replayed: pipeline time per request and the process's memory.

    python -m bench.fuzz_replay [--count 10000] [--seed 7] [--http] [--cache-mb 512]
                                [--slowest 20] [--only 123,456] [--every 1000]

Drives the proxy with ``tests/test_fuzz.py``'s seeded byte generator (``Gen``, the bodies
and headers of its ``stress`` run, request ``i`` of seed ``s`` from ``Gen(s * 1_000_003 +
i)``), in process (the app's lifespan in this loop, an httpx client calling it directly) or,
with ``--http``, over loopback to uvicorn in a thread. The upstream is the fuzz run's fake
(``hostile_responder``), the config the fuzz rig's (a 3,000-token ``tiny`` model so
compaction runs too). Sequential, one request at a time: the pipeline time is then the
request's own work.

Per request it records ``pipeline_ms`` (what the access log prints, read from its record) and
the body's size; it prints p50/p99/max of the pipeline time for bodies under 1 MiB and for all
of them, the slowest requests (index, body size, ms: replay one with ``--only``), the
pipeline budget's degradations (``ctxproxy_pipeline_degraded_total``), and the resident set
(current and high-water, from /proc) every ``--every`` requests against the configured cache
sizes (``server.cache_mb``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.fuzz import MAX_BODY_MB, Gen, hostile_responder
from harness.inprocess import InProcess
from proxy.app import create_app
from proxy.config import Config, config_from_mapping
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import serve_in_thread

ROOT = Path(__file__).resolve().parent.parent

MB = 1024 * 1024


@dataclass
class Timings(logging.Handler):
    """The access log's ``pipeline_ms`` of each request, in order."""

    values: list[float | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        logging.Handler.__init__(self, logging.INFO)

    def __hash__(self) -> int:
        return id(self)

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 5 and str(record.msg).startswith("%s %s %d"):
            value = args[4]
            self.values.append(None if value == "-" else float(str(value)))


def rss_mb() -> tuple[float, float]:
    """(resident now, high-water) of this process, in MiB."""
    now = peak = 0.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            now = int(line.split()[1]) / 1024
        elif line.startswith("VmHWM:"):
            peak = int(line.split()[1]) / 1024
    return now, peak


def config(upstream: str, data: Path, cache_mb: int, budget: int | None) -> Config:
    server: dict[str, Any] = {"max_body_mb": MAX_BODY_MB, "cache_mb": cache_mb}
    if budget is not None:
        server["pipeline_budget"] = budget  # (a tree from before the budget refuses the key)
    return config_from_mapping({
        "upstream": {"base_url": upstream + "/v1", "timeout_s": 30},
        "anthropic": {"base_url": upstream},
        "storage": {"data_dir": str(data)},
        "server": server,
        "compaction": {"context_windows": {"tiny": 3000}},
    })


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def replay(args: argparse.Namespace) -> None:
    timings = Timings()
    access = logging.getLogger("proxy.server.access")
    access.setLevel(logging.INFO)
    access.addHandler(timings)
    access.propagate = False
    logging.getLogger("proxy").setLevel(logging.CRITICAL)  # the fuzz's own warnings: noise here
    indices = ([int(x) for x in args.only.split(",")] if args.only
               else list(range(args.start, args.start + args.count)))
    fake = FakeUpstream(responder=hostile_responder, record=False)
    sizes: list[int] = []
    values: list[float | None] = []
    print(f"cache_mb={args.cache_mb} (configured caches: {cache_total(args.cache_mb):.0f} MiB)"
          f" seed={args.seed} requests={len(indices)} mode={'http' if args.http else 'inproc'}",
          flush=True)
    started = time.perf_counter()
    with serve_in_thread(fake) as upstream, tempfile.TemporaryDirectory() as tmp:
        app = create_app(config(upstream.url, Path(tmp) / "data", args.cache_mb, args.budget))
        if args.http:
            server = serve_in_thread(app, lifespan="on")
            srv = server.__enter__()
            client = httpx.AsyncClient(base_url=srv.url, timeout=120)
            runner: Any = None
        else:
            runner = InProcess(app)
            await runner.start()
            client = runner.client
        try:
            todo = iter(enumerate(indices))
            done = [0]
            results: dict[int, tuple[int, float | None]] = {}

            async def worker() -> None:
                for n, i in todo:
                    gen = Gen(args.seed * 1_000_003 + i)
                    body = gen.body()
                    headers = gen.headers()
                    path = "/v1/chat/completions" if gen.chance(0.9) else "/chat/completions"
                    logged = len(timings.values)
                    try:
                        r = await client.post(path, content=body, headers=headers, timeout=120)
                        ms: Any = r.headers.get("x-ctxproxy-pipeline-ms")
                        if ms is None and args.concurrency == 1 and len(timings.values) > logged:
                            ms = timings.values[-1]  # a tree without the header: its access log
                        results[n] = (len(body), float(ms) if ms is not None else None)
                    except httpx.HTTPError as exc:
                        print(f"#{i} {type(exc).__name__}: {exc}", flush=True)
                        results[n] = (len(body), None)
                    done[0] += 1
                    if done[0] % args.every == 0 or done[0] == len(indices):
                        now, peak = rss_mb()
                        print(f"  after {done[0]:>6} requests: rss={now:.0f} MiB "
                              f"high-water={peak:.0f} MiB ({time.perf_counter() - started:.0f} s)",
                              flush=True)

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            for n in range(len(indices)):
                size, ms = results[n]
                sizes.append(size)
                values.append(ms)
            if runner is not None:
                await runner.drain()
                account(runner.state["services"])
        finally:
            if runner is not None:
                await runner.stop()
            else:
                await client.aclose()
                server.__exit__(None, None, None)
    access.removeHandler(timings)
    summarize(indices, sizes, values, args)


def account(svc: Any) -> None:
    """What the bounded caches hold now, by their own measure (bytes or characters pinned),
    against their bounds."""
    off = svc.pipeline.offloader
    rows = [
        ("token counts (chars)", svc.pipeline.counter._texts),
        ("cuts", off._cache),
        ("file-aware decisions", off.filewise._epochs),
        ("superseded marks", off.filewise._marks),
        ("parsed calls", off.filewise.calls._parsed),
        ("policies matched", off.policies._calls),
        ("quote working sets", off._working),
        ("read rounds", svc.replays._known),
    ]
    dialog = getattr(svc.store, "dialog", None)
    if dialog is not None and getattr(dialog, "digest_cache", None) is not None:
        rows.append(("message digests", dialog.digest_cache._data))
    records = getattr(svc.compactor, "_records", None)
    if records is not None:
        rows.append(("summaries", records))
    total = 0
    print("caches (held / bound, MiB):")
    for name, cache in rows:
        total += cache.size
        print(f"  {name:<22} {cache.size / MB:8.1f} / {cache._maxsize / MB:8.1f}"
              f"  ({len(cache)} entries)")
    print(f"  {'together':<22} {total / MB:8.1f}")


def cache_total(cache_mb: int) -> float:
    """What :func:`proxy.services.open_services` gives the caches of ``cache_mb`` together."""
    try:
        from proxy.services import cache_split
    except ImportError:  # a tree from before cache_split: its caches took 105% of cache_mb
        return cache_mb * 1.05
    return sum(cache_split(cache_mb * MB).values()) / MB


def summarize(indices: list[int], sizes: list[int], values: list[float | None],
              args: argparse.Namespace) -> None:
    rows = [(i, s, v) for i, s, v in zip(indices, sizes, values, strict=False) if v is not None]
    small = [v for _, s, v in rows if s < MB]
    every = [v for _, _, v in rows]
    for name, vs in (("bodies < 1 MiB", small), ("all bodies", every)):
        if vs:
            print(f"pipeline_ms {name:<15} n={len(vs):>6} p50={pct(vs, 0.5):8.2f} "
                  f"p99={pct(vs, 0.99):8.2f} max={max(vs):9.2f} mean={statistics.mean(vs):7.2f}")
    print(f"slowest {args.slowest}:")
    for i, s, v in sorted(rows, key=lambda r: -r[2])[: args.slowest]:
        print(f"  #{i:<6} body={s:>9} bytes pipeline_ms={v:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--only", default="", help="comma-separated request indices")
    parser.add_argument("--http", action="store_true")
    parser.add_argument("--cache-mb", type=int, default=512)
    parser.add_argument("--budget", type=int, default=None,
                        help="server.pipeline_budget (work units); default: the config's")
    parser.add_argument("--slowest", type=int, default=20)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests in flight at once (the stress run: 4)")
    asyncio.run(replay(parser.parse_args()))


if __name__ == "__main__":
    main()

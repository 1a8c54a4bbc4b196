"""Which PostgreSQL driver for the shared store (issue 15): psycopg 3 (sync pool, called from
worker threads as every store method is) vs asyncpg (its own pool, on the event loop).

    python -m bench.pg_driver [--ops 3000] [--concurrency 16]

Starts a throwaway server (harness.postgres), then runs the two calls a request makes most
(a summary lookup by primary key, an idempotent insert of an original) through each driver,
``--concurrency`` callers at once on one event loop, interleaved over 3 rounds. Reports ops/s
and p50/p99 per op, and the process CPU per op.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import asyncpg

from harness.postgres import PostgresServer
from proxy.store.postgres import PgPool, upgrade

LOOKUP = "SELECT text FROM summaries WHERE tenant = $1 AND session = $2 AND chain = $3"
INSERT = ("INSERT INTO originals (tenant, session, rid, content, size) VALUES ($1, $2, $3, $4, $5) "
          "ON CONFLICT DO NOTHING")
PAYLOAD = b"x" * 4096


async def run(op: Callable[[int], Awaitable[None]], n: int, conc: int) -> tuple[float, list[float]]:
    lat: list[float] = []
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            t = time.perf_counter()
            await op(i)
            lat.append((time.perf_counter() - t) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return time.perf_counter() - t0, lat


def pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    with PostgresServer() as server:
        url = server.create_database("drivers")
        pool = PgPool(url, max_size=args.concurrency)
        pool.open()
        with pool.connection() as conn:
            upgrade(conn)
        apool = await asyncpg.create_pool(url, min_size=1, max_size=args.concurrency)

        def ps_lookup(i: int) -> None:
            with pool.connection() as conn:
                conn.execute(LOOKUP.replace("$1", "%s").replace("$2", "%s").replace("$3", "%s"),
                             ("t", "s", f"{i:032x}")).fetchone()

        def ps_insert(i: int) -> None:
            with pool.connection() as conn:
                conn.execute(INSERT.replace("$1", "%s").replace("$2", "%s").replace("$3", "%s")
                             .replace("$4", "%s").replace("$5", "%s"),
                             ("t", "p", f"{i:08d}", PAYLOAD, len(PAYLOAD)))

        async def psycopg_op(i: int) -> None:
            await asyncio.to_thread(ps_lookup if i % 2 else ps_insert, i)

        async def asyncpg_op(i: int) -> None:
            async with apool.acquire() as conn:
                if i % 2:
                    await conn.fetchrow(LOOKUP, "t", "s", f"{i:032x}")
                else:
                    await conn.execute(INSERT, "t", "a", f"{i:08d}", PAYLOAD, len(PAYLOAD))

        results: dict[str, list[tuple[float, list[float], float]]] = {"psycopg": [], "asyncpg": []}
        for _ in range(3):
            for name, op in (("psycopg", psycopg_op), ("asyncpg", asyncpg_op)):
                cpu = time.process_time()
                took, lat = await run(op, args.ops, args.concurrency)
                results[name].append((took, lat, time.process_time() - cpu))
        await apool.close()
        pool.close()
    print(f"{'driver':8} {'ops/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'CPU us/op':>9}  "
          f"({args.ops} ops x 3 rounds, {args.concurrency} callers, medians)")
    for name, runs in results.items():
        rate = statistics.median(args.ops / t for t, _, _ in runs)
        p50 = statistics.median(pct(lat, 0.5) for _, lat, _ in runs)
        p99 = statistics.median(pct(lat, 0.99) for _, lat, _ in runs)
        cpu = statistics.median(c / args.ops * 1e6 for _, _, c in runs)
        print(f"{name:8} {rate:8.0f} {p50:7.2f} {p99:7.2f} {cpu:9.0f}")


if __name__ == "__main__":
    asyncio.run(main())

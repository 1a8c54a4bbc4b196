"""Scaling out (issue 15): replicas behind haproxy on one PostgreSQL, and the backend's costs.

    python -m bench.scale_out [--seconds 5] [--rounds 2] [--sessions 8]

Starts a throwaway PostgreSQL (harness.postgres), the fake upstream (its own process,
bench/replay_upstream.py, answering as harness.replay's model), three ``ctxproxy serve`` processes sharing one
database and three haproxy instances in front of 1, 2 and 3 of them (the config the tests use,
harness.cluster). Reports, each configuration interleaved within every round:

1. throughput through the balancer with 1, 2 and 3 replicas, as ratios to 1 replica: small
   requests (wrk, 32 connections, a resent two-message chat) and the
   session replay (``--sessions`` concurrent agents, fresh sessions per run); plus CPU
   milliseconds per request of the replicas and of PostgreSQL (from /proc);
2. pipeline p50/p99 (the proxy's own ``pipeline_ms``) and client-side latency p50/p99 of one
   replica on PostgreSQL vs one on the files + SQLite default, same replay, same machine;
3. a cold replica (never saw the session) serving the next turn of a ~100k-token history vs the
   warm replica that served the turn before (median of 5 sessions, order alternated).

Everything shares the machine's cores (2 here): the ratios say how much a second and third
replica buy on this box, not on a real deployment with a core per replica.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import yaml
from overhead import wrk  # bench/overhead.py: runs wrk, parses its figures

from harness.cluster import Haproxy
from harness.postgres import PostgresServer
from harness.process import ProxyProcess
from harness.replay import MODEL, RECENT_MAX, WINDOW, Agent
from proxy.demo.run import SYSTEM, TASK, TOOLS, script

TICK = os.sysconf("SC_CLK_TCK")


def cpu_ms(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total * 1000 / TICK


def postgres_pids() -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() == "postgres":
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def config(tmp: Path, name: str, fake_url: str, url: str | None, window: int = WINDOW,
           recent: int = RECENT_MAX) -> Path:
    storage: dict[str, Any] = {"data_dir": str(tmp / f"{name}-data")}
    if url is not None:
        storage["url"] = url
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "upstream": {"base_url": fake_url},
        "storage": storage,
        "offload": {"recent_max_bytes": recent, "markdown_max_bytes": recent},
        "compaction": {"context_windows": {MODEL: window}},
    }))
    return path


SMALL_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["x-session-id"] = "small"
wrk.body = [[%s]]
"""


def small_wrk(url: str, seconds: float, tmp: Path, conns: int = 32) -> int:
    """Requests wrk completed (1 thread, ``conns`` connections): a load generator that does not
    compete for the interpreter (the Python one below tops out near 600 req/s here)."""
    script = tmp / "small.lua"
    body = orjson.dumps({"model": MODEL, "messages": [
        {"role": "system", "content": "bench"}, {"role": "user", "content": "hi"}]}).decode()
    script.write_text(SMALL_LUA % body)
    stats = wrk(url + "/v1/chat/completions", script, int(seconds), conns)
    return int(stats["rps"] * int(seconds))


async def small_load(url: str, seconds: float, conns: int = 32) -> int:
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(k: int) -> None:
        nonlocal done
        body = orjson.dumps({"model": MODEL, "messages": [
            {"role": "system", "content": "bench"}, {"role": "user", "content": f"hi {k}"}]})
        headers = {"x-session-id": f"small-{k}-{random.randrange(10**9)}",
                   "content-type": "application/json"}
        async with aiohttp.ClientSession() as http:
            while time.perf_counter() < stop:
                async with http.post(url + "/v1/chat/completions", data=body,
                                     headers=headers) as r:
                    await r.read()
                    if r.status == 200:
                        done += 1

    await asyncio.gather(*(worker(k) for k in range(conns)))
    return done


def replay_load(url: str, sessions: int, tag: str) -> int:
    """Requests made by ``sessions`` concurrent replayed agents (fresh sessions)."""
    agents = [Agent(f"{tag}{k:03d}"[-7:]) for k in range(sessions)]
    with ThreadPoolExecutor(sessions) as pool:
        for f in [pool.submit(a.run, url) for a in agents]:
            f.result()
    return sum(len(a.answers) for a in agents)


def throughput(args: argparse.Namespace, fake_url: str, tmp: Path, url: str) -> None:
    cfgs = [config(tmp, f"r{i}", fake_url, url) for i in range(3)]
    replicas = [ProxyProcess(c, log_path=tmp / f"r{i}.log") for i, c in enumerate(cfgs)]
    balancers: list[Haproxy] = []
    try:
        for r in replicas:
            r.start(60)
        for n in (1, 2, 3):
            d = tmp / f"lb{n}"
            d.mkdir()
            b = Haproxy(d, [(r.host, r.port) for r in replicas[:n]])
            b.start()
            balancers.append(b)
        pids = [r.pid for r in replicas if r.pid is not None]
        small: dict[int, list[tuple[float, float, float]]] = {1: [], 2: [], 3: []}
        replay: dict[int, list[tuple[float, float, float]]] = {1: [], 2: [], 3: []}
        for rnd in range(args.rounds):
            for n, b in zip((1, 2, 3), balancers, strict=True):
                c0, p0, t0 = cpu_ms(pids), cpu_ms(postgres_pids()), time.perf_counter()
                if shutil.which("wrk"):
                    count = small_wrk(b.url, args.seconds, tmp)
                else:
                    count = asyncio.run(small_load(b.url, args.seconds))
                took = time.perf_counter() - t0
                small[n].append((count / took, (cpu_ms(pids) - c0) / count,
                                 (cpu_ms(postgres_pids()) - p0) / count))
                c0, p0, t0 = cpu_ms(pids), cpu_ms(postgres_pids()), time.perf_counter()
                count = replay_load(b.url, args.sessions, f"t{rnd}{n}")
                took = time.perf_counter() - t0
                replay[n].append((count / took, (cpu_ms(pids) - c0) / count,
                                  (cpu_ms(postgres_pids()) - p0) / count))
        print(f"\n1. throughput through haproxy ({args.rounds} rounds, medians; CPU ms per "
              "request: replicas, PostgreSQL)")
        print(f"{'load':8} {'replicas':>8} {'req/s':>8} {'ratio':>6} {'cpu ms':>7} {'pg ms':>6}")
        for name, data in (("small", small), ("replay", replay)):
            base = statistics.median(x[0] for x in data[1])
            for n in (1, 2, 3):
                rate = statistics.median(x[0] for x in data[n])
                print(f"{name:8} {n:8d} {rate:8.0f} {rate / base:6.2f} "
                      f"{statistics.median(x[1] for x in data[n]):7.2f} "
                      f"{statistics.median(x[2] for x in data[n]):6.2f}")
    finally:
        for b in balancers:
            b.stop()
        for r in replicas:
            r.stop()


def pipeline_times(log: Path) -> list[float]:
    return [float(m) for m in re.findall(r"POST /v1/chat/completions 200 .*?pipeline_ms=([\d.]+)",
                                         log.read_text(errors="replace"))]


def backends(args: argparse.Namespace, fake_url: str, tmp: Path, url: str) -> None:
    runs = {"postgres": config(tmp, "bpg", fake_url, url), "sqlite": config(tmp, "bsq", fake_url,
                                                                           None)}
    procs = {k: ProxyProcess(c, log_path=tmp / f"{k}.log") for k, c in runs.items()}
    latency: dict[str, list[float]] = {k: [] for k in runs}
    try:
        for p in procs.values():
            p.start(60)
        for rnd in range(args.rounds * 2):
            order = list(procs) if rnd % 2 == 0 else list(reversed(procs))
            for name in order:
                agent = Agent(f"b{rnd:02d}{name[:4]}"[:7])
                began = time.perf_counter()
                timed: list[float] = []

                def on_turn(_: int, timed: list[float] = timed) -> None:
                    nonlocal began
                    now = time.perf_counter()
                    timed.append((now - began) * 1000)
                    began = now

                agent.run(procs[name].url, on_turn=on_turn)
                latency[name] += timed
        print("\n2. one replica, the same session replay: PostgreSQL vs files + SQLite (ms)")
        print(f"{'backend':9} {'pipe p50':>9} {'pipe p99':>9} {'req p50':>8} {'req p99':>8} "
              f"{'requests':>8}")
        for name in runs:
            pipe = pipeline_times(tmp / f"{name}.log")
            print(f"{name:9} {pct(pipe, .5):9.2f} {pct(pipe, .99):9.2f} "
                  f"{pct(latency[name], .5):8.2f} {pct(latency[name], .99):8.2f} {len(pipe):8d}")
    finally:
        for p in procs.values():
            p.stop()


def history(tokens: int) -> list[dict[str, Any]]:
    """A coding-agent history of about ``tokens`` tokens (~4 characters each)."""
    rnd = random.Random(3)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": TASK}]
    size = 0
    for i, step in enumerate(script(steps_n=400)):
        out = step.output(rnd)
        call = {"id": f"call_{i:03d}", "type": "function",
                "function": {"name": step.tool, "arguments": orjson.dumps(step.args).decode()}}
        msgs += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": out}]
        size += len(out)
        if size >= tokens * 4:
            break
    return msgs


def cold_vs_warm(fake_url: str, tmp: Path, url: str, sessions: int = 5) -> None:
    cfgs = [config(tmp, f"c{i}", fake_url, url, window=128_000, recent=51_200) for i in range(2)]
    warm, cold = (ProxyProcess(c, log_path=tmp / f"c{i}.log") for i, c in enumerate(cfgs))
    base = history(100_000)
    times: dict[str, list[float]] = {"warm": [], "cold": []}
    try:
        warm.start(60)
        cold.start(60)
        with httpx.Client(timeout=120) as http:
            def post(target: ProxyProcess, sid: str, msgs: list[dict[str, Any]]) -> float:
                t = time.perf_counter()
                r = http.post(target.url + "/v1/chat/completions",
                              content=orjson.dumps({"model": MODEL, "messages": msgs,
                                                    "tools": TOOLS}),
                              headers={"x-session-id": sid, "content-type": "application/json"})
                assert r.status_code == 200, r.text[:300]
                return (time.perf_counter() - t) * 1000

            for k in range(sessions):
                sid = f"cold{k:03d}"
                turn = base[:-2]
                post(warm, sid, turn)  # the turn before: the warm replica serves it
                nxt = base
                order = ("cold", "warm") if k % 2 else ("warm", "cold")
                for name in order:
                    times[name].append(post(cold if name == "cold" else warm, sid, nxt))
        w, c = statistics.median(times["warm"]), statistics.median(times["cold"])
        print(f"\n3. next turn of a ~100k-token history ({sum(len(str(m)) for m in base) // 4:,} "
              f"tokens est.), median of {sessions} sessions: warm {w:.0f} ms, cold {c:.0f} ms, "
              f"cold/warm {c / w:.2f}x")
    finally:
        warm.stop()
        cold.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--only", choices=["throughput", "backends", "cold"])
    args = ap.parse_args()
    launcher = Path(__file__).with_name("replay_upstream.py")
    upstream = subprocess.Popen([sys.executable, str(launcher)], stdout=subprocess.PIPE, text=True)
    try:
        assert upstream.stdout is not None
        fake_url = upstream.stdout.readline().split()[1] + "/v1"
        with PostgresServer() as server, tempfile.TemporaryDirectory() as tmpdir:
            run_all(args, fake_url, Path(tmpdir), server)
    finally:
        upstream.terminate()
        upstream.wait()


def run_all(args: argparse.Namespace, fake_url: str, tmp: Path, server: PostgresServer) -> None:
    if args.only in (None, "throughput"):
        throughput(args, fake_url, tmp, server.create_database("throughput"))
    if args.only in (None, "backends"):
        backends(args, fake_url, tmp, server.create_database("backends"))
    if args.only in (None, "cold"):
        cold_vs_warm(fake_url, tmp, server.create_database("cold"))


if __name__ == "__main__":
    main()

"""Load: many concurrent agent sessions through one proxy (issue 6 figures).

    python bench/load.py [--sessions 64] [--turns 30] [--window 32000]

Each session is a scripted agent (tool outputs of 1-300 KB, log-uniform) resending its whole
history every turn; the fake upstream plays the model and the summarizer. Reports errors,
summarizer calls vs compaction events, per-request latency p50/p99, and the proxy's RSS before,
in the middle and after (no growth trend expected once caches are warm).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import statistics
import tempfile
import time
from typing import Any

import aiohttp
import orjson

from proxy.app import create_app
from proxy.config import config_from_mapping
from proxy.demo import SYSTEM, script
from proxy.testing.fake_upstream import FakeUpstream, Reply
from proxy.testing.servers import serve_in_thread

MODEL = "load-model"
SUMMARY = ("## Goal\nKeep the service up.\n## Constraints & Preferences\n- none\n## Progress\n"
           "### Done\n- ran tools\n### In Progress\n- more tools\n### Blocked\n- none\n"
           "## Key Decisions\n- none\n## Next Steps\n- continue\n## Critical Context\n- none\n")


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Model:
    def __init__(self) -> None:
        self.summaries = 0

    def __call__(self, body: dict[str, Any]) -> Reply:
        msgs = body["messages"]
        first = msgs[0].get("content") or ""
        if isinstance(first, str) and not first.startswith(SYSTEM) and "summar" in first.lower():
            self.summaries += 1
            return Reply(content=SUMMARY, delay_s=0.2)
        last = msgs[-1]
        if last.get("role") == "tool":
            n = int(str(last.get("tool_call_id", "c0")).split("_")[-1]) + 1
        else:
            n = 0
        return Reply(content=None, delay_s=0.02, tool_calls=[
            {"id": f"call_{n}", "name": "bash", "arguments": {"step": n}}])


async def session(url: str, idx: int, turns: int, steps: list[Any], lat: list[float],
                  errors: list[str]) -> None:
    rnd = random.Random(idx)
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"Session {idx}: fix the bug."}]
    headers = {"authorization": f"Bearer sk-load-{idx % 8}", "x-session-id": f"load-{idx}",
               "content-type": "application/json"}
    async with aiohttp.ClientSession() as http:
        for _ in range(turns):
            body = orjson.dumps({"model": MODEL, "messages": history})
            t0 = time.perf_counter()
            try:
                async with http.post(url + "/v1/chat/completions", data=body, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=120)) as r:
                    payload = await r.read()
                    if r.status != 200:
                        errors.append(f"{r.status}: {payload[:100]!r}")
                        return
            except Exception as exc:  # the load generator records, never crashes
                errors.append(repr(exc))
                return
            lat.append((time.perf_counter() - t0) * 1000)
            msg = orjson.loads(payload)["choices"][0]["message"]
            history.append(msg)
            for call in msg.get("tool_calls") or []:
                n = int(call["id"].split("_")[-1])
                history.append({"role": "tool", "tool_call_id": call["id"],
                                "content": steps[n % len(steps)].output(rnd)})


async def drive(url: str, sessions: int, turns: int, lat: list[float], errors: list[str],
                marks: list[float]) -> None:
    steps = script(steps_n=64)
    tasks = [asyncio.create_task(session(url, i, turns, steps, lat, errors)) for i in range(sessions)]
    while not all(t.done() for t in tasks):
        await asyncio.sleep(2)
        marks.append(rss_mb())
    await asyncio.gather(*tasks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--window", type=int, default=128_000)
    args = ap.parse_args()
    model = Model()
    fake = FakeUpstream(responder=model, record=False)
    with tempfile.TemporaryDirectory() as tmp, serve_in_thread(fake) as up:
        cfg = config_from_mapping({"upstream": {"base_url": up.url + "/v1"}, "storage": {"data_dir": tmp},
                                   "compaction": {"context_windows": {MODEL: args.window}}})
        # The proxy runs in this process (a thread), so RSS below is the proxy's plus the
        # load generator's and the fake's: an upper bound.
        with serve_in_thread(create_app(cfg), lifespan="on") as proxy:
            before = rss_mb()
            lat: list[float] = []
            errors: list[str] = []
            marks: list[float] = []
            t0 = time.perf_counter()
            asyncio.run(drive(proxy.url, args.sessions, args.turns, lat, errors, marks))
            elapsed = time.perf_counter() - t0
            after = rss_mb()
            db = sorted(os.listdir(tmp))
            import httpx

            metrics = {
                line.split()[0]: float(line.split()[1])
                for line in httpx.get(proxy.url + "/metrics").text.splitlines()
                if line.startswith("ctxproxy_") and "{" not in line.split()[0]
            }
    lat.sort()
    print(f"# {args.sessions} sessions x {args.turns} turns, window {args.window:,}, {elapsed:.0f} s")
    print(f"requests {len(lat)}  errors {len(errors)}  {errors[:3]}")
    print(f"latency ms p50 {statistics.median(lat):.0f}  p99 {lat[int(0.99 * (len(lat) - 1))]:.0f}")
    comp = metrics.get("ctxproxy_compactions_total", 0)
    pre = metrics.get("ctxproxy_precompactions_total", 0)
    print(f"summarizer calls {model.summaries}; compaction events {comp:.0f}; "
          f"background preparations {pre:.0f} (a prepared summary a session never needed is the "
          f"only extra call)")
    third = max(len(marks) // 3, 1)
    print(f"RSS MB before {before:.0f}, during (first/last third avg) "
          f"{statistics.mean(marks[:third]) if marks else 0:.0f} / {statistics.mean(marks[-third:]) if marks else 0:.0f}, "
          f"after {after:.0f}  (data dir entries: {len(db)})")


if __name__ == "__main__":
    main()

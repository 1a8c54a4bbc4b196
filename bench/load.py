"""Load: many concurrent agent sessions through one proxy (issue 6 figures).

    python -m bench.load [--sessions 64] [--turns 30] [--window 32000]

Each session is a scripted agent (tool outputs of 1-300 KB, log-uniform) resending its whole
history every turn; the fake upstream plays the model and the summarizer. Reports errors,
summarizer calls vs compaction events, per-request latency p50/p99, and the proxy's RSS (the
proxy runs as its own process) after start-up, and peak/after each round of fresh sessions: with
caches bounded, the rounds after the first show no growth trend. The proxy's event loop runs in
asyncio debug mode (bench/debug_serve.py instead of ``python -m proxy serve``) and the callbacks
that held it 10 ms or more are counted; ``--no-loop-debug`` runs the plain server instead.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

from harness.process import ProxyProcess
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.run import SYSTEM, script
from proxy.demo.servers import serve_in_thread

MODEL = "load-model"
SUMMARY = ("## Goal\nKeep the service up.\n## Constraints & Preferences\n- none\n## Progress\n"
           "### Done\n- ran tools\n### In Progress\n- more tools\n### Blocked\n- none\n"
           "## Key Decisions\n- none\n## Next Steps\n- continue\n## Critical Context\n- none\n")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


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
                  errors: list[str], round_no: int) -> None:
    rnd = random.Random(idx)
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"Session {idx}: fix the bug."}]
    headers = {"authorization": f"Bearer sk-load-{idx % 8}", "x-session-id": f"load-{round_no}-{idx}",
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
                marks: list[float], pid: int, round_no: int) -> None:
    steps = script(steps_n=64)
    tasks = [asyncio.create_task(session(url, i, turns, steps, lat, errors, round_no))
             for i in range(sessions)]
    while not all(t.done() for t in tasks):
        await asyncio.sleep(1)
        marks.append(rss_mb(pid))
    await asyncio.gather(*tasks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of fresh sessions (soak)")
    ap.add_argument("--window", type=int, default=128_000)
    ap.add_argument("--cache-mb", type=int, default=None, help="server.cache_mb (default: its default)")
    ap.add_argument("--no-loop-debug", dest="loop_debug", action="store_false",
                    help="run `python -m proxy serve`, without the event loop's debug mode and "
                         "its slow-callback count")
    args = ap.parse_args()
    model = Model()
    fake = FakeUpstream(responder=model, record=False)
    tmp = Path(tempfile.mkdtemp(prefix="ctxload-"))
    all_errors: list[str] = []
    with serve_in_thread(fake) as up:
        (tmp / "config.yaml").write_text(
            f"upstream: {{base_url: '{up.url}/v1'}}\nstorage: {{data_dir: '{tmp / 'data'}'}}\n"
            f"compaction: {{context_windows: {{{MODEL}: {args.window}}}}}\n"
            + (f"server: {{cache_mb: {args.cache_mb}}}\n" if args.cache_mb else ""))
        # The proxy is its own process, as users run it: the RSS figures are the proxy's alone.
        # Unless --no-loop-debug, the same server through bench/debug_serve.py, which writes
        # its slow-callback summary to loop.txt once SIGTERM has shut it down.
        report = tmp / "loop.txt"
        launcher = (sys.executable, str(Path(__file__).with_name("debug_serve.py")),
                    "--loop-report", str(report))
        proxy = ProxyProcess(tmp / "config.yaml", log_path=tmp / "proxy.log",
                             extra_args=("--log-level", "info"),
                             command=launcher if args.loop_debug else None)
        proxy.start()
        pid, url = proxy.pid, proxy.url
        assert pid is not None
        try:
            print(f"# {args.sessions} sessions x {args.turns} turns x {args.rounds} rounds, "
                  f"window {args.window:,}; proxy pid {pid}, log {tmp / 'proxy.log'}")
            print(f"RSS MB after start-up {rss_mb(pid):.0f}")
            print("round requests errors  p50 ms  p99 ms  RSS MB: peak  after")
            for r in range(args.rounds):
                lat: list[float] = []
                errors: list[str] = []
                marks: list[float] = []
                asyncio.run(drive(url, args.sessions, args.turns, lat, errors, marks, pid, r))
                time.sleep(1.5)  # one stats flush, so "after" is at rest
                lat.sort()
                all_errors += errors
                p99 = lat[int(0.99 * (len(lat) - 1))] if lat else 0.0
                print(f"{r + 1:>5} {len(lat):>8} {len(errors):>6} {statistics.median(lat):>7.0f} "
                      f"{p99:>7.0f}  {max(marks, default=0):>11.0f} {rss_mb(pid):>6.0f}")
            metrics = {
                line.split()[0]: float(line.split()[1])
                for line in httpx.get(url + "/metrics").text.splitlines()
                if line.startswith("ctxproxy_") and "{" not in line.split()[0]
            }
        finally:
            proxy.signal(signal.SIGTERM)
            proxy.wait(30)
    loop_line = None
    if args.loop_debug:
        loop_line = (report.read_text().rstrip() if report.exists()
                     else f"event loop: no report (the proxy did not shut down cleanly; see {tmp})")
    if all_errors or (args.loop_debug and not report.exists()):
        print(f"kept {tmp} for its proxy.log")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    comp = metrics.get("ctxproxy_compactions_total", 0)
    pre = metrics.get("ctxproxy_precompactions_total", 0)
    print(f"errors {len(all_errors)} {all_errors[:3]}")
    print(f"summarizer calls {model.summaries}; compaction events {comp:.0f}; "
          f"background preparations {pre:.0f} (a prepared summary a session never needed is the "
          f"only extra call)")
    if loop_line is not None:
        print(loop_line)


if __name__ == "__main__":
    main()

"""Offload pipeline cost: a 60-turn history with 30 tool outputs of 5-300 KB.

    python -m bench.offload [--repeats 20]

Runs the real pipeline (the app's default stages: offload, compact, validate, count, with the
dialog archive written first, as the route does) in-process over the history as a client
resends it: the first request (cuts and writes every file), then repeats of the same history
(must write nothing and cost little), and prints ms per request, files written, and bytes the
client sent vs bytes forwarded.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from typing import Any

import orjson

from proxy.config import config_from_mapping
from proxy.formats.chat.request import request as chat
from proxy.model import RequestView
from proxy.services import open_services
from proxy.session import Identity


def history(seed: int = 7) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the failing tests in the repo."},
    ]
    for t in range(30):
        size = rnd.randint(5_000, 300_000)
        line = f"[turn {t}] " + "log output " * 8 + "\n"
        out = (line * (size // len(line) + 1))[:size]
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{t}", "type": "function",
             "function": {"name": "bash", "arguments": orjson.dumps({"cmd": f"step {t}"}).decode()}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{t}", "content": out})
        if t % 3 == 2:
            msgs.append({"role": "assistant", "content": f"Progress note {t}."})
            msgs.append({"role": "user", "content": f"Continue with step {t + 1}."})
    return msgs


async def measure(repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # Offload alone: compaction off (it would call a summarizer), upstream never contacted.
        cfg = config_from_mapping({"storage": {"data_dir": tmp}, "compaction": {"enabled": False},
                                   "upstream": {"base_url": "http://127.0.0.1:9/v1"}})
        svc = await open_services(cfg)
        svc.pipeline.counter.counter.preload(("gpt-4o",))
        msgs = history()
        body = orjson.dumps({"model": "gpt-4o", "messages": msgs})
        ident = Identity("t-bench", "s-bench", None)

        async def one() -> tuple[float, float, dict[str, int], int]:
            t0 = time.perf_counter()
            parsed = chat.parse(body)
            writes = svc.writes.for_request(ident.tenant, provider_judges=False)
            chains = svc.archive.chains(parsed["messages"])
            await svc.archive.record_request(ident, parsed["messages"], chains, writes)
            # The pipeline's own time: everything inline (the route would move the pure steps
            # of a body this large to a worker thread).
            view = RequestView("gpt-4o", parsed, ident, chains, writes=writes)
            result = await svc.pipeline.run(view)
            out = chat.write(body, parsed["messages"], result.messages) if result.changed else body
            total = (time.perf_counter() - t0) * 1000
            return result.elapsed_ms, total, dict(result.stats), len(out)

        first = await one()
        reps = [await one() for _ in range(repeats)]
        n_msgs = len(msgs)
        print(f"# history: {n_msgs} messages, 30 tool outputs 5-300 KB, {len(body) / 1e6:.2f} MB sent")
        print(f"{'request':8} {'pipeline ms':>12} {'+parse/dump ms':>15} {'files':>6} {'forwarded':>10}")
        print(f"{'first':8} {first[0]:12.2f} {first[1]:15.2f} {first[2].get('files_written', 0):6d} "
              f"{first[3] / 1e3:9.0f}K")
        pm = statistics.median(r[0] for r in reps)
        tm = statistics.median(r[1] for r in reps)
        written = sum(r[2].get("files_written", 0) for r in reps)
        print(f"{'repeat':8} {pm:12.2f} {tm:15.2f} {written:6d} {reps[0][3] / 1e3:9.0f}K"
              f"   (median of {repeats}; p99 pipeline {max(r[0] for r in reps):.2f} ms)")
        print(f"bytes sent {len(body)} -> forwarded {reps[0][3]} "
              f"({reps[0][3] / len(body) * 100:.1f}%); offloaded {reps[0][2].get('offloaded')}, "
              f"aged turns {reps[0][2].get('aged_turns')}; tokens {reps[0][2].get('tokens_in')} "
              f"-> {reps[0][2].get('tokens_out')}")
        await svc.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    asyncio.run(measure(ap.parse_args().repeats))


if __name__ == "__main__":
    main()

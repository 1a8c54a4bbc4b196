"""A long agent session through the full pipeline (issue 4).

    python -m bench.session [--steps 64] [--window 128000] [--format chat|responses]

Replays a scripted coding-agent session (tool outputs of 1-300 KB, a few user constraints) through
a real ctxproxy on loopback, against the fake upstream acting as both the model and the
summarizer. The client resends its whole history every turn, as agents do, in the wire format
``--format`` names (chat completions, or the Responses API as Codex speaks it). Reports:

- total tokens the client sent vs total forwarded;
- the largest forwarded request vs the window and the threshold;
- summarizer calls vs compaction events (must be equal: compactions, not turns, cost calls);
- pipeline ms per request (p50, p99), from the proxy's access log;
- latency of each threshold-crossing turn vs a normal turn (pre-compaction hides the summarizer);
- prefix stability: for each pair of consecutive forwarded requests, the share of the earlier
  one (tools, then messages, as canonical JSON) that is a whole-message common prefix of the
  later one. Every change of that prefix discards the provider's prompt cache;
- the proxy's event loop: callbacks that held it 10 ms or more (asyncio debug mode on the
  proxy's loop only; ``--no-loop-debug`` turns it off for figures without debug overhead).

``--memory`` turns long-term memory on: a warm-up session (the same script, another session id)
is compacted first, its durable facts (the scripted summarizer quotes the user's constraints)
are folded into MEMORY.md, and the measured session then starts with it. Also reported: memory
bytes each forwarded request carries, summarizer calls per compaction, fold calls.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import re
import statistics
import tempfile
from typing import Any

import orjson

from harness.slow_callbacks import SlowCallbacks
from proxy.app import create_app
from proxy.compaction.message import SUMMARY_HEADING
from proxy.config import config_from_mapping
from proxy.demo.fake.own_calls import instructions_of, last_text, own_call
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.run import MODEL, WIRES, ScriptedModel, TurnFigures, drive, script
from proxy.demo.servers import serve_in_thread
from proxy.memory.inject import is_memory_message

CONSTRAINTS = [
    "Constraint: never edit files under migrations/.",
    "Please keep the public signature of checkout.total() unchanged.",
    "Use Decimal everywhere money is involved, no floats.",
    "Also cover the discount-code path with a test.",
    "Don't add new dependencies to pyproject.toml.",
    "Run the full suite before you report back.",
    "Keep the changelog entry under three lines.",
    "Check the logging configuration as well.",
    "Summarise what changed at the end.",
    "One more pass over the error handling, please.",
    "Last: make sure mypy is clean.",
    "Thanks, wrap it up.",
    "Double-check the rounding tests once more.",
    "And the CLI help text should mention the new flag.",
    "Finally, re-run the slow tests.",
    "Done? Then write the summary.",
]


class PipelineTimes(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.ms: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = re.search(r"POST /v1/(?:chat/completions|responses) \d+ .*pipeline_ms=([\d.]+)",
                      record.getMessage())
        if m:
            self.ms.append(float(m.group(1)))


def conversation(body: dict[str, Any]) -> list[dict[str, Any]]:
    return body["messages"] if "messages" in body else body["input"]


class Remembering:
    """The scripted model, plus long-term memory: summaries asked for durable facts carry the
    user's constraints found in the transcript (quoted) and a lesson; folds are answered from
    the notes they are sent. ``model`` is swapped between the warm-up and measured sessions."""

    def __init__(self, model: ScriptedModel) -> None:
        self.model = model
        self.folds = 0

    def __call__(self, body: dict[str, Any]) -> Reply:
        msgs = conversation(body)
        first = instructions_of(body)
        if own_call(body) == "fold":
            self.folds += 1
            notes = last_text(body).split("<notes>", 1)[1].split("</notes>", 1)[0]
            bullets = sorted({line for line in notes.split("\n") if line.startswith("- [")})
            prefs = [b for b in bullets if "Preference:" in b]
            lessons = [b for b in bullets if "Lesson:" in b]
            text = ("## Preferences & Standing Instructions\n" + "\n".join(prefs)
                    + "\n## Lessons\n" + "\n".join(lessons) + "\n")
            return Reply(content=text)
        reply = self.model(body)
        if own_call(body) == "summarizer" and "## Durable Facts" in first:
            seen = " ".join(str(m.get("content") or "") for m in msgs)
            facts = [f'- Preference: "{c}"' for c in CONSTRAINTS if c in seen]
            facts.append("- Lesson: `round()` broke test_rounding with AssertionError; fixed by "
                         "`Decimal.quantize`")
            reply = dataclasses.replace(
                reply, content=f"{reply.content}## Durable Facts\n" + "\n".join(facts) + "\n")
        return reply


def is_internal(body: dict[str, Any]) -> bool:
    """A summarizer or fold call (not the agent's), in the session's own format."""
    return own_call(body) is not None




def canonical_units(body: dict[str, Any]) -> list[bytes]:
    opt = orjson.OPT_SORT_KEYS
    return [orjson.dumps(body.get("tools"), option=opt)] + [
        orjson.dumps(m, option=opt) for m in conversation(body)
    ]


def summary_of(body: dict[str, Any]) -> str | None:
    """The summary a forwarded request carries (after the system prompt, and the memory when
    it is on), if any."""
    for item in conversation(body)[:3]:
        if item.get("role") not in ("system", "developer", "user"):
            continue
        content = item.get("content")
        if isinstance(content, list):  # Responses content parts
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        if isinstance(content, str) and content.startswith(SUMMARY_HEADING):
            return content
    return None


def stability(a: list[bytes], b: list[bytes]) -> float:
    total = sum(len(u) for u in a)
    shared = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        shared += len(x)
    return shared / total if total else 1.0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=64, help="tool calls in the session")
    ap.add_argument("--window", type=int, default=128_000)
    ap.add_argument("--summary-delay", type=float, default=1.0)
    ap.add_argument("--model-delay", type=float, default=0.5)
    ap.add_argument("--keep-recent", type=float, default=None,
                    help="compaction.keep_recent_ratio (default: the config default)")
    ap.add_argument("--format", choices=sorted(WIRES), default="chat",
                    help="the client's wire format")
    ap.add_argument("--explain", action="store_true", help="print why each prefix break happened")
    ap.add_argument("--memory", action="store_true",
                    help="long-term memory on, with a warm-up session folded into MEMORY.md first")
    ap.add_argument("--no-loop-debug", dest="loop_debug", action="store_false",
                    help="do not run the proxy's event loop in debug mode (no slow-callback count)")
    args = ap.parse_args()
    if args.memory and args.format != "chat":
        ap.error("--memory measures the chat format only")

    def scripted() -> ScriptedModel:
        return ScriptedModel(script(steps_n=args.steps), summary_delay_s=args.summary_delay,
                             model_delay_s=args.model_delay, text_every=4)

    model = scripted()
    remembering = Remembering(model)
    fake = FakeUpstream(responder=remembering, models=(MODEL,))
    times = PipelineTimes()
    access = logging.getLogger("proxy.server.access")
    access.addHandler(times)
    access.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory() as tmp, serve_in_thread(fake) as upstream:
        config = config_from_mapping({
            "upstream": {"base_url": upstream.url + "/v1"},
            "storage": {"data_dir": tmp},
            "compaction": {"context_windows": {MODEL: args.window},
                           **({} if args.keep_recent is None
                              else {"keep_recent_ratio": args.keep_recent})},
            "memory": {"enabled": args.memory},
        })
        threshold = int(config.compaction.threshold_ratio * args.window)
        # Only the proxy's loop (its server thread) is watched: not the fake upstream's, which
        # has its own thread, nor the client's (this thread). The count goes in the summary.
        watch = SlowCallbacks(threshold_s=0.010, log_slow=False) if args.loop_debug else None
        with serve_in_thread(create_app(config), lifespan="on",
                             loop_setup=watch.install if watch else None) as proxy:
            warm_calls = 0
            if args.memory:
                asyncio.run(drive(proxy.url, model, session="warm-up", follow_ups=CONSTRAINTS,
                                  max_turns=500))
                proxy.drain()  # the fold, started by the warm-up's requests
                warm_calls = model.summaries
                model = remembering.model = scripted()
            start = len(fake.received)
            figures: list[TurnFigures] = asyncio.run(
                drive(proxy.url, model, follow_ups=CONSTRAINTS, max_turns=500, wire=args.format)
            )
            proxy.drain()
    received = fake.received[start:]
    forwarded = [r.json() for r in received if r.path.endswith(WIRES[args.format]().path)]
    forwarded = [b for b in forwarded if not is_internal(b)]
    units = [canonical_units(b) for b in forwarded]
    stab = [stability(a, b) for a, b in zip(units, units[1:], strict=False)]
    summaries = [summary_of(b) for b in forwarded]
    events = sum(1 for a, b in zip(summaries, summaries[1:], strict=False) if b is not None and a != b)
    crossing = [i + 1 for i, (a, b) in enumerate(zip(summaries, summaries[1:], strict=False))
                if b is not None and a != b]
    sent = sum(f.sent for f in figures)
    fwd = sum(f.forwarded for f in figures)
    normal = [f.ms for i, f in enumerate(figures) if i not in crossing and i > 0]
    cross_ms = [figures[i].ms for i in crossing]
    print(f"# {args.format}: {len(figures)} turns, {args.steps} tool calls (1-300 KB outputs), window {args.window:,}, "
          f"threshold {threshold:,}; summarizer answers in {args.summary_delay:g} s, model in "
          f"{args.model_delay:g} s")
    print(f"tokens sent by the client   {sent:>12,}")
    print(f"tokens forwarded            {fwd:>12,}  ({fwd / sent * 100:.1f}% of sent; target <= 15%)")
    largest = max(f.forwarded for f in figures)
    over = sum(1 for f in figures if f.forwarded > threshold)
    print(f"largest forwarded request   {largest:>12,}  ({largest / args.window * 100:.0f}% of the "
          f"window; {over} requests over the threshold; target 0)")
    unused = model.summaries - events
    note = (f"; {unused} prepared in the background for a threshold the session never reached"
            if unused > 0 else "")
    print(f"summarizer calls            {model.summaries:>12}  (compaction events: {events}{note})")
    rest = times.ms[1:]
    print(f"pipeline ms per request     p50 {statistics.median(rest):.2f}  p99 {pct(rest, 0.99):.2f}"
          f"  max {max(rest):.2f}  (first request, which loads the tokenizer: {times.ms[0]:.0f} ms)")
    if cross_ms:
        ratio = max(cross_ms) / statistics.median(normal)
        print(f"threshold-crossing turns    {', '.join(f'{m:.0f} ms' for m in cross_ms)} vs normal "
              f"p50 {statistics.median(normal):.0f} ms -> worst {ratio:.2f}x (target <= 1.2x)")
    print(f"prefix stability            mean {statistics.mean(stab):.3f}  min {min(stab):.3f}  "
          f"pairs below 0.5: {sum(1 for s in stab if s < 0.5)} of {len(stab)} (target mean >= 0.95)")
    if args.memory:
        sizes = [len(m["content"].encode()) for b in forwarded for m in b["messages"][1:2]
                 if is_memory_message(m)]
        print(f"memory                      {len(sizes)} of {len(forwarded)} requests carry it, "
              f"{statistics.mean(sizes) if sizes else 0:,.0f} bytes each; warm-up: "
              f"{warm_calls} summarizer calls; fold calls {remembering.folds} (at most one per "
              f"scope and day); summarizer calls beyond compactions and preparations: "
              f"{model.summaries - events - max(unused, 0)} (target 0)")
    if watch is not None:
        watch.uninstall()
        print(watch.summary())
    if args.explain:
        print("  forwarded tokens per turn: " + " ".join(
            f"{f.forwarded // 1000}k{'*' if f.compacted else ''}" for f in figures))
        explain(forwarded)


def explain(forwarded: list[dict[str, Any]]) -> None:
    """Why each prefix break happened (for tuning; --explain)."""
    units = [canonical_units(b) for b in forwarded]
    for i, (a, b) in enumerate(zip(units, units[1:], strict=False)):
        s = stability(a, b)
        if s >= 0.99:
            continue
        k = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        before, later = conversation(forwarded[i]), conversation(forwarded[i + 1])
        msg = before[k - 1] if 0 < k <= len(before) else {}
        nxt = later[k - 1] if 0 < k <= len(later) else {}
        print(f"  pair {i}->{i + 1}: stability {s:.3f}, first change at unit {k} "
              f"({msg.get('role')}: {len(str(msg.get('content')))} -> {nxt.get('role')}: "
              f"{len(str(nxt.get('content')))} chars)")
        print("    after: " + " ".join(
            f"{str(m.get('role') or m.get('type'))[:2]}"
            f"{len(str(m.get('content') or m.get('output') or m.get('tool_calls')))//1000}k"
            for m in later))


if __name__ == "__main__":
    main()

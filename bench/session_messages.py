"""The session benchmark (bench/session.py) replayed in Anthropic Messages form next to chat
completions, in the same run (issue 14).

    python -m bench.session_messages [--steps 64] [--window 128000]

The same scripted coding-agent session (tool outputs of 1-300 KB, user follow-ups) is played
twice against one proxy in front of the fake upstream, which is both the model and the
summarizer: once as chat completions (``/v1/chat/completions``, demo.drive) and once as
Messages (``/v1/messages``: ``system`` as text blocks, ``tool_use``/``tool_result`` blocks, a
thinking block with its signature in every assistant turn, Claude Code's moving cache marker on
the last block). Each client resends its whole history every turn. Prints, per format, the
tokens the client sent and forwarded, the largest forwarded request, summarizer calls, turn
latency and prefix stability (the share of each forwarded request that the next one repeats,
whole blocks: tools, system, then messages; cache_control markers left out, since they are
not part of the cached prefix).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from typing import Any

import aiohttp
import orjson
from session import stability  # bench/session.py: the same measure for both formats

from proxy.app import create_app
from proxy.config import Config, config_from_mapping
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.run import MODEL, SYSTEM, TASK, TOOLS, ScriptedModel, TurnFigures, drive, script
from proxy.demo.servers import serve_in_thread
from proxy.formats.messages.request import strip_cache_control

FOLLOW_UPS = [
    "Constraint: never edit files under migrations/.",
    "Please keep the public signature of checkout.total() unchanged.",
    "Use Decimal everywhere money is involved, no floats.",
    "Also cover the discount-code path with a test.",
    "Don't add new dependencies to pyproject.toml.",
    "Run the full suite before you report back.",
    "Keep the changelog entry under three lines.",
    "Summarise what changed at the end.",
] * 2


def anthropic_tools() -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = TOOLS
    return [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
             "input_schema": t["function"]["parameters"]} for t in tools]


class Model:
    """The scripted model for both formats: Messages summarizer calls (the prompt in
    ``system``) are told apart here, chat ones by ScriptedModel itself."""

    def __init__(self, steps_n: int, seed: int = 7) -> None:
        self.chat = ScriptedModel(script(seed, steps_n), summary_delay_s=0.0, text_every=4)
        self.messages = ScriptedModel(script(seed, steps_n), summary_delay_s=0.0, text_every=4)

    def __call__(self, body: dict[str, Any]) -> Reply:
        if "system" not in body:
            return self.chat(body)
        if "summar" in str(body["system"]).lower() and not body.get("tools"):
            self.messages.summaries += 1
            return Reply(content=self.messages._summary(body["messages"]))
        reply = self.messages({"messages": []})
        reply.reasoning = f"thinking before call {self.messages.issued}"
        return reply


async def drive_messages(url: str, model: ScriptedModel, max_turns: int = 500) -> list[TurnFigures]:
    """demo.drive, in Messages form."""
    rnd = random.Random(11)
    steps = model.steps
    system = [{"type": "text", "text": "x-anthropic-billing-header: bench"},
              {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    history: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": TASK}]}]
    follow = iter(FOLLOW_UPS)
    figures: list[TurnFigures] = []
    headers = {"x-claude-code-session-id": "bench-messages", "x-api-key": "sk-ant-bench",
               "anthropic-version": "2023-06-01", "content-type": "application/json"}
    tools = anthropic_tools()
    async with aiohttp.ClientSession() as http:
        for turn in range(1, max_turns + 1):
            # Claude Code's moving marker: on the last block of the last message, this turn only.
            sent = [*history[:-1], {**history[-1], "content": [
                *history[-1]["content"][:-1],
                {**history[-1]["content"][-1], "cache_control": {"type": "ephemeral"}}]}]
            body = orjson.dumps({"model": MODEL, "max_tokens": 8192, "system": system,
                                 "messages": sent, "tools": tools})
            t0 = time.perf_counter()
            async with http.post(url + "/v1/messages", data=body, headers=headers) as r:
                answer = orjson.loads(await r.read())
                h = r.headers
            ms = (time.perf_counter() - t0) * 1000
            figures.append(TurnFigures(turn, int(h.get("x-ctxproxy-tokens-in", 0)),
                                       int(h.get("x-ctxproxy-tokens-out", 0)),
                                       int(h.get("x-ctxproxy-offloaded", 0)),
                                       h.get("x-ctxproxy-compacted") == "1", model.summaries, ms))
            history.append({"role": "assistant", "content": answer["content"]})
            calls = [b for b in answer["content"] if b["type"] == "tool_use"]
            if calls:
                history.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": c["id"],
                     "content": steps[int(c["id"].split("_")[1])].output(rnd)} for c in calls]})
                continue
            nxt = next(follow, None)
            if nxt is None or model.issued >= len(steps):
                break
            history.append({"role": "user", "content": [{"type": "text", "text": nxt}]})
    return figures




def units(body: dict[str, Any]) -> list[bytes]:
    body = strip_cache_control(body)
    opt = orjson.OPT_SORT_KEYS
    head = [orjson.dumps(body.get("tools"), option=opt)]
    if "system" in body:
        head += [orjson.dumps(b, option=opt) for b in body["system"]] \
            if isinstance(body["system"], list) else [orjson.dumps(body["system"])]
    return head + [orjson.dumps(m, option=opt) for m in body["messages"]]


def report(name: str, figures: list[TurnFigures], forwarded: list[dict[str, Any]],
           summaries: int, window: int) -> None:
    sent = sum(f.sent for f in figures)
    fwd = sum(f.forwarded for f in figures)
    stab = [stability(units(a), units(b)) for a, b in zip(forwarded, forwarded[1:], strict=False)]
    ms = [f.ms for f in figures[1:]]
    print(f"{name:9} {len(figures):5} {sent:>11,} {fwd:>10,} {fwd / sent * 100:6.1f}% "
          f"{max(f.forwarded for f in figures) / window * 100:7.0f}% {summaries:6} "
          f"{statistics.median(ms):7.1f} {statistics.mean(stab):7.3f} "
          f"{sum(1 for s in stab if s < 0.5):5}")


def bench_config(upstream_url: str, data_dir: str, window: int, **more: Any) -> Config:
    """A proxy in front of the fake at ``upstream_url`` (both APIs), its data in ``data_dir``,
    ``window`` tokens for the scripted model; ``more``: other sections."""
    return config_from_mapping({
        "upstream": {"base_url": upstream_url + "/v1"},
        "anthropic": {"base_url": upstream_url},
        "storage": {"data_dir": data_dir},
        "compaction": {"context_windows": {MODEL: window}},
        **more,
    })


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=64, help="tool calls in each session")
    ap.add_argument("--window", type=int, default=128_000)
    args = ap.parse_args()
    model = Model(args.steps)
    fake = FakeUpstream(responder=model, models=(MODEL,))
    with tempfile.TemporaryDirectory() as tmp, serve_in_thread(fake) as upstream:
        config = bench_config(upstream.url, tmp, args.window)
        with serve_in_thread(create_app(config), lifespan="on") as proxy:
            chat = asyncio.run(drive(proxy.url, model.chat, follow_ups=FOLLOW_UPS, max_turns=500))
            messages = asyncio.run(drive_messages(proxy.url, model.messages))
    bodies = [r.json() for r in fake.received]
    chat_fwd = [b for b in bodies if "system" not in b and b.get("tools")]
    msg_fwd = [b for b in bodies if "system" in b and b.get("tools")]
    print(f"# the same {args.steps}-call session (1-300 KB tool outputs) in both formats, window "
          f"{args.window:,}, one proxy, one run")
    print(f"{'format':9} {'turns':>5} {'sent tok':>11} {'fwd tok':>10} {'fwd %':>7} "
          f"{'largest':>8} {'summ.':>6} {'p50 ms':>7} {'prefix':>7} {'<0.5':>5}")
    report("chat", chat, chat_fwd, model.chat.summaries, args.window)
    report("messages", messages, msg_fwd, model.messages.summaries, args.window)


if __name__ == "__main__":
    main()

"""`ctxproxy demo`: a long scripted agent session through a real proxy, offline.

Starts a built-in scripted model (the fake upstream, which also answers summarizer calls) and
ctxproxy on loopback, then plays an agent that reads files, runs tests and greps through a
repository with real-sized outputs (1-300 KB), resending its whole history every turn as agents
do. Each turn prints what the client sent and what the proxy forwarded.
"""

from __future__ import annotations

import asyncio
import functools
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import orjson

from proxy.app import create_app
from proxy.config import config_from_mapping
from proxy.demo.fake.own_calls import own_call
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import serve_in_thread

MODEL = "demo-model"
WINDOW = 64_000
SYSTEM = (
    "You are a coding agent working in /work/shop-api. Use the tools to inspect and fix the "
    "code. Keep answers short."
)
TASK = (
    "The checkout tests fail with a rounding error. Find and fix the bug. Constraints: do not "
    "modify anything under migrations/, and keep the code compatible with Python 3.11."
)
FOLLOW_UPS = [
    "Also make sure the discount code path is covered by a test.",
    "Please don't change the public signature of checkout.total().",
    "Run the whole suite once more and summarise what changed.",
    "Check the logging setup too; the logs are too noisy in production.",
    "Use Decimal everywhere money is involved, no floats.",
    "Don't add new dependencies to pyproject.toml.",
    "One more pass over the error handling, please.",
    "Make sure mypy is clean.",
    "Last thing: update the changelog entry for this fix.",
]
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "description": desc,
                                       "parameters": {"type": "object", "properties": props}}}
    for name, desc, props in [
        ("bash", "Run a shell command", {"cmd": {"type": "string"}}),
        ("read_file", "Read a file", {"file_path": {"type": "string"},
                                      "start_line": {"type": "integer"}}),
        ("grep", "Search the repository", {"pattern": {"type": "string"}}),
    ]
]


def _fill(size: int, line: Callable[[int], list[str]]) -> str:
    """Lines from `line(n)` until the text reaches `size` characters."""
    out: list[str] = []
    total = n = 0
    while total < size:
        n += 1
        for text in line(n):
            out.append(text)
            total += len(text) + 1
    return "\n".join(out) + "\n"


def _pytest_log(rnd: random.Random, size: int) -> str:
    def line(n: int) -> list[str]:
        lines = [f"tests/test_checkout.py::test_case_{n:04d} PASSED{' ' * rnd.randint(1, 30)}[{n % 100:3d}%]"]
        if n % 97 == 0:
            lines += [
                f"tests/test_checkout.py::test_rounding_{n} FAILED",
                "Traceback (most recent call last):",
                '  File "/work/shop-api/shop/checkout.py", line 88, in total',
                "    return round(subtotal * (1 - discount), 2)",
                f"AssertionError: assert Decimal('19.99') == Decimal('{19 + n % 7}.98')",
            ]
        return lines

    return "============================= test session starts ==============================\n" + _fill(size, line)


def _source(rnd: random.Random, path: str, size: int) -> str:
    return _fill(size, lambda i: [
        f"{i:6d}\t    value_{i} = compute_{rnd.randint(1, 99)}(order, rate={rnd.random():.4f})  # {path}"])


def _grep(rnd: random.Random, size: int) -> str:
    return _fill(size, lambda i: [
        f"shop/{rnd.choice(['checkout', 'cart', 'pricing', 'tax'])}.py:{rnd.randint(1, 900)}:"
        f"    total = round(amount * {rnd.random():.3f}, 2)"])


def _contributing(rnd: random.Random) -> str:
    return "# Contributing\n\n" + "Please follow the style guide.\n" * 600


@dataclass
class Step:
    tool: str
    args: dict[str, Any]
    output: Callable[[random.Random], str]


def script(seed: int = 7, steps_n: int = 40) -> list[Step]:
    rnd = random.Random(seed)
    steps: list[Step] = []
    for i in range(steps_n):
        kind = i % 5
        # Log-uniform over 1-300 KB: most outputs are small, some are huge, as in real sessions.
        size = int(1_000 * 300 ** rnd.random())
        if kind == 0:
            steps.append(Step("bash", {"cmd": f"pytest -x tests/ -k step{i}"},
                              functools.partial(_pytest_log, size=size)))
        elif kind in (1, 3):
            path = f"/work/shop-api/shop/module_{i}.py"
            steps.append(Step("read_file", {"file_path": path, "start_line": 1},
                              functools.partial(_source, path=path, size=size)))
        elif kind == 2:
            steps.append(Step("grep", {"pattern": f"round\\(.*{i}"}, functools.partial(_grep, size=size)))
        else:
            steps.append(Step("read_file", {"file_path": "/work/shop-api/CONTRIBUTING.md"}, _contributing))
    return steps


@dataclass
class ScriptedModel:
    """The model behind the proxy: tool calls by the script, text every fourth step."""

    steps: list[Step]
    summaries: int = 0
    calls: int = 0
    summary_delay_s: float = 0.3
    model_delay_s: float = 0.0
    text_every: int = 4
    issued: int = 0
    since_text: int = 0

    def __call__(self, body: dict[str, Any]) -> Reply:
        if own_call(body) is not None:  # the proxy's summarizer, in the session's format
            self.summaries += 1
            prompt = body.get("messages") or body.get("input") or []
            return Reply(content=self._summary(prompt), delay_s=self.summary_delay_s)
        self.calls += 1
        # The model's own position in the script, not inferred from the (possibly compacted)
        # history it was sent: the session plays the same whatever the proxy forwards.
        if self.since_text >= self.text_every or self.issued >= len(self.steps):
            self.since_text = 0
            return Reply(content=f"Progress after {self.issued} tool calls: narrowed the bug "
                         "down to shop/checkout.py:88.", delay_s=self.model_delay_s)
        step = self.steps[self.issued]
        call_id = f"call_{self.issued:03d}"
        self.issued += 1
        self.since_text += 1
        return Reply(content=None, delay_s=self.model_delay_s, tool_calls=[
            {"id": call_id, "name": step.tool, "arguments": step.args}])

    def _summary(self, prompt: list[dict[str, Any]]) -> str:
        text = " ".join(str(m.get("content") or "") for m in prompt)
        return (
            "## Goal\nFix the rounding bug in shop/checkout.py so the checkout tests pass.\n"
            "## Constraints & Preferences\n- Do not modify migrations/.\n- Stay compatible with Python 3.11.\n"
            "## Progress\n### Done\n- Ran the test suite; failures in tests/test_checkout.py.\n"
            "### In Progress\n- Reading shop/checkout.py around line 88.\n### Blocked\n- Nothing.\n"
            "## Key Decisions\n- Use Decimal quantize instead of round().\n"
            "## Next Steps\n- Patch checkout.total() and rerun pytest.\n"
            f"## Critical Context\n- AssertionError in test_rounding (prompt of {len(text)} chars summarized).\n"
        )


@dataclass
class TurnFigures:
    turn: int
    sent: int
    forwarded: int
    offloaded: int
    compacted: bool
    compactions: int
    ms: float


class Wire(Protocol):
    """One wire format, as the demo's client speaks it."""

    path: str

    def start(self) -> list[dict[str, Any]]: ...

    def body(self, history: list[dict[str, Any]]) -> dict[str, Any]: ...

    def answer(self, answer: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]: ...

    def output(self, call_id: str, text: str) -> dict[str, Any]: ...

    def user(self, text: str) -> dict[str, Any]: ...


class ChatWire:
    """The client's side of chat completions: a messages list, tool calls answered by id."""

    path = "/v1/chat/completions"

    def start(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]

    def body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        return {"model": MODEL, "messages": history, "tools": TOOLS}

    def answer(self, answer: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
        msg = answer["choices"][0]["message"]
        return [msg], [call["id"] for call in msg.get("tool_calls") or []]

    def output(self, call_id: str, text: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": call_id, "content": text}

    def user(self, text: str) -> dict[str, Any]:
        return {"role": "user", "content": text}


class ResponsesWire:
    """The client's side of the Responses API as Codex speaks it: a developer item instead of
    instructions, the output items resent as they came (reasoning with its encrypted content),
    ``store: false``."""

    path = "/v1/responses"
    tools: list[dict[str, Any]] = [{"type": "function", **t["function"]} for t in TOOLS]

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message", "role": "developer", "content": SYSTEM},
                {"type": "message", "role": "user", "content": TASK}]

    def body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        return {"model": MODEL, "input": history, "tools": self.tools, "store": False,
                "include": ["reasoning.encrypted_content"], "stream": False}

    def answer(self, answer: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
        items = [{k: v for k, v in item.items() if k not in ("id", "status")}
                 for item in answer["output"]]
        return items, [i["call_id"] for i in items if i.get("type") == "function_call"]

    def output(self, call_id: str, text: str) -> dict[str, Any]:
        return {"type": "function_call_output", "call_id": call_id, "output": text}

    def user(self, text: str) -> dict[str, Any]:
        return {"type": "message", "role": "user", "content": text}


WIRES: dict[str, Callable[[], Wire]] = {"chat": ChatWire, "responses": ResponsesWire}


async def drive(url: str, model: ScriptedModel, *, session: str = "demo",
                on_turn: Callable[[TurnFigures], None] | None = None,
                max_turns: int = 200, follow_ups: list[str] | None = None,
                wire: str = "chat") -> list[TurnFigures]:
    """Play the session in one wire format: the client resends its whole history every request."""
    rnd = random.Random(11)
    steps = model.steps
    client = WIRES[wire]()
    history = client.start()
    figures: list[TurnFigures] = []
    follow = iter(FOLLOW_UPS if follow_ups is None else follow_ups)
    # No API key: the session belongs to the anon tenant, so /files shows it to a plain browser.
    headers = {"x-session-id": session,
               "content-type": "application/json"}
    async with aiohttp.ClientSession() as http:
        for turn in range(1, max_turns + 1):
            body = orjson.dumps(client.body(history))
            t0 = time.perf_counter()
            async with http.post(url + client.path, data=body, headers=headers) as r:
                answer = orjson.loads(await r.read())
                h = r.headers
            ms = (time.perf_counter() - t0) * 1000
            fig = TurnFigures(turn, int(h.get("x-ctxproxy-tokens-in", 0)),
                              int(h.get("x-ctxproxy-tokens-out", 0)),
                              int(h.get("x-ctxproxy-offloaded", 0)),
                              h.get("x-ctxproxy-compacted") == "1", model.summaries, ms)
            figures.append(fig)
            if on_turn:
                on_turn(fig)
            items, calls = client.answer(answer)
            history.extend(items)
            for call_id in calls:
                index = int(call_id.split("_")[1])
                history.append(client.output(call_id, steps[index].output(rnd)))
            if not calls:
                nxt = next(follow, None)
                if nxt is None or model.issued >= len(steps):
                    break
                history.append(client.user(nxt))
    return figures


def _k(n: int) -> str:
    return f"{n / 1000:,.1f}k"


def run_demo(*, data_dir: str | None = None, keep_serving: bool = False) -> int:
    steps = script()
    model = ScriptedModel(steps)
    fake = FakeUpstream(responder=model, models=(MODEL,), record=False)
    root = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="ctxproxy-demo-"))
    with serve_in_thread(fake) as upstream:
        config = config_from_mapping({
            "upstream": {"base_url": upstream.url + "/v1"},
            "storage": {"data_dir": str(root)},
            "compaction": {"context_windows": {MODEL: WINDOW}},
        })
        with serve_in_thread(create_app(config), lifespan="on") as proxy:
            print(f"ctxproxy demo: scripted model on {upstream.url}, proxy on {proxy.url}, "
                  f"context window {WINDOW:,} tokens, data in {root}")
            print(f"{'turn':>4}  {'client sent':>12}  {'forwarded':>10}  {'offloaded':>9}  "
                  f"{'compactions':>11}  {'ms':>6}")

            def line(f: TurnFigures) -> None:
                mark = " (summary in use)" if f.compacted else ""
                print(f"{f.turn:4d}  {_k(f.sent):>8} tok  {_k(f.forwarded):>6} tok  {f.offloaded:9d}  "
                      f"{f.compactions:11d}  {f.ms:6.0f}{mark}", flush=True)

            figures = asyncio.run(drive(proxy.url, model, on_turn=line))
            sent = sum(f.sent for f in figures)
            fwd = sum(f.forwarded for f in figures)
            files = len(list(root.rglob("tool_result/*.txt")))
            print()
            print(f"{len(figures)} turns: the client sent {_k(sent)} tokens in total, ctxproxy "
                  f"forwarded {_k(fwd)} ({fwd / max(sent, 1) * 100:.1f}%); largest request forwarded "
                  f"{_k(max(f.forwarded for f in figures))} of a {_k(WINDOW)} window")
            print(f"{model.summaries} summarizer calls, {files} tool outputs offloaded to files")
            print(f"files: {proxy.url}/files  (data dir: {root})")
            if keep_serving:
                print("serving until Ctrl-C ...", flush=True)
                try:
                    while True:
                        time.sleep(3600)
                except KeyboardInterrupt:
                    pass
    return 0

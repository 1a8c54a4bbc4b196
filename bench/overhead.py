"""Proxy overhead: small requests direct to the fake upstream vs through ctxproxy, interleaved.

    python -m bench.overhead [--rounds 3] [--duration 5] [--connections 32] [--api all]

Starts the fake upstream and ctxproxy as separate processes on loopback and drives both with
wrk (Debian package `wrk`), alternating direct and proxied runs so machine noise hits both alike.
Prints req/s, p50 and p99 per mode and the through-proxy / direct ratio. ``--api messages``
sends small Anthropic Messages requests (``/v1/messages``, to the proxy's Anthropic upstream)
instead of chat completions, ``--api responses`` small OpenAI Responses requests
(``/v1/responses``), ``--api both`` chat and Messages interleaved in one run (``msg`` and
``msgstream`` rows), ``--api all`` the three; the bare aiohttp pass-through serves the OpenAI
formats only.

``--tools`` makes every request declare a tool of the client's own (as agents do): the proxy
then offers its read tool and answers through its read loop (docs/retrieval.md), though the
model never calls it. ``--baseline DIR`` adds a ``base`` mode: a second proxy run from the
source tree ``DIR`` (e.g. a worktree of an earlier commit), measured interleaved with the rest,
so a change's before and after share one run. ``--ledger-off`` adds a ``noledg`` mode: a second
proxy from this tree with the cost ledger off (``ledger: {enabled: false}``), so the ledger's
own cost is the ``proxy`` vs ``noledg`` ratio of one run. ``--otel`` adds an ``otel`` mode: a
second proxy from this tree with telemetry on (docs/observability.md#opentelemetry), exporting
every request's spans to a local OTLP sink (``python -m harness.otlp``), so the cost of
telemetry on vs off shares one run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from harness.process import free_port

ROOT = Path(__file__).resolve().parent.parent
BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hi."}]}
RESPONSES_BODY = {"model": "gpt-4o-mini", "store": False,
                  "input": [{"type": "message", "role": "user", "content": "Say hi."}]}
MESSAGES_BODY = {"model": "claude-haiku-4-5", "max_tokens": 64,
                 "messages": [{"role": "user", "content": "Say hi."}]}
# A client's own tool, in each format's shape (--tools).
_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command.",
                                                "parameters": _SCHEMA}}]
RESPONSES_TOOLS = [{"type": "function", "name": "bash", "description": "Run a command.",
                    "parameters": _SCHEMA}]
MESSAGES_TOOLS = [{"name": "Bash", "description": "Run a command.", "input_schema": _SCHEMA}]
LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench"
wrk.body = [[%s]]
"""
MESSAGES_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["x-api-key"] = "sk-ant-bench"
wrk.headers["anthropic-version"] = "2023-06-01"
wrk.body = [[%s]]
"""


def start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)


def wait_http(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    assert m, text
    return float(m.group(1)) * _UNITS[m.group(2)]


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (Linux /proc): what a request costs the proxy
    whatever else the machine runs (wall-clock figures are not, on a shared machine)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(url: str, script: Path, duration: int, connections: int) -> dict[str, float]:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(script), url],
        capture_output=True, text=True, check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock_err = re.search(r"Socket errors: (.*)", out)
    return {
        "rps": rps, "p50": p50, "p99": p99,
        "requests": float(re.search(r"(\d+) requests in", out).group(1)),  # type: ignore[union-attr]
        "non2xx": float(errors.group(1)) if errors else 0.0,
        "sock_errors": 1.0 if sock_err else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--connections", type=int, default=32, help="for throughput")
    ap.add_argument("--latency-connections", type=int, default=1, help="for unsaturated latency")
    ap.add_argument("--api", choices=("chat", "responses", "messages", "both", "all"),
                    default="chat", help="chat completions, OpenAI Responses, Anthropic Messages, "
                    "chat and Messages interleaved (both), or all three")
    ap.add_argument("--tools", action="store_true",
                    help="requests declare a client tool (the proxy's read loop answers them)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="also measure a proxy run from this source tree (mode 'base')")
    ap.add_argument("--ledger-off", action="store_true",
                    help="also measure a proxy from this tree with the cost ledger off (mode "
                    "'noledg'): the ledger's cost is proxy vs noledg")
    ap.add_argument("--otel", action="store_true",
                    help="also measure a proxy with telemetry on, exporting to a local OTLP "
                    "sink (mode 'otel')")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get install wrk")

    tmp = Path(tempfile.mkdtemp(prefix="ctxbench-"))
    fake_port, proxy_port = free_port(), free_port()
    bare_port, base_port = free_port(), free_port()
    otel_port, sink_port = free_port(), free_port()
    noledg_port = free_port()
    fake = start([sys.executable, "-m", "proxy.demo.fake.upstream", "--port", str(fake_port)])
    bare = start([sys.executable, str(ROOT / "bench" / "bare_passthrough.py"),
                  f"http://127.0.0.1:{fake_port}", str(bare_port)])
    cfg = tmp / "config.yaml"
    cfg.write_text(
        f"upstream: {{base_url: 'http://127.0.0.1:{fake_port}/v1'}}\n"
        f"anthropic: {{base_url: 'http://127.0.0.1:{fake_port}'}}\n"
        f"storage: {{data_dir: '{tmp / 'data'}'}}\n"
    )
    env = {**os.environ}

    def serve(tree: Path, port: int, data: Path, extra: str = "") -> subprocess.Popen[str]:
        # ``python -m proxy`` imports the package of its working directory: the tree's own.
        conf = data.parent / f"config-{port}.yaml"
        conf.write_text(cfg.read_text().replace(str(tmp / "data"), str(data)) + extra)
        return subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(conf), "--port", str(port),
             "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=tree)

    proxy = serve(ROOT, proxy_port, tmp / "data")
    base = serve(args.baseline.resolve(), base_port, tmp / "base-data") if args.baseline else None
    noledg = (serve(ROOT, noledg_port, tmp / "noledg-data", "ledger: {enabled: false}\n")
              if args.ledger_off else None)
    sink = otel = None
    if args.otel:
        sink = start([sys.executable, "-m", "harness.otlp", "--port", str(sink_port)])
        otel = serve(ROOT, otel_port, tmp / "otel-data", "telemetry: {enabled: true, endpoint: "
                     f"'http://127.0.0.1:{sink_port}/v1/traces'}}\n")
    try:
        wait_http(f"http://127.0.0.1:{fake_port}/v1/models")
        wait_http(f"http://127.0.0.1:{proxy_port}/healthz")
        wait_http(f"http://127.0.0.1:{bare_port}/")
        if base is not None:
            wait_http(f"http://127.0.0.1:{base_port}/healthz")
        if noledg is not None:
            wait_http(f"http://127.0.0.1:{noledg_port}/healthz")
        if otel is not None:
            wait_http(f"http://127.0.0.1:{sink_port}/")
            wait_http(f"http://127.0.0.1:{otel_port}/healthz")
        scripts: dict[str, Path] = {}
        targets: dict[str, dict[str, str]] = {}  # request kind -> mode -> URL
        kinds: list[tuple[str, Any, str]] = []
        chat, resp, msg = BODY, RESPONSES_BODY, MESSAGES_BODY
        if args.tools:
            chat, resp = {**chat, "tools": CHAT_TOOLS}, {**resp, "tools": RESPONSES_TOOLS}
            msg = {**msg, "tools": MESSAGES_TOOLS}
        if args.api in ("chat", "both", "all"):
            kinds += [("small", chat, LUA), ("stream", {**chat, "stream": True,
                       "stream_options": {"include_usage": True}}, LUA)]
        if args.api in ("responses", "all"):
            kinds += [("resp", resp, LUA), ("respstream", {**resp, "stream": True}, LUA)]
        if args.api in ("messages", "both", "all"):
            kinds += [("msg", msg, MESSAGES_LUA),
                      ("msgstream", {**msg, "stream": True}, MESSAGES_LUA)]
        for name, body, lua in kinds:
            path = tmp / f"{name}.lua"
            path.write_text(lua % orjson.dumps(body).decode())
            scripts[name] = path
            route = ("/v1/messages" if lua is MESSAGES_LUA else
                     "/v1/responses" if name.startswith("resp") else "/v1/chat/completions")
            targets[name] = {"direct": f"http://127.0.0.1:{fake_port}{route}",
                             "proxy": f"http://127.0.0.1:{proxy_port}{route}"}
            if lua is LUA:  # the bare pass-through serves the OpenAI formats only
                targets[name]["bare"] = f"http://127.0.0.1:{bare_port}{route}"
            if base is not None:
                targets[name]["base"] = f"http://127.0.0.1:{base_port}{route}"
            if otel is not None:
                targets[name]["otel"] = f"http://127.0.0.1:{otel_port}{route}"
            if noledg is not None:
                targets[name]["noledg"] = f"http://127.0.0.1:{noledg_port}{route}"
        tput: dict[tuple[str, str], list[dict[str, float]]] = {}
        lat: dict[tuple[str, str], list[dict[str, float]]] = {}
        for kind, script in scripts.items():  # warm-up
            for target in targets[kind].values():
                wrk(target, script, 1, args.connections)
        pids = {"proxy": proxy.pid, **({"base": base.pid} if base is not None else {}),
                **({"otel": otel.pid} if otel is not None else {}),
                **({"noledg": noledg.pid} if noledg is not None else {})}
        cpu: dict[tuple[str, str], list[float]] = {}  # CPU ms per request of the proxy's process
        for _ in range(args.rounds):
            for kind, script in scripts.items():
                for mode, target in targets[kind].items():
                    before = cpu_seconds(pids[mode]) if mode in pids else 0.0
                    run = wrk(target, script, args.duration, args.connections)
                    tput.setdefault((kind, mode), []).append(run)
                    if mode in pids:
                        cpu.setdefault((kind, mode), []).append(
                            (cpu_seconds(pids[mode]) - before) * 1000 / max(run["requests"], 1))
                    lat.setdefault((kind, mode), []).append(
                        wrk(target, script, args.duration, args.latency_connections)
                    )
        print(f"# {args.api}{' with a client tool' if args.tools else ''}; "
              f"{args.rounds} rounds x {args.duration}s each, interleaved; "
              "wrk 1 thread; "
              f"{os.cpu_count()} cores shared by wrk, proxy and upstream")
        print(f"# throughput at {args.connections} connections; latency at "
              f"{args.latency_connections} connection(s); medians over rounds")
        print(f"{'request':9} {'mode':7} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}")
        for kind in scripts:
            row: dict[str, dict[str, float]] = {}
            for mode in targets[kind]:
                t, lt = tput[(kind, mode)], lat[(kind, mode)]
                row[mode] = {
                    "rps": statistics.median(r["rps"] for r in t),
                    "p50": statistics.median(r["p50"] for r in lt),
                    "p99": statistics.median(r["p99"] for r in lt),
                }
                errs = sum(r["non2xx"] + r["sock_errors"] for r in t + lt)
                print(f"{kind:9} {mode:7} {row[mode]['rps']:9.0f} {row[mode]['p50']:8.2f} "
                      f"{row[mode]['p99']:8.2f} {errs:6.0f}")
            d = row["direct"]
            for mode in [m for m in ("bare", "base", "proxy", "noledg", "otel") if m in row]:
                print(f"{kind:9} {mode:7} ratio {row[mode]['rps'] / d['rps']:.2f}x direct, "
                      f"p50 +{row[mode]['p50'] - d['p50']:.2f} ms, p99 +{row[mode]['p99'] - d['p99']:.2f} ms")
            if "bare" in row:
                print(f"{kind:9} proxy   vs bare aiohttp pass-through: "
                      f"{row['proxy']['rps'] / row['bare']['rps']:.2f}x throughput")
            for mode in [m for m in ("base", "proxy", "noledg", "otel") if (kind, m) in cpu]:
                print(f"{kind:9} {mode:7} CPU {statistics.median(cpu[(kind, mode)]):.3f} ms "
                      "per request (the proxy's process, throughput runs)")
            if "base" in row:
                print(f"{kind:9} proxy   vs base: {row['proxy']['rps'] / row['base']['rps']:.2f}x "
                      f"throughput, p50 {row['proxy']['p50'] - row['base']['p50']:+.2f} ms")
            # A feature's cost: the mode with it on against the mode with it off.
            for on_mode, off_mode, what in (("proxy", "noledg", "the ledger"),
                                            ("otel", "proxy", "telemetry")):
                if on_mode not in row or off_mode not in row:
                    continue
                on, off = (statistics.median(cpu[(kind, m)]) for m in (on_mode, off_mode))
                print(f"{kind:9} {on_mode:7} vs {off_mode} ({what} on vs off): "
                      f"{row[on_mode]['rps'] / row[off_mode]['rps']:.2f}x throughput, "
                      f"p50 {row[on_mode]['p50'] - row[off_mode]['p50']:+.2f} ms, "
                      f"CPU {on / off:.2f}x ({on - off:+.3f} ms per request)")
    finally:
        for p in (proxy, base, noledg, otel, sink, bare, fake):
            if p is None:
                continue
            p.terminate()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

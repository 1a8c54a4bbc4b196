"""ctxproxy vs LiteLLM's proxy, in front of the same fake upstream, interleaved.

    python bench/peers/run.py [--quick] [--rounds 3] [--duration 5] [--big-reps 5] [--startups 3]

Runs from the repository root with the dev virtualenv (/work/venv). On first use it creates
bench/peers/.venv and installs LiteLLM's proxy there (`litellm[proxy]`, same version as the
dev venv's litellm); later runs reuse it (`--reinstall` rebuilds it). Then, all on loopback:

* the fake upstream (`python -m proxy.demo.fake.upstream`), one instance for everyone;
* ctxproxy (`python -m proxy serve`, default pipeline) with upstream.base_url = the fake;
* LiteLLM's proxy (`litellm --config bench/peers/litellm_config.yaml --num_workers 1`), fully
  offline (local cost map, offline mode, no database, no admin UI, no release check) with one
  `openai/gpt-4o-mini` route whose api_base is the fake.

Measured in one run:

* start-up: process spawn until the readiness endpoint answers 200 (ctxproxy `/healthz`,
  LiteLLM `/health/liveliness`), `--startups` spawns each, alternating; RSS (process tree) right
  after start-up and again after all the load below;
* small requests, non-streaming and streaming (`include_usage`), with wrk: req/s and latency at
  32 connections, p50/p99 at 1 connection; A/B/C rounds with the order rotated, medians;
* a ~100k-token agent history (many tool calls with file reads, test logs, greps, diffs):
  end-to-end latency of the first request of a session and of its next turn (the same history
  plus one tool round, as an agent resends it), `--big-reps` sessions per target, p50.

Prints a markdown table. Writes only under bench/peers/ (.venv, and .run/ for configs, logs and
ctxproxy's data dir, removed at the end unless --keep-run).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from harness.process import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VENV = HERE / ".venv"
MARKER = VENV / "ctxbench-installed.json"
MODEL = "gpt-4o-mini"
SMALL = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}]}
STREAM = {**SMALL, "stream": True, "stream_options": {"include_usage": True}}
LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %s"
wrk.body = [[%s]]
"""
TARGETS = ("direct", "litellm", "ctxproxy")


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


# --- LiteLLM's virtualenv -------------------------------------------------------------------


def wanted_litellm_version() -> str:
    try:
        from importlib.metadata import version

        return version("litellm")
    except Exception:  # noqa: BLE001 - the dev venv without litellm: take the index's newest
        return ""


def ensure_venv(reinstall: bool) -> str:
    """Create/reuse bench/peers/.venv with LiteLLM's proxy; return the installed version."""
    want = wanted_litellm_version()
    if not reinstall and MARKER.exists() and (VENV / "bin" / "litellm").exists():
        info = json.loads(MARKER.read_text())
        if not want or info.get("version") == want:
            return str(info["version"])
        log(f"bench/peers/.venv has litellm {info.get('version')}, dev venv has {want}: rebuilding")
    if VENV.exists():
        shutil.rmtree(VENV)
    base = getattr(sys, "_base_executable", None) or sys.executable
    log(f"creating {VENV} with {base}")
    subprocess.run([base, "-m", "venv", str(VENV)], check=True, timeout=300)
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
    spec = f"litellm[proxy]=={want}" if want else "litellm[proxy]"
    log(f"pip install {spec} (a minute or two)")
    t0 = time.perf_counter()
    how = "extra"
    first = subprocess.run([*pip, spec], capture_output=True, text=True, timeout=1800)
    if first.returncode != 0:
        errors = [ln for ln in first.stderr.splitlines() if ln.startswith("ERROR")]
        log(f"{spec} does not resolve here ({'; '.join(errors[-1:])}); installing "
            f"litellm{'==' + want if want else ''} + requirements-proxy.txt instead")
        how = "requirements-proxy.txt"
        core = f"litellm=={want}" if want else "litellm"
        second = subprocess.run([*pip, core, "-r", str(HERE / "requirements-proxy.txt")],
                                capture_output=True, text=True, timeout=1800)
        if second.returncode != 0:
            sys.exit(f"installing LiteLLM's proxy failed:\n{second.stderr[-3000:]}")
    out = subprocess.run([str(VENV / "bin" / "python"), "-c",
                          "import importlib.metadata as m; print(m.version('litellm'))"],
                         capture_output=True, text=True, check=True, timeout=120)
    got = out.stdout.strip()
    MARKER.write_text(json.dumps({"version": got, "how": how}))
    log(f"installed litellm {got} ({how}) in {time.perf_counter() - t0:.0f} s")
    return got


# --- processes ------------------------------------------------------------------------------


class Procs:
    """Every child runs in its own session (process group); cleanup ends each group by its id."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, argv: list[str], *, env: dict[str, str], cwd: Path, log_path: Path,
              stdout_pipe: bool = False) -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as out:
            p = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if stdout_pipe else out, stderr=out,
                env=env, cwd=cwd, start_new_session=True,
            )
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes], grace: float = 8.0) -> None:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        # The group may outlive its leader (workers, helpers): make sure it is gone.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)
        if p.stdout is not None:
            p.stdout.close()
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self) -> None:
        for p in reversed(list(self.procs)):
            self.stop(p, grace=5.0)


def ready(port: int, path: str) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def wait_ready(p: subprocess.Popen[bytes], port: int, path: str, began: float, timeout: float,
               log_path: Path) -> float:
    while True:
        if ready(port, path):
            return time.perf_counter() - began
        if p.poll() is not None:
            raise RuntimeError(f"exited with {p.returncode} during start-up; log tail:\n"
                               f"{tail(log_path)}")
        if time.perf_counter() - began > timeout:
            raise RuntimeError(f"not ready after {timeout:.0f}s; log tail:\n{tail(log_path)}")
        time.sleep(0.01)


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_bytes()[-n:].decode("utf-8", "replace")
    except OSError:
        return "(no log)"


def tree_rss_mb(pid: int) -> float:
    """VmRSS of ``pid`` and all its descendants, in MiB (shared pages counted per process)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    total_kb, todo = 0, [pid]
    while todo:
        cur = todo.pop()
        todo.extend(children.get(cur, []))
        try:
            for line in Path(f"/proc/{cur}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
        except OSError:
            pass
    return total_kb / 1024


def settled_rss_mb(pid: int, window: float = 1.0, limit: float = 15.0) -> float:
    """RSS once start-up work that runs after readiness (ctxproxy loads its tokenizer in the
    background) is done: sampled every 0.25 s until it moved < 1 MB over ``window`` seconds."""
    began = time.perf_counter()
    samples = [(began, tree_rss_mb(pid))]
    while time.perf_counter() - began < limit:
        time.sleep(0.25)
        now = time.perf_counter()
        samples.append((now, tree_rss_mb(pid)))
        recent = [mb for t, mb in samples if now - t <= window]
        if now - began >= window and max(recent) - min(recent) < 1.0:
            break
    return samples[-1][1]


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    startup_s: list[float] = field(default_factory=list)
    rss_start_mb: list[float] = field(default_factory=list)
    rss_ready_mb: list[float] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"


class Bench:
    def __init__(self, args: argparse.Namespace, run_dir: Path, procs: Procs) -> None:
        self.args = args
        self.run = run_dir
        self.procs = procs
        self.key = "sk-ctxbench-" + secrets.token_hex(16)
        self.fake_port = 0
        self.spawns = 0
        self.child_env = {
            **{k: v for k, v in os.environ.items()
               if not k.startswith(("DATABASE_", "REDIS_", "LITELLM_", "OPENAI_", "PYTHONPATH"))
               and k.upper() not in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")},
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
            "TMPDIR": str(run_dir / "tmp"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        }
        (run_dir / "tmp").mkdir(parents=True, exist_ok=True)

    # --- starting things ---

    def start_fake(self) -> None:
        self.fake_port = free_port()
        path = self.run / "fake.log"
        p = self.procs.spawn([sys.executable, "-m", "proxy.demo.fake.upstream", "--port",
                              str(self.fake_port)], env=self.child_env, cwd=ROOT, log_path=path)
        wait_ready(p, self.fake_port, "/v1/models", time.perf_counter(), 30, path)

    def spawn_ctxproxy(self) -> tuple[subprocess.Popen[bytes], int, Path]:
        self.spawns += 1
        port, n = free_port(), self.spawns
        cfg = self.run / f"ctxproxy-{n}.yaml"
        cfg.write_text(
            f"upstream: {{base_url: 'http://127.0.0.1:{self.fake_port}/v1'}}\n"
            f"storage: {{data_dir: '{self.run / f'ctxproxy-data-{n}'}'}}\n"
        )
        path = self.run / f"ctxproxy-{n}.log"
        argv = [sys.executable, "-m", "proxy", "serve", "--config", str(cfg), "--host",
                "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        return self.procs.spawn(argv, env=self.child_env, cwd=ROOT, log_path=path), port, path

    def spawn_litellm(self) -> tuple[subprocess.Popen[bytes], int, Path]:
        self.spawns += 1
        port, n = free_port(), self.spawns
        env = {
            **self.child_env,
            "LITELLM_MASTER_KEY": self.key,
            "CTXBENCH_FAKE_API_BASE": f"http://127.0.0.1:{self.fake_port}/v1",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_OFFLINE_MODE": "true",
            "LITELLM_DISABLE_LATEST_RELEASE_CHECK": "true",
            "LITELLM_DONT_SHOW_FEEDBACK_BOX": "true",
            "DISABLE_ADMIN_UI": "True",
        }
        path = self.run / f"litellm-{n}.log"
        argv = [str(VENV / "bin" / "litellm"), "--config", str(HERE / "litellm_config.yaml"),
                "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1",
                "--log_config", str(HERE / "uvicorn_log_config.yaml")]
        return self.procs.spawn(argv, env=env, cwd=self.run, log_path=path), port, path

    def startups(self) -> dict[str, Server]:
        """`--startups` spawns of each, alternating; the last of each stays up for the load."""
        kinds: dict[str, tuple[Callable[[], tuple[subprocess.Popen[bytes], int, Path]], str, float]] = {
            "ctxproxy": (self.spawn_ctxproxy, "/healthz", 60.0),
            "litellm": (self.spawn_litellm, "/health/liveliness", 180.0),
        }
        servers: dict[str, Server] = {}
        for i in range(self.args.startups):
            order = list(kinds) if i % 2 == 0 else list(reversed(kinds))
            for name in order:
                spawn, path, timeout = kinds[name]
                began = time.perf_counter()
                p, port, log_path = spawn()
                took = wait_ready(p, port, path, began, timeout, log_path)
                rss_ready = tree_rss_mb(p.pid)
                rss = settled_rss_mb(p.pid)
                log(f"start-up {i + 1}/{self.args.startups} {name}: {took:.2f} s, RSS {rss_ready:.0f} MB "
                    f"at readiness, {rss:.0f} MB settled")
                prev = servers.get(name)
                srv = Server(name, port, p, log_path)
                if prev is not None:
                    srv.startup_s, srv.rss_start_mb = prev.startup_s, prev.rss_start_mb
                    srv.rss_ready_mb = prev.rss_ready_mb
                    self.procs.stop(prev.proc)
                srv.startup_s.append(took)
                srv.rss_start_mb.append(rss)
                srv.rss_ready_mb.append(rss_ready)
                servers[name] = srv
        return servers


# --- wrk -------------------------------------------------------------------------------------

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not m:
        raise ValueError(f"wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def wrk(url: str, script: Path, duration: int, connections: int) -> dict[str, float]:
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--timeout", "10s", "--latency",
            "-s", str(script), url]
    out = subprocess.run(argv, capture_output=True, text=True, check=True,
                         timeout=duration + 60).stdout

    def grab(pattern: str) -> str:
        m = re.search(pattern, out, re.M)
        if m is None:
            raise RuntimeError(f"unexpected wrk output:\n{out}")
        return m.group(1)

    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    total = int(grab(r"(\d+) requests in"))
    return {
        "rps": float(grab(r"Requests/sec:\s+([\d.]+)")),
        "p50": _ms(grab(r"^\s+50%\s+(\S+)")),
        "p99": _ms(grab(r"^\s+99%\s+(\S+)")),
        "requests": float(total),
        "errors": float((int(non2xx.group(1)) if non2xx else 0)
                        + (sum(int(g) for g in sock.groups()) if sock else 0)),
    }


# --- the ~100k-token agent history ---------------------------------------------------------

WORDS = ("order", "cart", "price", "total", "discount", "tax", "rate", "item", "user", "session",
         "invoice", "refund", "payment", "amount", "currency", "line", "batch", "queue", "retry",
         "client", "config", "cache", "record", "result", "value", "state", "event", "handler")


def _ident(rnd: random.Random) -> str:
    return "_".join(rnd.sample(WORDS, rnd.randint(1, 3)))


def _fill(size: int, line: Callable[[int], str]) -> str:
    out, total, n = [], 0, 0
    while total < size:
        n += 1
        text = line(n)
        out.append(text)
        total += len(text) + 1
    return "\n".join(out) + "\n"


def _source(rnd: random.Random, path: str, size: int) -> str:
    def line(n: int) -> str:
        r = rnd.random()
        if r < 0.08:
            return f"{n:6d}\tdef {_ident(rnd)}(self, {_ident(rnd)}: int, {_ident(rnd)}: str | None = None) -> dict:"
        if r < 0.14:
            return f'{n:6d}\t    """Return the {_ident(rnd).replace("_", " ")} for {_ident(rnd).replace("_", " ")}."""'
        if r < 0.2:
            return f"{n:6d}\t"
        return (f"{n:6d}\t        {_ident(rnd)} = self.{_ident(rnd)}({_ident(rnd)}, "
                f"{rnd.choice(WORDS)}={rnd.randint(0, 999)})  # {rnd.choice(WORDS)}")
    return _fill(size, line) + f"(end of {path})\n"


def _pytest(rnd: random.Random, size: int) -> str:
    def line(n: int) -> str:
        if rnd.random() < 0.03:
            return (f"tests/test_{rnd.choice(WORDS)}.py::test_{_ident(rnd)} FAILED\n"
                    f"Traceback (most recent call last):\n"
                    f'  File "/repo/shop/{rnd.choice(WORDS)}.py", line {rnd.randint(1, 900)}, in {_ident(rnd)}\n'
                    f"    return round({_ident(rnd)} * (1 - {_ident(rnd)}), 2)\n"
                    f"AssertionError: assert Decimal('{rnd.randint(1, 99)}.99') == Decimal('{rnd.randint(1, 99)}.98')")
        return (f"tests/test_{rnd.choice(WORDS)}.py::test_{_ident(rnd)}[{rnd.randint(0, 64)}] PASSED"
                f"{' ' * rnd.randint(1, 20)}[{n % 100:3d}%]")
    return ("============================= test session starts ==============================\n"
            "platform linux -- Python 3.11.7, pytest-8.3.4\ncollected 2417 items\n\n"
            + _fill(size, line) + "=========== 3 failed, 2414 passed in 41.20s ===========\n")


def _grep(rnd: random.Random, size: int) -> str:
    return _fill(size, lambda n: f"shop/{rnd.choice(WORDS)}/{_ident(rnd)}.py:{rnd.randint(1, 900)}:"
                                 f"        {_ident(rnd)} = round({_ident(rnd)} * {rnd.random():.3f}, 2)")


def _diff(rnd: random.Random, size: int) -> str:
    def line(n: int) -> str:
        if n % 25 == 1:
            return (f"diff --git a/shop/{_ident(rnd)}.py b/shop/{_ident(rnd)}.py\n"
                    f"@@ -{rnd.randint(1, 400)},7 +{rnd.randint(1, 400)},9 @@ def {_ident(rnd)}(self):")
        sign = rnd.choice(" +-  ")
        return f"{sign}        {_ident(rnd)} = {_ident(rnd)}.{_ident(rnd)}({rnd.randint(0, 99)})"
    return _fill(size, line)


def agent_history(target_tokens: int, count: Callable[[str], int], seed: int = 11) -> list[dict[str, Any]]:
    """A coding agent's session: tool rounds (reads, tests, greps, diffs, 0.5-60 KB outputs,
    log-uniform), a short note every few rounds, until the history reaches ``target_tokens``."""
    rnd = random.Random(seed)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent working in /repo. Use the tools to "
                                      "inspect, test and fix the code. Keep answers short."},
        {"role": "user", "content": "The checkout tests fail with a rounding error. Find and fix "
                                    "it; don't touch migrations/, keep Python 3.11 compatible."},
    ]
    tokens = sum(count(m["content"]) for m in msgs)
    turn = 0
    while tokens < target_tokens:
        turn += 1
        size = int(500 * 120 ** rnd.random())  # 0.5-60 KB, most outputs small
        kind = rnd.choice(("read", "read", "test", "grep", "diff", "ls"))
        if kind == "read":
            path = f"/repo/shop/{_ident(rnd)}.py"
            name, args, out = "read_file", {"file_path": path, "start_line": 1}, _source(rnd, path, size)
        elif kind == "test":
            name, args, out = "bash", {"cmd": f"pytest -q tests/ -k {_ident(rnd)}"}, _pytest(rnd, size)
        elif kind == "grep":
            name, args, out = "grep", {"pattern": f"round\\(.*{rnd.choice(WORDS)}"}, _grep(rnd, size)
        elif kind == "diff":
            name, args, out = "bash", {"cmd": "git diff"}, _diff(rnd, size)
        else:
            name, args = "bash", {"cmd": f"ls -la shop/{rnd.choice(WORDS)}"}
            out = _fill(min(size, 3000), lambda n: f"-rw-r--r-- 1 dev dev {rnd.randint(100, 99999):6d} "
                                                   f"Dec  2 10:{n % 60:02d} {_ident(rnd)}.py")
        call_id = f"call_{turn:04d}"
        note = f"Checking {args.get('file_path') or args.get('cmd') or args.get('pattern')}."
        msgs.append({"role": "assistant", "content": note, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": orjson.dumps(args).decode()}}]})
        msgs.append({"role": "tool", "tool_call_id": call_id, "content": out})
        tokens += count(note) + count(out) + 20
        if turn % 6 == 0:
            text = (f"So far: the {_ident(rnd).replace('_', ' ')} path rounds before applying the "
                    f"{_ident(rnd).replace('_', ' ')}; next I'll check the {rnd.choice(WORDS)} tests.")
            msgs.append({"role": "assistant", "content": text})
            msgs.append({"role": "user", "content": "Go on."})
            tokens += count(text) + 10
    return msgs


def token_counter() -> tuple[Callable[[str], int], str]:
    try:
        from proxy.tokens.counter import TokenCounter

        tc = TokenCounter()
        if tc.encoding_name(MODEL) != "utf8/4":
            return (lambda text: tc.count_text(text, MODEL)), tc.encoding_name(MODEL)
    except Exception:  # noqa: BLE001 - fall back to the estimate
        pass
    return (lambda text: len(text.encode()) // 4), "utf8/4 estimate"


def variant(base: list[dict[str, Any]], nonce: str) -> list[dict[str, Any]]:
    """The same history as another session: every tool output and the task carry ``nonce``."""
    out = []
    for m in base:
        if m["role"] in ("tool", "system"):
            m = {**m, "content": f"[{nonce}]\n{m['content']}"}
        out.append(m)
    return out


def next_turn(msgs: list[dict[str, Any]], rnd: random.Random) -> list[dict[str, Any]]:
    call_id = f"call_next_{rnd.randint(0, 10**9)}"
    return [*msgs,
            {"role": "assistant", "content": "Running the failing test again.", "tool_calls": [
                {"id": call_id, "type": "function", "function": {
                    "name": "bash", "arguments": '{"cmd": "pytest -q tests/test_checkout.py"}'}}]},
            {"role": "tool", "tool_call_id": call_id, "content": _pytest(rnd, 3000)}]


def post(client: httpx.Client, url: str, body: bytes) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = client.post(url, content=body)
    data = r.content
    took = (time.perf_counter() - t0) * 1000
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {data[:500]!r}")
    usage = orjson.loads(data).get("usage") or {}
    # The fake upstream reports prompt_tokens = bytes it received // 4.
    return took, int(usage.get("prompt_tokens", 0)) * 4


# --- the run ---------------------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run(args: argparse.Namespace, run_dir: Path, procs: Procs, version: str) -> str:
    bench = Bench(args, run_dir, procs)
    bench.start_fake()
    servers = bench.startups()
    urls = {"direct": f"http://127.0.0.1:{bench.fake_port}/v1/chat/completions",
            "litellm": servers["litellm"].url, "ctxproxy": servers["ctxproxy"].url}

    # Small requests with wrk.
    scripts = {}
    for kind, body in (("small", SMALL), ("stream", STREAM)):
        path = run_dir / f"{kind}.lua"
        path.write_text(LUA % (bench.key, orjson.dumps(body).decode()))
        scripts[kind] = path
    for script in scripts.values():  # warm-up: connections, caches, lazy imports
        for url in urls.values():
            wrk(url, script, 1, args.connections)
    tput: dict[tuple[str, str], list[dict[str, float]]] = {}
    lat: dict[tuple[str, str], list[dict[str, float]]] = {}
    for rnd_i in range(args.rounds):
        order = list(TARGETS[rnd_i % 3:] + TARGETS[:rnd_i % 3])
        for kind, script in scripts.items():
            for target in order:
                t = wrk(urls[target], script, args.duration, args.connections)
                lt = wrk(urls[target], script, args.duration, 1)
                tput.setdefault((kind, target), []).append(t)
                lat.setdefault((kind, target), []).append(lt)
                log(f"round {rnd_i + 1}/{args.rounds} {kind:6} {target:8} {t['rps']:8.0f} req/s "
                    f"@{args.connections}, p99 {lt['p99']:.2f} ms @1")

    rss_wrk = {name: tree_rss_mb(s.proc.pid) for name, s in servers.items()}

    # The ~100k-token history.
    count, enc = token_counter()
    base = agent_history(args.big_tokens, count)
    base_tokens = sum(count(m.get("content") or "") for m in base)
    rnd = random.Random(5)
    big: dict[str, dict[str, list[float]]] = {t: {"first": [], "next": [], "fwd": []} for t in TARGETS}
    headers = {"Authorization": f"Bearer {bench.key}", "Content-Type": "application/json"}
    clients = {t: httpx.Client(headers=headers, timeout=httpx.Timeout(120.0)) for t in TARGETS}
    try:
        for t in TARGETS:  # warm-up with a history nobody else uses
            post(clients[t], urls[t], orjson.dumps({"model": MODEL, "messages": variant(base, f"warm-{t}")}))
        sizes = []
        for rep in range(args.big_reps):
            order = list(TARGETS[rep % 3:] + TARGETS[:rep % 3])
            for t in order:
                msgs = variant(base, f"session-{rep}-{t}-{secrets.token_hex(4)}")
                first = orjson.dumps({"model": MODEL, "messages": msgs})
                nxt = orjson.dumps({"model": MODEL, "messages": next_turn(msgs, rnd)})
                sizes.append(len(first))
                ms1, fwd = post(clients[t], urls[t], first)
                ms2, _ = post(clients[t], urls[t], nxt)
                big[t]["first"].append(ms1)
                big[t]["next"].append(ms2)
                big[t]["fwd"].append(fwd)
            log(f"100k history rep {rep + 1}/{args.big_reps}: " + ", ".join(
                f"{t} {big[t]['first'][-1]:.0f}/{big[t]['next'][-1]:.0f} ms" for t in TARGETS))
    finally:
        for c in clients.values():
            c.close()

    time.sleep(1.0)
    rss_after = {name: tree_rss_mb(s.proc.pid) for name, s in servers.items()}
    for name, s in servers.items():
        if s.proc.poll() is not None:
            raise RuntimeError(f"{name} died during the run; log tail:\n{tail(s.log_path)}")

    # --- report ---
    def row(label: str, vals: dict[str, str], note: str = "") -> str:
        return f"| {label} | {vals.get('direct', '-')} | {vals.get('litellm', '-')} | " \
               f"{vals.get('ctxproxy', '-')} | {note} |"

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.1f}x" if b > 0 else "-"

    def lower(ctx: float, lite: float, what: str = "") -> str:
        """How ctxproxy's value compares where lower is better: '5.2x lower' / '1.3x higher'."""
        if ctx <= 0 or lite <= 0:
            return "-"
        word = "lower" if ctx <= lite else "higher"
        return f"{what}{max(ctx, lite) / min(ctx, lite):.1f}x {word}"

    lines = [
        f"# ctxproxy vs LiteLLM proxy {version} — {time.strftime('%Y-%m-%d %H:%M')}, "
        f"{os.cpu_count()} cores shared by wrk, the proxies and the fake upstream; "
        f"load average at the end {os.getloadavg()[0]:.2f}",
        f"# wrk: {args.rounds} rounds x {args.duration} s per cell, order rotated; throughput "
        f"at {args.connections} connections, latency at 1; medians over rounds. LiteLLM: 1 worker.",
        "",
        "| metric | direct | LiteLLM proxy | ctxproxy | ctxproxy vs LiteLLM |",
        "|---|---:|---:|---:|---:|",
    ]
    errors: dict[str, float] = dict.fromkeys(TARGETS, 0.0)
    for kind in scripts:
        r = {t: med([x["rps"] for x in tput[(kind, t)]]) for t in TARGETS}
        p50c = {t: med([x["p50"] for x in tput[(kind, t)]]) for t in TARGETS}
        p99c = {t: med([x["p99"] for x in tput[(kind, t)]]) for t in TARGETS}
        p50 = {t: med([x["p50"] for x in lat[(kind, t)]]) for t in TARGETS}
        p99 = {t: med([x["p99"] for x in lat[(kind, t)]]) for t in TARGETS}
        for t in TARGETS:
            errors[t] += sum(x["errors"] for x in tput[(kind, t)] + lat[(kind, t)])
        lines.append(row(f"{kind}: req/s @{args.connections} conns",
                         {t: f"{r[t]:.0f}" for t in TARGETS}, ratio(r["ctxproxy"], r["litellm"]) + " the req/s"))
        lines.append(row(f"{kind}: p50 / p99 ms @{args.connections} conns",
                         {t: f"{p50c[t]:.2f} / {p99c[t]:.2f}" for t in TARGETS},
                         lower(p99c["ctxproxy"], p99c["litellm"], "p99 ")))
        lines.append(row(f"{kind}: p50 / p99 ms @1 conn",
                         {t: f"{p50[t]:.2f} / {p99[t]:.2f}" for t in TARGETS},
                         lower(p99["ctxproxy"], p99["litellm"], "p99 ")))
    lines.append(row("small+stream: errors (non-2xx, socket)", {t: f"{errors[t]:.0f}" for t in TARGETS}))
    bf = {t: med(big[t]["first"]) for t in TARGETS}
    bn = {t: med(big[t]["next"]) for t in TARGETS}
    lines.append(row(f"~100k-token history: first request p50 ms (n={args.big_reps})",
                     {t: f"{bf[t]:.0f}" for t in TARGETS}, lower(bf["ctxproxy"], bf["litellm"])))
    lines.append(row(f"~100k-token history: next turn p50 ms (n={args.big_reps})",
                     {t: f"{bn[t]:.0f}" for t in TARGETS}, lower(bn["ctxproxy"], bn["litellm"])))
    lines.append(row("~100k-token history: KB the upstream received",
                     {t: f"{med(big[t]['fwd']) / 1024:.0f}" for t in TARGETS}))
    su = {n: med(s.startup_s) for n, s in servers.items()}
    rs = {n: med(s.rss_start_mb) for n, s in servers.items()}
    lines.append(row(f"start-up s, spawn -> ready (median of {args.startups})",
                     {n: f"{v:.2f}" for n, v in su.items()}, lower(su["ctxproxy"], su["litellm"])))
    rr = {n: med(s.rss_ready_mb) for n, s in servers.items()}
    lines.append(row("RSS MB at readiness (process tree)",
                     {n: f"{v:.0f}" for n, v in rr.items()}, lower(rr["ctxproxy"], rr["litellm"])))
    lines.append(row("RSS MB after start-up, settled (process tree)",
                     {n: f"{v:.0f}" for n, v in rs.items()}, lower(rs["ctxproxy"], rs["litellm"])))
    lines.append(row("RSS MB after the small/stream load", {n: f"{v:.0f}" for n, v in rss_wrk.items()},
                     lower(rss_wrk["ctxproxy"], rss_wrk["litellm"])))
    lines.append(row(f"RSS MB after that + {1 + args.big_reps} ~100k sessions",
                     {n: f"{v:.0f}" for n, v in rss_after.items()},
                     lower(rss_after["ctxproxy"], rss_after["litellm"])))
    lines += [
        "",
        f"History: {len(base)} messages, {statistics.median(sizes) / 1024:.0f} KB of JSON, "
        f"{base_tokens:,} tokens ({enc}); each session is a fresh copy (new content hashes), "
        "its next turn adds one tool round. Readiness: ctxproxy /healthz, LiteLLM /health/liveliness.",
        "",
        "Targets:",
    ]
    small_r = {t: med([x["rps"] for x in tput[("small", t)]]) for t in TARGETS}
    small_p99 = {t: med([x["p99"] for x in lat[("small", t)]]) for t in TARGETS}
    small_p99c = {t: med([x["p99"] for x in tput[("small", t)]]) for t in TARGETS}

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    x = small_r["ctxproxy"] / small_r["litellm"] if small_r["litellm"] else float("inf")
    lines += [
        f"- small-request throughput >= 10x LiteLLM: {x:.1f}x — {verdict(x >= 10)}",
        f"- lower small-request p99: {small_p99['ctxproxy']:.2f} vs {small_p99['litellm']:.2f} ms @1, "
        f"{small_p99c['ctxproxy']:.2f} vs {small_p99c['litellm']:.2f} ms @{args.connections} — "
        f"{verdict(small_p99['ctxproxy'] < small_p99['litellm'] and small_p99c['ctxproxy'] < small_p99c['litellm'])}",
        f"- ctxproxy start-up < 1.5 s: {su['ctxproxy']:.2f} s — {verdict(su['ctxproxy'] < 1.5)} "
        f"(LiteLLM: {su['litellm']:.2f} s)",
        f"- ctxproxy RSS < 150 MB after start-up: {rs['ctxproxy']:.0f} MB — {verdict(rs['ctxproxy'] < 150)}; "
        f"after the load: {rss_after['ctxproxy']:.0f} MB — {verdict(rss_after['ctxproxy'] < 150)} "
        f"(LiteLLM: {rs['litellm']:.0f} / {rss_after['litellm']:.0f} MB)",
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round x 3 s, 2 big reps, 1 start-up")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=5, help="seconds per wrk cell")
    ap.add_argument("--connections", type=int, default=32, help="for throughput")
    ap.add_argument("--big-reps", type=int, default=5, help="sessions of the ~100k-token history per target")
    ap.add_argument("--big-tokens", type=int, default=100_000)
    ap.add_argument("--startups", type=int, default=3, help="spawns of each proxy for start-up time")
    ap.add_argument("--reinstall", action="store_true", help="rebuild bench/peers/.venv")
    ap.add_argument("--keep-run", action="store_true", help="keep bench/peers/.run/<stamp> (logs, data)")
    ap.add_argument("--save", type=Path, help="also write the table to this file")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.duration, args.big_reps, args.startups = 1, 3, 2, 1
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get install wrk")
    if not (ROOT / "proxy" / "__init__.py").exists():
        sys.exit(f"run from a ctxproxy checkout ({ROOT} has no proxy/)")
    began = time.perf_counter()
    version = ensure_venv(args.reinstall)
    run_dir = HERE / ".run" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    procs = Procs()
    ok = False
    try:
        with sigterm_as_exit():
            table = run(args, run_dir, procs, version)
            ok = True
    finally:
        procs.stop_all()
        if ok and not args.keep_run:
            shutil.rmtree(run_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                (HERE / ".run").rmdir()
        elif not ok:
            log(f"failed; logs kept in {run_dir}")
    print(table)
    if args.save:
        args.save.write_text(table + "\n")
    log(f"done in {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()

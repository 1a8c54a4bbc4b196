"""Crash safety of the real server process (issue 6): ``kill -9`` during a replayed session.

An agent session is replayed through ``python -m proxy serve`` (a child process) against the
fake upstream (in this process). The client resends its whole history every turn; tool outputs
are large enough to be offloaded and the context window small enough for compactions. The
server is SIGKILLed at chosen and random moments -- while the proxy waits for the model, in the
middle of a relayed stream, at a random delay into a turn -- restarted, and the interrupted turn
is retried; after some kills a torn archive line is planted as a kill mid-``write`` would leave
it. Checked after every restart: ``/files`` lists and serves only complete offloaded files. At
the end: every dialog line parses except the torn fragments (closed off by the writer, never
glued to the next line; a torn *last* line is skipped by the reader), every index row points at
its line, every ``tool_result`` file equals the original the client sent, the model's reads of
offloaded files (the read path) returned the complete original, SQLite's integrity check passes
and every summary row is consistent with its ``.md`` copy, the archive and the history; the
replay's last turn succeeds.

The default suite kills 3 times (each kill costs a start-up, ~1 s, and a cold first request,
~0.6 s while the tokenizer loads); ``test_crash_stress`` kills 50 times and runs only with
``-m stress`` or ``CTXPROXY_STRESS=1`` (``CTXPROXY_STRESS_KILLS`` and ``CTXPROXY_CRASH_SEED``
tune it; pyproject's addopts do not deselect the marker, so the test skips itself otherwise).
"""

from __future__ import annotations

import os
import random
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import orjson
import pytest
import yaml

from harness.process import ProxyProcess
from proxy.compaction.prompt import SECTIONS, SYSTEM_PROMPT
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.formats.chat.answer import StreamAssembler
from proxy.store.chains import chain_hashes
from proxy.store.db import Database
from proxy.store.dialog_read import parse_record, read_lines
from proxy.store.summaries import SummaryStore, _markdown
from proxy.store.tool_results import ToolResultStore, relative_path, result_id
from proxy.truncation.cut import read_chunk
from proxy.truncation.notice import parse_notice

ROOT = Path(__file__).resolve().parents[1]
TENANT = "anon"  # no API key
SESSION = "crash"
MODEL = "crash-model"
WINDOW = 12_000
RECENT_MAX = 4096
SLACK = 100
READ_TOOL = "read_offloaded"
SYSTEM = "You are a coding agent replaying a scripted session for the crash-safety test."
TASK = "Find out why the checkout tests fail and fix it. Do not touch migrations/."
FINAL = "All steps done."
TEXT_EVERY = 5  # a text answer (and a user follow-up) after every fifth tool call
READ_EVERY = 4  # the model reads an offloaded file after every fourth tool call
MODEL_DELAY_S = 0.02
STREAM_CHUNK_DELAY_S = 0.01
SUMMARY = "\n".join(f"{h}\n- crash replay: {h.strip('# ').lower()}" for h in SECTIONS) + "\n"
TOOLS = [
    {"type": "function", "function": {"name": name, "description": name,
                                      "parameters": {"type": "object", "properties": {}}}}
    for name in ("bash", "grep")
]
DEFAULT_KILLS = 3  # the default suite; test_crash_stress does 50
LINE_PREFIX = b'{"v":1,'  # how every archive line starts (orjson, keys in insertion order)

KillMode = Literal["upstream", "stream", "timer"]


# --- the scripted session --------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    tool: str
    args: dict[str, Any]
    output: str


def make_steps(n: int, seed: int) -> list[Step]:
    """Tool outputs of 0.5-40 KB (log-uniform), some non-ASCII, each unique."""
    rnd = random.Random(seed)
    steps = []
    for i in range(n):
        size = int(500 * 80 ** rnd.random())
        accent = "é日本" if i % 4 == 1 else ""
        lines: list[str] = []
        total = 0
        while total < size:
            line = f"step {i} line {len(lines) + 1}: {accent}value={rnd.randint(0, 10**9)}"
            if rnd.random() < 0.02:
                line = f"Traceback (most recent call last): step {i} error {rnd.randint(0, 99)}"
            lines.append(line)
            total += len(line) + 1
        tool = "bash" if i % 2 else "grep"
        steps.append(Step(tool, {"cmd": f"{tool} step {i}"}, "\n".join(lines) + "\n"))
    return steps


def offloaded_path(text: str) -> str:
    return relative_path(result_id(TENANT, SESSION, text))


@dataclass
class ReplayModel:
    """The model behind the proxy, deterministic in the history it is sent (so a retried turn
    gets the same answer): the next tool call follows the newest client tool result it sees."""

    steps: list[Step]
    originals: dict[str, str]  # "tool_result/<id>.txt" -> the output the client sent
    on_request: Callable[[], None] | None = None  # called as each model request arrives
    summaries: int = 0
    reads: int = 0
    read_problems: list[str] = field(default_factory=list)

    def __call__(self, body: dict[str, Any]) -> Reply:
        if self.on_request is not None:
            self.on_request()
        msgs: list[dict[str, Any]] = body.get("messages") or []
        if msgs and msgs[0].get("content") == SYSTEM_PROMPT:
            self.summaries += 1
            return Reply(content=SUMMARY, delay_s=MODEL_DELAY_S)
        last = msgs[-1]
        n = newest_step(msgs)
        after_tool = last.get("role") == "tool"
        if after_tool and str(last.get("tool_call_id")).startswith("read_"):
            self._check_read(msgs)
        elif after_tool and n % READ_EVERY == READ_EVERY - 1:
            target = self._read_target(body)
            if target is not None:
                return Reply(content=None, delay_s=MODEL_DELAY_S, tool_calls=[{
                    "id": f"read_{n:03d}", "name": READ_TOOL,
                    "arguments": {"file_path": target, "start_line": 1}}])
        trickle = STREAM_CHUNK_DELAY_S if body.get("stream") else 0.0
        if n + 1 >= len(self.steps):
            return Reply(content=FINAL, delay_s=MODEL_DELAY_S, chunk_delay_s=trickle)
        if after_tool and (n + 1) % TEXT_EVERY == 0:
            return Reply(content=f"Progress after step {n}.", delay_s=MODEL_DELAY_S,
                         chunk_delay_s=trickle)
        step = self.steps[n + 1]
        return Reply(content=None, delay_s=MODEL_DELAY_S, chunk_delay_s=trickle, tool_calls=[
            {"id": f"call_{n + 1:03d}", "name": step.tool, "arguments": step.args}])

    def _read_target(self, body: dict[str, Any]) -> str | None:
        names = {(t.get("function") or {}).get("name") for t in body.get("tools") or []}
        if READ_TOOL not in names:
            return None
        for m in reversed(body["messages"]):
            content = m.get("content")
            if m.get("role") == "tool" and isinstance(content, str):
                notice = parse_notice(content)
                if notice is not None and notice.tool == READ_TOOL:
                    return notice.file_path
        return None

    def _check_read(self, msgs: list[dict[str, Any]]) -> None:
        """The proxy ran our read: it must have read the whole original, never a partial file."""
        self.reads += 1
        call = msgs[-2]["tool_calls"][0]["function"]
        path = orjson.loads(call["arguments"])["file_path"]
        original = self.originals.get(path)
        if original is None:
            self.read_problems.append(f"read of an unknown file {path}")
            return
        expected = read_chunk(original, 1, 0, RECENT_MAX, file_path=path, tool=READ_TOOL)
        if msgs[-1].get("content") != expected:
            got = str(msgs[-1].get("content"))[:200]
            self.read_problems.append(f"read of {path} returned {got!r}")


def newest_step(msgs: list[dict[str, Any]]) -> int:
    """Index of the newest client tool result (``call_NNN``) in ``msgs``; -1 if none."""
    for m in reversed(msgs):
        cid = m.get("tool_call_id")
        if m.get("role") == "tool" and isinstance(cid, str) and cid.startswith("call_"):
            return int(cid.removeprefix("call_"))
    return -1


@dataclass
class Client:
    """The agent: resends its whole history each turn and appends what the model answered."""

    steps: list[Step]
    history: list[dict[str, Any]] = field(default_factory=lambda: [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}])
    turns: int = 0
    done: bool = False
    last_request: list[dict[str, Any]] = field(default_factory=list)

    def body(self, stream: bool) -> bytes:
        return orjson.dumps({"model": MODEL, "messages": self.history, "tools": TOOLS,
                             "stream": stream})

    def apply(self, msg: dict[str, Any]) -> None:
        self.last_request = list(self.history)
        self.turns += 1
        self.history.append(msg)
        calls = msg.get("tool_calls") or []
        for call in calls:
            cid = call["id"]
            assert cid.startswith("call_"), f"the proxy leaked its own tool call {cid}"
            step = self.steps[int(cid.removeprefix("call_"))]
            self.history.append({"role": "tool", "tool_call_id": cid, "content": step.output})
        if not calls:
            if msg.get("content") == FINAL:
                self.done = True
            else:
                self.history.append({"role": "user", "content": f"Go on (turn {self.turns})."})


class Interrupted(Exception):
    """The turn did not complete (the server died under it)."""


def send(http: httpx.Client, url: str, body: bytes, stream: bool,
         on_first_chunk: Callable[[], None] | None = None) -> dict[str, Any]:
    headers = {"x-session-id": SESSION, "content-type": "application/json"}
    endpoint = url + "/v1/chat/completions"
    try:
        if not stream:
            r = http.post(endpoint, content=body, headers=headers)
            assert r.status_code == 200, f"{r.status_code}: {r.text[:500]}"
            message: dict[str, Any] = r.json()["choices"][0]["message"]
            return message
        with http.stream("POST", endpoint, content=body, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                raise AssertionError(f"{r.status_code}: {r.text[:500]}")
            asm = StreamAssembler()
            for chunk in r.iter_raw():
                asm.feed(chunk)
                if on_first_chunk is not None:
                    on_first_chunk()
                    on_first_chunk = None
            if not asm.done:
                raise Interrupted("stream ended without [DONE]")
            assembled = asm.message()
            assert assembled is not None
            return assembled
    except httpx.TransportError as exc:
        raise Interrupted(repr(exc)) from exc


# --- killing ---------------------------------------------------------------------------------


@dataclass
class Kill:
    mode: KillMode
    mid_request: bool
    turn: int


class Killer:
    """SIGKILLs one particular server process (never a later one), once."""

    def __init__(self, proc: subprocess.Popen[bytes], in_flight: threading.Event,
                 mode: KillMode, turn: int) -> None:
        self.proc = proc
        self.in_flight = in_flight
        self.mode: KillMode = mode
        self.turn = turn
        self.fired = threading.Event()
        self.kill: Kill | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def now(self) -> None:
        with self._lock:
            if self.fired.is_set():
                return
            if self.proc.poll() is None:
                mid = self.in_flight.is_set()
                self.proc.send_signal(signal.SIGKILL)
                self.kill = Kill(self.mode, mid, self.turn)
            self.fired.set()

    def after(self, delay: float) -> None:
        def run() -> None:
            time.sleep(delay)
            self.now()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


@dataclass
class CrashReport:
    kills: list[Kill]
    startup_s: list[float]
    turns: int
    attempts: int
    summaries: int
    reads: int
    offloaded_files: int
    stray_temp_files: int
    torn_planted: int
    torn_found: int
    duplicate_lines: int
    seconds: float

    def line(self) -> str:
        modes = {m: sum(1 for k in self.kills if k.mode == m) for m in ("upstream", "stream", "timer")}
        mid = sum(1 for k in self.kills if k.mid_request)
        s = self.startup_s
        return (f"{len(self.kills)} kills ({mid} mid-request; {modes}), {self.turns} turns in "
                f"{self.attempts} attempts, {self.summaries} summarizer calls, {self.reads} reads, "
                f"{self.offloaded_files} offloaded files ({self.stray_temp_files} stray temp), "
                f"torn lines planted {self.torn_planted} / found {self.torn_found}, "
                f"{self.duplicate_lines} re-written lines; start-up median "
                f"{statistics.median(s):.2f} s max {max(s):.2f} s over {len(s)} starts; "
                f"{self.seconds:.1f} s")


# --- the run ---------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def session_dir(data_dir: Path) -> Path:
    return data_dir / TENANT / SESSION


def plant_torn_line(data_dir: Path) -> bytes | None:
    """What a kill in the middle of a large ``write`` leaves: the first half of a line, no
    newline, at the end of the newest archive file."""
    files = sorted((session_dir(data_dir) / "dialog").glob("*.jsonl"))
    if not files:
        return None
    data = files[-1].read_bytes()
    lines = data.split(b"\n")
    if len(lines) < 2 or not lines[-2] or lines[-1]:
        return None  # nothing whole to copy, or a torn line is there already
    fragment = lines[-2][: max(8, len(lines[-2]) // 2)]
    with open(files[-1], "ab") as f:
        f.write(fragment)
    return fragment


def check_served(http: httpx.Client, url: str, originals: dict[str, str]) -> int:
    """``/files`` lists only complete offloaded files and serves each one whole."""
    r = http.get(f"{url}/files/{TENANT}/{SESSION}", headers={"accept": "application/json"})
    if r.status_code == 404:
        return 0  # nothing recorded for the session yet
    assert r.status_code == 200, r.text[:300]
    listed = r.json()["tool_results"]
    for entry in listed:
        rel = f"tool_result/{entry['name']}"
        assert rel in originals, f"/files lists {rel}, which is no original of the replay"
        want = originals[rel].encode("utf-8")
        assert entry["size"] == len(want), f"/files lists {rel} with {entry['size']} bytes"
        raw = http.get(f"{url}/files/{TENANT}/{SESSION}/{rel}", params={"raw": "1"})
        assert raw.status_code == 200 and raw.content == want, f"{rel} served partially"
    return len(listed)


def run_crash_replay(
    tmp_path: Path, fake: FakeUpstream, fake_url: str, *, kills: int, steps_n: int, seed: int
) -> CrashReport:
    began = time.perf_counter()
    rng = random.Random(seed)
    data_dir = tmp_path / "data"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "server": {"shutdown_timeout_s": 2},
        "upstream": {"base_url": fake_url},
        "storage": {"data_dir": str(data_dir)},
        "offload": {"recent_max_bytes": RECENT_MAX, "old_max_bytes": 1024,
                    "markdown_max_bytes": RECENT_MAX, "slack_bytes": SLACK,
                    "age_batch_bytes": 8192},
        "compaction": {"context_windows": {MODEL: WINDOW}},
    }))
    steps = make_steps(steps_n, seed)
    originals = {offloaded_path(s.output): s.output for s in steps}
    model = ReplayModel(steps, originals)
    fake.responder = model
    server = ProxyProcess(cfg, log_path=tmp_path / "server.log", python=sys.executable,
                          env=child_env(), cwd=ROOT)
    client = Client(steps)
    in_flight = threading.Event()
    # Kills spread over the turns the session will take (tool calls plus text answers).
    expected_turns = steps_n + steps_n // TEXT_EVERY
    schedule = sorted(rng.randrange(1, max(2, expected_turns - 2)) for _ in range(kills))
    done_kills: list[Kill] = []
    pending: Killer | None = None
    planted: list[bytes] = []
    restarts = attempts = 0
    turn_s = 0.1

    def restart(http: httpx.Client, killer: Killer) -> None:
        """After a kill: plant a torn line now and then, start again, check what /files serves."""
        nonlocal restarts
        killer.join()
        assert killer.kill is not None, "the process was dead before its kill"
        done_kills.append(killer.kill)
        server.wait(timeout=10)
        restarts += 1
        if restarts % 3 == 1:
            fragment = plant_torn_line(data_dir)
            if fragment is not None:
                planted.append(fragment)
        server.start()
        check_served(http, server.url, originals)

    try:
        server.start()
        with httpx.Client(timeout=60) as http:
            while not client.done:
                attempts += 1
                assert attempts < 10 * expected_turns + 10 * kills, "the replay does not progress"
                stream = client.turns % 3 == 2
                if pending is None and schedule and schedule[0] <= client.turns:
                    index = kills - len(schedule)
                    mode: KillMode = "upstream" if index == 0 else "stream" if index == 1 else "timer"
                    if mode != "stream" or stream:
                        schedule.pop(0)
                        assert server.proc is not None
                        pending = Killer(server.proc, in_flight, mode, client.turns)
                        if mode == "timer":
                            pending.after(rng.uniform(0, 1.5 * turn_s))
                killer = pending
                model.on_request = killer.now if killer and killer.mode == "upstream" else None
                first_chunk = killer.now if killer and killer.mode == "stream" else None
                t0 = time.perf_counter()
                in_flight.set()
                try:
                    msg = send(http, server.url, client.body(stream), stream, first_chunk)
                except Interrupted as exc:
                    in_flight.clear()
                    model.on_request = None
                    assert killer is not None and killer.fired.is_set(), (
                        f"turn {client.turns} failed without a kill: {exc}{server.log_tail()}")
                    restart(http, killer)
                    pending = None
                    continue  # retry the interrupted turn
                finally:
                    in_flight.clear()
                turn_s = 0.7 * turn_s + 0.3 * (time.perf_counter() - t0)
                client.apply(msg)
                if pending is not None and pending.fired.is_set():
                    # Fired once this turn's answer had arrived: the server died between turns.
                    restart(http, pending)
                    pending = None
            model.on_request = None
            if pending is not None:  # a timer still running at the end: let it fire, restart
                pending.join()
                restart(http, pending)
            # After all that, the last turn, resent, still succeeds and the files serve whole.
            again = send(http, server.url, orjson.dumps({
                "model": MODEL, "messages": client.last_request, "tools": TOOLS}), False)
            assert again.get("content") == FINAL
            served = check_served(http, server.url, originals)
        server.signal(signal.SIGTERM)
        assert server.wait(timeout=15) == 0
    finally:
        server.kill()
        fake.responder = None

    assert len(done_kills) == kills, (done_kills, schedule)
    assert not model.read_problems, model.read_problems
    report = check_data(data_dir, client, steps, originals, planted, kills)
    assert served == report.offloaded_files
    return CrashReport(
        kills=done_kills, startup_s=server.startup_s, turns=client.turns, attempts=attempts,
        summaries=model.summaries, reads=model.reads, offloaded_files=report.offloaded_files,
        stray_temp_files=report.stray_temp_files, torn_planted=len(planted),
        torn_found=report.torn_found, duplicate_lines=report.duplicates,
        seconds=time.perf_counter() - began,
    )


# --- the checks on disk ----------------------------------------------------------------------


@dataclass
class DataReport:
    offloaded_files: int
    stray_temp_files: int
    torn_found: int
    duplicates: int


def check_data(
    data_dir: Path, client: Client, steps: list[Step], originals: dict[str, str],
    planted: list[bytes], kills: int,
) -> DataReport:
    sdir = session_dir(data_dir)
    # -- dialog archive: every line parses, but the torn fragments; none glued to the next.
    physical: dict[str, list[bytes]] = {}
    torn_found = 0
    seen_chains: list[str] = []
    for path in sorted((sdir / "dialog").glob("*.jsonl")):
        rel = f"dialog/{path.name}"
        lines = path.read_bytes().split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline
        physical[rel] = lines + ([tail] if tail else [])
        parsed_at: list[int] = []
        for number, line in enumerate(lines, start=1):
            assert line.startswith(LINE_PREFIX), f"{rel}:{number} is no archive line: {line[:80]!r}"
            assert line.count(LINE_PREFIX) == 1, f"{rel}:{number}: two lines glued together"
            record = parse_record(line)
            if record is None:
                # A torn write closed off by the next append: one we planted, or a real one.
                torn_found += 1
                assert line in planted or torn_found <= kills + len(planted), f"{rel}:{number}"
                continue
            assert set(record) == {"v", "ts", "session", "pos", "chain", "parent", "role",
                                   "message"}, f"{rel}:{number}"
            seen_chains.append(record["chain"])
            parsed_at.append(number)
        if tail:
            assert tail.startswith(LINE_PREFIX) and tail.count(LINE_PREFIX) == 1
            if parse_record(tail) is None:
                torn_found += 1
            else:
                parsed_at.append(len(lines) + 1)
        # The project's reader yields exactly the lines that parse, torn ones skipped.
        assert [d.line for d in read_lines(path)] == parsed_at
    assert len(seen_chains) >= len(client.last_request)

    db_file = data_dir / "_index.sqlite3"
    conn = sqlite3.connect(db_file)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        # -- the index: every row names the physical line holding its message.
        rows = conn.execute(
            "SELECT chain, position, role, file, line FROM messages WHERE tenant=? AND session=?",
            (TENANT, SESSION),
        ).fetchall()
        for chain, position, role, file, line in rows:
            record = parse_record(physical[file][line - 1])
            assert record is not None and record["chain"] == chain, (file, line)
            assert record["pos"] == position and record["role"] == role, (file, line)
        for file, lines_n, size in conn.execute(
            "SELECT file, lines, size FROM dialog_files WHERE tenant=? AND session=?",
            (TENANT, SESSION),
        ):
            actual = (sdir / file).read_bytes()
            if size == len(actual):  # the counter the writer trusts when the size matches
                assert lines_n == actual.count(b"\n"), file
        index = {r[0]: (r[3], r[4]) for r in rows}
    finally:
        conn.close()

    # -- lossless: every message of the last request is archived exactly as the client sent it.
    chains = chain_hashes(client.last_request)
    for chain, message in zip(chains, client.last_request, strict=True):
        assert chain in index, f"message at position {chains.index(chain)} not archived"
        file, line = index[chain]
        record = parse_record(physical[file][line - 1])
        assert record is not None and record["message"] == message

    # -- offloaded files: complete, and each equal to the original the client sent.
    files = 0
    stray = 0
    tool_dir = sdir / "tool_result"
    for entry in sorted(tool_dir.iterdir()) if tool_dir.is_dir() else []:
        if entry.name.startswith(".") and entry.name.endswith(".tmp"):
            stray += 1  # a write the kill interrupted: never listed or served, gc removes it
            continue
        rel = f"tool_result/{entry.name}"
        assert rel in originals, f"unexpected file {rel}"
        assert entry.read_bytes() == originals[rel].encode("utf-8"), f"{rel} is not complete"
        files += 1
    big = {offloaded_path(s.output) for s in steps
           if len(s.output.encode("utf-8")) > RECENT_MAX + SLACK}
    on_disk = {f"tool_result/{e.name}" for e in tool_dir.iterdir()} if tool_dir.is_dir() else set()
    assert big <= on_disk, f"offloaded outputs without their file: {sorted(big - on_disk)}"

    # -- the summary cache: each row consistent with its .md, the archive and the history.
    db = Database.in_dir(data_dir)
    try:
        store = SummaryStore(db, data_dir)
        history = store.history(TENANT, SESSION)  # SummaryRecord validates every row
        assert history, "the replay never compacted: make the window smaller"
        by_chain = {rec.chain: rec for rec in history}
        for rec in history:
            assert store.md_path(rec).read_bytes() == _markdown(rec), rec.md_name
            assert rec.chain in index, f"summary {rec.md_name} replaces an unarchived message"
            assert rec.chain in chains, f"summary {rec.md_name} is off the session's history"
            assert rec.upto == chains.index(rec.chain) + 1 and rec.head <= rec.upto
            assert rec.previous_chain is None or rec.previous_chain in by_chain
            assert "## Goal" in rec.text
            for span in rec.span:
                assert span.file in physical, span
                assert 1 <= span.first_line <= span.last_line <= len(physical[span.file]), span
        latest = store.find_latest(TENANT, SESSION, chains)
        assert latest is not None and latest == max(history, key=lambda r: r.upto)
    finally:
        db.close()
    duplicates = len(seen_chains) - len(set(seen_chains))
    return DataReport(files, stray, torn_found, duplicates)


# --- the tests -------------------------------------------------------------------------------


def stress_enabled(config: pytest.Config) -> bool:
    markexpr = str(config.getoption("markexpr", "") or "")
    return "stress" in markexpr or os.environ.get("CTXPROXY_STRESS") == "1"


@pytest.fixture
def quiet_fake(fake: FakeUpstream) -> Iterator[FakeUpstream]:
    fake.record = False  # a long replay: do not keep every request body
    yield fake
    fake.record = True


def test_crash_replay_with_kills(tmp_path: Path, quiet_fake: FakeUpstream, fake_url: str) -> None:
    report = run_crash_replay(tmp_path, quiet_fake, fake_url, kills=DEFAULT_KILLS, steps_n=10,
                              seed=6)
    print(f"\ncrash replay: {report.line()}")
    assert report.summaries >= 1 and report.reads >= 1 and report.torn_planted >= 1
    assert any(k.mid_request for k in report.kills)


@pytest.mark.stress
@pytest.mark.timeout(1800)
def test_crash_stress(
    request: pytest.FixtureRequest, tmp_path: Path, quiet_fake: FakeUpstream, fake_url: str
) -> None:
    if not stress_enabled(request.config):
        pytest.skip("stress run: use -m stress or CTXPROXY_STRESS=1")
    kills = int(os.environ.get("CTXPROXY_STRESS_KILLS", "50"))
    seed = int(os.environ.get("CTXPROXY_CRASH_SEED", str(random.randrange(1 << 30))))
    print(f"\ncrash stress: seed {seed} (CTXPROXY_CRASH_SEED to repeat)")
    report = run_crash_replay(tmp_path, quiet_fake, fake_url, kills=kills,
                              steps_n=max(12, kills), seed=seed)
    print(f"crash stress: {report.line()}")
    assert report.summaries >= 1 and report.reads >= 1


# --- durability of offloaded files (no power cut needed to check the mechanism) ---------------


def test_tool_result_is_fsynced_before_rename_and_dir_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}") if Path("/proc/self/fd").is_dir() else "?"
        events.append(f"fsync {Path(target).name}")
        real_fsync(fd)

    def replace(src: Any, dst: Any, **dir_fds: Any) -> None:
        events.append(f"rename {Path(dst).name}")
        real_replace(src, dst, **dir_fds)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store = ToolResultStore(tmp_path, 5)
    text = "x" * 5000
    rid = result_id(TENANT, SESSION, text)
    assert store.save(TENANT, SESSION, rid, text)
    name = f"{rid}.txt"
    # New directories fsynced into their parents, the data before the rename, the entry after.
    assert len(events) == 6, events
    assert events[:3] == [f"fsync {tmp_path.name}", f"fsync {TENANT}", f"fsync {SESSION}"]
    assert re.fullmatch(rf"fsync \.{re.escape(name)}\.[0-9a-f]{{12}}\.tmp", events[3]), events
    assert events[4:] == [f"rename {name}", "fsync tool_result"]
    events.clear()
    assert not store.save(TENANT, SESSION, rid, text)  # written once: a resend costs a stat
    assert events == []
    assert store.path(TENANT, SESSION, rid).read_text() == text


def test_tool_result_with_the_wrong_size_is_rewritten(tmp_path: Path) -> None:
    """What a power cut without fsync leaves (an empty or short file under the final name)
    is repaired from the resent original instead of being served for good."""
    store = ToolResultStore(tmp_path, 5)
    for text in ("plain ascii\n" * 500, "non-ascii é日本\n" * 500):
        rid = result_id(TENANT, SESSION, text)
        path = store.path(TENANT, SESSION, rid)
        assert store.save(TENANT, SESSION, rid, text)
        for damaged in (b"", text.encode()[:100]):
            path.write_bytes(damaged)
            assert store.save(TENANT, SESSION, rid, text)
            assert path.read_bytes() == text.encode()
        assert not store.save(TENANT, SESSION, rid, text)
    # A symlink in its place is replaced, never followed.
    rid = result_id(TENANT, SESSION, "other")
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    store.path(TENANT, SESSION, rid).symlink_to(outside)
    assert store.save(TENANT, SESSION, rid, "other")
    assert not store.path(TENANT, SESSION, rid).is_symlink() and outside.read_text() == "keep"
    assert store.read(TENANT, SESSION, rid) == "other"

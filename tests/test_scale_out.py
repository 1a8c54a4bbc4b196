"""Many replicas, one PostgreSQL (issue 15): three real ``ctxproxy serve`` processes behind a
real haproxy (round robin, no stickiness), sharing one database started by the tests.

* One agent session with offloads, reads of offloaded files and several compactions, every
  request on the next replica: the forwarded bodies (summarizer calls included) are byte-identical
  to the same session through one replica, with the same number of summarizer calls; ``/files``
  on every replica shows the whole session.
* 16 concurrent sessions: each forwards what the one-replica session forwards (up to its own
  ids), and the summarizer is called once per compaction.
* ``kill -9`` of one replica mid-run: the balancer routes around it, every turn completes (a
  request the dead replica had taken is retried by the client, as agents do), the archive holds
  every message once.
* The database stopped for a few seconds mid-run: no request fails, ``/readyz`` says the store
  is down while ``/healthz`` stays live, and the store is back (and complete) afterwards.

The model is deterministic in the history it is sent, so any replica, any order, any retry gets
the same answer.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from proxy.compaction.prompt import SECTIONS, SYSTEM_PROMPT
from proxy.pipeline.notice import parse_notice
from proxy.pipeline.truncate import read_chunk
from proxy.store.chains import chain_hashes
from proxy.testing.cluster import Cluster, find_haproxy
from proxy.testing.fake_upstream import FakeUpstream, Reply
from proxy.testing.postgres import PostgresServer
from proxy.testing.servers import ServerThread, serve_in_thread
from tests.pg import pg_url, postgres

__all__ = ["pg_url", "postgres"]  # fixtures

pytestmark = pytest.mark.skipif(find_haproxy() is None,
                                reason="haproxy is not installed (.ci/run installs it)")

MODEL = "scale-model"
WINDOW = 9_000
RECENT_MAX = 3000
READ_TOOL = "read_offloaded"
STEPS = 14
READ_EVERY = 4
SUMMARY = "\n".join(f"{h}\n- replay: {h.strip('# ').lower()}" for h in SECTIONS) + "\n"
FINAL = "All steps done."
RID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
DAY = re.compile(rb"dialog/\d{4}-\d{2}-\d{2}\.jsonl")  # runs may straddle midnight (UTC)
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "bash",
                                           "parameters": {"type": "object", "properties": {}}}}]


def output(sid: str, i: int) -> str:
    """Step ``i``'s tool output: 1-6 KB, so about half are offloaded."""
    size = 1000 + (i * 2371) % 5000
    lines = [f"[{sid}] step {i}"]
    while sum(len(x) + 1 for x in lines) < size:
        lines.append(f"step {i} line {len(lines)}: value={(i * 7919 + len(lines) * 104729) % 10**9}")
    return "\n".join(lines) + "\n"


def newest_step(msgs: list[dict[str, Any]]) -> int:
    for m in reversed(msgs):
        cid = m.get("tool_call_id")
        if m.get("role") == "tool" and isinstance(cid, str) and cid.startswith("call_"):
            return int(cid.removeprefix("call_"))
    return -1


@dataclass
class Model:
    """Answers from the history alone (any replica, any retry: the same answer)."""

    summaries: int = 0
    reads: int = 0
    problems: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, body: dict[str, Any]) -> Reply:
        msgs: list[dict[str, Any]] = body.get("messages") or []
        if msgs and msgs[0].get("content") == SYSTEM_PROMPT:
            with self.lock:
                self.summaries += 1
            return Reply(content=SUMMARY)
        sid = str(msgs[0].get("content", "")).rsplit(" ", 1)[-1]
        last = msgs[-1]
        n = newest_step(msgs)
        if last.get("role") == "tool" and str(last.get("tool_call_id")).startswith("read_"):
            self._check_read(sid, msgs)
        elif last.get("role") == "tool" and n % READ_EVERY == READ_EVERY - 1:
            target = self._notice(msgs)
            if target is not None:
                return Reply(content=None, tool_calls=[{
                    "id": f"read_{n:03d}", "name": READ_TOOL,
                    "arguments": {"file_path": target, "start_line": 1}}])
        if n + 1 >= STEPS:
            return Reply(content=FINAL)
        return Reply(content=None, tool_calls=[
            {"id": f"call_{n + 1:03d}", "name": "bash",
             "arguments": {"cmd": f"step {n + 1} of {sid}"}}])

    @staticmethod
    def _notice(msgs: list[dict[str, Any]]) -> str | None:
        for m in reversed(msgs):
            content = m.get("content")
            if m.get("role") == "tool" and isinstance(content, str):
                notice = parse_notice(content)
                if notice is not None and notice.tool == READ_TOOL:
                    return notice.file_path
        return None

    def _check_read(self, sid: str, msgs: list[dict[str, Any]]) -> None:
        """The read tool (run by whichever replica) returned the original's first chunk."""
        with self.lock:
            self.reads += 1
        path = orjson.loads(msgs[-2]["tool_calls"][0]["function"]["arguments"])["file_path"]
        for m in msgs:
            content = m.get("content")
            if m.get("role") == "tool" and isinstance(content, str):
                notice = parse_notice(content)
                if notice is not None and notice.file_path == path:
                    i = int(str(m["tool_call_id"]).removeprefix("call_"))
                    want = read_chunk(output(sid, i), 1, 0, RECENT_MAX, file_path=path,
                                      tool=READ_TOOL)
                    if msgs[-1].get("content") != want:
                        self.problems.append(f"{sid}: read of {path} got "
                                             f"{str(msgs[-1].get('content'))[:120]!r}")
                    return
        self.problems.append(f"{sid}: read of {path}, which no notice names")


@dataclass
class Agent:
    """Resends its whole history every turn; retries a turn the balancer could not complete
    (the replica serving it was killed), as agents retry failed calls."""

    sid: str
    history: list[dict[str, Any]] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)
    retries: int = 0
    failures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.history = [{"role": "system", "content": f"You are a replayed agent {self.sid}"},
                        {"role": "user", "content": f"Run every step, session {self.sid}."}]

    def run(self, url: str, *, retry: bool = False, on_turn: Any = None) -> None:
        headers = {"x-session-id": self.sid, "content-type": "application/json"}
        with httpx.Client(timeout=60) as http:
            for turn in range(100):
                body = orjson.dumps({"model": MODEL, "messages": self.history, "tools": TOOLS})
                while True:
                    try:
                        r = http.post(url + "/v1/chat/completions", content=body,
                                      headers=headers)
                        if r.status_code == 200:
                            break
                        problem = f"turn {turn}: {r.status_code} {r.text[:200]}"
                    except httpx.TransportError as exc:
                        problem = f"turn {turn}: {exc!r}"
                    if not retry:
                        self.failures.append(problem)
                        return
                    self.retries += 1
                    time.sleep(0.1)
                msg = r.json()["choices"][0]["message"]
                self.answers.append(msg)
                self.history.append(msg)
                if on_turn is not None:
                    on_turn(turn)
                calls = msg.get("tool_calls") or []
                for call in calls:
                    i = int(call["id"].removeprefix("call_"))
                    self.history.append({"role": "tool", "tool_call_id": call["id"],
                                         "content": output(self.sid, i)})
                if not calls:
                    return


def forwarded(fake: FakeUpstream, sid: str) -> list[bytes]:
    """The bodies the upstream got for one session (model and summarizer calls), in order,
    with the session's own name, ids and archive day made generic."""
    marker = sid.encode()
    return [DAY.sub(b"dialog/DAY.jsonl", RID.sub(b"RID", r.body)).replace(marker, b"SID")
            for r in fake.received
            if r.path.endswith("/chat/completions") and marker in r.body]


def replica_config(tmp: Path, name: str, fake_url: str, url: str) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "server": {"shutdown_timeout_s": 2},
        "upstream": {"base_url": fake_url},
        # Each replica its own (empty) data_dir: nothing there is needed for correctness.
        "storage": {"data_dir": str(tmp / f"{name}-data"), "url": url,
                    "statement_timeout_s": 2},
        "offload": {"recent_max_bytes": RECENT_MAX, "old_max_bytes": 1024,
                    "markdown_max_bytes": RECENT_MAX, "slack_bytes": 100},
        "compaction": {"context_windows": {MODEL: WINDOW}, "summarizer_timeout_s": 3},
    }))
    return path


@dataclass
class Setup:
    fake: FakeUpstream
    model: Model
    cluster: Cluster
    server: PostgresServer
    solo: list[bytes]  # the one-replica run's forwarded bodies
    solo_summaries: int
    solo_agent: Agent


@pytest.fixture(scope="module")
def setup(postgres: PostgresServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("scale")
    model = Model()
    fake = FakeUpstream(responder=model)
    upstream: ServerThread = serve_in_thread(fake)
    upstream.start()
    fake_url = upstream.url + "/v1"
    shared = postgres.create_database("shared")
    cluster = Cluster(tmp, [replica_config(tmp, f"r{i}", fake_url, shared) for i in range(3)])
    try:
        cluster.start()
        # The reference: a session of its own, all of it on one replica (its bodies compare
        # with other sessions' up to the session's own name and ids).
        agent = Agent("sess-ss")  # every session name is 7 characters: same sizes
        agent.run(cluster.replicas[0].url)
        assert not agent.failures, agent.failures
        bodies = forwarded(fake, agent.sid)
        yield Setup(fake, model, cluster, postgres, bodies, model.summaries, agent)
    finally:
        cluster.stop()
        upstream.stop()


def files_of(url: str, sid: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/files/anon/{sid}", headers={"accept": "application/json"})
    assert r.status_code == 200, r.text
    payload: dict[str, Any] = r.json()
    return payload


def requests_served(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    found = re.findall(r'^ctxproxy_requests_total\{route="chat"[^}]*\} ([0-9.e+]+)$', text,
                       re.M)
    return sum(float(v) for v in found)


def test_one_session_round_robin_is_byte_identical_to_one_replica(setup: Setup) -> None:
    solo = setup.solo
    assert setup.solo_summaries >= 2, "the script must compact more than once"
    assert any(b"TRUNCATED" in b for b in solo), "the script must offload"
    before = setup.model.summaries
    reads = setup.model.reads
    agent = Agent("sess-00")
    agent.run(setup.cluster.url)
    assert not agent.failures, agent.failures
    assert setup.model.summaries - before == setup.solo_summaries
    got = forwarded(setup.fake, agent.sid)
    for k, (x, y) in enumerate(zip(got, solo, strict=False)):
        assert x == y, f"request {k}: " + _debug_diff(x, y)
    assert len(got) == len(solo)
    assert setup.model.reads - reads >= 2 and not setup.model.problems, setup.model.problems
    # Round robin: every replica served part of the session.
    served = [requests_served(r.url) for r in setup.cluster.replicas]
    assert all(n >= 3 for n in served), served
    # /files on every replica: the whole session.
    views = [files_of(r.url, agent.sid) for r in setup.cluster.replicas]
    offloaded = {e["name"] for e in views[0]["tool_results"]}
    assert len(offloaded) >= 4
    summaries = [s["name"] for s in views[0]["summaries"]]
    assert len(summaries) == setup.solo_summaries
    for v in views:
        assert {e["name"] for e in v["tool_results"]} == offloaded
        assert [s["name"] for s in v["summaries"]] == summaries
        assert v["dialog_files"] == views[0]["dialog_files"]
        # (turns and tokens are summed per replica and flushed each second; messages are the
        # archive's own count)
        assert v["stats"]["messages"] == views[0]["stats"]["messages"] >= len(agent.history)
    # And the files themselves, from another replica than the one that wrote them.
    name = sorted(offloaded)[0]
    text = httpx.get(f"{setup.cluster.replicas[2].url}/files/anon/{agent.sid}/tool_result/{name}",
                     headers={"accept": "text/plain"}).text
    assert text.startswith(f"[{agent.sid}] step ")


def test_sixteen_concurrent_sessions(setup: Setup) -> None:
    before = setup.model.summaries
    agents = [Agent(f"sess-{k:02d}") for k in range(10, 26)]
    with ThreadPoolExecutor(16) as pool:
        for f in [pool.submit(a.run, setup.cluster.url) for a in agents]:
            f.result()
    for a in agents:
        assert not a.failures, a.failures
        assert forwarded(setup.fake, a.sid) == setup.solo, a.sid
    assert setup.model.summaries - before == 16 * setup.solo_summaries
    assert not setup.model.problems, setup.model.problems


def archived_chains(url: str, sid: str) -> list[str]:
    view = files_of(url, sid)
    chains: list[str] = []
    for f in view["dialog_files"]:
        raw = httpx.get(f"{url}/files/anon/{sid}/dialog/{f['name']}",
                        headers={"accept": "text/plain"}).content
        chains += [orjson.loads(line)["chain"] for line in raw.splitlines() if line.strip()]
    return chains


def test_database_stopped_mid_run(setup: Setup) -> None:
    agent = Agent("sess-db")
    replicas = setup.cluster.replicas
    seen: dict[str, list[int]] = {"readyz": [], "healthz": []}

    def outage(turn: int) -> None:
        if turn != 3:
            return
        setup.server.stop("fast")
        try:
            seen["readyz"] = [httpx.get(r.url + "/readyz").status_code for r in replicas]
            seen["healthz"] = [httpx.get(r.url + "/healthz").status_code for r in replicas]
            # Keep the session going while the database is away.
            for _ in range(4):
                body = orjson.dumps({"model": MODEL, "messages": agent.history, "tools": TOOLS})
                r = httpx.post(setup.cluster.url + "/v1/chat/completions", content=body,
                               headers={"x-session-id": agent.sid,
                                        "content-type": "application/json"}, timeout=30)
                assert r.status_code == 200, r.text
            time.sleep(0.5)
        finally:
            setup.server.start()

    agent.run(setup.cluster.url, on_turn=outage)
    assert not agent.failures, agent.failures
    assert agent.answers[-1].get("content") == FINAL
    assert seen["readyz"] == [503, 503, 503] and seen["healthz"] == [200, 200, 200]
    deadline = time.monotonic() + 20
    while any(httpx.get(r.url + "/readyz").status_code != 200 for r in replicas):
        assert time.monotonic() < deadline, "the store did not come back"
        time.sleep(0.1)
    metrics = httpx.get(replicas[0].url + "/metrics").text
    down = re.search(r"^ctxproxy_store_unavailable_total ([0-9.e+]+)$", metrics, re.M)
    assert down is not None and float(down.group(1)) > 0
    # One more turn after recovery archives what the outage could not.
    agent.history.append({"role": "user", "content": "One more check, please."})
    body = orjson.dumps({"model": MODEL, "messages": agent.history, "tools": TOOLS})
    r = httpx.post(setup.cluster.url + "/v1/chat/completions", content=body,
                   headers={"x-session-id": agent.sid, "content-type": "application/json"})
    assert r.status_code == 200
    chains = archived_chains(replicas[2].url, agent.sid)
    assert set(chain_hashes(agent.history)) <= set(chains)
    assert len(chains) == len(set(chains))


def test_kill_9_one_replica_mid_run(setup: Setup) -> None:
    victim = setup.cluster.replicas[1]
    agents = [Agent(f"sess-k{k}") for k in range(4)]

    def kill_at(turn: int) -> None:
        if turn == 4:
            victim.kill()  # a turn of another session may be in flight on it

    try:
        with ThreadPoolExecutor(4) as pool:
            runs = [pool.submit(a.run, setup.cluster.url, retry=True,
                                on_turn=kill_at if i == 0 else None)
                    for i, a in enumerate(agents)]
            for f in runs:
                f.result()
        assert not victim.running
        survivor = setup.cluster.replicas[0].url
        for a in agents:
            assert a.answers[-1].get("content") == FINAL, a.sid
            # A retried turn may have reached the upstream twice (before the kill, and again).
            assert list(dict.fromkeys(forwarded(setup.fake, a.sid))) == setup.solo
            chains = archived_chains(survivor, a.sid)
            assert len(chains) == len(set(chains)), "a message archived twice"
            expected = chain_hashes([*a.history])
            assert set(expected) <= set(chains), "a message missing from the archive"
    finally:
        victim.kill()  # the last test of the module: no restart needed

def _debug_diff(a: bytes, b: bytes) -> str:
    i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    return f"at {i}: {a[max(0, i - 150):i + 150]!r}\n vs {b[max(0, i - 150):i + 150]!r}"

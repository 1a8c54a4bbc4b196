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

The session (:mod:`harness.replay`): its model is deterministic in the history it is sent,
so any replica, any order, any retry gets the same answer.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import orjson
import psycopg
import pytest
import yaml

from harness.cluster import Cluster, find_haproxy
from harness.postgres import PostgresServer
from harness.replay import FINAL, MODEL, RECENT_MAX, TOOLS, WINDOW, Agent, Model, forwarded
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import ServerThread, serve_in_thread
from proxy.store.chains import chain_hashes
from tests.pg import pg_url, postgres

__all__ = ["pg_url", "postgres"]  # fixtures

pytestmark = pytest.mark.skipif(find_haproxy() is None,
                                reason="haproxy is not installed (.ci/run installs it)")

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
    url: str  # the shared database


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
        yield Setup(fake, model, cluster, postgres, bodies, model.summaries, agent, shared)
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


def test_a_dead_replicas_claim_expires(setup: Setup) -> None:
    """Claims left by a replica that died mid-summary (inserted here for every chain the session
    will have) hold the compaction up only until they expire; then one live replica makes it."""
    sid = "sess-cl"
    history = orjson.loads(orjson.dumps(setup.solo_agent.history).replace(b"sess-ss", sid.encode()))
    chains = chain_hashes(history)
    hold_s = 1.5
    with psycopg.connect(setup.url, autocommit=True) as conn:
        conn.execute(
            """INSERT INTO claims (tenant, session, chain, owner, expires_at)
               SELECT 'anon', %s, c, 'dead-replica', now() + %s FROM unnest(%s::text[]) AS c""",
            (sid, timedelta(seconds=hold_s), chains))
    before = setup.model.summaries
    agent = Agent(sid)
    began = time.monotonic()
    agent.run(setup.cluster.url)
    took = time.monotonic() - began
    assert not agent.failures, agent.failures
    assert setup.model.summaries - before == setup.solo_summaries
    assert forwarded(setup.fake, sid) == setup.solo
    assert hold_s <= took < hold_s + 10  # waited for the expiry, then went on


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
            # Keep the session going while the database is away: the turn's request again
            # (the history ends with the answer's calls, which have no results yet).
            for _ in range(4):
                body = orjson.dumps({"model": MODEL, "messages": agent.history[:-1],
                                     "tools": TOOLS})
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

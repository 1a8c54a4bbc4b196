"""Graceful shutdown of the real server process (issue 6).

SIGTERM while requests are in flight through ``python -m proxy serve``: the listening socket
closes at once (new connections are refused), the in-flight stream and request run to the end
for their clients, their answers are archived, and only then does the process exit, with code 0
and within ``server.shutdown_timeout_s`` plus a small bound. A stream that outlives the drain
deadline is cut off and its upstream call cancelled.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from harness.process import ProxyProcess
from proxy.demo.fake.replies import stream_events
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.store.dialog_read import read

ROOT = Path(__file__).resolve().parents[1]
SESSION = "drain"
STREAM_TEXT = "".join(f"word{i} " for i in range(40))


def child_env() -> dict[str, str]:
    """The child runs this tree's code, whatever is installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture
def make_server(tmp_path: Path, fake_url: str) -> Iterator[Any]:
    started: list[ProxyProcess] = []

    def factory(shutdown_timeout_s: float) -> ProxyProcess:
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(yaml.safe_dump({
            "server": {"shutdown_timeout_s": shutdown_timeout_s},
            "upstream": {"base_url": fake_url},
            "storage": {"data_dir": str(tmp_path / "data")},
        }))
        proc = ProxyProcess(cfg, log_path=tmp_path / "server.log", python=sys.executable,
                            env=child_env(), cwd=ROOT)
        started.append(proc)
        proc.start()
        return proc

    yield factory
    for proc in started:
        proc.kill()


@dataclass
class StreamClient:
    """Reads one streaming chat completion in a thread, noting when each piece arrived."""

    url: str
    body: dict[str, Any]
    chunks: list[bytes] = field(default_factory=list)
    first: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    ended_at: float | None = None
    status: int | None = None
    thread: threading.Thread | None = None

    def start(self) -> StreamClient:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=self.body,
                              headers={"x-session-id": SESSION}, timeout=30) as r:
                self.status = r.status_code
                for piece in r.iter_raw():
                    self.chunks.append(piece)
                    self.first.set()
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.first.set()

    def join(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the client is still reading"

    @property
    def body_bytes(self) -> bytes:
        return b"".join(self.chunks)


def refused(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return False
    except ConnectionRefusedError:
        return True


def archived_answers(data_dir: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted((data_dir / "anon" / SESSION / "dialog").glob("*.jsonl")):
        out += [r["message"] for r in read(path) if r.get("role") == "assistant"]
    return out


def test_sigterm_drains_in_flight_stream_and_request(
    make_server: Any, fake: FakeUpstream, tmp_path: Path
) -> None:
    slow_stream = Reply(content=STREAM_TEXT, stream_pieces=8, chunk_delay_s=0.15)
    slow_whole = Reply(content="the whole answer", delay_s=1.0)
    fake.responder = lambda body: slow_stream if body.get("stream") else slow_whole
    server = make_server(shutdown_timeout_s=10)
    messages = [{"role": "user", "content": "stream please"}]
    client = StreamClient(server.url, {"model": "m", "messages": messages, "stream": True})
    client.start()
    whole: dict[str, Any] = {}

    def non_stream() -> None:
        r = httpx.post(server.url + "/v1/chat/completions", headers={"x-session-id": "whole"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                       timeout=30)
        whole["status"], whole["body"] = r.status_code, r.json()

    other = threading.Thread(target=non_stream, daemon=True)
    other.start()
    assert client.first.wait(10) and client.error is None
    assert fake.wait_for(lambda f: f.request_count >= 2, timeout=5)

    sent_at = time.monotonic()
    server.signal(signal.SIGTERM)
    # Shutdown started: the listening socket closes while both answers are still on the way.
    deadline = sent_at + 2.0
    while not refused(server.url):
        assert time.monotonic() < deadline, "new connections still accepted after SIGTERM"
        time.sleep(0.02)
    refused_at = time.monotonic()
    assert client.ended_at is None, "the stream ended before the drain could be observed"

    client.join(timeout=15)
    other.join(timeout=15)
    code = server.wait(timeout=10)
    exited_at = time.monotonic()

    assert client.error is None and client.status == 200
    rec = next(r for r in fake.completed if r.json().get("stream"))
    seq = orjson.loads(client.body_bytes.split(b"\n", 1)[0].removeprefix(b"data: "))["id"]
    events = stream_events(rec, rec.json(), slow_stream, int(seq.rsplit("-", 1)[1]))
    assert client.body_bytes == b"".join(events)  # every event, byte for byte, then [DONE]
    assert client.body_bytes.endswith(b"data: [DONE]\n\n")
    assert whole["status"] == 200
    assert whole["body"]["choices"][0]["message"]["content"] == "the whole answer"
    # The upstream calls ran to their end: the aiohttp session was not closed under them.
    assert fake.cancelled_count == 0 and fake.aborted_count == 0
    assert code == 0, f"exit status {code}"
    assert client.ended_at is not None and client.ended_at <= exited_at
    assert refused_at < client.ended_at
    assert exited_at - sent_at < 1.5 + 3.0  # the stream's remaining ~1.2 s, plus a bound
    # The answer was archived after the stream, before the database closed.
    assert any(m.get("content") == STREAM_TEXT for m in archived_answers(tmp_path / "data"))


def test_drain_deadline_cuts_off_a_stream_that_runs_too_long(
    make_server: Any, fake: FakeUpstream
) -> None:
    fake.script(Reply(content=STREAM_TEXT, stream_pieces=40, chunk_delay_s=0.5))  # ~20 s
    server = make_server(shutdown_timeout_s=1)
    client = StreamClient(
        server.url,
        {"model": "m", "messages": [{"role": "user", "content": "long"}], "stream": True},
    )
    client.start()
    assert client.first.wait(10) and client.error is None
    sent_at = time.monotonic()
    server.signal(signal.SIGTERM)
    code = server.wait(timeout=10)
    took = time.monotonic() - sent_at
    client.join(timeout=5)
    assert code == 0
    assert 0.9 < took < 1.0 + 2.5, f"exit {took:.2f} s after SIGTERM with a 1 s drain deadline"
    assert not client.body_bytes.endswith(b"data: [DONE]\n\n")  # cut off, not completed
    # The proxy's upstream call ended with the cancelled request instead of running on.
    assert fake.wait_for(lambda f: f.cancelled_count == 1, timeout=5)

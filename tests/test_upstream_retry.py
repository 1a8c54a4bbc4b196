"""A POST is never sent twice: an upstream that read the whole request and then dropped the
connection may be generating (and billing) the answer, so the client gets a 502, not a retry."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from proxy.app import create_app
from proxy.config import config_from_mapping
from proxy.testing.servers import serve_in_thread

ANSWER = orjson.dumps({"id": "x", "object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})


class DroppingUpstream:
    """Raw HTTP/1.1 on loopback: the first `drops` requests are read whole and then the
    connection is closed without a byte of answer; later requests get a 200."""

    def __init__(self, drops: int) -> None:
        self.drops = drops
        self.requests = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                with self._lock:
                    self.requests += 1
                    drop = self.requests <= self.drops
                if drop:
                    return
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def upstream_factory() -> Iterator[list[DroppingUpstream]]:
    made: list[DroppingUpstream] = []
    yield made
    for up in made:
        up.close()


def post(upstream: DroppingUpstream, tmp_path: Path) -> httpx.Response:
    config = config_from_mapping({"upstream": {"base_url": upstream.url},
                                  "storage": {"data_dir": str(tmp_path / "data")}})
    with serve_in_thread(create_app(config), lifespan="on") as proxy:
        return httpx.post(proxy.url + "/v1/chat/completions", timeout=10, json={
            "model": "m", "messages": [{"role": "user", "content": "hello"}]})


def test_a_post_the_upstream_received_is_never_retried(
    upstream_factory: list[DroppingUpstream], tmp_path: Path
) -> None:
    up = DroppingUpstream(drops=1)
    upstream_factory.append(up)
    r = post(up, tmp_path)
    assert r.status_code == 502
    error = r.json()["error"]
    assert error["type"] == "upstream_error" and "not retried" in error["message"]
    assert up.requests == 1  # exactly one receipt: nothing billed twice


def test_the_next_request_gets_its_answer(
    upstream_factory: list[DroppingUpstream], tmp_path: Path
) -> None:
    up = DroppingUpstream(drops=1)
    upstream_factory.append(up)
    config = config_from_mapping({"upstream": {"base_url": up.url},
                                  "storage": {"data_dir": str(tmp_path / "data")}})
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    with serve_in_thread(create_app(config), lifespan="on") as proxy:
        first = httpx.post(proxy.url + "/v1/chat/completions", timeout=10, json=body)
        second = httpx.post(proxy.url + "/v1/chat/completions", timeout=10, json=body)
    assert (first.status_code, second.status_code) == (502, 200)
    assert second.content == ANSWER and up.requests == 2

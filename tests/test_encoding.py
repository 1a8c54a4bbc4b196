"""Compressed request bodies (proxy.server.encoding) and slow clients (proxy.server.protocol, read_body's
idle deadline)."""

from __future__ import annotations

import asyncio
import gzip
import socket
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
import zstandard

from harness.inprocess import InProcess
from harness.process import ProxyProcess
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import serve_in_thread
from proxy.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from proxy.server.encoding import decode_body, encodings
from proxy.server.protocol import header_deadline_protocol

from .conftest import InProcessFactory

BODY = orjson.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi " * 500}]})


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


@pytest.mark.parametrize(("header", "encode"), [
    (b"gzip", gzip.compress), (b"x-gzip", gzip.compress), (b"deflate", zlib.compress),
    (b"deflate", _raw_deflate), (b"zstd", zstandard.ZstdCompressor(level=3).compress),
    (b"identity", lambda b: b),
    (b"gzip, zstd", lambda b: zstandard.ZstdCompressor().compress(gzip.compress(b))),
])
def test_every_supported_coding_decodes(header: bytes, encode: Any) -> None:
    assert decode_body(encode(BODY), encodings(header), 1 << 20) == BODY


def test_a_bomb_stops_one_byte_past_the_limit() -> None:
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    assert len(bomb) < 10_000
    for name, data in (("zstd", bomb), ("gzip", gzip.compress(b"\0" * (64 << 20)))):
        with pytest.raises(PayloadTooLarge):
            decode_body(data, [name], 1 << 20)


def test_bad_or_unknown_codings_are_client_errors() -> None:
    with pytest.raises(BadRequest, match="not valid gzip"):
        decode_body(b"plain json", ["gzip"], 1 << 20)
    with pytest.raises(BadRequest, match="incomplete"):
        decode_body(gzip.compress(BODY)[:-20], ["gzip"], 1 << 20)
    with pytest.raises(UnsupportedMediaType, match="gzip, deflate, zstd, identity"):
        decode_body(BODY, ["br"], 1 << 20)


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
async def test_a_compressed_request_goes_upstream_decoded_without_the_header(
    inproc: InProcess, fake: FakeUpstream, coding: str
) -> None:
    data = gzip.compress(BODY) if coding == "gzip" else zstandard.ZstdCompressor().compress(BODY)
    r = await inproc.client.post("/v1/chat/completions", content=data,
                                 headers={"content-encoding": coding,
                                          "authorization": "Bearer sk-x"})
    assert r.status_code == 200, r.text
    got = fake.received[-1]
    assert got.body == BODY and "content-encoding" not in got.headers


async def test_a_plain_body_never_forwards_a_content_encoding(
    inproc: InProcess, fake: FakeUpstream
) -> None:
    r = await inproc.client.post("/v1/embeddings", content=b'{"input": "x", "model": "e"}',
                                 headers={"content-encoding": "identity"})
    assert r.status_code == 200
    assert "content-encoding" not in fake.received[-1].headers


async def test_an_unsupported_coding_is_a_415_naming_the_supported_ones(
    inproc: InProcess, fake: FakeUpstream
) -> None:
    r = await inproc.client.post("/v1/chat/completions", content=b"\x1b\x00",
                                 headers={"content-encoding": "br"})
    assert r.status_code == 415 and "zstd" in r.json()["error"]["message"]
    assert fake.request_count == 0


async def test_a_stalled_body_gets_a_408(make_inproc: InProcessFactory, fake: FakeUpstream) -> None:
    app = await make_inproc({"server": {"body_timeout_s": 0.2}})

    async def stalling() -> AsyncIterator[bytes]:
        yield BODY[:10]
        await asyncio.Event().wait()  # the rest never comes
        yield b""

    r = await app.client.post("/v1/chat/completions", content=stalling())
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
    assert fake.request_count == 0


def test_a_connection_that_never_finishes_its_headers_is_closed(fake: FakeUpstream) -> None:
    with serve_in_thread(fake, http=header_deadline_protocol(0.3)) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
            assert sock.recv(1024) == b""  # closed by the server, well before the timeout
        # A whole request on a connection of its own still works.
        assert httpx.get(srv.url + "/v1/models").status_code == 200


def test_ctxproxy_serve_closes_a_connection_whose_headers_never_end(
    fake_url: str, tmp_path: Path
) -> None:
    """The real command: uvicorn runs with the deadline protocol."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"server": {"header_timeout_s": 0.5},
                                   "upstream": {"base_url": fake_url},
                                   "storage": {"data_dir": str(tmp_path / "data")}}))
    server = ProxyProcess(cfg, log_path=tmp_path / "server.log")
    server.start()
    try:
        with socket.create_connection((server.host, server.port), timeout=20) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
            assert sock.recv(1024) == b""
    finally:
        server.kill()

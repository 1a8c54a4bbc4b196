from __future__ import annotations

import logging
import re

import httpx
import pytest

from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread


def test_one_access_line_per_request(
    proxy: ServerThread, fake: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    fake.script(Reply(content="hello"))
    with caplog.at_level(logging.INFO, logger="proxy.server.access"):
        r = httpx.post(
            proxy.url + "/v1/chat/completions",
            content=b'{"model":"m","messages":[{"role":"user","content":"hi"}]}',
            headers={"authorization": "Bearer sk-very-secret"},
        )
        httpx.get(proxy.url + "/healthz")
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "proxy.server.access"]
    assert len(lines) == 2
    m = re.fullmatch(
        r"POST /v1/chat/completions 200 upstream_ms=([\d.]+) pipeline_ms=[\d.]+ bytes=(\d+) "
        r"total_ms=[\d.]+",
        lines[0],
    )
    assert m and int(m.group(2)) == len(r.content)
    assert lines[1].startswith("GET /healthz 200 upstream_ms=- pipeline_ms=- bytes=15")
    assert all("sk-very-secret" not in line for line in caplog.text.splitlines())

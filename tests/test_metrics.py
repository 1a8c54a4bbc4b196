"""GET /metrics: Prometheus text with the proxy's counters."""

from __future__ import annotations

import re

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread
from proxy.metrics import route_of

from .conftest import ProxyFactory


def scrape(srv: ServerThread) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_count_requests_tokens_and_offloads(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    srv = make_proxy()
    big = "log line with some words\n" * 4000
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": big}]
    r = httpx.post(srv.url + "/v1/chat/completions", content=orjson.dumps({"model": "gpt-4o", "messages": msgs}))
    assert r.status_code == 200
    fake.script(Reply.error(429, "slow down"))
    httpx.post(srv.url + "/v1/chat/completions", content=orjson.dumps({"model": "gpt-4o", "messages": msgs}))
    httpx.post(srv.url + "/v1/chat/completions", content=b"{bad")
    m = scrape(srv)
    assert m[("ctxproxy_requests_total", (("route", "chat"), ("status", "200")))] == 1
    assert m[("ctxproxy_requests_total", (("route", "chat"), ("status", "429")))] == 1
    assert m[("ctxproxy_requests_total", (("route", "chat"), ("status", "400")))] == 1
    assert m[("ctxproxy_tokens_in_total", ())] == 2 * int(r.headers["x-ctxproxy-tokens-in"])
    assert m[("ctxproxy_tokens_out_total", ())] == 2 * int(r.headers["x-ctxproxy-tokens-out"])
    assert m[("ctxproxy_offloaded_results_total", ())] == 2
    assert m[("ctxproxy_upstream_seconds_count", (("route", "chat"),))] == 2
    assert ("ctxproxy_summarizer_failures_total", ()) in m
    assert m[("ctxproxy_disk_errors_total", ())] == 0


def test_no_keys_in_metrics(make_proxy: ProxyFactory) -> None:
    srv = make_proxy()
    httpx.post(srv.url + "/v1/chat/completions", headers={"authorization": "Bearer sk-secret-xyz"},
               content=b'{"model":"m","messages":[]}')
    assert "sk-secret-xyz" not in httpx.get(srv.url + "/metrics").text


def test_route_labels_are_bounded() -> None:
    assert route_of("/v1/chat/completions") == route_of("/chat/completions") == "chat"
    assert route_of("/v1/files/abc") == "passthrough"
    assert route_of("/files/t/s/tool_result/x.txt") == "files"
    assert route_of("/anything/" + "x" * 50) == "other"
    assert re.fullmatch(r"[a-z]+", route_of("/healthz"))

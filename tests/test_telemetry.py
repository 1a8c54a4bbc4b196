"""OpenTelemetry spans per request (proxy.telemetry), exported over OTLP/HTTP to an in-process
collector on a loopback socket (harness.otlp), from a proxy in front of the fake upstream.

The proxy's own side runs in process (its lifespan in the test's loop, so a request's span is
ended before its response returns); the upstream and the collector are real sockets. Export is
awaited with the proxy's drain hook (the provider's force_flush), never a sleep.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.otlp import KIND_CLIENT, KIND_INTERNAL, STATUS_ERROR, Collected, OtlpCollector
from proxy.config import Config, config_from_mapping
from proxy.config.telemetry import TelemetryConfig
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread, serve_in_thread
from proxy.errors import ConfigError
from proxy.model import RequestView, StageOutcome
from proxy.session import Identity
from proxy.store.ledger_entry import LedgerEntry
from proxy.telemetry import NULL_SPAN, NullTelemetry, installation_problem, open_telemetry
from proxy.telemetry.attributes import (
    pipeline_attributes,
    provider_of,
    server_of,
    usage_attributes,
)
from proxy.telemetry.otel import OtelTelemetry
from proxy.usage import Usage
from tests.conftest import InProcessFactory, ProxyFactory, closed_port

ROOT = Path(__file__).resolve().parent.parent
CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Say hi, please."}]}
RESPONSES = {"model": "gpt-4o-mini", "store": False,
             "input": [{"type": "message", "role": "user", "content": "Say hi."}]}
MESSAGES = {"model": "claude-haiku-4-5", "max_tokens": 64,
            "messages": [{"role": "user", "content": "Say hi."}]}
ANTHROPIC_HEADERS = {"x-api-key": "sk-ant-test", "anthropic-version": "2023-06-01"}
SECRET = "Bearer collector-secret-123"


@pytest.fixture
def collector() -> Iterator[tuple[OtlpCollector, ServerThread]]:
    col = OtlpCollector()
    with serve_in_thread(col) as srv:
        yield col, srv


def traced(srv: ServerThread, **extra: Any) -> dict[str, Any]:
    return {"telemetry": {"enabled": True, "endpoint": srv.url + "/v1/traces",
                          "headers": {"authorization": SECRET}, **extra}}


def one(col: OtlpCollector, name: str) -> Collected:
    spans = col.named(name)
    assert len(spans) == 1, [s.name for s in col.spans]
    return spans[0]


def _port(url: str) -> int:
    port = httpx.URL(url).port
    assert port is not None
    return port


# -- spans from the proxy ------------------------------------------------------------------------


async def test_chat_span_carries_the_pipelines_figures(
    make_inproc: InProcessFactory, fake_url: str,
    collector: tuple[OtlpCollector, ServerThread],
) -> None:
    col, srv = collector
    proxy = await make_inproc(traced(srv))
    r = await proxy.client.post("/v1/chat/completions", json=CHAT,
                                headers={"authorization": "Bearer sk-client-key"})
    assert r.status_code == 200
    assert col.spans == []  # batched: nothing is exported on the request's path
    await proxy.drain()
    span = one(col, "chat gpt-4o")
    a = span.attributes
    assert span.kind == KIND_CLIENT and span.parent_span_id == ""
    assert span.status != STATUS_ERROR and "error.type" not in a
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == a["gen_ai.system"] == "openai"
    assert a["gen_ai.request.model"] == "gpt-4o"
    assert "gen_ai.request.stream" not in a
    assert (a["server.address"], a["server.port"]) == ("127.0.0.1", _port(fake_url))
    assert a["ctxproxy.api"] == "chat"
    assert a["ctxproxy.session"] == a["gen_ai.conversation.id"] == r.headers["x-ctxproxy-session"]
    assert a["ctxproxy.tenant"].startswith("t-")
    assert a["ctxproxy.tokens.sent"] == int(r.headers["x-ctxproxy-tokens-in"]) > 0
    assert a["ctxproxy.tokens.forwarded"] == int(r.headers["x-ctxproxy-tokens-out"]) > 0
    assert a["ctxproxy.offloaded"] == int(r.headers["x-ctxproxy-offloaded"]) == 0
    assert a["ctxproxy.compacted"] is False and a["ctxproxy.compaction"] is False
    assert "gen_ai.conversation.compacted" not in a
    assert a["ctxproxy.read_rounds"] == 0
    assert a["http.response.status_code"] == 200
    # The ledger's figures, recorded after the response, finish the span: the provider's own
    # usage (the fake's), its cost at gpt-4o's price, the counterfactual.
    entry = proxy.state["services"].store.ledger.totals()[0]
    assert a["gen_ai.usage.input_tokens"] == entry.billed.prompt > 0
    assert a["gen_ai.usage.output_tokens"] == entry.billed.output > 0
    assert a["ctxproxy.cost.usd"] == pytest.approx(entry.cost) and entry.cost > 0
    assert a["ctxproxy.cost.direct_usd"] == pytest.approx(entry.direct_cost)
    assert a["ctxproxy.usage.estimated"] is False and "ctxproxy.cache.reason" not in a
    assert span.resource["service.name"] == "ctxproxy" and span.scope == "ctxproxy"
    # A pipeline that changed nothing has its time on the span, and no child span.
    assert 0 < a["ctxproxy.pipeline.duration_s"] < (span.end_ns - span.start_ns) / 1e9
    assert col.named("ctxproxy.pipeline") == [] and len(col.spans) == 1
    # The collector's auth header arrives; no client key and no message content leaves.
    assert col.exports and all(e["authorization"] == SECRET for e in col.exports)
    sent = repr([(s.attributes, s.resource) for s in col.spans])
    assert "sk-client-key" not in sent and "Say hi" not in sent


async def test_offloads_show_on_the_span(
    make_inproc: InProcessFactory, collector: tuple[OtlpCollector, ServerThread],
) -> None:
    col, srv = collector
    proxy = await make_inproc(traced(srv))
    huge = "line of tool output\n" * 5000  # ~100 KB: cut at stage 1
    body = {"model": "gpt-4o", "messages": [
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": huge},
    ]}
    r = await proxy.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["x-ctxproxy-offloaded"] == "1"
    await proxy.drain()
    a = one(col, "chat gpt-4o").attributes
    assert a["ctxproxy.offloaded"] == 1
    assert a["ctxproxy.tokens.sent"] == int(r.headers["x-ctxproxy-tokens-in"])
    assert a["ctxproxy.tokens.forwarded"] == int(r.headers["x-ctxproxy-tokens-out"])
    assert a["ctxproxy.tokens.forwarded"] < a["ctxproxy.tokens.sent"]
    # The pipeline changed the request: its run is a child span inside the request's.
    span, pipe = one(col, "chat gpt-4o"), one(col, "ctxproxy.pipeline")
    assert pipe.kind == KIND_INTERNAL
    assert (pipe.trace_id, pipe.parent_span_id) == (span.trace_id, span.span_id)
    assert span.start_ns <= pipe.start_ns <= pipe.end_ns <= span.end_ns
    assert pipe.end_ns - pipe.start_ns == pytest.approx(
        a["ctxproxy.pipeline.duration_s"] * 1e9, abs=1000)
    assert pipe.attributes["ctxproxy.pipeline.changed"] is True
    assert "ctxproxy.pipeline.failed" not in pipe.attributes


class _Boom:
    name = "boom"

    def __call__(self, messages: list[dict[str, Any]], request: RequestView) -> StageOutcome:
        raise OSError("disk full")


async def test_a_failed_stage_is_named_on_the_pipeline_span(
    make_inproc: InProcessFactory, collector: tuple[OtlpCollector, ServerThread],
) -> None:
    col, srv = collector
    proxy = await make_inproc(traced(srv), stages=[_Boom()])
    r = await proxy.client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    await proxy.drain()
    pipe = one(col, "ctxproxy.pipeline")
    assert pipe.attributes["ctxproxy.pipeline.failed"] == ["boom"]
    assert pipe.attributes["ctxproxy.pipeline.changed"] is False
    assert pipe.parent_span_id == one(col, "chat gpt-4o").span_id


async def test_responses_span(
    make_inproc: InProcessFactory, collector: tuple[OtlpCollector, ServerThread],
) -> None:
    col, srv = collector
    proxy = await make_inproc(traced(srv))
    r = await proxy.client.post("/v1/responses", json={**RESPONSES, "stream": True})
    assert r.status_code == 200
    await proxy.drain()
    a = one(col, "chat gpt-4o-mini").attributes
    assert a["ctxproxy.api"] == "responses" and a["gen_ai.provider.name"] == "openai"
    assert a["gen_ai.request.stream"] is True
    assert a["ctxproxy.tokens.sent"] == int(r.headers["x-ctxproxy-tokens-in"])
    assert a["ctxproxy.session"] == r.headers["x-ctxproxy-session"]
    assert a["http.response.status_code"] == 200


async def test_messages_span(
    make_inproc: InProcessFactory, fake_url: str,
    collector: tuple[OtlpCollector, ServerThread],
) -> None:
    col, srv = collector
    proxy = await make_inproc(traced(srv))
    r = await proxy.client.post("/v1/messages", json=MESSAGES, headers=ANTHROPIC_HEADERS)
    assert r.status_code == 200
    await proxy.drain()
    span = one(col, "chat claude-haiku-4-5")
    a = span.attributes
    assert span.kind == KIND_CLIENT
    assert a["ctxproxy.api"] == "messages"
    assert a["gen_ai.provider.name"] == a["gen_ai.system"] == "anthropic"
    assert (a["server.address"], a["server.port"]) == ("127.0.0.1", _port(fake_url))
    assert a["ctxproxy.tokens.sent"] == int(r.headers["x-ctxproxy-tokens-in"])
    assert a["ctxproxy.tokens.forwarded"] == int(r.headers["x-ctxproxy-tokens-out"])
    assert "sk-ant-test" not in repr(span)


async def test_an_upstream_error_status_marks_the_span(
    make_inproc: InProcessFactory, fake: FakeUpstream,
    collector: tuple[OtlpCollector, ServerThread],
) -> None:
    col, srv = collector
    proxy = await make_inproc(traced(srv))
    fake.script(Reply(status=429))
    r = await proxy.client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 429
    await proxy.drain()
    span = one(col, "chat gpt-4o")
    assert span.status == STATUS_ERROR
    assert span.attributes["error.type"] == "429"
    assert span.attributes["http.response.status_code"] == 429


async def test_an_unreachable_upstream_marks_the_span(
    make_inproc: InProcessFactory, collector: tuple[OtlpCollector, ServerThread],
) -> None:
    col, srv = collector
    dead = f"http://127.0.0.1:{closed_port()}/v1"
    proxy = await make_inproc({**traced(srv), "upstream": {"base_url": dead}})
    r = await proxy.client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 502
    await proxy.drain()
    span = one(col, "chat gpt-4o")
    assert span.status == STATUS_ERROR
    assert span.attributes["error.type"] == "UpstreamError"
    assert span.attributes["http.response.status_code"] == 502


async def test_a_client_traceparent_makes_the_span_its_child(
    make_inproc: InProcessFactory, collector: tuple[OtlpCollector, ServerThread],
) -> None:
    col, srv = collector
    # sample_ratio 0: only a caller's sampled trace is recorded (ParentBased).
    proxy = await make_inproc(traced(srv, sample_ratio=0.0))
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = await proxy.client.post("/v1/chat/completions", json=CHAT,
                                headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    assert r.status_code == 200
    r = await proxy.client.post("/v1/chat/completions", json=CHAT)  # not sampled
    assert r.status_code == 200
    await proxy.drain()
    span = one(col, "chat gpt-4o")
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent)


async def test_a_failing_telemetry_call_never_fails_the_request(
    make_inproc: InProcessFactory, collector: tuple[OtlpCollector, ServerThread],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    import proxy.telemetry.otel as otel

    def broken(stats: Any) -> Any:
        raise RuntimeError("telemetry bug")

    monkeypatch.setattr(otel, "pipeline_attributes", broken)
    col, srv = collector
    proxy = await make_inproc(traced(srv))
    with caplog.at_level(logging.ERROR, logger="proxy.telemetry"):
        for _ in range(2):
            r = await proxy.client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200
    await proxy.drain()
    # The span is still finished and exported, without what failed; logged once.
    spans = col.named("chat gpt-4o")
    assert len(spans) == 2 and all("ctxproxy.tokens.sent" not in s.attributes for s in spans)
    logged = [r for r in caplog.records if r.name == "proxy.telemetry"]
    assert len(logged) == 1 and "set_pipeline" in logged[0].getMessage()


def test_a_collector_refusing_connections_never_fails_a_request(
    make_proxy: ProxyFactory,
) -> None:
    """A real server on loopback whose collector is down: requests are answered as usual."""
    dead = f"http://127.0.0.1:{closed_port()}/v1/traces"
    srv = make_proxy({"telemetry": {"enabled": True, "endpoint": dead, "timeout_s": 0.5}})
    for stream in (False, True):
        r = httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "stream": stream},
                       timeout=10)
        assert r.status_code == 200 and r.headers["x-ctxproxy-tokens-in"]
    srv.drain()  # the export fails (bounded by timeout_s): drain still returns
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 200


# -- the span's life: end, then the ledger's figures ---------------------------------------------


def _entry(**kw: Any) -> LedgerEntry:
    base: dict[str, Any] = dict(tenant="t", session="s", id="r1", request="r1", ts=0.0,
                                kind="request", api="chat", model="gpt-4o")
    return LedgerEntry(**{**base, **kw})


@pytest.fixture
def otel(collector: tuple[OtlpCollector, ServerThread]) -> Iterator[OtelTelemetry]:
    _, srv = collector
    telemetry = OtelTelemetry(TelemetryConfig(enabled=True, endpoint=srv.url + "/v1/traces"))
    yield telemetry
    telemetry.provider.shutdown()


IDENTITY = Identity(tenant="team-a", session="sess-1", api_key="sk-never-sent")


def _request(telemetry: OtelTelemetry) -> Any:
    return telemetry.request("chat", "gpt-4o", IDENTITY, stream=False, headers=[],
                             base_url="https://api.openai.com/v1")


def test_ledger_sets_usage_and_cost_and_finishes_at_the_end_time(
    otel: OtelTelemetry, collector: tuple[OtlpCollector, ServerThread],
) -> None:
    col, _ = collector
    span = _request(otel)
    end = 1_900_000_000_000_000_000
    span.end(rounds=1, end_time_ns=end)
    assert otel.flush() and col.spans == []  # ended, but waiting for the ledger
    entry = _entry(usage=Usage(input=100, cache_read=900, cache_write_5m=40, cache_write_1h=10,
                               output=20, reasoning=5),
                   cost=0.0125, direct_cost=0.05, cache_reason="compaction")
    read_round = _entry(id="r2", kind="read_round", usage=None,
                        estimate=Usage(input=50, output=7), cost=0.0005)
    span.ledger(entry, [read_round], response_model="gpt-4o-2024-08-06")
    span.ledger(entry)  # finished exactly once: later calls do nothing
    span.close()
    assert otel.flush()
    [got] = col.spans
    a = got.attributes
    assert got.end_ns == end
    assert a["gen_ai.usage.input_tokens"] == 100 + 900 + 40 + 10 + 50
    assert a["gen_ai.usage.output_tokens"] == 27
    assert a["gen_ai.usage.cache_read.input_tokens"] == 900
    assert a["gen_ai.usage.cache_creation.input_tokens"] == 50
    assert a["gen_ai.usage.cache_write.input_tokens"] == 50
    assert a["gen_ai.usage.reasoning.output_tokens"] == 5
    assert a["ctxproxy.cost.usd"] == pytest.approx(0.013)
    assert a["ctxproxy.cost.direct_usd"] == 0.05
    assert a["ctxproxy.cache.reason"] == "compaction"
    assert a["ctxproxy.usage.estimated"] is True  # the round had no provider usage
    assert a["gen_ai.response.model"] == "gpt-4o-2024-08-06"
    assert a["ctxproxy.read_rounds"] == 1
    assert (a["server.address"], a["server.port"]) == ("api.openai.com", 443)
    assert (a["ctxproxy.tenant"], a["ctxproxy.session"]) == ("team-a", "sess-1")
    assert "sk-never-sent" not in repr(got)


def test_ledger_without_price_or_break_leaves_those_out(
    otel: OtelTelemetry, collector: tuple[OtlpCollector, ServerThread],
) -> None:
    col, _ = collector
    span = _request(otel)
    span.ledger(_entry(usage=Usage(input=10, output=2)))  # before the end: waits for it
    assert otel.flush() and col.spans == []
    span.end()
    assert otel.flush()
    [got] = col.spans
    a = got.attributes
    assert a["gen_ai.usage.input_tokens"] == 10 and a["ctxproxy.usage.estimated"] is False
    for absent in ("ctxproxy.cost.usd", "ctxproxy.cost.direct_usd", "ctxproxy.cache.reason",
                   "gen_ai.usage.reasoning.output_tokens", "gen_ai.response.model"):
        assert absent not in a


def test_close_finishes_without_ledger_figures(
    otel: OtelTelemetry, collector: tuple[OtlpCollector, ServerThread],
) -> None:
    col, _ = collector
    span = _request(otel)
    span.close()  # before the end: finished when it ends
    span.end(end_time_ns=2_000_000_000_000_000_000)
    span.ledger(_entry(usage=Usage(input=10)))  # too late: already finished
    span.end()  # ends once
    assert otel.flush()
    [got] = col.spans
    assert got.end_ns == 2_000_000_000_000_000_000
    assert "gen_ai.usage.input_tokens" not in got.attributes


async def test_a_failure_while_ending_still_finishes_the_span_once(
    collector: tuple[OtlpCollector, ServerThread], monkeypatch: pytest.MonkeyPatch,
) -> None:
    import proxy.telemetry.otel as module

    def broken(*args: Any) -> Any:
        raise RuntimeError("telemetry bug")

    monkeypatch.setattr(module, "end_attributes", broken)
    monkeypatch.setattr(module, "ledger_attributes", broken)
    col, srv = collector
    telemetry = OtelTelemetry(TelemetryConfig(enabled=True, endpoint=srv.url + "/v1/traces"))
    by_ledger, waiting = _request(telemetry), _request(telemetry)
    by_ledger.end()
    waiting.end()  # nothing calls back: shutdown finishes it
    by_ledger.ledger(_entry(usage=Usage(input=1)))
    assert telemetry.flush() and len(col.spans) == 1
    await telemetry.close()
    spans = col.named("chat gpt-4o")
    assert len(spans) == 2 and telemetry.failures.count == 3
    assert all("ctxproxy.read_rounds" not in s.attributes for s in spans)


async def test_spans_still_waiting_are_finished_at_shutdown(
    collector: tuple[OtlpCollector, ServerThread],
) -> None:
    col, srv = collector
    telemetry = OtelTelemetry(TelemetryConfig(enabled=True, endpoint=srv.url + "/v1/traces"))
    for _ in range(3):
        _request(telemetry).end()
    await telemetry.drain()
    assert col.spans == []
    await telemetry.close()
    assert len(col.named("chat gpt-4o")) == 3


def test_waiting_spans_are_bounded(
    otel: OtelTelemetry, collector: tuple[OtlpCollector, ServerThread],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import proxy.telemetry.otel as module

    monkeypatch.setattr(module, "MAX_WAITING", 2)
    col, _ = collector
    spans = [_request(otel) for _ in range(3)]
    for span in spans:
        span.end()
    assert otel.flush()
    assert len(col.spans) == 1  # the oldest, finished without ledger figures
    spans[0].ledger(_entry(usage=Usage(input=1)))  # already finished: nothing more
    spans[1].ledger(_entry(usage=Usage(input=1)))
    assert otel.flush()
    assert len(col.spans) == 2
    assert sum("gen_ai.usage.input_tokens" in s.attributes for s in col.spans) == 1


# -- off by default, and configuration -----------------------------------------------------------


def test_off_by_default_is_the_null_object() -> None:
    telemetry = open_telemetry(Config().telemetry)
    assert isinstance(telemetry, NullTelemetry) and not telemetry.enabled
    span = telemetry.request("chat", "m", IDENTITY, stream=False, headers=[], base_url=None)
    assert span is NULL_SPAN

    async def send(message: Any) -> None:
        return None

    assert span.watch(send) is send
    asyncio.run(telemetry.drain())


OFF_SCRIPT = """
import asyncio, sys
from proxy.app import create_app
from proxy.config import config_from_mapping
from proxy.demo.fake.upstream import FakeUpstream
from harness.inprocess import InProcess
from proxy.demo.servers import serve_in_thread

async def main() -> None:
    with serve_in_thread(FakeUpstream()) as up:
        config = config_from_mapping({
            "upstream": {"base_url": up.url + "/v1"}, "anthropic": {"base_url": up.url},
            "storage": {"data_dir": sys.argv[1]}})
        async with InProcess(create_app(config)) as proxy:
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            r = await proxy.client.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            r = await proxy.client.post("/v1/messages", json={**chat, "max_tokens": 8},
                                        headers={"x-api-key": "k"})
            assert r.status_code == 200, r.text
            await proxy.drain()
    print(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"))

asyncio.run(main())
"""


def test_off_never_imports_opentelemetry(tmp_path: Path) -> None:
    """Importing the app and serving requests with the default configuration: no
    ``opentelemetry`` module is ever loaded (a subprocess: this one has imported it)."""
    proc = subprocess.run([sys.executable, "-c", OFF_SCRIPT, str(tmp_path / "data")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_enabled_needs_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError) as exc:
        config_from_mapping({"telemetry": {"enabled": True}})
    assert exc.value.message.startswith("telemetry:") and "endpoint" in exc.value.message
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert config_from_mapping({"telemetry": {"enabled": True}}).telemetry.endpoint is None
    with pytest.raises(ConfigError) as exc:
        config_from_mapping({"telemetry": {"endpoint": "collector:4318"}})
    assert exc.value.message.startswith("telemetry.endpoint:")


def test_headers_come_from_the_environment_and_are_never_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTLP_TOKEN_TEST", "Bearer from-env-456")
    config = config_from_mapping({"telemetry": {
        "enabled": True, "endpoint": "http://127.0.0.1:4318/v1/traces",
        "headers": {"authorization": "os.environ/OTLP_TOKEN_TEST"}}})
    assert config.telemetry.headers == {"authorization": "Bearer from-env-456"}
    assert "from-env-456" not in repr(config) and "from-env-456" not in str(config)


def test_installation_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    on = TelemetryConfig(enabled=True, endpoint="http://127.0.0.1:4318/v1/traces")
    assert installation_problem(TelemetryConfig()) is None
    assert installation_problem(on) is None  # the dev extra installs it
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    problem = installation_problem(on)
    assert problem is not None and "ctxproxy[otel]" in problem


def test_cli_refuses_telemetry_without_an_endpoint(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("telemetry: {enabled: true}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    proc = subprocess.run([sys.executable, "-m", "proxy", "serve", "--config", str(path)],
                          capture_output=True, text=True, timeout=30, cwd=ROOT, env=env)
    assert proc.returncode == 2
    assert "telemetry" in proc.stderr and "endpoint" in proc.stderr


# -- the attributes (pure) -----------------------------------------------------------------------


def test_provider_names() -> None:
    assert provider_of("chat") == provider_of("responses") == "openai"
    assert provider_of("messages") == "anthropic"
    assert provider_of("chat", {"model": "anthropic/claude-x"}) == "anthropic"
    assert provider_of("chat", {"model": "bedrock/anthropic.claude"}) == "aws.bedrock"
    assert provider_of("chat", {"model": "ollama/llama3"}) == "ollama"
    assert provider_of("chat", {"model": "gpt-4o"}) == "openai"


def test_pipeline_attributes_of_a_compaction() -> None:
    a = pipeline_attributes({"tokens_in": 90_000, "tokens_out": 30_000, "offloaded": 2,
                             "compacted": 1, "compactions": 1}, 12.5)
    assert a == {"ctxproxy.pipeline.duration_s": 0.0125, "ctxproxy.tokens.sent": 90_000,
                 "ctxproxy.tokens.forwarded": 30_000, "ctxproxy.offloaded": 2,
                 "ctxproxy.compacted": True, "ctxproxy.compaction": True,
                 "gen_ai.conversation.compacted": True}
    # A summary reused (no new one); the conventions' flag is never sent false.
    a = pipeline_attributes({"compacted": 1}, 1.0)
    assert a["ctxproxy.compacted"] is True and a["ctxproxy.compaction"] is False
    assert "ctxproxy.tokens.sent" not in pipeline_attributes({}, 1.0)
    assert "gen_ai.conversation.compacted" not in pipeline_attributes({}, 1.0)


def test_server_of() -> None:
    assert server_of("https://api.anthropic.com") == ("api.anthropic.com", 443)
    assert server_of("http://vllm:8000/v1") == ("vllm", 8000)
    assert server_of("http://[::1]:9/v1") == ("::1", 9)
    assert server_of(None) is None and server_of("not a url") is None
    assert server_of("http://h:99999/") is None  # an invalid port


@given(st.builds(Usage, *[st.integers(0, 10**9)] * 6))
def test_input_tokens_count_every_prompt_token(usage: Usage) -> None:
    a = usage_attributes(usage)
    assert a["gen_ai.usage.input_tokens"] == usage.input + usage.cache_read + usage.cache_write
    assert a["gen_ai.usage.input_tokens"] >= (a["gen_ai.usage.cache_read.input_tokens"]
                                              + a["gen_ai.usage.cache_creation.input_tokens"])
    assert a["gen_ai.usage.output_tokens"] == usage.output

"""Raw forwarding: byte identity both ways, headers, sessions, pass-through routes (in process)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from harness.inprocess import InProcess
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.model import RequestView, StageOutcome
from proxy.session import tenant_of

from .conftest import InProcessFactory

# Odd spacing, key order, unicode escapes and unknown fields: re-serialising would change them.
RAW_BODY = (
    b'{ "model":"gpt-4o",  "messages":[{"role":"user","content":"h\\u00e9llo \xf0\x9f\x98\x80"}],'
    b'"x_unknown": {"nested": [1, 2.50, null]}, "temperature":0.2 }'
)


async def post(app: InProcess, path: str, body: bytes, **headers: str) -> httpx.Response:
    headers.setdefault("content-type", "application/json")
    return await app.client.post(path, content=body, headers=headers)


async def test_unchanged_request_reaches_upstream_byte_for_byte(
    inproc: InProcess, fake: FakeUpstream
) -> None:
    r = await post(inproc, "/v1/chat/completions", RAW_BODY, authorization="Bearer sk-abc")
    assert r.status_code == 200
    assert fake.received[-1].body == RAW_BODY
    assert fake.received[-1].path == "/v1/chat/completions"


async def test_response_body_passes_byte_for_byte(inproc: InProcess, fake: FakeUpstream) -> None:
    weird = b'{"id":"x",  "object":"chat.completion","choices":[],"zzz_extra":"\\u2603"}'
    fake.script(Reply(body=weird, headers={"x-request-id": "req-1", "openai-processing-ms": "7"}))
    r = await post(inproc, "/v1/chat/completions", RAW_BODY)
    assert r.content == weird
    assert r.headers["x-request-id"] == "req-1"
    assert r.headers["openai-processing-ms"] == "7"


async def test_sse_passes_byte_for_byte(inproc: InProcess, fake: FakeUpstream) -> None:
    sse = (
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
        b'"delta":{"content":"he"}}]}\n\n: keep-alive comment\n\n'
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"llo"}}]}\n\n'
        b"data: [DONE]\n\n"
    )
    fake.script(Reply(body=sse, headers={"content-type": "text/event-stream"}))
    body = orjson.loads(RAW_BODY)
    body["stream"] = True
    async with inproc.client.stream(
        "POST", "/v1/chat/completions", content=orjson.dumps(body)
    ) as r:
        got = b"".join([chunk async for chunk in r.aiter_raw()])
    assert got == sse


async def test_ctxproxy_headers(inproc: InProcess) -> None:
    r = await post(inproc, "/v1/chat/completions", RAW_BODY, **{"x-session-id": "my-sess"})
    assert r.headers["x-ctxproxy-session"] == "my-sess"
    assert int(r.headers["x-ctxproxy-tokens-in"]) > 0
    assert int(r.headers["x-ctxproxy-tokens-out"]) > 0
    assert r.headers["x-ctxproxy-offloaded"] == "0"
    assert r.headers["x-ctxproxy-compacted"] == "0"


async def test_derived_session_is_stable_over_turns(inproc: InProcess) -> None:
    turn1 = {"model": "m", "messages": [{"role": "user", "content": "start"}]}
    turn2 = {
        "model": "m",
        "messages": turn1["messages"] + [  # type: ignore[operator]
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "next"},
        ],
    }
    s1 = (await post(inproc, "/v1/chat/completions", orjson.dumps(turn1))).headers["x-ctxproxy-session"]
    s2 = (await post(inproc, "/v1/chat/completions", orjson.dumps(turn2))).headers["x-ctxproxy-session"]
    assert s1 == s2 and s1.startswith("s-")


async def test_client_key_forwarded_when_no_upstream_key(inproc: InProcess, fake: FakeUpstream) -> None:
    await post(inproc, "/v1/chat/completions", RAW_BODY, authorization="Bearer sk-client")
    assert fake.received[-1].headers["authorization"] == "Bearer sk-client"


async def test_upstream_key_replaces_client_key(make_inproc: InProcessFactory, fake: FakeUpstream) -> None:
    app = await make_inproc({"upstream": {"api_key": "sk-server"}})
    await post(app, "/v1/chat/completions", RAW_BODY, authorization="Bearer sk-client")
    assert fake.received[-1].headers["authorization"] == "Bearer sk-server"
    assert "sk-client" not in str(fake.received[-1].raw_headers)


async def test_headers_that_matter_pass_and_hop_by_hop_do_not(
    inproc: InProcess, fake: FakeUpstream
) -> None:
    await post(
        inproc,
        "/v1/chat/completions",
        RAW_BODY,
        **{
            "openai-organization": "org-1",
            "openai-project": "proj-1",
            "x-stainless-lang": "python",
            "user-agent": "MyAgent/1.0",
            "keep-alive": "timeout=5",
            "proxy-authorization": "Basic xyz",
            "te": "trailers",
            "x-ctxproxy-session": "internal",
        },
    )
    h = fake.received[-1].headers
    assert h["openai-organization"] == "org-1"
    assert h["openai-project"] == "proj-1"
    assert h["x-stainless-lang"] == "python"
    assert h["user-agent"] == "MyAgent/1.0"
    assert h["content-type"] == "application/json"
    for dropped in ("keep-alive", "proxy-authorization", "te", "x-ctxproxy-session"):
        assert dropped not in h


async def test_both_chat_paths(inproc: InProcess, fake: FakeUpstream) -> None:
    assert (await post(inproc, "/chat/completions", RAW_BODY)).status_code == 200
    assert fake.received[-1].path == "/v1/chat/completions"
    assert fake.received[-1].body == RAW_BODY


async def test_query_string_and_other_v1_routes_pass_through(
    inproc: InProcess, fake: FakeUpstream
) -> None:
    r = await inproc.client.post(
        "/v1/embeddings?api-version=2024-01",
        content=b'{"model":"e","input":"abc"}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200 and r.json()["object"] == "list"
    assert fake.received[-1].query == "api-version=2024-01"
    assert fake.received[-1].body == b'{"model":"e","input":"abc"}'
    r = await inproc.client.delete("/v1/files/file-123?x=1")
    echo = r.json()
    assert echo["method"] == "DELETE" and echo["path"] == "/v1/files/file-123"
    assert fake.received[-1].query == "x=1"


async def test_models_passthrough_and_configured(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    app = await make_inproc()
    assert (await app.client.get("/v1/models")).json()["data"][0]["id"] == "fake-model"
    routed = await make_inproc(
        {"model_list": [{"model_name": "claude", "litellm_params": {"model": "anthropic/x"}}]}
    )
    data = (await routed.client.get("/v1/models")).json()
    assert [m["id"] for m in data["data"]] == ["claude"]


async def test_healthz(inproc: InProcess) -> None:
    r = await inproc.client.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


async def test_the_root_answers_a_liveness_probe(inproc: InProcess) -> None:
    """Claude Code sends ``HEAD /`` to its base URL before the first request."""
    head = await inproc.client.head("/")
    assert head.status_code == 200 and head.content == b""
    assert (await inproc.client.get("/")).json() == {"status": "ok"}


async def test_unknown_route_is_enveloped(inproc: InProcess) -> None:
    r = await inproc.client.get("/nope")
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = await inproc.client.put("/healthz")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


class _Rewrite:
    name = "rewrite"

    def __call__(self, messages: list[dict[str, Any]], request: RequestView) -> StageOutcome:
        return StageOutcome([{**m, "content": "CUT"} for m in messages], True, {"offloaded": 1})


class _Boom:
    name = "boom"

    def __call__(self, messages: list[dict[str, Any]], request: RequestView) -> StageOutcome:
        raise OSError("disk full")


async def test_changed_request_is_reserialised_with_unknown_fields(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    app = await make_inproc(stages=[_Rewrite()])
    r = await post(app, "/v1/chat/completions", RAW_BODY)
    sent = fake.received[-1].json()
    assert sent["messages"][0]["content"] == "CUT"
    assert sent["x_unknown"] == {"nested": [1, 2.5, None]}
    assert list(sent) == ["model", "messages", "x_unknown", "temperature"]
    assert r.headers["x-ctxproxy-offloaded"] == "1"


async def test_failing_stage_degrades_to_forwarding(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    app = await make_inproc(stages=[_Boom(), _Rewrite()])
    r = await post(app, "/v1/chat/completions", RAW_BODY)
    assert r.status_code == 200
    assert fake.received[-1].json()["messages"][0]["content"] == "CUT"


@pytest.mark.parametrize("key", ["sk-one", None])
async def test_tenant_never_contains_key(inproc: InProcess, key: str | None) -> None:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = await post(inproc, "/v1/chat/completions", RAW_BODY, **headers)
    assert r.status_code == 200
    assert tenant_of(key) != key


async def test_an_answer_larger_than_the_relay_buffer_is_archived(
    inproc: InProcess, fake: FakeUpstream, data_dir: Any
) -> None:
    """Answers over 16 MiB are relayed as they arrive instead of buffered first; the archive
    still gets them whole."""
    big = "y" * (17 * 1024 * 1024)
    fake.script(Reply(content=big))
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "write a lot"}],
            "user": "big-answer"}
    r = await inproc.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and len(r.content) > 16 * 1024 * 1024
    await inproc.drain()  # the archive writes still running
    [dialog] = list(data_dir.glob("anon/big-answer/dialog/*.jsonl"))
    records = [orjson.loads(line) for line in dialog.read_bytes().splitlines()]
    assert [r["role"] for r in records] == ["user", "assistant"]
    assert records[1]["message"]["content"] == big

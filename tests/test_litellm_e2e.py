"""An Anthropic route end to end: openai SDK -> proxy -> litellm -> respx-mocked Anthropic API."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import openai
import orjson
import pytest
import respx

from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import ServerThread
from proxy.formats.chat.request import ChatFormat, ChatTap
from proxy.usage import Usage, parse_usage

from .conftest import ProxyFactory
from .test_litellm_route import anthropic_error, sse_response, text_events

ROUTE = {
    "model_name": "claude",
    "litellm_params": {"model": "anthropic/claude-3-5-sonnet-20241022", "api_key": "sk-ant-test"},
}
MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]
ANSWER = {
    "id": "msg_01",
    "type": "message",
    "role": "assistant",
    "model": "claude-3-5-sonnet-20241022",
    "content": [{"type": "text", "text": "Hello from Claude"}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 12, "output_tokens": 5},
}


@pytest.fixture
def anthropic() -> Iterator[respx.MockRouter]:
    # The SDK sends through httpx2, which respx does not patch: only litellm's httpx is mocked.
    with respx.mock(assert_all_mocked=True, assert_all_called=False) as mock:
        yield mock


@pytest.fixture
def routed(make_proxy: ProxyFactory) -> ServerThread:
    return make_proxy({"model_list": [ROUTE]})


def sdk(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-client", max_retries=0, timeout=60)


def test_non_stream(routed: ServerThread, anthropic: respx.MockRouter) -> None:
    route = anthropic.post("https://api.anthropic.com/v1/messages").mock(
        return_value=httpx.Response(200, json=ANSWER)
    )
    raw = sdk(routed).chat.completions.with_raw_response.create(
        model="claude", messages=MSGS, max_tokens=50  # type: ignore[arg-type]
    )
    resp = raw.parse()
    assert resp.choices[0].message.content == "Hello from Claude"
    assert resp.model == "claude"
    assert resp.usage is not None and resp.usage.completion_tokens == 5
    assert raw.headers["x-ctxproxy-session"]
    sent = route.calls.last.request
    assert sent.headers["x-api-key"] == "sk-ant-test"
    assert b"You are terse." in sent.content


def test_stream(routed: ServerThread, anthropic: respx.MockRouter) -> None:
    anthropic.post("https://api.anthropic.com/v1/messages").mock(
        return_value=sse_response(text_events("Hel", "lo ", "there"))
    )
    chunks = list(
        sdk(routed).chat.completions.create(
            model="claude", messages=MSGS, max_tokens=50, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there"
    assert len([c for c in chunks if c.usage is not None]) == 1


def test_stream_usage_reaches_the_tap_not_the_client(
    routed: ServerThread, anthropic: respx.MockRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client asked no usage chunk, and gets none; the proxy keeps the usage the provider
    billed (the ledger reads it from the answer's tap)."""
    made: list[ChatTap] = []

    def tap(self: ChatFormat, original: Callable[[ChatFormat], ChatTap] = ChatFormat.tap) -> ChatTap:
        made.append(original(self))
        return made[-1]

    monkeypatch.setattr(ChatFormat, "tap", tap)
    anthropic.post("https://api.anthropic.com/v1/messages").mock(
        return_value=sse_response(text_events("Hel", "lo"))
    )
    chunks = list(sdk(routed).chat.completions.create(
        model="claude", messages=MSGS, max_tokens=50, stream=True,  # type: ignore[arg-type]
    ))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert all(c.usage is None for c in chunks)
    [seen] = made
    assert parse_usage("chat", seen.usage()) == Usage(input=25, output=15)


def test_provider_error_is_enveloped(routed: ServerThread, anthropic: respx.MockRouter) -> None:
    anthropic.post("https://api.anthropic.com/v1/messages").mock(
        return_value=anthropic_error(429, "rate_limit_error", "slow down")
    )
    with pytest.raises(openai.RateLimitError) as info:
        sdk(routed).chat.completions.create(model="claude", messages=MSGS, max_tokens=5)  # type: ignore[arg-type]
    assert "slow down" in str(info.value)
    assert "sk-ant-test" not in str(info.value)


def test_other_models_still_go_upstream(routed: ServerThread) -> None:
    r = sdk(routed).chat.completions.create(model="gpt-4o", messages=MSGS)  # type: ignore[arg-type]
    assert r.choices[0].message.content == "ok"


# --- the summarizer through a route -------------------------------------------------------------

SUMMARY = """## Goal
Say hello.
## Constraints & Preferences
- be terse
## Progress
### Done
- said hello
### In Progress
- nothing
### Blocked
- nothing
## Key Decisions
- none
## Next Steps
- wait
## Critical Context
- none
"""


def long_chat() -> list[dict[str, str]]:
    out = [{"role": "system", "content": "You are terse."}]
    for t in range(30):
        out += [{"role": "user", "content": f"request {t}: " + "please do the thing " * 15},
                {"role": "assistant", "content": f"answer {t}: " + "done with it " * 20}]
    return out


@pytest.mark.parametrize(("target", "temperature", "sent"), [
    ("anthropic/claude-sonnet-5", 0.0, None),  # the catalogue: no sampling parameters
    ("anthropic/claude-3-5-sonnet-20241022", None, None),  # none configured: none sent
    ("anthropic/claude-3-5-sonnet-20241022", 0.2, 0.2),
])
def test_a_routed_summarizer_sends_only_the_sampling_the_model_takes(
    make_proxy: ProxyFactory, fake: FakeUpstream, anthropic: respx.MockRouter, target: str,
    temperature: float | None, sent: float | None,
) -> None:
    """compaction.model naming a route: the summary comes through litellm (with the route's
    key), and carries a temperature only where one is configured and the model takes it."""
    route = anthropic.post("https://api.anthropic.com/v1/messages").mock(
        return_value=httpx.Response(200, json={**ANSWER, "content": [
            {"type": "text", "text": SUMMARY}]}))
    srv = make_proxy({
        "model_list": [{"model_name": "summ",
                        "litellm_params": {"model": target, "api_key": "sk-ant-route"}}],
        "compaction": {"model": "summ", "temperature": temperature,
                       "context_windows": {"gpt-4o": 4000}},
    })
    raw = sdk(srv).chat.completions.with_raw_response.create(
        model="gpt-4o", messages=long_chat())  # type: ignore[arg-type]
    assert raw.headers["x-ctxproxy-compacted"] == "1"
    (call,) = route.calls
    body = orjson.loads(call.request.content)
    assert call.request.headers["x-api-key"] == "sk-ant-route"
    assert body.get("temperature") == sent and "top_p" not in body and "top_k" not in body
    assert "sk-test" not in str(call.request.headers)  # the client's key stays with OpenAI
    assert b"- said hello" in fake.received[-1].body  # the model's summary, not the fallback

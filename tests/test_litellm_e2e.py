"""An Anthropic route end to end: openai SDK -> proxy -> litellm -> respx-mocked Anthropic API."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
import respx

from proxy.formats.chat import ChatFormat, ChatTap
from proxy.ledger.usage import Usage, parse_usage
from proxy.testing.servers import ServerThread

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

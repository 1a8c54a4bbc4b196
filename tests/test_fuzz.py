"""Generated bad input against a real proxy: never a proxy-made 5xx, always the envelope."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.testing.servers import ServerThread

from .conftest import ProxyFactory

_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
)
_json = st.recursive(
    _leaf, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
    max_leaves=16,
)
_role = st.sampled_from(["user", "assistant", "tool", "system", "developer", "function", "nope", None])
_part = st.one_of(_json, st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "file", "x"])},
    optional={"text": _json, "image_url": _json}))
_call = st.fixed_dictionaries({"id": _json, "type": st.just("function"),
                               "function": st.fixed_dictionaries({"name": _json, "arguments": _json})})
_message = st.one_of(_json, st.fixed_dictionaries({"role": _role}, optional={
    "content": st.one_of(_json, st.lists(_part, max_size=3), st.text(max_size=4000)),
    "tool_calls": st.one_of(_json, st.lists(_call, max_size=3)),
    "tool_call_id": _json, "name": _json}))
_body = st.fixed_dictionaries(
    {"model": st.one_of(st.just("gpt-4o"), _json), "messages": st.one_of(st.lists(_message, max_size=6), _json)},
    optional={"stream": _json, "max_tokens": _json, "tools": _json, "metadata": _json, "user": _json,
              "stream_options": _json, "prompt_cache_key": _json})


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def test_generated_requests_never_get_a_proxy_5xx(make_proxy: ProxyFactory, client: httpx.Client) -> None:
    srv: ServerThread = make_proxy()

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_body)
    def one(body: dict[str, object]) -> None:
        r = client.post(srv.url + "/v1/chat/completions", content=orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS))
        assert r.status_code < 500, (r.status_code, r.text[:300])
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    one()


def test_message_count_limit(make_proxy: ProxyFactory) -> None:
    srv = make_proxy({"server": {"max_messages": 10}})
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}] * 11})
    r = httpx.post(srv.url + "/v1/chat/completions", content=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "at most 10" in r.json()["error"]["message"]

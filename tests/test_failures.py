"""Failure behaviour: every proxy error in OpenAI's envelope, upstream errors untouched."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
import orjson
import pytest

from proxy.testing.fake_upstream import FakeUpstream, Reply, error_body
from proxy.testing.servers import ServerThread

from .conftest import ProxyFactory, closed_port

CHAT = "/v1/chat/completions"
GOOD = orjson.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})


def assert_envelope(r: httpx.Response, status: int, param: str | None = None) -> dict[str, object]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    return err  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (b"", None),
        (b"[1, 2]", None),
        (b'"just a string"', None),
        (b'{"messages": []}', "model"),
        (b'{"model": 5, "messages": []}', "model"),
        (b'{"model": "gpt-4o"}', "messages"),
        (b'{"model": "gpt-4o", "messages": {"role": "user"}}', "messages"),
        (b'{"model": "gpt-4o", "messages": [], "x": "\xff\xfe"}', None),
    ],
)
def test_bad_requests_get_400(
    proxy: ServerThread, fake: FakeUpstream, body: bytes, param: str | None
) -> None:
    r = httpx.post(proxy.url + CHAT, content=body, headers={"content-type": "application/json"})
    assert_envelope(r, 400, param)
    assert fake.received == []  # nothing reached the upstream


def test_body_over_limit_gets_413(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    srv = make_proxy({"server": {"max_body_mb": 0.01}})
    big = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 20000}]})
    assert_envelope(httpx.post(srv.url + CHAT, content=big), 413)

    def chunked() -> object:
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    # Without a content-length the limit is enforced while reading.
    assert_envelope(httpx.post(srv.url + CHAT, content=chunked()), 413)  # type: ignore[arg-type]
    assert fake.received == []
    assert httpx.post(srv.url + CHAT, content=GOOD).status_code == 200


def test_upstream_unreachable_gets_502(make_proxy: ProxyFactory) -> None:
    srv = make_proxy({"upstream": {"base_url": f"http://127.0.0.1:{closed_port()}/v1"}})
    err = assert_envelope(httpx.post(srv.url + CHAT, content=GOOD), 502)
    assert err["code"] == "upstream_unavailable"
    assert_envelope(httpx.get(srv.url + "/v1/models"), 502)


def test_upstream_timeout_gets_504(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    srv = make_proxy({"upstream": {"timeout_s": 0.3}})
    fake.script(Reply(delay_s=2))
    err = assert_envelope(httpx.post(srv.url + CHAT, content=GOOD, timeout=10), 504)
    assert err["code"] == "upstream_timeout"


@pytest.mark.parametrize("status", [400, 401, 404, 429, 500, 503])
def test_upstream_errors_pass_through_unchanged(
    proxy: ServerThread, fake: FakeUpstream, status: int
) -> None:
    body = error_body(status, f"upstream says {status}")
    fake.script(Reply(status=status, body=body, headers={"retry-after": "3"}))
    r = httpx.post(proxy.url + CHAT, content=GOOD)
    assert r.status_code == status
    assert r.content == body
    assert r.headers["retry-after"] == "3"


def test_non_json_upstream_body_passes_through(proxy: ServerThread, fake: FakeUpstream) -> None:
    fake.script(Reply(status=502, body=b"<html>bad gateway</html>", headers={"content-type": "text/html"}))
    r = httpx.post(proxy.url + CHAT, content=GOOD)
    assert r.status_code == 502 and r.content == b"<html>bad gateway</html>"


def test_upstream_body_breaking_mid_way_gets_502(proxy: ServerThread, fake: FakeUpstream) -> None:
    fake.script(Reply(content="x" * 5000, break_after_events=1))
    err = assert_envelope(httpx.post(proxy.url + CHAT, content=GOOD), 502)
    assert "broke" in str(err["message"])


def test_stream_breaking_mid_way_ends_client_stream_cleanly(
    proxy: ServerThread, fake: FakeUpstream
) -> None:
    fake.script(Reply(content="abcdefgh" * 10, break_after_events=2))
    body = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]})
    with httpx.stream("POST", proxy.url + CHAT, content=body, timeout=10) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())  # a torn chunked body would raise here
    events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert len(events) == 3
    last = orjson.loads(events[-1][len(b"data: ") :])
    assert last["error"]["code"] == "upstream_stream_broken"


async def _abandon(url: str, body: bytes, after: float, stream: bool) -> None:
    async with aiohttp.ClientSession() as s:
        try:
            async with s.post(url, data=body, timeout=aiohttp.ClientTimeout(total=after)) as r:
                if stream:
                    await r.content.readany()
                    await asyncio.sleep(after)
                    r.close()  # walk away mid-stream
                    return
                await r.read()
        except (TimeoutError, aiohttp.ClientError):
            pass


async def _abandon_once_forwarded(
    url: str, body: bytes, fake: FakeUpstream, headers: dict[str, str] | None = None
) -> None:
    """Post, and walk away as soon as the upstream has the request (the first request of a
    fresh proxy may still be loading its tokenizer, so no fixed delay would do)."""
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(s.post(url, data=body, headers=headers))
        assert await fake.wait_for_async(lambda f: len(f.received) == 1, timeout=10)
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, aiohttp.ClientError):
            pass


def test_disconnect_cancels_non_streaming_upstream_call(
    proxy: ServerThread, fake: FakeUpstream
) -> None:
    fake.script(Reply(delay_s=20))
    asyncio.run(_abandon_once_forwarded(proxy.url + CHAT, GOOD, fake))
    assert fake.wait_for(lambda f: len(f.cancelled) == 1, timeout=10)
    assert fake.completed == []


def test_disconnect_cancels_streaming_upstream_call(
    proxy: ServerThread, fake: FakeUpstream
) -> None:
    # 20 s of stream, so that even a loaded machine sees the cancel long before it could end.
    fake.script(Reply(content="word " * 200, stream_pieces=200, chunk_delay_s=0.1))
    body = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]})
    asyncio.run(_abandon(proxy.url + CHAT, body, 0.5, stream=True))
    assert fake.wait_for(lambda f: len(f.cancelled) == 1, timeout=10)
    assert fake.completed == []


def test_proxy_survives_failures(proxy: ServerThread, fake: FakeUpstream) -> None:
    for _ in range(3):
        httpx.post(proxy.url + CHAT, content=b"{bad")
    assert httpx.post(proxy.url + CHAT, content=GOOD).json()["choices"][0]["message"]["content"] == "ok"

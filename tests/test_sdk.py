"""The real openai SDK as the client, through the proxy, to the fake upstream on real sockets."""

from __future__ import annotations

import asyncio

import openai
import pytest

from proxy.testing.fake_upstream import FakeUpstream, Reply
from proxy.testing.servers import ServerThread

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
CALLS = [
    {"name": "read_file", "arguments": {"path": "a.py"}},
    {"name": "grep", "arguments": {"pattern": "TODO", "path": "."}},
]


def client(srv: ServerThread, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-test", max_retries=0, **kw)  # type: ignore[arg-type]


def test_sync_completion(proxy: ServerThread, fake: FakeUpstream) -> None:
    fake.script(Reply(content="hi there"))
    raw = client(proxy).chat.completions.with_raw_response.create(model="gpt-4o", messages=MSGS)  # type: ignore[arg-type]
    resp = raw.parse()
    assert resp.choices[0].message.content == "hi there"
    assert raw.headers["x-ctxproxy-session"]
    assert fake.received[-1].json()["messages"] == MSGS
    assert fake.received[-1].headers["authorization"] == "Bearer sk-test"


def test_async_completion(proxy: ServerThread, fake: FakeUpstream) -> None:
    fake.script(Reply(content="async hi"))

    async def go() -> str | None:
        c = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0)
        r = await c.chat.completions.create(model="gpt-4o", messages=MSGS)  # type: ignore[arg-type]
        await c.close()
        return r.choices[0].message.content

    assert asyncio.run(go()) == "async hi"


def test_streaming_with_usage(proxy: ServerThread, fake: FakeUpstream) -> None:
    fake.script(Reply(content="streamed answer here", stream_pieces=5))
    chunks = list(
        client(proxy).chat.completions.create(
            model="gpt-4o", messages=MSGS, stream=True, stream_options={"include_usage": True}  # type: ignore[arg-type]
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "streamed answer here"
    usage = [c for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].choices == [] and chunks[-1] is usage[0]


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls(proxy: ServerThread, fake: FakeUpstream, stream: bool) -> None:
    fake.script(Reply(content=None, tool_calls=CALLS))
    c = client(proxy)
    if not stream:
        msg = c.chat.completions.create(model="gpt-4o", messages=MSGS).choices[0].message  # type: ignore[arg-type]
        calls = [(t.function.name, t.function.arguments) for t in msg.tool_calls or []]  # type: ignore[union-attr]
    else:
        acc: dict[int, list[str]] = {}
        for chunk in c.chat.completions.create(model="gpt-4o", messages=MSGS, stream=True):  # type: ignore[arg-type]
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                slot = acc.setdefault(d.index, ["", ""])
                if d.function and d.function.name:
                    slot[0] += d.function.name
                if d.function and d.function.arguments:
                    slot[1] += d.function.arguments
        calls = [tuple(acc[i]) for i in sorted(acc)]  # type: ignore[misc]
    assert calls == [
        ("read_file", '{"path":"a.py"}'),
        ("grep", '{"pattern":"TODO","path":"."}'),
    ]


def test_tool_result_turn_round_trips(proxy: ServerThread, fake: FakeUpstream) -> None:
    history = MSGS + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py\n"},
    ]
    fake.script(Reply(content="two files"))
    r = client(proxy).chat.completions.create(model="gpt-4o", messages=history)  # type: ignore[arg-type]
    assert r.choices[0].message.content == "two files"
    assert fake.received[-1].json()["messages"] == history


@pytest.mark.parametrize(
    "status, exc",
    [(400, openai.BadRequestError), (401, openai.AuthenticationError),
     (429, openai.RateLimitError), (500, openai.InternalServerError)],
)
def test_upstream_errors_reach_sdk(
    proxy: ServerThread, fake: FakeUpstream, status: int, exc: type[Exception]
) -> None:
    fake.script(Reply.error(status, f"boom {status}"))
    with pytest.raises(exc) as info:
        client(proxy).chat.completions.create(model="gpt-4o", messages=MSGS)  # type: ignore[arg-type]
    assert f"boom {status}" in str(info.value)


def test_proxy_errors_reach_sdk_as_api_errors(proxy: ServerThread) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(proxy).chat.completions.create(model="gpt-4o", messages="nope")  # type: ignore[arg-type]
    assert info.value.body["param"] == "messages"  # type: ignore[index]


def test_embeddings_and_models_through_sdk(proxy: ServerThread) -> None:
    c = client(proxy)
    assert len(c.embeddings.create(model="e", input="abc").data[0].embedding) == 8
    assert [m.id for m in c.models.list()] == ["fake-model"]

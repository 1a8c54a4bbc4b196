"""retrieval.mode proxy: the model reads offloaded files through the proxy's own tool (the
proxy in process; the openai SDK as the client, over the in-process transport)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from harness.inprocess import InProcess
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.store.dialog import read
from proxy.truncation.notice import parse_notice, split_notice

from .conftest import InProcessFactory

FACT = "PLANTED-FACT-7731"


def big_output(lines: int = 3000, fact_at: int = 2500) -> str:
    return "".join(
        (f"line {i}: {FACT} is the answer\n" if i == fact_at else f"line {i}: " + "x" * 50 + "\n")
        for i in range(1, lines + 1)
    )


def history(output: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": output},
        {"role": "user", "content": "what does line 2500 say?"},
    ]


class Reader:
    """A model that follows notices with read_offloaded until it finds the fact."""

    def __init__(self, fake: FakeUpstream, *, extra_call: bool = False, path: str | None = None,
                 forever: bool = False) -> None:
        self.extra_call = extra_call
        self.path = path
        self.forever = forever
        self.calls = 0
        self.read_text = ""
        fake.responder = self

    def __call__(self, body: dict[str, Any]) -> Reply:
        self.calls += 1
        msgs = body["messages"]
        last = msgs[-1]
        text = last.get("content") if last.get("role") == "tool" else None
        if isinstance(text, str) and FACT in text and not self.forever:
            return Reply(content=f"It says {FACT}.", usage={"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15})
        source = text if isinstance(text, str) else next(
            m["content"] for m in reversed(msgs) if m.get("role") == "tool")
        notice = parse_notice(source)
        if isinstance(text, str):
            self.read_text += split_notice(text)[0] if notice else text
            if notice is None and not self.forever:
                return Reply(content="Read it all; no fact.")
        args = ({"file_path": self.path, "start_line": 1} if self.path else
                {"file_path": notice.file_path, "start_line": notice.next_line} if notice else
                {"file_path": "tool_result/none.txt"})
        calls = [{"id": f"r{self.calls}", "name": "read_offloaded", "arguments": args}]
        if self.extra_call:
            calls.append({"id": "b1", "name": "bash", "arguments": {"cmd": "ls"}})
        return Reply(content=None, tool_calls=calls,
                     usage={"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107})


def chat(app: InProcess, api_key: str = "sk-r") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=app.url + "/v1", api_key=api_key, max_retries=0,
                              http_client=app.client)


async def test_non_stream_reads_through_the_proxy(make_inproc: InProcessFactory, fake: FakeUpstream) -> None:
    model = Reader(fake)
    app = await make_inproc()
    raw = await chat(app).chat.completions.with_raw_response.create(model="gpt-4o", messages=history(big_output()))  # type: ignore[arg-type]
    resp = raw.parse()
    assert resp.choices[0].message.content == f"It says {FACT}."
    assert resp.choices[0].message.tool_calls is None
    assert raw.headers["x-ctxproxy-read-rounds"] == str(model.calls - 1)
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == 100 * (model.calls - 1) + 10  # summed over rounds
    first = fake.received[0].json()
    assert [t["function"]["name"] for t in first["tools"]] == ["read_offloaded"]
    second = fake.received[1].json()["messages"]
    assert second[-2]["tool_calls"][0]["function"]["name"] == "read_offloaded"
    assert second[-1]["role"] == "tool" and "line 7" not in second[-1]["content"][:20]


async def test_stream_withholds_the_proxys_calls(make_inproc: InProcessFactory, fake: FakeUpstream) -> None:
    model = Reader(fake)
    app = await make_inproc()
    chunks = [c async for c in await chat(app).chat.completions.create(
        model="gpt-4o", messages=history(big_output()), stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True})]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == f"It says {FACT}."
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    usage = [c for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].usage.prompt_tokens == 100 * (model.calls - 1) + 10  # type: ignore[union-attr]
    assert chunks[-1] is usage[0]


async def test_stream_without_usage_request_gets_none(make_inproc: InProcessFactory, fake: FakeUpstream) -> None:
    Reader(fake)
    app = await make_inproc()
    chunks = [c async for c in await chat(app).chat.completions.create(
        model="gpt-4o", messages=history(big_output()), stream=True)]  # type: ignore[arg-type]
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == f"It says {FACT}."


@pytest.mark.parametrize("stream", [False, True])
async def test_mixed_calls_pass_only_the_clients(make_inproc: InProcessFactory, fake: FakeUpstream, stream: bool) -> None:
    Reader(fake, extra_call=True)
    app = await make_inproc()
    c = chat(app)
    if stream:
        names = [d.function.name async for ch in await c.chat.completions.create(
            model="gpt-4o", messages=history(big_output()), stream=True)  # type: ignore[arg-type]
            for d in ((ch.choices[0].delta.tool_calls or []) if ch.choices else [])
            if d.function and d.function.name]
        indexes = [d.index async for ch in await c.chat.completions.create(
            model="gpt-4o", messages=history(big_output()), stream=True)  # type: ignore[arg-type]
            for d in ((ch.choices[0].delta.tool_calls or []) if ch.choices else [])]
        assert set(indexes) == {0}
    else:
        msg = (await c.chat.completions.create(model="gpt-4o", messages=history(big_output()))).choices[0].message  # type: ignore[arg-type]
        names = [t.function.name for t in msg.tool_calls or []]  # type: ignore[union-attr]
    assert names == ["bash"]
    assert all(len(r.json()["messages"]) == 4 for r in fake.received)  # no second round


@pytest.mark.parametrize("path", ["../../../etc/passwd", "/etc/passwd", "tool_result/../../x.txt",
                                  "dialog/../../../x.jsonl", "tool_result/%2e%2e.txt"])
async def test_read_tool_refuses_foreign_paths(make_inproc: InProcessFactory, fake: FakeUpstream, path: str) -> None:
    Reader(fake, path=path)
    app = await make_inproc({"retrieval": {"max_rounds": 1}})
    await chat(app).chat.completions.create(model="gpt-4o", messages=history(big_output()))  # type: ignore[arg-type]
    result = fake.received[1].json()["messages"][-1]["content"]
    assert result.startswith("error:") and "root:" not in result


async def test_max_rounds_then_a_limit_notice_with_the_same_tools(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    """Past max_rounds the model's read calls are answered with a notice that reading is over
    for this turn, then it is asked once more; the tools array is the same in every round (a
    changed tools array would discard the provider's prompt cache)."""
    model = Reader(fake, forever=True)
    app = await make_inproc({"retrieval": {"max_rounds": 2}})
    resp = await chat(app).chat.completions.create(model="gpt-4o", messages=history(big_output()))  # type: ignore[arg-type]
    assert model.calls == 4  # two reads, the limit notice, and the final answer
    rounds = [r.json() for r in fake.received]
    assert all(r["tools"] == rounds[0]["tools"] for r in rounds)
    notice = rounds[-1]["messages"][-1]
    assert notice["role"] == "tool" and "limit of 2 reads" in notice["content"]
    assert resp.choices[0].message.tool_calls is None  # the read call is not handed to the client


async def test_a_chain_of_reads_walks_the_whole_file(make_inproc: InProcessFactory, fake: FakeUpstream) -> None:
    output = big_output(lines=1200, fact_at=99999)  # no fact: the model reads to the end
    model = Reader(fake, forever=False)
    app = await make_inproc({"offload": {"recent_max_bytes": 20000}, "retrieval": {"max_rounds": 20}})
    await chat(app).chat.completions.create(model="gpt-4o", messages=history(output))  # type: ignore[arg-type]
    excerpt = split_notice(fake.received[0].json()["messages"][2]["content"])[0]  # type: ignore[index]
    assert excerpt + model.read_text == output


async def test_archive_records_the_proxys_rounds(make_inproc: InProcessFactory, fake: FakeUpstream, tmp_path: Path) -> None:
    Reader(fake)
    app = await make_inproc()
    await chat(app).chat.completions.create(model="gpt-4o", messages=history(big_output()))  # type: ignore[arg-type]
    await app.drain()  # the answer is archived after the response
    recs = [r for f in (tmp_path / "data").rglob("dialog/*.jsonl") for r in read(f)]
    names = [c["function"]["name"] for r in recs for c in (r["message"].get("tool_calls") or [])]
    assert "read_offloaded" in names
    assert recs[-1]["message"]["content"] == f"It says {FACT}."
    assert any(r["role"] == "tool" and FACT in r["message"]["content"] for r in recs)


async def test_no_notice_no_tool_and_bytes_untouched(make_inproc: InProcessFactory, fake: FakeUpstream) -> None:
    app = await make_inproc()
    body = orjson.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    await app.client.post("/v1/chat/completions", content=body)
    assert fake.received[-1].body == body


async def test_mode_client_names_the_clients_tool(make_inproc: InProcessFactory, fake: FakeUpstream) -> None:
    app = await make_inproc({"retrieval": {"mode": "client", "client_tool_name": "Read",
                                    "client_tool": {"path_arg": "file_path", "line_arg": "offset"}}})
    await chat(app).chat.completions.create(model="gpt-4o", messages=history(big_output()))  # type: ignore[arg-type]
    sent = fake.received[-1].json()
    notice = parse_notice(sent["messages"][2]["content"])
    assert notice is not None and notice.tool == "Read"
    assert Path(notice.file_path).is_absolute() and Path(notice.file_path).read_text() == big_output()
    assert "offset=" in sent["messages"][2]["content"] and "tools" not in sent


async def test_mode_none_gives_the_files_url(make_inproc: InProcessFactory, fake: FakeUpstream) -> None:
    app = await make_inproc({"retrieval": {"mode": "none"}, "server": {"public_url": "http://proxy.example:4000"}})
    await chat(app).chat.completions.create(model="gpt-4o", messages=history(big_output()))  # type: ignore[arg-type]
    sent = fake.received[-1].json()
    content = sent["messages"][2]["content"]
    notice = parse_notice(content)
    assert notice is not None and notice.file_path.startswith("http://proxy.example:4000/files/")
    assert notice.file_path.endswith(".txt") and "/tool_result/" in notice.file_path
    assert "tools" not in sent


async def test_dialog_file_read_from_the_end(make_inproc: InProcessFactory, fake: FakeUpstream) -> None:
    from proxy.compaction.message import summary_body

    from .test_compaction import SUMMARY, is_summarizer
    from .test_compaction import history as long_history

    seen: dict[str, Any] = {}

    def responder(body: dict[str, Any]) -> Reply:
        if is_summarizer(body):
            return Reply(content=SUMMARY)
        msgs = body["messages"]
        if msgs[-1]["role"] == "tool":
            seen["result"] = msgs[-1]["content"]
            return Reply(content="read it")
        summary = msgs[1]["content"]
        assert summary_body(summary) is not None
        pointer = summary.split("saved in ", 1)[1].split(".", 1)[0] + ".jsonl"
        seen["pointer"] = summary
        return Reply(content=None, tool_calls=[{"name": "read_offloaded", "arguments": {
            "file_path": pointer.split(" lines")[0], "start_line": 3}}])

    fake.responder = responder
    app = await make_inproc({"compaction": {"context_windows": {"gpt-4o": 4000}}})
    resp = await chat(app, api_key="sk-t").chat.completions.create(
        model="gpt-4o", messages=long_history(30))  # type: ignore[arg-type]
    assert resp.choices[0].message.content == "read it"
    record = orjson.loads(seen["result"].splitlines()[0])
    assert record["pos"] == 2 and record["message"]["role"] == "assistant"  # archived line 3


async def test_an_upstream_error_mid_stream_reaches_the_client(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    """An error event in a read round is passed on as it came and ends the stream: no
    [DONE], no further round, as if the error had never happened."""
    error = b'data: {"error":{"message":"overloaded","type":"server_error","code":null}}\n\n'
    sse = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
           b'"delta":{"content":"Hel"}}]}\n\n' + error)
    fake.script(Reply(body=sse, headers={"content-type": "text/event-stream"}))
    app = await make_inproc()
    body = {"model": "gpt-4o", "messages": history(big_output()), "stream": True}
    r = await app.client.post("/v1/chat/completions", json=body,
                              headers={"authorization": "Bearer sk-r"})
    raw = r.content
    assert r.status_code == 200
    assert raw.endswith(error) and b"[DONE]" not in raw and b'"Hel"' in raw
    assert fake.request_count == 1

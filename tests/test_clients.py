"""Real client packages against the real proxy on loopback, in front of the fake upstream.

The openai SDK (sync and async), the litellm SDK, langchain-openai and openai-agents each talk to
the proxy the way a user would set them up; the fake records what reached the "provider". No
network at all. litellm, langchain and openai-agents take seconds to import: each test imports
what it uses, so that collecting the suite does not.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")

import asyncio  # noqa: E402
import functools  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402
import orjson  # noqa: E402
import pytest  # noqa: E402

from proxy.compaction.message import is_summary_message  # noqa: E402
from proxy.compaction.prompt import SYSTEM_PROMPT as SUMMARIZER_PROMPT  # noqa: E402
from proxy.demo.fake.own_calls import instructions_of
from proxy.demo.fake.replies import stream_events
from proxy.demo.fake.upstream import FakeUpstream, Received, Reply
from proxy.demo.servers import ServerThread
from proxy.truncation.notice import split_notice

from .conftest import ProxyFactory  # noqa: E402

if TYPE_CHECKING:
    from langchain_core.tools import BaseTool
    from langchain_openai import ChatOpenAI

# litellm's first calls build pydantic models of its own types: third-party noise, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly.*qualifier:UserWarning")

MODEL = "gpt-4o"
MSGS: list[dict[str, Any]] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello"},
]
CALLS = [
    {"name": "read_file", "arguments": {"path": "a.py"}},
    {"name": "grep", "arguments": {"pattern": "TODO", "path": "."}},
]

NOTICE = "<<<TRUNCATED>>>"
SUMMARY = """## Goal
Read every log part.
## Constraints & Preferences
- None
## Progress
### Done
- read the first parts
### In Progress
- reading the next part
### Blocked
- None
## Key Decisions
- None
## Next Steps
- read on
## Critical Context
- worker[3] logs
"""


def sdk(base_url: str, **kw: Any) -> openai.OpenAI:
    kw.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=base_url, api_key="sk-test", timeout=30, **kw)


def asdk(base_url: str, **kw: Any) -> openai.AsyncOpenAI:
    kw.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(base_url=base_url, api_key="sk-test", timeout=30, **kw)


def chat_calls(fake: FakeUpstream) -> list[Received]:
    return [r for r in fake.received if r.path.endswith("/chat/completions")]


def is_summarizer(body: dict[str, Any]) -> bool:
    """The proxy's summarizer call, in the format of the session it summarizes."""
    return instructions_of(body) == SUMMARIZER_PROMPT


def model_calls(fake: FakeUpstream) -> list[dict[str, Any]]:
    return [b for b in (r.json() for r in chat_calls(fake)) if not is_summarizer(b)]


def log_text(part: int, size: int) -> str:
    """Log-like text of about ``size`` bytes, different for every part."""
    lines = []
    n = 0
    total = 0
    while total < size:
        line = (
            f"2024-05-01T12:{n // 60 % 60:02d}:{n % 60:02d}.{n * 7 % 1000:03d}Z INFO "
            f"worker[{part}] processed job {part * 100_000 + n} in {n * 13 % 97}ms status=ok\n"
        )
        lines.append(line)
        total += len(line)
        n += 1
    return "".join(lines)


def big_tool_history(size: int = 80_000) -> list[dict[str, Any]]:
    call = {"id": "call_big", "type": "function", "function": {"name": "cat", "arguments": "{}"}}
    return [
        *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_big", "content": log_text(1, size)},
    ]


def pairs_problems(messages: list[dict[str, Any]]) -> list[str]:
    """Every tool message answers a call of the assistant message right before its block, and
    every call of an assistant message is answered in the block after it."""
    problems: list[str] = []
    open_ids: set[str] | None = None
    answered: set[str] = set()

    def close(at: int) -> None:
        if open_ids is not None and open_ids - answered:
            problems.append(f"calls {sorted(open_ids - answered)} before {at} unanswered")

    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool":
            tid = m.get("tool_call_id")
            if open_ids is None or tid not in open_ids or tid in answered:
                problems.append(f"message {i}: tool result {tid!r} answers no preceding call")
            answered.add(str(tid))
            continue
        close(i)
        open_ids, answered = None, set()
        if role == "assistant" and m.get("tool_calls"):
            open_ids = {c["id"] for c in m["tool_calls"]}
    close(len(messages))
    return problems


def without_ids(obj: Any) -> Any:
    """A parsed answer with the per-request ids blanked (the fake numbers its answers)."""
    if isinstance(obj, dict):
        return {k: "<id>" if k == "id" else without_ids(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [without_ids(v) for v in obj]
    return obj


# --- 1. the openai SDK ----------------------------------------------------------------------


def test_sync_completion(module_proxy: ServerThread, fake: FakeUpstream) -> None:
    fake.script(Reply(content="hi there"))
    raw = sdk(module_proxy.url + "/v1").chat.completions.with_raw_response.create(model="gpt-4o", messages=MSGS)  # type: ignore[arg-type]
    resp = raw.parse()
    assert resp.choices[0].message.content == "hi there"
    assert raw.headers["x-ctxproxy-session"]
    assert fake.received[-1].json()["messages"] == MSGS
    assert fake.received[-1].headers["authorization"] == "Bearer sk-test"


def test_async_completion(module_proxy: ServerThread, fake: FakeUpstream) -> None:
    fake.script(Reply(content="async hi"))

    async def go() -> str | None:
        c = asdk(module_proxy.url + "/v1")
        r = await c.chat.completions.create(model="gpt-4o", messages=MSGS)  # type: ignore[arg-type]
        await c.close()
        return r.choices[0].message.content

    assert asyncio.run(go()) == "async hi"


def test_streaming_with_usage(module_proxy: ServerThread, fake: FakeUpstream) -> None:
    fake.script(Reply(content="streamed answer here", stream_pieces=5))
    chunks = list(
        sdk(module_proxy.url + "/v1").chat.completions.create(
            model="gpt-4o", messages=MSGS, stream=True, stream_options={"include_usage": True}  # type: ignore[arg-type]
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "streamed answer here"
    usage = [c for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].choices == [] and chunks[-1] is usage[0]


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls(module_proxy: ServerThread, fake: FakeUpstream, stream: bool) -> None:
    fake.script(Reply(content=None, tool_calls=CALLS))
    c = sdk(module_proxy.url + "/v1")
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


def test_tool_result_turn_round_trips(module_proxy: ServerThread, fake: FakeUpstream) -> None:
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
    r = sdk(module_proxy.url + "/v1").chat.completions.create(model="gpt-4o", messages=history)  # type: ignore[arg-type]
    assert r.choices[0].message.content == "two files"
    assert fake.received[-1].json()["messages"] == history


@pytest.mark.parametrize(
    "status, exc",
    [(400, openai.BadRequestError), (401, openai.AuthenticationError),
     (429, openai.RateLimitError), (500, openai.InternalServerError)],
)
def test_upstream_errors_reach_sdk(
    module_proxy: ServerThread, fake: FakeUpstream, status: int, exc: type[Exception]
) -> None:
    fake.script(Reply.error(status, f"boom {status}"))
    with pytest.raises(exc) as info:
        sdk(module_proxy.url + "/v1").chat.completions.create(model="gpt-4o", messages=MSGS)  # type: ignore[arg-type]
    assert f"boom {status}" in str(info.value)


def test_proxy_errors_reach_sdk_as_api_errors(module_proxy: ServerThread) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk(module_proxy.url + "/v1").chat.completions.create(model="gpt-4o", messages="nope")  # type: ignore[arg-type]
    assert info.value.body["param"] == "messages"  # type: ignore[index]


def test_embeddings_and_models_through_sdk(module_proxy: ServerThread) -> None:
    c = sdk(module_proxy.url + "/v1")
    assert len(c.embeddings.create(model="e", input="abc").data[0].embedding) == 8
    assert [m.id for m in c.models.list()] == ["fake-model"]


# --- 2. litellm SDK ------------------------------------------------------------------------


def test_litellm_completion_and_acompletion(module_proxy: ServerThread, fake: FakeUpstream) -> None:
    import litellm

    fake.script(Reply(content="from litellm sync"), Reply(content="from litellm async"))
    kw: dict[str, Any] = {
        "model": f"openai/{MODEL}",
        "api_base": module_proxy.url + "/v1",
        "api_key": "sk-test",
        "messages": MSGS,
        "num_retries": 0,
    }
    r = litellm.completion(**kw)
    assert r.choices[0].message.content == "from litellm sync"

    async def go() -> Any:
        return await litellm.acompletion(**kw)

    r2 = asyncio.run(go())
    assert r2.choices[0].message.content == "from litellm async"
    calls = chat_calls(fake)
    assert [c.path for c in calls] == ["/v1/chat/completions"] * 2
    for c in calls:
        body = c.json()
        assert body["model"] == MODEL and body["messages"] == MSGS
        assert c.headers["authorization"] == "Bearer sk-test"


def test_litellm_streaming(module_proxy: ServerThread, fake: FakeUpstream) -> None:
    import litellm

    fake.script(Reply(content="litellm streamed this answer", stream_pieces=5))
    chunks = list(
        litellm.completion(
            model=f"openai/{MODEL}", api_base=module_proxy.url + "/v1", api_key="sk-test",
            messages=MSGS, stream=True, num_retries=0,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "litellm streamed this answer"
    [call] = chat_calls(fake)
    assert call.json()["stream"] is True and call.json()["messages"] == MSGS


# --- 3. langchain-openai -------------------------------------------------------------------


@functools.cache
def get_weather() -> BaseTool:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    return get_weather


def chat_model(srv_url: str, **kw: Any) -> ChatOpenAI:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=srv_url, api_key="sk-test", max_retries=0, **kw)


def test_langchain_bind_tools_parses_tool_call(module_proxy: ServerThread, fake: FakeUpstream) -> None:
    from langchain_core.messages import AIMessage, HumanMessage

    fake.script(Reply(content=None, tool_calls=[
        {"id": "call_w1", "name": "get_weather", "arguments": {"city": "Paris"}}]))
    llm = chat_model(module_proxy.url + "/v1").bind_tools([get_weather()])
    msg = llm.invoke([HumanMessage("weather in Paris?")])
    assert isinstance(msg, AIMessage)
    assert msg.tool_calls == [
        {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_w1", "type": "tool_call"}
    ]
    [call] = chat_calls(fake)
    sent = call.json()
    # The client's tools as it sent them, then the proxy's read tool: offered from an agent's
    # first request on, so ``tools`` never changes mid-session (prompt cache, signed thinking).
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather", "read_offloaded"]


def test_langchain_streaming_with_usage(module_proxy: ServerThread, fake: FakeUpstream) -> None:
    from langchain_core.messages import AIMessageChunk

    usage = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
    fake.script(Reply(content="langchain streamed words", stream_pieces=4, usage=usage))
    llm = chat_model(module_proxy.url + "/v1", stream_usage=True)
    chunks = list(llm.stream("hi"))
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert isinstance(whole, AIMessageChunk)
    assert whole.content == "langchain streamed words"
    assert whole.usage_metadata is not None
    assert (whole.usage_metadata["input_tokens"], whole.usage_metadata["output_tokens"]) == (11, 7)
    [call] = chat_calls(fake)
    assert call.json()["stream_options"] == {"include_usage": True}


def test_langchain_streaming_default_has_no_stream_options(
    module_proxy: ServerThread, fake: FakeUpstream
) -> None:
    text = "a longer langchain answer streamed in many small pieces, all of them"
    fake.script(Reply(content=text, stream_pieces=12))
    chunks = list(chat_model(module_proxy.url + "/v1").stream("hi"))
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert whole.content == text
    assert whole.response_metadata.get("finish_reason") == "stop"  # the last chunk arrived
    assert all(not c.usage_metadata for c in chunks)
    [call] = chat_calls(fake)
    assert "stream_options" not in call.json() and call.json()["stream"] is True


# --- 4. openai-agents: a real multi-turn tool loop -------------------------------------------

AGENT_TOOL_TURNS = 6
AGENT_FINAL = "All six log parts were read: no errors."
AGENT_CONFIG: dict[str, Any] = {
    "compaction": {"context_windows": {MODEL: 12_000}},
    "offload": {"recent_max_bytes": 8000, "old_max_bytes": 1500},
}


class AgentScript:
    """The fake's responder: summarizer calls get a summary; model calls read the next log part
    (derived from the newest tool result, so compaction dropping old turns cannot confuse it)."""

    def __init__(self) -> None:
        self.summaries = 0

    def __call__(self, body: dict[str, Any]) -> Reply:
        if is_summarizer(body):
            self.summaries += 1
            return Reply(content=SUMMARY)
        done = [m for m in body["messages"] if m.get("role") == "tool"]
        part = int(done[-1]["tool_call_id"].rsplit("_", 1)[1]) + 1 if done else 0
        if part >= AGENT_TOOL_TURNS:
            return Reply(content=AGENT_FINAL)
        return Reply(content=None, tool_calls=[
            {"id": f"call_part_{part}", "name": "read_log", "arguments": {"part": part}}])


OUTPUTS: dict[int, str] = {}


def read_log(part: int) -> str:
    """Read one part of the service log."""
    OUTPUTS[part] = log_text(part, 60_000 + part * 28_000)  # 60 KB .. 200 KB
    return OUTPUTS[part]


def run_log_agent(url: str, model_class: str) -> tuple[Any, list[dict[str, str]]]:
    """The log-reading agent through the proxy with openai-agents' ``model_class``
    (``OpenAIChatCompletionsModel`` or ``OpenAIResponsesModel``): its result, and the
    ``x-ctxproxy-*`` headers of every model call."""
    import agents
    from agents import Agent, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    OUTPUTS.clear()
    headers: list[dict[str, str]] = []

    async def on_response(resp: Any) -> None:
        headers.append({k: v for k, v in resp.headers.items() if k.startswith("x-ctxproxy-")})

    async def go() -> Any:
        client = asdk(
            url + "/v1",
            http_client=openai.DefaultAsyncHttpxClient(event_hooks={"response": [on_response]}),
        )
        agent = Agent(
            name="log reader",
            instructions="You read the service log part by part, then report.",
            tools=[function_tool(read_log)],
            model=getattr(agents, model_class)(model=MODEL, openai_client=client),
        )
        try:
            return await Runner.run(agent, "Read all log parts and report.", max_turns=10)
        finally:
            await client.close()

    return asyncio.run(go()), headers


def test_agents_tool_loop_offloads_and_compacts(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    script = AgentScript()
    fake.responder = script
    srv = make_proxy(AGENT_CONFIG)
    result, headers = run_log_agent(srv.url, "OpenAIChatCompletionsModel")
    assert result.final_output == AGENT_FINAL
    assert sorted(OUTPUTS) == list(range(AGENT_TOOL_TURNS))

    calls = model_calls(fake)
    assert len(calls) == len(headers) == AGENT_TOOL_TURNS + 1
    assert script.summaries >= 1
    for i, body in enumerate(calls):
        msgs = body["messages"]
        assert pairs_problems(msgs) == [], (i, pairs_problems(msgs))
        tools = [m for m in msgs if m.get("role") == "tool"]
        assert len(tools) >= min(i, 1)  # the newest result always goes along
        for m in tools:  # every big output arrived cut, with the notice, never whole
            assert NOTICE in m["content"] and len(m["content"].encode()) < 10_000
            part = int(m["tool_call_id"].rsplit("_", 1)[1])
            excerpt, _ = split_notice(m["content"])  # type: ignore[misc]
            assert OUTPUTS[part].startswith(excerpt)
    summarized = [any(is_summary_message(m) for m in b["messages"]) for b in calls]
    assert any(summarized), "no forwarded request carried a summary"
    # What the proxy told the client matches what reached the upstream.
    assert [h["x-ctxproxy-compacted"] == "1" for h in headers] == summarized
    assert [int(h["x-ctxproxy-offloaded"]) for h in headers] == list(range(len(calls)))
    budget = int(0.75 * AGENT_CONFIG["compaction"]["context_windows"][MODEL])
    assert all(int(h["x-ctxproxy-tokens-out"]) <= budget for h in headers)
    assert int(headers[-1]["x-ctxproxy-tokens-in"]) > 10 * budget
    compacted = [b for b, s in zip(calls, summarized, strict=True) if s]
    first = compacted[0]["messages"]
    assert first[0]["content"].startswith("You read the service log")
    assert is_summary_message(first[1])
    assert "Read every log part." in first[1]["content"]  # the summarizer's, not the fallback
    # The last request still ends with the newest tool result, the one the model answers.
    assert calls[-1]["messages"][-1]["tool_call_id"] == f"call_part_{AGENT_TOOL_TURNS - 1}"


class ResponsesAgentScript:
    """The same model in the Responses API, openai-agents' default: it reads the part after the
    newest ``function_call_output`` in the forwarded input."""

    def __init__(self) -> None:
        self.summaries = 0

    def __call__(self, body: dict[str, Any]) -> Reply:
        if is_summarizer(body):
            self.summaries += 1
            return Reply(content=SUMMARY)
        done = [i for i in body["input"] if i.get("type") == "function_call_output"]
        part = int(done[-1]["call_id"].rsplit("_", 1)[1]) + 1 if done else 0
        if part >= AGENT_TOOL_TURNS:
            return Reply(content=AGENT_FINAL, reasoning="all parts read")
        return Reply(content=None, reasoning=f"part {part} next", tool_calls=[
            {"id": f"call_part_{part}", "name": "read_log", "arguments": {"part": part}}])


def responses_pairs_problems(items: list[dict[str, Any]]) -> list[str]:
    calls = [i["call_id"] for i in items if i.get("type") == "function_call"]
    outputs = [i["call_id"] for i in items if i.get("type") == "function_call_output"]
    return [] if calls == outputs else [f"calls {calls} outputs {outputs}"]


def test_agents_default_responses_model_offloads_and_compacts(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """openai-agents' default model speaks /v1/responses: the same offload and compaction as
    chat mode, with every call still paired with its output and reasoning items untouched."""
    script = ResponsesAgentScript()
    fake.responder = script
    srv = make_proxy(AGENT_CONFIG)
    result, headers = run_log_agent(srv.url, "OpenAIResponsesModel")
    assert result.final_output == AGENT_FINAL
    assert sorted(OUTPUTS) == list(range(AGENT_TOOL_TURNS))
    calls = [r.json() for r in fake.received if r.path.endswith("/responses")
             and not is_summarizer(r.json())]
    assert len(calls) == len(headers) == AGENT_TOOL_TURNS + 1
    # A Responses session is summarized through the Responses API (none went to chat).
    assert script.summaries >= 1 and not chat_calls(fake)
    for i, body in enumerate(calls):
        items = body["input"]
        assert responses_pairs_problems(items) == [], i
        outputs = [o for o in items if o.get("type") == "function_call_output"]
        assert len(outputs) >= min(i, 1)  # the newest result always goes along
        for o in outputs:
            assert NOTICE in o["output"] and len(o["output"].encode()) < 10_000
            excerpt, _ = split_notice(o["output"])  # type: ignore[misc]
            assert OUTPUTS[int(o["call_id"].rsplit("_", 1)[1])].startswith(excerpt)
    summarized = ["Read every log part." in str(b["input"]) for b in calls]
    assert any(summarized), "no forwarded request carried the summarizer's summary"
    assert [h["x-ctxproxy-compacted"] == "1" for h in headers] == summarized
    budget = int(0.75 * AGENT_CONFIG["compaction"]["context_windows"][MODEL])
    assert all(int(h["x-ctxproxy-tokens-out"]) <= budget for h in headers)
    assert int(headers[-1]["x-ctxproxy-tokens-in"]) > 10 * budget
    first = next(b for b, s in zip(calls, summarized, strict=True) if s)
    assert first["instructions"].startswith("You read the service log")
    assert first["input"][0]["role"] == "developer"  # the summary leads the kept items
    assert calls[-1]["input"][-1]["call_id"] == f"call_part_{AGENT_TOOL_TURNS - 1}"


# --- 5. known client behaviours ----------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["", "/v1"])
def test_base_url_with_and_without_v1(module_proxy: ServerThread, fake: FakeUpstream, suffix: str) -> None:
    fake.script(Reply(content=f"via {suffix or 'root'}"))
    raw = sdk(module_proxy.url + suffix).chat.completions.with_raw_response.create(
        model=MODEL, messages=MSGS  # type: ignore[arg-type]
    )
    assert raw.parse().choices[0].message.content == f"via {suffix or 'root'}"
    assert raw.headers["x-ctxproxy-session"] and raw.headers["x-ctxproxy-compacted"] == "0"
    [call] = chat_calls(fake)
    assert call.path == "/v1/chat/completions" and call.json()["messages"] == MSGS


def test_sdk_retries_429_through_proxy(module_proxy: ServerThread, fake: FakeUpstream) -> None:
    fake.script(
        Reply.error(429, "slow down", headers={"retry-after": "0", "retry-after-ms": "10"}),
        Reply(content="after the retry"),
    )
    r = sdk(module_proxy.url + "/v1", max_retries=2).chat.completions.create(model=MODEL, messages=MSGS)  # type: ignore[arg-type]
    assert r.choices[0].message.content == "after the retry"
    assert len(chat_calls(fake)) == 2
    assert [c.reply.status for c in chat_calls(fake)] == [429, 200]  # type: ignore[union-attr]


def test_429_headers_reach_the_client(module_proxy: ServerThread, fake: FakeUpstream) -> None:
    fake.script(Reply.error(429, "slow down", headers={"retry-after": "7"}))
    with pytest.raises(openai.RateLimitError) as info:
        sdk(module_proxy.url + "/v1").chat.completions.create(model=MODEL, messages=MSGS)  # type: ignore[arg-type]
    assert info.value.response.headers["retry-after"] == "7"
    assert len(chat_calls(fake)) == 1  # the proxy itself does not retry


def stream_raw(url: str, body: dict[str, Any]) -> bytes:
    with httpx.stream("POST", url + "/chat/completions", content=orjson.dumps(body),
                      headers={"authorization": "Bearer sk-test"}, timeout=30) as r:
        assert r.status_code == 200
        return b"".join(r.iter_raw())


def test_stream_without_usage_passes_byte_for_byte(module_proxy: ServerThread, fake: FakeUpstream) -> None:
    reply = Reply(content="no usage was asked for", stream_pieces=6)
    fake.script(reply)
    body = {"model": MODEL, "messages": MSGS, "stream": True}
    got = stream_raw(module_proxy.url + "/v1", body)
    [call] = chat_calls(fake)
    sent = b"".join(stream_events(call, call.json(), reply, 1))  # what the fake sent (1st answer)
    assert got == sent
    assert b'"usage"' not in got and got.endswith(b"data: [DONE]\n\n")
    # The SDK sees the same: whole text, no usage anywhere.
    fake.script(Reply(content="no usage was asked for", stream_pieces=6))
    chunks: list[Any] = list(sdk(module_proxy.url + "/v1").chat.completions.create(
        model=MODEL, messages=MSGS, stream=True  # type: ignore[arg-type]
    ))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.content
    assert all(c.usage is None for c in chunks)


def sse_payloads(raw: bytes) -> list[Any]:
    out = []
    for event in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
        if data:
            joined = b"\n".join(data)
            out.append(joined.decode() if joined == b"[DONE]" else orjson.loads(joined))
    return out


def test_stream_without_usage_through_read_loop(
    module_proxy: ServerThread, fake: FakeUpstream, fake_url: str
) -> None:
    """A slimmed request goes through the read-tool loop, which asks the upstream for usage
    itself: the client, which did not, still gets no usage chunk and no usage fields."""
    history = big_tool_history()
    body = {"model": MODEL, "messages": history, "stream": True}
    fake.script(Reply(content="streamed after the offload", stream_pieces=5))
    direct = sse_payloads(stream_raw(fake_url, body))
    fake.script(Reply(content="streamed after the offload", stream_pieces=5))
    via = sse_payloads(stream_raw(module_proxy.url + "/v1", body))
    call = chat_calls(fake)[-1].json()
    assert NOTICE in call["messages"][-1]["content"]  # really slimmed, really the read loop
    assert [t["function"]["name"] for t in call["tools"]] == ["read_offloaded"]
    assert via[-1] == "[DONE]" and sum(1 for e in via if e == "[DONE]") == 1
    assert all("usage" not in e for e in via if isinstance(e, dict))
    assert without_ids(via) == without_ids(direct)


# --- 6. the same answers with and without the proxy ---------------------------------------------

HISTORIES = {"plain": MSGS, "slimmed": big_tool_history()}
FIXED_USAGE = {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
ANSWERS = [
    Reply(content="the same answer", usage=FIXED_USAGE),
    Reply(content=None, usage=FIXED_USAGE,
          tool_calls=[{"id": "call_s1", "name": "get_weather", "arguments": {"city": "Oslo"}}]),
]


@pytest.mark.parametrize("history", list(HISTORIES))
@pytest.mark.parametrize("stream", [False, True])
def test_openai_sdk_answers_match_direct(
    module_proxy: ServerThread, fake: FakeUpstream, fake_url: str, history: str, stream: bool
) -> None:
    msgs = HISTORIES[history]
    got: dict[str, list[Any]] = {}
    for name, base in (("direct", fake_url), ("proxy", module_proxy.url + "/v1")):
        fake.script(*ANSWERS)
        c = sdk(base)
        answers = []
        for _ in ANSWERS:
            kw: dict[str, Any] = {"model": MODEL, "messages": msgs}
            if stream:
                kw |= {"stream": True, "stream_options": {"include_usage": True}}
                answers.append([ch.model_dump() for ch in c.chat.completions.create(**kw)])
            else:
                answers.append(c.chat.completions.create(**kw).model_dump())
        got[name] = answers
    assert without_ids(got["proxy"]) == without_ids(got["direct"])
    forwarded = [r.json()["messages"] for r in chat_calls(fake)[len(ANSWERS):]]
    if history == "plain":
        assert forwarded == [msgs] * len(ANSWERS)
    else:
        assert all(NOTICE in f[-1]["content"] and f[:-1] == msgs[:-1] for f in forwarded)


@pytest.mark.parametrize("history", list(HISTORIES))
def test_langchain_answers_match_direct(
    module_proxy: ServerThread, fake: FakeUpstream, fake_url: str, history: str
) -> None:
    msgs = HISTORIES[history]
    got: dict[str, list[Any]] = {}
    for name, base in (("direct", fake_url), ("proxy", module_proxy.url + "/v1")):
        fake.script(*ANSWERS)
        llm = chat_model(base).bind_tools([get_weather()])
        out = []
        for _ in ANSWERS:
            m = llm.invoke(msgs)
            out.append((m.content, m.tool_calls, m.usage_metadata,
                        {k: v for k, v in m.response_metadata.items() if k != "id"}))
        got[name] = out
    assert got["proxy"] == got["direct"]
    assert got["proxy"][1][1][0]["args"] == {"city": "Oslo"}

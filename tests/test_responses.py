"""``POST /v1/responses`` through the same pipeline as chat completions
(docs/formats.md#openai-responses): untouched items byte for byte, tool outputs offloaded and
aged, compaction with a developer summary item, Responses pairing rules, the read tool withheld
from the client, the archive, sub-paths and continued responses passed through."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.compaction.message import SUMMARY_HEADING
from proxy.demo.fake.own_calls import own_call
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread
from proxy.formats.responses.request import RESPONSES
from proxy.pipeline.validate import PLACEHOLDER, validate
from proxy.store.dialog import read
from proxy.truncation.notice import parse_notice, split_notice

from .conftest import ProxyFactory, examples

RESPONSES_PATH = "/v1/responses"
SUMMARY = """## Goal
Find why the checkout build fails and fix it.
## Constraints & Preferences
- keep the public API of checkout unchanged
## Progress
### Done
- ran the build and read the first failure
### In Progress
- reading the linker output
### Blocked
- nothing at the moment
## Key Decisions
- fix the rounding helper first
## Next Steps
- rerun the build after the fix
## Critical Context
- the failing test is tests/test_checkout.py::test_total
"""


def big(mark: str = "x", lines: int = 2000) -> str:
    return "".join(f"{mark} line {i}: " + "y" * 60 + "\n" for i in range(1, lines + 1))


def dev(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "developer",
            "content": [{"type": "input_text", "text": text}]}


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def assistant(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "id": f"msg_{abs(hash(text)) % 10**8}",
            "status": "completed", "phase": "final_answer",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def turn(n: int, output: Any, *, custom: bool = False, reasoning: bool = True) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append({"type": "reasoning", "id": f"rs_{n}", "summary": [],
                      "encrypted_content": f"gAAAA-opaque-{n}-" + "Q" * 40})
    if custom:
        items += [{"type": "custom_tool_call", "id": f"ctc_{n}", "call_id": f"call_{n}",
                   "name": "apply_patch", "input": f"*** Begin Patch {n}"},
                  {"type": "custom_tool_call_output", "call_id": f"call_{n}", "output": output}]
    else:
        items += [{"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}",
                   "name": "exec_command", "arguments": orjson.dumps({"cmd": f"step {n}"}).decode(),
                   "status": "completed"},
                  {"type": "function_call_output", "call_id": f"call_{n}", "output": output}]
    return items


def body(items: list[Any], **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-5.1-codex", "input": items, "store": False,
            "include": ["reasoning.encrypted_content"], **extra}


def post(srv: ServerThread, payload: Any, key: str = "sk-resp", **headers: str) -> httpx.Response:
    raw = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    return httpx.post(srv.url + RESPONSES_PATH, content=raw, timeout=30,
                      headers={"authorization": f"Bearer {key}", "content-type": "application/json",
                               **headers})


def summarizing(fake: FakeUpstream) -> None:
    def responder(req: dict[str, Any]) -> Reply:
        if own_call(req) == "summarizer":
            return Reply(content=SUMMARY)
        return Reply(content="ok")

    fake.responder = responder


# --- forwarding ----------------------------------------------------------------------------------


def test_nothing_to_slim_reaches_the_upstream_byte_for_byte(
    proxy: ServerThread, fake: FakeUpstream
) -> None:
    raw = (b'{ "model":"gpt-5.1-codex", "input":[{"type":"message","role":"user","content":'
           b'"h\\u00e9llo"}],  "x_unknown":{"n":[1,2.50,null]}, "store":false }')
    r = post(proxy, raw)
    assert r.status_code == 200 and r.headers["x-ctxproxy-offloaded"] == "0"
    assert fake.received[-1].body == raw and fake.received[-1].path == RESPONSES_PATH


def test_tool_outputs_are_offloaded_and_everything_else_is_untouched(
    proxy: ServerThread, fake: FakeUpstream
) -> None:
    parts = [{"type": "input_text", "text": big("b")}, {"type": "input_image",
                                                         "image_url": "https://x/y.png"}]
    unknown = {"type": "future_item", "id": "fi_1", "payload": {"keep": [1, 2.50]}}
    items = [dev("Agent."), user("run"), *turn(1, big("a")), unknown, *turn(2, parts, custom=True),
             user("what failed?")]
    raw = orjson.dumps(body(items))
    r = post(proxy, raw)
    assert r.status_code == 200 and r.headers["x-ctxproxy-offloaded"] == "2"
    sent = fake.received[-1]
    out = sent.json()["input"]
    assert [i["type"] for i in out] == [i["type"] for i in items]
    cut = out[4]["output"]
    assert parse_notice(cut) is not None and split_notice(cut)[0] == big("a")[: len(split_notice(cut)[0])]
    custom = out[8]["output"]
    assert custom[1] == parts[1] and parse_notice(custom[0]["text"]) is not None
    # Every item the pipeline did not cut arrives exactly as the client wrote it.
    for k in (0, 1, 2, 3, 5, 6, 7, 9):
        assert orjson.dumps(items[k]) in sent.body
    assert sent.json()["x_unknown"] if "x_unknown" in sent.json() else True
    assert [t["name"] for t in sent.json()["tools"]] == ["read_offloaded"]


def test_instructions_and_string_input(proxy: ServerThread, fake: FakeUpstream) -> None:
    r = post(proxy, {"model": "gpt-4o", "instructions": "Be brief.", "input": "hello"})
    assert r.status_code == 200
    sent = fake.received[-1].json()
    assert sent["instructions"] == "Be brief." and sent["input"] == "hello"


def test_bad_input_gets_a_400_envelope(proxy: ServerThread, fake: FakeUpstream) -> None:
    for payload, param in ((b"[1]", None), (orjson.dumps({"input": []}), "model"),
                           (orjson.dumps({"model": "m", "input": 7}), "input"),
                           (orjson.dumps({"model": "m", "input": [1]}), "input[0]")):
        r = post(proxy, payload)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert fake.request_count == 0


def test_subpaths_and_other_methods_pass_through(proxy: ServerThread, fake: FakeUpstream) -> None:
    for method, path in (("POST", "/v1/responses/compact"), ("POST", "/v1/responses/input_tokens"),
                         ("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1")):
        r = httpx.request(method, proxy.url + path, timeout=10,
                          content=orjson.dumps({"model": "m", "input": [user("x" * 60000)]}))
        assert r.status_code == 200
        assert fake.received[-1].path == path
    # The compaction endpoint got the body as sent: not slimmed, not rewritten.
    assert b"x" * 60000 in fake.received[0].body


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions", "/files"])
def test_a_websocket_upgrade_gets_a_426_envelope(proxy: ServerThread, fake: FakeUpstream,
                                                 path: str) -> None:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    before = len(fake.received)
    with pytest.raises(InvalidStatus) as refused:
        connect(proxy.url.replace("http://", "ws://") + path, open_timeout=10).close()
    answer = refused.value.response
    assert answer.status_code == 426
    assert orjson.loads(answer.body)["error"]["code"] == "websocket_not_supported"
    assert len(fake.received) == before  # nothing went upstream


def test_a_continued_response_is_slimmed_but_not_compacted(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    srv = make_proxy({"compaction": {"context_windows": {"gpt-4o": 4000}}})
    items = [*turn(1, big("c"))[1:]]
    r = post(srv, {"model": "gpt-4o", "previous_response_id": "resp_prev", "input": items})
    assert r.status_code == 200 and r.headers["x-ctxproxy-history"] == "upstream"
    assert r.headers["x-ctxproxy-offloaded"] == "1" and r.headers["x-ctxproxy-compacted"] == "0"
    sent = fake.received[-1].json()
    assert sent["previous_response_id"] == "resp_prev"
    assert [i["type"] for i in sent["input"]] == ["function_call", "function_call_output"]


# --- pairing --------------------------------------------------------------------------------------


ORPHAN = {"type": "function_call_output", "call_id": "call_gone", "output": "stale"}
OPEN_CALL = {"type": "custom_tool_call", "id": "ctc_9", "call_id": "call_9",
             "name": "apply_patch", "input": "*** Begin Patch"}


def test_the_clients_own_pairing_goes_upstream_as_sent(
    proxy: ServerThread, fake: FakeUpstream
) -> None:
    """An orphan output and an unanswered call the client sent are the provider's to judge
    (and an output answering a stored response's call is no orphan there)."""
    fake.strict = False  # the provider refuses this request: here it is what it receives
    raw = orjson.dumps(body([user("go"), ORPHAN, *turn(1, "fine"), OPEN_CALL]))
    assert post(proxy, raw).status_code == 200
    assert fake.received[-1].body == raw


def test_a_call_the_proxy_left_unanswered_gets_a_result_of_its_own_type() -> None:
    """What the validator adds for a break of the proxy's making (its result evicted) is an
    output item of the call's type."""
    raw = orjson.dumps(body([user("go"), ORPHAN, *turn(1, "fine"), OPEN_CALL,
                             {"type": "custom_tool_call_output", "call_id": "call_9",
                              "output": "patched"}]))
    parsed = RESPONSES.parse(raw, 1000)
    evicted = [m for m in parsed.history if m.get("tool_call_id") != "call_9"]
    result = validate(evicted, parsed.history)
    out = orjson.loads(RESPONSES.write(raw, parsed, result.messages))["input"]
    assert ORPHAN in out  # the client's own orphan stays
    assert out[-2] == OPEN_CALL
    assert out[-1] == {"type": "custom_tool_call_output", "call_id": "call_9", "output": PLACEHOLDER}


# --- compaction -----------------------------------------------------------------------------------


def long_session(turns: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [dev("You are a coding agent."), dev("<skills>none</skills>"),
                                   user("fix the checkout build")]
    for n in range(turns):
        items += turn(n, f"step {n} output: " + "word " * 400)
        items.append(assistant(f"step {n} done: " + "note " * 60))
        items.append(user(f"continue with step {n + 1}"))
    return items


def test_compaction_puts_a_developer_summary_after_the_leading_items(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    summarizing(fake)
    srv = make_proxy({"compaction": {"context_windows": {"gpt-5.1-codex": 8000}}})
    items = long_session(20)
    r = post(srv, body(items, instructions="Be careful."))
    assert r.status_code == 200 and r.headers["x-ctxproxy-compacted"] == "1"
    sent = fake.received[-1].json()
    assert sent["instructions"] == "Be careful."
    out = sent["input"]
    assert out[:2] == items[:2]
    summary = out[2]
    assert summary["role"] == "developer" and summary["type"] == "message"
    assert summary["content"][0]["text"].startswith(SUMMARY_HEADING)
    # The model's summary (not the fallback), asked through the Responses API.
    assert "fix the rounding helper first" in summary["content"][0]["text"]
    asked = [r for r in fake.received if own_call(r.json()) == "summarizer"]
    assert [r.path for r in asked] == ["/v1/responses"]
    kept = out[3:]
    assert kept == items[len(items) - len(kept):]  # a suffix of the client's items, untouched
    # The kept suffix never separates a call from its output, nor a reasoning item from its call.
    calls = {i["call_id"] for i in kept if i["type"] == "function_call"}
    outputs = {i["call_id"] for i in kept if i["type"] == "function_call_output"}
    assert calls == outputs
    for k, item in enumerate(kept):
        if item["type"] == "reasoning":
            assert kept[k + 1]["type"] == "function_call"
    # The next turn reuses the summary: no new summarizer call, the same prefix bytes.
    before = len(fake.received)
    nxt = [*items, *turn(99, "tail"), user("and now?")]
    r2 = post(srv, body(nxt, instructions="Be careful."))
    assert r2.headers["x-ctxproxy-compacted"] == "1" and len(fake.received) == before + 1
    assert fake.received[-1].json()["input"][: len(out)] == out


def test_an_additional_tools_item_survives_compaction(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    summarizing(fake)
    srv = make_proxy({"compaction": {"context_windows": {"gpt-5.1-codex": 8000}}})
    extra_tools = {"type": "additional_tools", "role": "developer",
                   "tools": [{"type": "function", "name": "deploy", "parameters": {}}]}
    items = long_session(20)
    items.insert(5, extra_tools)  # mid-conversation: tools available from there on
    r = post(srv, body(items))
    assert r.headers["x-ctxproxy-compacted"] == "1"
    out = fake.received[-1].json()["input"]
    assert extra_tools in out and out.index(extra_tools) == 3  # right after the summary


# --- the read tool ------------------------------------------------------------------------------


class Reader:
    """A model that reads the offloaded file once, then answers."""

    def __init__(self, fake: FakeUpstream) -> None:
        self.calls = 0
        fake.responder = self

    def __call__(self, req: dict[str, Any]) -> Reply:
        self.calls += 1
        last = req["input"][-1]
        if last.get("type") == "function_call_output":
            return Reply(content="The file says it all.", reasoning="done thinking")
        notice = next(parse_notice(i["output"]) for i in req["input"]
                      if i.get("type") == "function_call_output" and isinstance(i["output"], str)
                      and parse_notice(i["output"]))
        assert notice is not None
        return Reply(content=None, reasoning="I should read more", tool_calls=[
            {"name": "read_offloaded", "id": "call_read",
             "arguments": {"file_path": notice.file_path, "start_line": notice.next_line}}])


def reading_input() -> list[dict[str, Any]]:
    return [dev("Agent."), user("run"), *turn(1, big("r")), user("what is on line 1500?")]


def test_the_read_tool_is_run_by_the_proxy(proxy: ServerThread, fake: FakeUpstream) -> None:
    model = Reader(fake)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-r", max_retries=0)
    raw = client.responses.with_raw_response.create(
        model="gpt-5.1-codex", input=reading_input(), include=["reasoning.encrypted_content"])  # type: ignore[arg-type]
    resp = raw.parse()
    assert model.calls == 2 and raw.headers["x-ctxproxy-read-rounds"] == "1"
    assert resp.output_text == "The file says it all."
    assert [o.type for o in resp.output] == ["reasoning", "message"]  # the read is not there
    assert resp.usage is not None and resp.usage.output_tokens > 0
    second = fake.received[-1].json()["input"]
    assert [i["type"] for i in second[-3:]] == ["reasoning", "function_call", "function_call_output"]
    assert "line 1500" in second[-1]["output"] or "r line" in second[-1]["output"]


def test_the_read_tool_is_withheld_from_a_stream(proxy: ServerThread, fake: FakeUpstream) -> None:
    Reader(fake)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-r", max_retries=0)
    events = list(client.responses.create(
        model="gpt-5.1-codex", input=reading_input(), stream=True,  # type: ignore[arg-type]
        include=["reasoning.encrypted_content"]))
    kinds = [e.type for e in events]
    assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" not in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["reasoning", "message"]  # the first reasoning led into the read
    assert [e.output_index for e in added] == [0, 1]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == "The file says it all."
    assert [o.type for o in final.output] == ["reasoning", "message"]


def test_a_gateways_done_marker_ends_the_stream_once(
    proxy: ServerThread, fake: FakeUpstream
) -> None:
    """An OpenAI-compatible gateway ends every stream with ``data: [DONE]``: the read round's
    must not reach the client (the openai SDK stops reading at the first one)."""
    reader = Reader(fake)

    def ending(req: dict[str, Any]) -> Reply:
        return dataclasses.replace(reader(req), done_marker=True)

    fake.responder = ending
    payload = {"model": "gpt-5.1-codex", "input": reading_input(), "stream": True,
               "tools": [{"type": "function", "name": "shell", "parameters": {}}]}
    with httpx.stream("POST", proxy.url + "/v1/responses", json=payload,
                      headers={"authorization": "Bearer sk-r"}, timeout=30) as r:
        raw = b"".join(r.iter_bytes())
    assert reader.calls == 2
    assert raw.count(b"data: [DONE]") == 1 and raw.rstrip().endswith(b"data: [DONE]")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-r", max_retries=0)
    rest = {k: v for k, v in payload.items() if k != "stream"}
    events = list(client.responses.create(stream=True, **rest))  # type: ignore[call-overload]
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "The file says it all."  # type: ignore[union-attr]


def test_async_sdk_stream_and_not(proxy: ServerThread, fake: FakeUpstream) -> None:
    fake.script(Reply(content="async whole", reasoning="r1"), Reply(content="async streamed"))
    items = [dev("Agent."), user("run"), *turn(1, big("a"))]

    async def go() -> tuple[str, list[str]]:
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-async", max_retries=0)
        try:
            whole = await client.responses.create(model="gpt-5.1-codex", input=items)  # type: ignore[arg-type]
            stream = await client.responses.create(model="gpt-5.1-codex", input=items, stream=True)  # type: ignore[arg-type]
            kinds = [event.type async for event in stream]
            return whole.output_text, kinds
        finally:
            await client.close()

    text, kinds = asyncio.run(go())
    assert text == "async whole"
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    for sent in fake.received[-2:]:  # both went through the pipeline: the output arrived cut
        output = next(i for i in sent.json()["input"] if i.get("type") == "function_call_output")
        assert parse_notice(output["output"]) is not None


def test_images_are_counted_by_the_tile_rule() -> None:
    from proxy.tokens.counter import TokenCounter, image_tokens

    from .test_tokens import png_data_url

    counter = TokenCounter()

    def tokens(parts: list[dict[str, Any]]) -> int:
        parsed = RESPONSES.parse(orjson.dumps(body([
            {"type": "message", "role": "user", "content": parts}])), 1000)
        return counter.count_messages(parsed.history, "gpt-4o")

    text = [{"type": "input_text", "text": "look"}]
    image = {"type": "input_image", "image_url": png_data_url(2048, 4096), "detail": "high"}
    assert tokens([*text, image]) - tokens(text) == image_tokens(2048, 4096, "high") == 1105
    low = {**image, "detail": "low"}
    assert tokens([*text, low]) - tokens(text) == 85
    # An image in a tool's output counts the same way.
    out = RESPONSES.parse(orjson.dumps(body([
        *turn(1, [{"type": "input_text", "text": "shot"}, image], reasoning=False)])), 1000)
    plain = RESPONSES.parse(orjson.dumps(body([
        *turn(1, [{"type": "input_text", "text": "shot"}], reasoning=False)])), 1000)
    assert (counter.count_messages(out.history, "gpt-4o")
            - counter.count_messages(plain.history, "gpt-4o")) == 1105


# --- the archive --------------------------------------------------------------------------------


def test_input_items_and_output_items_are_archived(
    make_proxy: ProxyFactory, fake: FakeUpstream, data_dir: Path
) -> None:
    srv = make_proxy()
    fake.script(Reply(content="done", reasoning="thinking it over"))
    items = [dev("Agent."), user("run"), *turn(1, big("z")), user("and?")]
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-arch", max_retries=0)
    list(client.responses.create(model="gpt-5.1-codex", input=items, stream=True,  # type: ignore[arg-type]
                                 include=["reasoning.encrypted_content"],
                                 extra_headers={"x-session-id": "resp-archive"}))
    srv.drain()
    [dialog] = list(data_dir.glob("*/resp-archive/dialog/*.jsonl"))
    records = [r["message"] for r in read(dialog)]
    assert records[: len(items)] == items  # as sent, the full output included
    assert [r["type"] for r in records[len(items):]] == ["reasoning", "message"]
    # /files shows the items as the turns they are: the call, its output, the reasoning.
    tenant, session = dialog.parent.parent.parent.name, dialog.parent.parent.name
    page = httpx.get(f"{srv.url}/files/{tenant}/{session}/dialog/{dialog.name}",
                     headers={"authorization": "Bearer sk-arch"}).text
    assert "calls <code><b>exec_command</b></code>" in page and "result of <code>call_1</code>" in page
    assert "z line 1: " in page and "[encrypted reasoning]" in page


# --- property: what the pipeline may and may not do to items -----------------------------------


@st.composite
def histories(draw: st.DrawFn) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [dev("sys")]
    for n in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["user", "turn", "parallel", "assistant"]))
        if kind == "user":
            items.append(user(f"u{n} " + "w " * draw(st.integers(1, 400))))
        elif kind == "assistant":
            items.append(assistant(f"a{n}"))
        else:
            calls = 2 if kind == "parallel" else 1
            items.append({"type": "reasoning", "id": f"rs_{n}", "summary": [],
                          "encrypted_content": f"enc-{n}"})
            for c in range(calls):
                items.append({"type": "function_call", "id": f"fc_{n}_{c}", "call_id": f"c{n}_{c}",
                              "name": "f", "arguments": "{}"})
            for c in range(calls):
                size = draw(st.sampled_from([10, 3000, 70000]))
                items.append({"type": "function_call_output", "call_id": f"c{n}_{c}",
                              "output": f"out {n} {c}\n" * (size // 10)})
    items.append(user("now"))
    return items


@settings(max_examples=examples(40), deadline=None, suppress_health_check=list(HealthCheck))
@given(histories(), st.integers(3000, 40000))
def test_forwarded_items_keep_pairs_and_reasoning_intact(
    tmp_path_factory: pytest.TempPathFactory, items: list[dict[str, Any]], window: int
) -> None:
    """The pipeline run in-process: whatever it cuts and compacts, every call keeps its output,
    every kept reasoning item is byte-identical and still leads into its calls."""
    from proxy.catalog.windows import ContextWindows
    from proxy.compaction.compactor import NullCompactor
    from proxy.compaction.planner import Planner
    from proxy.config import config_from_mapping
    from proxy.model import RequestView
    from proxy.offload.stage import Offloader
    from proxy.pipeline.runner import Pipeline
    from proxy.store.chains import chain_hashes
    from proxy.store.tool_results import ToolResultStore
    from proxy.tokens.counter import TokenCounter
    from proxy.tokens.request import RequestCounter

    tmp = tmp_path_factory.mktemp("prop")
    config = config_from_mapping({"storage": {"data_dir": str(tmp)}, "offload": {"recent_n": 1}})
    counter = RequestCounter(TokenCounter())
    pipeline = Pipeline(
        offloader=Offloader(config.offload, config.retrieval, tmp),
        planner=Planner(config.compaction, counter, ContextWindows({"m": window}), None),
        compactor=NullCompactor(), counter=counter, originals=ToolResultStore(tmp, 5),
        timed_ageing=False, old_max_bytes=config.offload.old_max_bytes,
    )
    raw = orjson.dumps(body(items, model="m"))
    parsed = RESPONSES.parse(raw, 100_000)
    view = RequestView("m", parsed.body, _identity(), parsed.message_chains(chain_hashes(parsed.items)),
                       history=parsed.history, tools=parsed.tools)
    result = asyncio.run(pipeline.run(view))
    out = orjson.loads(RESPONSES.write(raw, parsed, result.messages)) if result.changed \
        else orjson.loads(raw)
    forwarded = out["input"]
    calls = [i["call_id"] for i in forwarded if i.get("type") == "function_call"]
    outputs = [i["call_id"] for i in forwarded if i.get("type") == "function_call_output"]
    assert sorted(calls) == sorted(outputs)
    for k, item in enumerate(forwarded):
        if item.get("type") == "reasoning":
            assert item in items and forwarded[k + 1]["type"] == "function_call"
            assert orjson.dumps(item) in raw


def _identity() -> Any:
    from proxy.session import Identity

    return Identity("t-prop", "s-prop", None)

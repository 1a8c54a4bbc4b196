"""``POST /v1/messages`` (Anthropic Messages) through the same pipeline as chat completions:
untouched blocks byte for byte (thinking signatures above all), tool results offloaded and
aged, compaction with a summary block in ``system`` and at most four cache markers, pairs and
the user-first rule, the read tool withheld from the client (stream and not), the archive,
sub-paths and errors passed through, and the anthropic SDK end to end."""

from __future__ import annotations

import asyncio
import base64
import struct
import zlib
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.compaction.message import SUMMARY_HEADING
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread
from proxy.formats.messages.request import MESSAGES, cache_markers
from proxy.pipeline.validate import BRIDGE, PLACEHOLDER, validate
from proxy.rawjson import members
from proxy.session import resolve
from proxy.store.dialog import read
from proxy.tokens.media import ANTHROPIC_UNKNOWN_IMAGE, anthropic_image_tokens
from proxy.truncation.notice import parse_notice

from .conftest import ProxyFactory

PATH = "/v1/messages"
MODEL = "claude-sonnet-4-5"
SUMMARY = """## Goal
Find why the checkout build fails and fix it.
## Constraints & Preferences
- keep the public API of checkout unchanged
## Progress
### Done
- read the first failure
### In Progress
- reading the linker output
### Blocked
- nothing
## Key Decisions
- fix the rounding helper first
## Next Steps
- rerun the build
## Critical Context
- tests/test_checkout.py::test_total fails
"""
SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
          {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
          {"type": "text", "text": "Tools and rules.", "cache_control": {"type": "ephemeral"}}]


def big(mark: str = "x", lines: int = 2000) -> str:
    return "".join(f"{mark} line {i}: " + "y" * 60 + "\n" for i in range(1, lines + 1))


def user(text: str, *, marker: bool = False) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": text}
    if marker:
        block["cache_control"] = {"type": "ephemeral"}
    return {"role": "user", "content": [block]}


def turn(n: int, output: Any, *, thinking: bool = True) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if thinking:
        blocks.append({"type": "thinking", "thinking": f"I should run step {n}",
                       "signature": f"EqQBCkYIBxgCKkD-sig-{n}-" + "Q" * 40})
    blocks.append({"type": "tool_use", "id": f"toolu_{n}", "name": "Bash",
                   "input": {"command": f"step {n}"}})
    return [{"role": "assistant", "content": blocks},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{n}",
                                          "content": output}]}]


def body(messages: list[Any], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4096, "system": SYSTEM, "messages": messages,
            "tools": [{"name": "Bash", "description": "Run a command.",
                       "input_schema": {"type": "object",
                                        "properties": {"command": {"type": "string"}}}}],
            **extra}


def post(srv: ServerThread, payload: Any, key: str = "sk-ant-test", query: str = "",
         **headers: str) -> httpx.Response:
    raw = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    return httpx.post(srv.url + PATH + query, content=raw, timeout=30,
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01",
                               "content-type": "application/json", **headers})


def is_summarizer(req: dict[str, Any]) -> bool:
    return "summar" in str(req.get("system", "")).lower() and not req.get("tools")


def summarizing(fake: FakeUpstream) -> None:
    def responder(req: dict[str, Any]) -> Reply:
        return Reply(content=SUMMARY if is_summarizer(req) else "ok")

    fake.responder = responder


def model_calls(fake: FakeUpstream) -> list[dict[str, Any]]:
    return [r.json() for r in fake.received if r.path == PATH and not is_summarizer(r.json())]


def unsigned(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn as forwarded after a compaction kept it: without its thinking blocks."""
    blocks = [b for b in message["content"]
              if b.get("type") not in ("thinking", "redacted_thinking")]
    return {**message, "content": blocks or [{"type": "text",
                                              "text": "(earlier reasoning omitted)"}]}


def lead_summary(body: dict[str, Any]) -> str | None:
    """The summary the proxy put at the head of a forwarded Messages body (a text block of the
    first user turn), or None."""
    first = body["messages"][0] if body.get("messages") else None
    if first is None or first["role"] != "user" or not isinstance(first["content"], list):
        return None
    return next((b["text"] for b in first["content"] if b.get("type") == "text"
                 and b["text"].startswith(SUMMARY_HEADING)), None)


def check_pairs(messages: list[dict[str, Any]]) -> None:
    """Anthropic's rules: the first message is a user message; every tool_use is answered by
    a tool_result in the very next message, and every tool_result answers one there; a
    ``role: "system"`` message (the client's own, on the models that take one) only right after
    a user turn and before an assistant turn."""
    assert messages[0]["role"] == "user"
    for i, m in enumerate(messages):
        if m["role"] == "system":
            assert messages[i - 1]["role"] == "user", i
            assert i + 1 == len(messages) or messages[i + 1]["role"] == "assistant", i
    messages = [m for m in messages if m["role"] != "system"]
    for i, m in enumerate(messages):
        blocks = m["content"] if isinstance(m["content"], list) else []
        uses = [b["id"] for b in blocks if b.get("type") == "tool_use"]
        results = [b["tool_use_id"] for b in blocks if b.get("type") == "tool_result"]
        if results:
            prev = messages[i - 1]["content"] if i else []
            asked = [b["id"] for b in prev if isinstance(b, dict) and b.get("type") == "tool_use"]
            assert sorted(results) == sorted(asked), (i, results, asked)
            kinds = [b.get("type") for b in blocks]
            assert kinds[: len(results)] == ["tool_result"] * len(results)  # results first
        if uses:
            nxt = messages[i + 1]["content"]
            assert sorted(b["tool_use_id"] for b in nxt if b.get("type") == "tool_result") == sorted(uses)


# --- forwarding ----------------------------------------------------------------------------------


def test_an_unchanged_request_reaches_anthropic_byte_for_byte(
    proxy: ServerThread, fake: FakeUpstream
) -> None:
    raw = (b'{ "model":"claude-sonnet-4-5", "max_tokens":64000, "messages":[{"role":"user",'
           b'"content":"h\\u00e9llo"}], "thinking":{"type":"adaptive"}, "x_new":[1,2.50,null],'
           b' "metadata":{"user_id":"{\\"session_id\\":\\"cc-1\\"}"} }')
    r = post(proxy, raw, query="?beta=true", **{"anthropic-beta": "context-1m-2025-08-07"})
    assert r.status_code == 200, r.text
    assert r.headers["x-ctxproxy-offloaded"] == "0" and r.headers["x-ctxproxy-session"] == "cc-1"
    rec = fake.received[-1]
    assert rec.body == raw and rec.path == PATH and rec.query == "beta=true"
    assert rec.headers["x-api-key"] == "sk-ant-test"
    assert rec.headers["anthropic-beta"] == "context-1m-2025-08-07"
    assert rec.headers["anthropic-version"] == "2023-06-01"
    assert r.json()["type"] == "message"


def test_tool_results_are_offloaded_and_every_other_block_is_untouched(
    proxy: ServerThread, fake: FakeUpstream
) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": base64.b64encode(png(4, 4)).decode()}}
    parts = [{"type": "text", "text": big("p")}, image]
    messages = [user("run it"), *turn(1, big("s")), *turn(2, parts)]
    messages[-1]["content"][0]["cache_control"] = {"type": "ephemeral"}  # Claude Code's marker
    messages[-1]["content"].append({"type": "text", "text": "now explain"})
    payload = body(messages)
    # The client escapes what orjson would not: its bytes must survive, not just its values.
    raw = orjson.dumps(payload).replace(b"run step 1", b"run st\\u00e9p 1")
    r = post(proxy, raw)
    assert r.status_code == 200 and r.headers["x-ctxproxy-offloaded"] == "2"
    assert b'"thinking":"I should run st\\u00e9p 1"' in fake.received[-1].body
    sent = fake.received[-1].json()
    out = sent["messages"]
    assert sent["system"] == SYSTEM and sent["tools"][:1] == payload["tools"]
    assert sent["tools"][1]["name"] == "read_offloaded"  # the proxy's read tool, Anthropic-shaped
    first = out[2]["content"][0]["content"]
    assert isinstance(first, str) and parse_notice(first) is not None and len(first) < 60_000
    second = out[4]["content"]
    assert second[0]["cache_control"] == {"type": "ephemeral"}  # the marker stays on the cut block
    assert second[0]["content"][1] == image and parse_notice(second[0]["content"][0]["text"])
    assert second[1] == {"type": "text", "text": "now explain"}
    # Assistant turns go out as their very bytes: thinking signatures are never re-serialised.
    assert orjson.dumps(messages[3]) in fake.received[-1].body
    assert out[0] == messages[0]


def test_old_results_age(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    srv = make_proxy({"offload": {"recent_n": 1, "age_policy": "eager"},
                      "compaction": {"enabled": False}})
    mid = big("a", 300)  # ~25 KB: under stage 1, over stage 2
    messages = [user("go"), *turn(1, mid), *turn(2, mid), *turn(3, mid), user("and?")]
    r = post(srv, body(messages))
    assert r.status_code == 200
    out = fake.received[-1].json()["messages"]
    results = [m["content"][0]["content"] for m in out if m["role"] == "user"
               and m["content"][0].get("type") == "tool_result"]
    assert [len(t) < 4000 for t in results] == [True, True, False]


UNANSWERED = {"role": "assistant", "content": [
    {"type": "tool_use", "id": "toolu_a", "name": "Bash", "input": {}},
    {"type": "tool_use", "id": "toolu_b", "name": "Bash", "input": {}}]}
ANSWER = {"role": "user", "content": [
    {"type": "tool_result", "tool_use_id": "toolu_a", "content": "done"},
    {"type": "text", "text": "next"}]}


def test_the_clients_own_missing_result_goes_upstream_as_sent(
    proxy: ServerThread, fake: FakeUpstream
) -> None:
    fake.strict = False  # the provider refuses this request: here it is what it receives
    raw = orjson.dumps(body([user("go"), UNANSWERED, ANSWER]))
    assert post(proxy, raw).status_code == 200
    # The client's messages byte for byte (the proxy's read tool joins its tools).
    assert members(fake.received[-1].body)["messages"] == members(raw)["messages"]


def test_a_result_the_proxy_lost_gets_a_placeholder_in_the_next_user_message() -> None:
    """A break of the proxy's making (a result evicted): the placeholder goes in the user
    message of the other results, before its other blocks."""
    both = {"role": "user", "content": [
        *ANSWER["content"][:1], {"type": "tool_result", "tool_use_id": "toolu_b", "content": "ok"},
        *ANSWER["content"][1:]]}
    raw = orjson.dumps(body([user("go"), UNANSWERED, both]))
    parsed = MESSAGES.parse(raw, 1000)
    evicted = [m for m in parsed.history if m.get("tool_call_id") != "toolu_b"]
    out = orjson.loads(MESSAGES.write(raw, parsed, validate(evicted, parsed.history).messages))
    assert out["messages"][2]["content"] == [
        ANSWER["content"][0], {"type": "tool_result", "tool_use_id": "toolu_b",
                               "content": PLACEHOLDER}, ANSWER["content"][1]]
    check_pairs(out["messages"])


def test_bad_input_gets_a_400(proxy: ServerThread, fake: FakeUpstream) -> None:
    for payload, param in [({"model": MODEL}, "messages"),
                           ({"model": MODEL, "messages": [{"role": "user", "content": 3}]},
                            "messages.0.content"),
                           ({"model": MODEL, "messages": [], "system": 5}, "system")]:
        r = post(proxy, payload)
        # Worded as Anthropic's API words it: the field's dotted path first.
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{param}: ")
        # Anthropic's envelope: what Claude Code and the anthropic SDK read.
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert post(proxy, b"{nope").status_code == 400
    client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-bad", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=10, messages="nope")  # type: ignore[arg-type]
    assert "messages: Input should be a valid list" in err.value.message
    assert not fake.received


def test_a_stream_that_breaks_ends_with_anthropics_error_event(
    proxy: ServerThread, fake: FakeUpstream
) -> None:
    fake.script(Reply(content="partial answer " * 20, break_after_events=4))
    client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-b", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as err:  # noqa: PT012
        with client.messages.stream(model=MODEL, max_tokens=64, messages=[user("hi")]) as s:  # type: ignore[list-item]
            s.until_done()
    assert "upstream stream broke off" in str(err.value)


def test_count_tokens_and_other_subpaths_pass_through(
    proxy: ServerThread, fake: FakeUpstream
) -> None:
    payload = {"model": MODEL, "messages": [user(big("c", 100))]}
    r = httpx.post(proxy.url + "/v1/messages/count_tokens?beta=true", content=orjson.dumps(payload),
                   headers={"x-api-key": "sk-ant-test", "anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.json()["input_tokens"] > 1000  # the client's text, uncut
    rec = fake.received[-1]
    assert rec.path == "/v1/messages/count_tokens" and rec.query == "beta=true"
    assert rec.body == orjson.dumps(payload)
    r = httpx.get(proxy.url + "/v1/messages/batches/b1",
                  headers={"x-api-key": "sk-ant-test", "anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.json()["path"] == "/v1/messages/batches/b1"


def test_anthropic_errors_pass_through(proxy: ServerThread, fake: FakeUpstream) -> None:
    fake.script(Reply.error(429, "slow down"), Reply(status=529))
    r = post(proxy, body([user("hi")]))
    assert r.status_code == 429
    assert r.json()["type"] == "error" and r.json()["error"] == {"type": "rate_limit_error",
                                                                 "message": "slow down"}
    r = post(proxy, body([user("hi")], stream=True))
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"


def test_the_configured_key_goes_as_x_api_key(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    srv = make_proxy({"anthropic": {"api_key": "sk-ant-operator"}})
    assert post(srv, body([user("hi")]), key="sk-ant-client").status_code == 200
    rec = fake.received[-1]
    assert rec.headers["x-api-key"] == "sk-ant-operator" and "authorization" not in rec.headers


def test_behind_auth_keys_the_proxys_key_never_reaches_anthropic(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    srv = make_proxy({"anthropic": {"api_key": "sk-ant-operator"},
                      "auth": {"keys": [{"key": "team-key", "tenant": "team"}]}})
    r = post(srv, body([user("hi")]), key="wrong")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert not fake.received
    assert post(srv, body([user("hi")]), key="team-key").status_code == 200
    assert fake.received[-1].headers["x-api-key"] == "sk-ant-operator"
    assert "team-key" not in str(fake.received[-1].raw_headers)


def test_an_exposed_anthropic_key_needs_auth() -> None:
    from proxy.config import config_from_mapping, exposure_problem

    exposed = {"server": {"host": "0.0.0.0"}, "anthropic": {"api_key": "sk-ant-op"}}
    problem = exposure_problem(config_from_mapping(exposed))
    assert problem is not None and "anthropic.api_key" in problem
    assert exposure_problem(config_from_mapping(
        {**exposed, "auth": {"keys": [{"key": "k1", "tenant": "team"}]}})) is None


def test_a_session_comes_from_claude_codes_metadata() -> None:
    meta = {"metadata": {"user_id": orjson.dumps({"device_id": "d", "session_id": "abc-1"}).decode()}}
    assert resolve({}, meta).session == "abc-1"
    old = {"metadata": {"user_id": "user_ff_account__session_0d9b-77"}}
    assert resolve({}, old).session == "0d9b-77"
    assert resolve({"x-claude-code-session-id": "hdr"}, meta).session == "hdr"


# --- compaction --------------------------------------------------------------------------------


def compacting(make_proxy: ProxyFactory, fake: FakeUpstream) -> ServerThread:
    """A proxy whose window (8,000 tokens) a 20-turn session overflows; the fake summarizes."""
    summarizing(fake)
    return make_proxy({"compaction": {"context_windows": {MODEL: 8000}}})


def long_session(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [user("fix the checkout build")]
    for n in range(turns):
        messages += turn(n, f"step {n} output: " + "word " * 400)
    messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return messages


def test_compaction_puts_the_summary_in_the_first_user_turn_and_keeps_valid_pairs(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    srv = compacting(make_proxy, fake)
    messages = long_session(20)
    payload = body(messages)
    r = post(srv, payload)
    assert r.status_code == 200 and r.headers["x-ctxproxy-compacted"] == "1"
    summarizer = next(r.json() for r in fake.received if is_summarizer(r.json()))
    assert summarizer["model"] == MODEL and summarizer["max_tokens"] > 0
    sent = model_calls(fake)[-1]
    # The top-level system (bound to every signed thinking block, and the cache's first
    # breakpoint) is the client's, untouched; the summary opens the first user turn (the API
    # refuses a system role at the start of messages, and anywhere on most models).
    assert sent["system"] == SYSTEM
    out = sent["messages"]
    assert out[0]["role"] == "user" and len(out[0]["content"]) == 2
    assert out[0]["content"][0]["text"].startswith(SUMMARY_HEADING)
    assert "checkout" in out[0]["content"][0]["text"]
    # The agent loop was cut mid-way: a short note after the summary opens the kept turns.
    assert out[0]["content"][1] == {"type": "text", "text": BRIDGE}
    kept = out[1:]
    # The client's, untouched, but for the thinking of the turns made before the compaction
    # (their prefix changed: a preserved-thinking model would refuse them).
    assert kept == [unsigned(m) if m["role"] == "assistant" else m
                    for m in messages[len(messages) - len(kept):]]
    check_pairs(out)
    assert cache_markers(sent) == 3  # the moving marker is on the kept last message
    # The next turn reuses the summary: no new summarizer call, the same prefix.
    before = len(fake.received)
    nxt = [*messages, {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
           user("and now?")]
    r2 = post(srv, body(nxt))
    assert r2.headers["x-ctxproxy-compacted"] == "1" and len(fake.received) == before + 1
    again = fake.received[-1].json()
    assert again["system"] == SYSTEM and again["messages"][: len(out)] == out


def test_claude_codes_environment_message_survives_compaction(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    srv = compacting(make_proxy, fake)
    messages = long_session(20)
    env = {"role": "system", "content": "# Environment\n - Primary working directory: /repo"}
    messages.insert(1, env)  # where Claude Code puts it (a beta it uses)
    r = post(srv, body(messages))
    assert r.headers["x-ctxproxy-compacted"] == "1"
    out = model_calls(fake)[-1]["messages"]
    assert out[0]["role"] == "user"
    assert out[0]["content"][0]["text"].startswith(SUMMARY_HEADING)
    assert out[0]["content"][1]["text"] == BRIDGE and out[1] == env
    assert out[2:] == [unsigned(m) if m["role"] == "assistant" else m
                       for m in messages[len(messages) - len(out) + 2:]]
    check_pairs(out)


# --- where the proxy's own text goes (the writer, pure) --------------------------------------


MEMORY = {"role": "system", "content": "# Long-term memory\nprefers tabs"}
SUMMARY_MSG = {"role": "system", "content": f"{SUMMARY_HEADING}\nthe earlier turns"}


def written(payload: dict[str, Any], keep: slice, added: list[dict[str, Any]], at: int = 0
            ) -> tuple[bytes, dict[str, Any]]:
    """The body the writer makes when the pipeline keeps ``history[keep]`` (the system field
    first) and puts ``added`` at index ``at`` of what it keeps."""
    raw = orjson.dumps(payload)
    parsed = MESSAGES.parse(raw, 1000)
    head = parsed.history[:1] if payload.get("system") else []
    rest = parsed.history[len(head):][keep]
    out = MESSAGES.write(raw, parsed, [*head, *rest[:at], *added, *rest[at:]])
    return out, orjson.loads(out)


def test_text_added_after_an_assistant_turn_opens_a_user_turn_of_its_own() -> None:
    """After a provider's compaction turn the summary leads the next user turn; where an
    assistant turn comes next, a user turn of its own (user and assistant alternate)."""
    reply = {"role": "assistant", "content": [{"type": "text", "text": "compacted"}]}
    later = {"role": "assistant", "content": [{"type": "text", "text": "working"}]}
    payload = body([user("start"), reply, later, user("next")])
    raw, out = written(payload, slice(None), [SUMMARY_MSG], at=2)
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "user", "assistant",
                                                    "user"]
    assert out["messages"][2] == {"role": "user", "content": [
        {"type": "text", "text": SUMMARY_MSG["content"]}]}
    assert out["messages"][:2] == payload["messages"][:2]


def test_memory_on_a_first_request_opens_the_first_user_turn() -> None:
    payload = body([{"role": "user", "content": "fix the bug"}])
    raw, out = written(payload, slice(None), [MEMORY])
    assert out["system"] == SYSTEM and len(out["messages"]) == 1
    assert out["messages"][0] == {"role": "user", "content": [
        {"type": "text", "text": MEMORY["content"]}, {"type": "text", "text": "fix the bug"}]}


def test_memory_and_summary_go_in_the_pipelines_order_before_the_users_blocks() -> None:
    first = user("go on", marker=True)
    payload = body([first, {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
                    user("next")])
    raw, out = written(payload, slice(None), [MEMORY, SUMMARY_MSG])
    lead = out["messages"][0]
    assert [b["text"] for b in lead["content"]] == [MEMORY["content"], SUMMARY_MSG["content"],
                                                    "go on"]
    assert lead["content"][2] == first["content"][0]  # the client's block, marker and all
    # Everything after the first turn goes out as the client wrote it.
    assert orjson.dumps(payload["messages"][1]) in raw and orjson.dumps(payload["messages"][2]) in raw


def test_tool_results_stay_first_in_the_lead_user_message() -> None:
    results = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "done"},
        {"type": "text", "text": "and?"}]}
    call = {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]}
    payload = body([user("start"), call, results])
    # The first turn kept is the results' own message (the API wants results first in it).
    _, out = written(payload, slice(2, None), [SUMMARY_MSG])
    lead = out["messages"][0]["content"]
    assert [b["type"] for b in lead] == ["tool_result", "text", "text"]
    assert [lead[1]["text"], lead[2]["text"]] == [SUMMARY_MSG["content"], "and?"]


def test_a_history_that_starts_with_an_assistant_turn_gets_a_user_turn_for_the_summary() -> None:
    payload = body([user("start"), {"role": "assistant", "content": [{"type": "text",
                                                                      "text": "working"}]},
                    user("next")])
    _, out = written(payload, slice(1, None), [SUMMARY_MSG])
    assert out["messages"][0] == {"role": "user", "content": [
        {"type": "text", "text": SUMMARY_MSG["content"]}]}
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "user"]


def test_an_evicted_client_system_message_goes_back_after_the_first_user_turn() -> None:
    env = {"role": "system", "content": "# Environment\n - cwd: /repo"}
    reply = {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}
    payload = body([user("start"), env, reply, user("a"), user("b"), reply, user("c")])
    _, out = written(payload, slice(3, None), [SUMMARY_MSG])
    roles = [m["role"] for m in out["messages"]]
    # Two user messages are one turn to the API: the system message goes after both, right
    # before the assistant turn, as the placement rule wants.
    assert roles == ["user", "user", "system", "assistant", "user"]
    assert out["messages"][2] == env
    assert out["messages"][0]["content"][0]["text"] == SUMMARY_MSG["content"]


def test_a_marker_evicted_with_its_turn_moves_to_the_summary(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    srv = compacting(make_proxy, fake)
    messages = long_session(20)
    marked = {"type": "ephemeral", "ttl": "5m"}
    messages[0]["content"][0]["cache_control"] = marked  # evicted by the compaction
    payload = {**body(messages), "system": "You are Claude Code."}
    assert cache_markers(payload) == 2
    r = post(srv, payload)
    assert r.headers["x-ctxproxy-compacted"] == "1"
    sent = model_calls(fake)[-1]
    assert sent["system"] == "You are Claude Code."
    lead = sent["messages"][0]
    assert lead["role"] == "user" and lead["content"][0]["text"].startswith(SUMMARY_HEADING)
    assert lead["content"][0]["cache_control"] == marked
    assert cache_markers(sent) == 2
    # Four markers already: none is added.
    full = {**body(long_session(20)), "system": [{**b, "cache_control": {"type": "ephemeral"}}
                                                  for b in SYSTEM]}
    full["messages"][0]["content"][0]["cache_control"] = marked
    assert cache_markers(full) == 5 - 1 + 1  # three system, the last message, the first
    full["system"][0].pop("cache_control")
    post(srv, full)
    assert cache_markers(model_calls(fake)[-1]) == 4


# --- the read tool ------------------------------------------------------------------------------


class Reading:
    """A model that reads the offloaded file once, then answers."""

    def __init__(self, fake: FakeUpstream) -> None:
        self.calls = 0
        fake.responder = self

    def __call__(self, req: dict[str, Any]) -> Reply:
        self.calls += 1
        last = req["messages"][-1]["content"]
        if isinstance(last, list) and last[0].get("type") == "tool_result" and \
                "offloaded" in str(req["messages"][-2]["content"]):
            return Reply(content="Line 1500 says y.", reasoning="read it")
        notice = next(parse_notice(b["content"]) for m in req["messages"] if m["role"] == "user"
                      for b in m["content"] if isinstance(b, dict) and b.get("type") == "tool_result"
                      and isinstance(b["content"], str) and parse_notice(b["content"]))
        assert notice is not None and any(t["name"] == "read_offloaded" for t in req["tools"])
        return Reply(content=None, reasoning="I should read more", tool_calls=[
            {"name": "read_offloaded", "id": "toolu_read",
             "arguments": {"file_path": notice.file_path, "start_line": notice.next_line}}])


def reading_messages() -> list[dict[str, Any]]:
    return [user("run"), *turn(1, big("r")), user("what is on line 1500?")]


def test_the_read_tool_is_run_by_the_proxy(proxy: ServerThread, fake: FakeUpstream) -> None:
    model = Reading(fake)
    client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-r", max_retries=0)
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=1024, messages=reading_messages())  # type: ignore[arg-type]
    msg = raw.parse()
    assert model.calls == 2 and raw.headers["x-ctxproxy-read-rounds"] == "1"
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[-1].text == "Line 1500 says y."  # type: ignore[union-attr]
    assert msg.stop_reason == "end_turn" and msg.usage.output_tokens > 0
    first, again = fake.received[-2].body, fake.received[-1].body
    sent = reading_messages()
    # The client's signed turn goes out as its bytes in every round.
    assert orjson.dumps(sent[1]) in first and orjson.dumps(sent[1]) in again
    second = fake.received[-1].json()["messages"]
    assert [t["name"] for t in fake.received[-1].json()["tools"]] == ["read_offloaded"]
    assert [b["type"] for b in second[-2]["content"]] == ["thinking", "tool_use"]
    assert second[-2]["content"][0]["signature"]  # the round's thinking went back signed
    assert "r line" in second[-1]["content"][0]["content"]


def test_the_read_tool_is_withheld_from_a_stream(proxy: ServerThread, fake: FakeUpstream) -> None:
    Reading(fake)
    client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-r", max_retries=0)
    with client.messages.stream(model=MODEL, max_tokens=1024,
                                messages=reading_messages()) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds.count("message_start") == 1 and kinds.count("message_stop") == 1
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.content_block.type for e in starts] == ["thinking", "thinking", "text"]
    assert [e.index for e in starts] == [0, 1, 2]  # consecutive for the client
    assert [b.type for b in final.content] == ["thinking", "thinking", "text"]
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0 and final.usage.input_tokens > 0


# --- the archive --------------------------------------------------------------------------------


def test_messages_and_the_streamed_answer_are_archived(
    make_proxy: ProxyFactory, fake: FakeUpstream, data_dir: Path
) -> None:
    srv = make_proxy()
    fake.script(Reply(content="running it", reasoning="thinking it over",
                      tool_calls=[{"name": "Bash", "id": "toolu_x", "arguments": {"command": "ls"}}]))
    messages = [user("run"), *turn(1, big("z")), user("and?")]
    client = anthropic.Anthropic(base_url=srv.url, api_key="sk-ant-arch", max_retries=0)
    with client.messages.stream(model=MODEL, max_tokens=256, system="Agent.",  # type: ignore[arg-type]
                                messages=messages,
                                extra_headers={"x-claude-code-session-id": "msg-archive"}) as s:
        s.until_done()
    srv.drain()
    [dialog] = list(data_dir.glob("*/msg-archive/dialog/*.jsonl"))
    records = [r["message"] for r in read(dialog)]
    assert records[0] == {"role": "system", "content": "Agent."}
    assert records[1: len(messages) + 1] == messages  # as sent, the full output included
    answer = records[-1]
    assert answer["role"] == "assistant"
    assert [b["type"] for b in answer["content"]] == ["thinking", "text", "tool_use"]
    assert answer["content"][0]["signature"] and answer["content"][0]["thinking"] == "thinking it over"
    assert answer["content"][2]["input"] == {"command": "ls"}


def test_the_tap_assembles_a_stream_into_the_message_the_body_would_be() -> None:
    from proxy.demo.fake.messages import message_body, message_events
    from proxy.demo.fake.replies import Received
    from proxy.formats.messages.answer import MessagesTap

    rec = Received("POST", PATH, "", {}, [], b"{}", 0.0)
    reply = Reply(content="two calls", reasoning="plan: é and 😀", stream_pieces=3, tool_calls=[
        {"name": "Bash", "id": "toolu_1", "arguments": {"command": "ls -la", "n": [1, 2]}},
        {"name": "Read", "id": "toolu_2", "arguments": {"file_path": "/x"}}])
    req = {"model": MODEL}
    streamed = MessagesTap()
    for event in message_events(rec, req, reply, 1):
        for cut in (event[:7], event[7:]):  # events split across chunks
            streamed.stream(cut)
    whole = MessagesTap()
    body = message_body(rec, req, reply, 1)
    whole.whole(orjson.dumps(body))
    assert streamed.answer() == whole.answer() == {"role": "assistant", "content": body["content"]}
    assert body["content"][0]["signature"]


# --- the anthropic SDK --------------------------------------------------------------------------


def test_the_sdk_sync_async_and_stream(proxy: ServerThread, fake: FakeUpstream) -> None:
    fake.default = Reply(content="hello there", reasoning="hm")
    client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-sdk", max_retries=0)
    msg = client.messages.create(model=MODEL, max_tokens=64, messages=[user("hi")])  # type: ignore[list-item]
    assert msg.content[-1].text == "hello there"  # type: ignore[union-attr]

    async def run() -> str:
        async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-ant-sdk",
                                            max_retries=0) as aclient:
            async with aclient.messages.stream(model=MODEL, max_tokens=64,
                                               messages=[user("hi")]) as stream:  # type: ignore[list-item]
                return "".join([t async for t in stream.text_stream])

    assert asyncio.run(run()) == "hello there"
    with client.messages.stream(model=MODEL, max_tokens=64, messages=[user("hi")]) as s:  # type: ignore[list-item]
        assert s.get_final_text() == "hello there"
    beta = client.beta.messages.create(model=MODEL, max_tokens=64, messages=[user("hi")],  # type: ignore[list-item]
                                       betas=["context-1m-2025-08-07"])
    assert beta.content[-1].text == "hello there"  # type: ignore[union-attr]
    assert fake.received[-1].headers["anthropic-beta"] == "context-1m-2025-08-07"


def test_an_sdk_tool_loop_with_offload_and_compaction(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    srv = make_proxy({"compaction": {"context_windows": {MODEL: 30000}},
                      "retrieval": {"mode": "client"}})
    steps = {"n": 0}

    def responder(req: dict[str, Any]) -> Reply:
        if is_summarizer(req):
            return Reply(content=SUMMARY)
        steps["n"] += 1
        if steps["n"] > 12:
            return Reply(content="all done")
        return Reply(content=None, reasoning=f"step {steps['n']}", tool_calls=[
            {"name": "Bash", "id": f"toolu_s{steps['n']}", "arguments": {"command": "cat log"}}])

    fake.responder = responder
    client = anthropic.Anthropic(base_url=srv.url, api_key="sk-ant-loop", max_retries=0)
    messages: list[Any] = [user("find the failure")]
    headers: list[httpx.Headers] = []
    while True:
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=1024, messages=messages,
            tools=[{"name": "Bash", "input_schema": {"type": "object"}}],
            extra_headers={"x-claude-code-session-id": "sdk-loop"})
        headers.append(raw.headers)
        msg = raw.parse()
        messages.append({"role": "assistant", "content": [b.model_dump() for b in msg.content]})
        if msg.stop_reason != "tool_use":
            break
        call = next(b for b in msg.content if b.type == "tool_use")
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": big(f"log{len(messages)}", 900)}]})
    assert msg.content[-1].text == "all done"  # type: ignore[union-attr]
    assert sum(int(h["x-ctxproxy-offloaded"]) for h in headers) > 0
    assert headers[-1]["x-ctxproxy-compacted"] == "1"
    last = model_calls(fake)[-1]
    assert last["messages"][0]["role"] == "user"
    assert last["messages"][0]["content"][0]["text"].startswith(SUMMARY_HEADING)
    check_pairs(last["messages"])
    assert int(headers[-1]["x-ctxproxy-tokens-out"]) < int(headers[-1]["x-ctxproxy-tokens-in"]) // 2


# --- counting -------------------------------------------------------------------------------------


def png(width: int, height: int) -> bytes:
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + header
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(header)) + chunk
            + struct.pack(">I", zlib.crc32(chunk)))


def test_images_count_by_anthropics_rule() -> None:
    def source(w: int, h: int) -> dict[str, Any]:
        return {"type": "base64", "media_type": "image/png",
                "data": base64.b64encode(png(w, h)).decode()}

    assert anthropic_image_tokens(source(750, 750)) == 750
    assert anthropic_image_tokens(source(1000, 1000)) == 1334  # 1,000,000 / 750, rounded up
    # Resized to about 1.15 megapixels (and a long edge of 1568) first: never more than ~1600.
    assert 1500 < anthropic_image_tokens(source(4000, 3000)) <= 1600
    assert anthropic_image_tokens({"type": "url", "url": "https://x/y.png"}) == ANTHROPIC_UNKNOWN_IMAGE


# --- property: what the pipeline may and may not do to Messages ---------------------------------


@st.composite
def histories(draw: st.DrawFn) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [user("start")]
    for n in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["user", "turn", "parallel", "text"]))
        if kind == "user" and messages[-1]["role"] == "assistant":
            messages.append(user(f"u{n} " + "w " * draw(st.integers(1, 400))))
        elif kind == "text" and messages[-1]["role"] == "user":
            messages.append({"role": "assistant", "content": [
                {"type": "thinking", "thinking": f"t{n}", "signature": f"sig{n}"},
                {"type": "text", "text": f"a{n}"}]})
        elif messages[-1]["role"] == "user":
            calls = 2 if kind == "parallel" else 1
            blocks: list[dict[str, Any]] = [
                {"type": "thinking", "thinking": f"t{n}", "signature": f"sig-{n}"}]
            blocks += [{"type": "tool_use", "id": f"c{n}_{c}", "name": "f", "input": {"n": c}}
                       for c in range(calls)]
            results = [{"type": "tool_result", "tool_use_id": f"c{n}_{c}",
                        "content": f"out {n} {c}\n" * (draw(st.sampled_from([10, 3000, 70000])) // 10)}
                       for c in range(calls)]
            marked = sum("cache_control" in b for m in messages for b in m["content"])
            if marked < 3 and draw(st.booleans()):  # a valid client: at most 4 with system's
                results[-1]["cache_control"] = {"type": "ephemeral"}
            messages += [{"role": "assistant", "content": blocks},
                         {"role": "user", "content": results}]
    if messages[-1]["role"] == "assistant":
        messages.append(user("now"))
    return messages


class _Compactor:
    """Always has a summary to offer (what a summarizer would write), so the property covers
    compaction without a network."""

    enabled = True

    def __init__(self) -> None:
        self.records: dict[str, Any] = {}

    async def state(self, request: Any) -> Any:
        return None

    def prepared_plan(self, request: Any, summary: Any) -> Any:
        return None

    async def obtain(self, plan: Any, request: Any, tokens: int) -> Any:
        from datetime import UTC, datetime

        from proxy.store.summaries import SummaryRecord

        return SummaryRecord(tenant="t", session="s", chain=plan.cut_chain, head=plan.head,
                             upto=plan.cut, text=SUMMARY, source="model", model=MODEL,
                             created_at=datetime.now(UTC), tokens_before=tokens, tokens_after=0,
                             previous_chain=None, span=())

    def prepare(self, plan: Any, request: Any, tokens: int) -> None:
        return None


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(histories(), st.integers(3000, 40000), st.booleans())
def test_forwarded_messages_keep_thinking_pairs_and_markers(
    tmp_path_factory: pytest.TempPathFactory, messages: list[dict[str, Any]], window: int,
    system_marker: bool,
) -> None:
    """The pipeline in process: whatever it cuts and compacts, every forwarded assistant turn
    is byte-identical to the client's (thinking signatures), or the client's bytes without its
    thinking blocks (a turn kept by a compaction: its prefix changed), pairs and the user-first
    rule hold, and no more than four cache markers go out."""
    from proxy.catalog.windows import ContextWindows
    from proxy.compaction.planner import Planner
    from proxy.config import config_from_mapping
    from proxy.model import RequestView
    from proxy.offload.stage import Offloader
    from proxy.pipeline.runner import Pipeline
    from proxy.session import Identity
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
        compactor=_Compactor(), counter=counter, originals=ToolResultStore(tmp, 5),
        timed_ageing=False, old_max_bytes=config.offload.old_max_bytes,
    )
    system: list[dict[str, Any]] = [{"type": "text", "text": "sys"}]
    if system_marker:
        system[0]["cache_control"] = {"type": "ephemeral"}
    payload = {"model": "m", "max_tokens": 100, "system": system, "messages": messages}
    raw = orjson.dumps(payload)
    parsed = MESSAGES.parse(raw, 100_000)
    view = RequestView("m", parsed.body, Identity("t", "s", None),
                       parsed.message_chains(chain_hashes(parsed.items)),
                       history=parsed.history, tools=parsed.tools, api="messages")
    result = asyncio.run(pipeline.run(view))
    out_raw = MESSAGES.write(raw, parsed, result.messages) if result.changed else raw
    out = orjson.loads(out_raw)
    check_pairs(out["messages"])
    for m in out["messages"]:
        if m["role"] == "assistant":
            assert m in messages or m in [unsigned(c) for c in messages
                                          if c["role"] == "assistant"]
            assert orjson.dumps(m) in out_raw
            if result.stats.get("compacted") or m not in messages:
                assert not any(b["type"] == "thinking" for b in m["content"])
    assert cache_markers(out) <= 4

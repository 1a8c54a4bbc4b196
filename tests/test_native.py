"""Provider-native context management (docs/native.md): compaction
items and blocks are never compacted, edited or counted past; a request in which the provider
compacts gets no summary from ctxproxy; provider-side tool-result clearing stands stage 2 down;
everything else passes byte for byte. Shapes are the ones Codex 0.171.0 sends (recorded in
tests/test_codex_remote_compaction.py) and Anthropic's documented ones."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.catalog.windows import ContextWindows
from proxy.compaction.planner import Plan, Planner
from proxy.config import config_from_mapping
from proxy.demo.fake.upstream import FakeUpstream
from proxy.formats.messages.request import MESSAGES
from proxy.formats.responses.request import RESPONSES
from proxy.history import native
from proxy.model import NATIVE, OPAQUE_TOKENS, RequestView
from proxy.session import resolve
from proxy.tokens.counter import TokenCounter
from proxy.tokens.request import RequestCounter

from . import test_messages as anth
from . import test_responses as resp
from .conftest import ProxyFactory

# What Codex 0.171.0 sent (tests/test_codex_remote_compaction.py): the trigger is the last
# input item of an ordinary streaming /v1/responses request; the compaction item comes back in
# the next requests with the id the provider gave it.
TRIGGER = {"type": "compaction_trigger"}
BLOB = ("ZmFrZS1jb21wYWN0aW9uOjA6MjoWH5ZHSbfjSSe48cLvoUNtCqqemIULI3Oacts4v/ufD8HPfN4IfVCPi2bdqeOX"
        "n5crqz/gLzfJiP5sZk0tnReNWQw/vs/QlZk66r/bk4J8ALWU5N5dfGKP2XwjeuDolmw=") * 20
COMPACTION = {"type": "compaction", "id": "cmp_fake_3", "encrypted_content": BLOB}
# Anthropic: server compaction returns a compaction block first in the assistant's content; the
# client sends it back and the API ignores everything before it.
BLOCK = {"type": "compaction", "content": "Summary so far: the checkout build fails in the "
         "rounding helper; tests/test_checkout.py::test_total is the failing test."}
CLAUDE_CODE_EDITS = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
WINDOW = 8000


def view(api: str, body: dict[str, Any], history: list[Any]) -> RequestView:
    return RequestView(model=body["model"], body=body, identity=resolve({}, body, tenant="t"),
                       history=history, api=api)


def after_compaction(turns: int) -> list[dict[str, Any]]:
    """Codex's history after a remote compaction: the developer context, the retained user
    messages, the compaction item, then the turns since."""
    items: list[dict[str, Any]] = [resp.dev("You are a coding agent."), resp.user("fix the build"),
                                   COMPACTION]
    for n in range(turns):
        items += resp.turn(n, f"step {n} output: " + "word " * 400)
        items.append(resp.assistant(f"step {n} done: " + "note " * 60))
        items.append(resp.user(f"continue with step {n + 1}"))
    return items


def posted_item(raw: bytes, item: dict[str, Any]) -> bool:
    return orjson.dumps(item) in raw


# --- reading: pure ----------------------------------------------------------------------------


def test_a_responses_compaction_item_marks_its_message_and_counts_its_estimate() -> None:
    items = [resp.dev("ctx"), resp.user("go"), COMPACTION, *resp.turn(1, "out"), resp.user("more")]
    parsed = RESPONSES.parse(orjson.dumps(resp.body(items)), 1000)
    marked = [m for m in parsed.history if m.get(NATIVE) == native.COMPACTION]
    assert len(marked) == 1
    k = parsed.history.index(marked[0])
    # It rides in its assistant run (with the reasoning and call after it): one unit, kept whole.
    assert [i["type"] for i in (parsed.items[j] for j in parsed.spans[k])] == \
        ["compaction", "reasoning", "function_call"]
    assert marked[0][OPAQUE_TOKENS] == len(BLOB) * 3 // 16
    # The head runs through that unit and the output answering its call.
    assert native.head(parsed.history) == k + 2
    counter = TokenCounter()
    with_item = counter.count_message(marked[0], "gpt-5.1-codex")
    without = counter.count_message({**marked[0], OPAQUE_TOKENS: 0}, "gpt-5.1-codex")
    assert with_item - without == len(BLOB) * 3 // 16
    # Unchanged, it is written back byte for byte.
    raw = orjson.dumps(resp.body(items))
    assert RESPONSES.write(raw, parsed, list(parsed.history)) == raw


def test_an_anthropic_compaction_block_marks_its_message() -> None:
    messages = [anth.user("go"), *anth.turn(1, "out"),
                {"role": "assistant", "content": [BLOCK, {"type": "text", "text": "resuming"}]},
                anth.user("more")]
    parsed = MESSAGES.parse(orjson.dumps(anth.body(messages)), 1000)
    marked = [k for k, m in enumerate(parsed.history) if m.get(NATIVE) == native.COMPACTION]
    assert len(marked) == 1
    assert parsed.history[marked[0]]["content"] == "resuming"
    assert native.head(parsed.history) == marked[0] + 1
    # In context: the system field, then from the compaction block on.
    assert list(native.in_context(parsed.history)) == [parsed.history[0], *parsed.history[marked[0]:]]


@pytest.mark.parametrize(("api", "extra", "expected"), [
    ("responses", {"input": [resp.user("x"), TRIGGER]}, native.Native(compacts=True)),
    ("responses", {"input": [resp.user("x")],
                   "context_management": [{"type": "compaction", "compact_threshold": 200000}]},
     native.Native(compacts=True)),
    ("responses", {"input": [resp.user("x"), COMPACTION]}, native.Native()),
    ("messages", {"context_management": CLAUDE_CODE_EDITS}, native.Native()),
    ("messages", {"context_management": {"edits": [
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 30000},
         "keep": {"type": "tool_uses", "value": 3}}]}},
     native.Native(clears_tool_results=True)),
    ("messages", {"context_management": {"edits": [{"type": "compact_20260112"}]}},
     native.Native(compacts=True)),
    ("messages", {"context_management": {"edits": [{"type": "some_future_edit_20270101"}]}},
     native.Native()),
    ("chat", {"context_management": {"edits": [{"type": "compact_20260112"}]}}, native.Native()),
])
def test_what_the_client_asked_the_provider_to_do(
    api: str, extra: dict[str, Any], expected: native.Native
) -> None:
    assert native.native(view(api, {"model": "m", **extra}, [])) == expected


# --- Responses through the proxy --------------------------------------------------------------


def test_ctxproxy_compaction_keeps_the_compaction_item_and_summarizes_only_after_it(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    resp.summarizing(fake)
    srv = make_proxy({"compaction": {"context_windows": {"gpt-5.1-codex": WINDOW}}})
    items = after_compaction(20)
    r = resp.post(srv, resp.body(items))
    assert r.status_code == 200 and r.headers["x-ctxproxy-compacted"] == "1"
    sent = fake.received[-1]
    out = sent.json()["input"]
    k = items.index(COMPACTION)
    assert out[: k + 1] == items[: k + 1]  # the head, through the compaction item
    assert posted_item(sent.body, COMPACTION)  # byte for byte
    summaries = [i for i, x in enumerate(out) if x.get("role") == "developer"
                 and resp.SUMMARY_HEADING in str(x.get("content"))]
    assert len(summaries) == 1 and summaries[0] > k
    # The compaction item's unit (its run and the output of its call) stays before the summary.
    assert [x["type"] for x in out[k: summaries[0]]] == \
        ["compaction", "reasoning", "function_call", "function_call_output"]
    kept = out[summaries[0] + 1:]
    assert kept == items[len(items) - len(kept):]
    for item in kept:
        assert posted_item(sent.body, item)


def test_the_output_in_the_compaction_items_turn_is_never_cut_harder(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """Codex after a remote compaction: the first call after the item rides in its turn; its
    output (12 KB: over stage 2's budget, under stage 1's) keeps its stage-1 form when ctxproxy
    later summarizes the turns after it."""
    resp.summarizing(fake)
    srv = make_proxy({"compaction": {"context_windows": {"gpt-5.1-codex": WINDOW}}})
    items = after_compaction(20)
    k = items.index(COMPACTION)
    first = next(i for i in range(k, len(items)) if items[i]["type"] == "function_call_output")
    items[first] = {**items[first], "output": "first output line\n" * 700}  # 12.6 KB
    r = resp.post(srv, resp.body(items))
    assert r.status_code == 200 and r.headers["x-ctxproxy-compacted"] == "1"
    sent = fake.received[-1]
    out = sent.json()["input"]
    assert out[: first + 1] == items[: first + 1]
    assert posted_item(sent.body, items[first])  # byte for byte, not re-cut


def test_the_threshold_counts_from_the_newest_compaction_item(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    resp.summarizing(fake)
    srv = make_proxy({"compaction": {"context_windows": {"gpt-5.1-codex": WINDOW}}})
    before = resp.long_session(20)[2:]  # ~20k tokens the provider no longer reads
    older = {**COMPACTION, "id": "cmp_old", "encrypted_content": "b2xk" * 50}
    items = [resp.dev("You are a coding agent."), older, *before, COMPACTION,
             *resp.turn(99, "short"), resp.user("next")]
    r = resp.post(srv, resp.body(items))
    assert r.status_code == 200 and r.headers["x-ctxproxy-compacted"] == "0"
    assert fake.received[-1].body == orjson.dumps(resp.body(items))  # untouched
    assert int(r.headers["x-ctxproxy-tokens-in"]) > WINDOW  # what was sent, all of it
    # Without the compaction item the same history is over the threshold and compacted.
    plain = [i for i in items if i.get("type") != "compaction"]
    r2 = resp.post(srv, resp.body(plain))
    assert r2.headers["x-ctxproxy-compacted"] == "1"


def test_a_compaction_trigger_request_is_never_compacted_by_ctxproxy(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    resp.summarizing(fake)
    srv = make_proxy({"compaction": {"context_windows": {"gpt-5.1-codex": WINDOW}}})
    items = [*resp.long_session(20), TRIGGER]
    r = resp.post(srv, resp.body(items, stream=True))
    assert r.status_code == 200 and r.headers["x-ctxproxy-compacted"] == "0"
    assert [q.path for q in fake.received] == [resp.RESPONSES_PATH]  # no summarizer call
    out = fake.received[-1].json()["input"]
    assert out[-1] == TRIGGER
    assert not any(resp.SUMMARY_HEADING in str(x.get("content")) for x in out)
    # The same history without the trigger is compacted (the test can fail).
    r2 = resp.post(srv, resp.body(items[:-1]))
    assert r2.headers["x-ctxproxy-compacted"] == "1"


def test_server_side_compaction_makes_ctxproxy_stand_down(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    resp.summarizing(fake)
    srv = make_proxy({"compaction": {"context_windows": {"gpt-5.1-codex": WINDOW}}})
    cm = [{"type": "compaction", "compact_threshold": 6000}]
    raw = orjson.dumps(resp.body(resp.long_session(20), context_management=cm))
    r = resp.post(srv, raw)
    assert r.headers["x-ctxproxy-compacted"] == "0"
    assert fake.received[-1].body == raw


def test_unknown_items_survive_byte_for_byte_around_a_compaction(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    resp.summarizing(fake)
    # Without the proxy's read tool: the read loop re-serializes the whole body to add it
    # (proxy.retrieval), which keeps every value but not the client's formatting.
    srv = make_proxy({"compaction": {"context_windows": {"gpt-5.1-codex": WINDOW}},
                      "retrieval": {"mode": "none"}})
    items = after_compaction(20)
    odd = b'{"type":"future_item", "x": [1, 2.50, null],"z":"\\u00e9"}'
    k = items.index(COMPACTION)
    raw_items = [orjson.dumps(i) for i in items]
    raw_items.insert(k, odd)  # before the compaction item: in the head
    raw_items.append(odd.replace(b"future_item", b"future_item_2"))  # in the kept tail
    raw = (b'{"model":"gpt-5.1-codex","store":false,"input":[' + b",".join(raw_items)
           + b'],"x_unknown":{"keep": true}}')
    r = resp.post(srv, raw)
    assert r.headers["x-ctxproxy-compacted"] == "1"
    sent = fake.received[-1].body
    assert odd in sent and odd.replace(b"future_item", b"future_item_2") in sent
    assert b'"x_unknown":{"keep": true}' in sent


# --- Anthropic through the proxy --------------------------------------------------------------


def test_anthropic_compaction_block_is_kept_and_only_what_follows_is_summarized(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    anth.summarizing(fake)
    srv = make_proxy({"compaction": {"context_windows": {anth.MODEL: WINDOW}}})
    compacted = {"role": "assistant", "content": [BLOCK, {"type": "text", "text": "Resuming."}]}
    messages = [anth.user("fix the build"), *anth.turn(0, "before " * 3000), compacted,
                anth.user("go on")]
    for n in range(1, 20):
        messages += anth.turn(n, f"step {n} output: " + "word " * 400)
    payload = anth.body(messages, context_management=CLAUDE_CODE_EDITS)
    r = anth.post(srv, payload)
    assert r.status_code == 200 and r.headers["x-ctxproxy-compacted"] == "1"
    sent = anth.model_calls(fake)[-1]
    raw = fake.received[-1].body
    out = sent["messages"]
    k = messages.index(compacted)
    assert out[: k + 1] == messages[: k + 1]
    assert orjson.dumps(compacted) in raw  # byte for byte
    assert sent["context_management"] == CLAUDE_CODE_EDITS
    # The summary: never in the system field; the first text of the user turn right after
    # the compaction block's turn.
    assert resp.SUMMARY_HEADING not in str(sent["system"])
    lead = out[k + 1]
    assert lead["role"] == "user" and lead["content"][0]["text"].startswith(resp.SUMMARY_HEADING)
    assert not any(resp.SUMMARY_HEADING in str(m["content"]) for m in out[:k + 1])
    assert len(out) - k - 2 < len(messages) - k - 1  # the turns after the block were compacted
    anth.check_pairs(out)


def test_anthropic_server_compaction_makes_ctxproxy_stand_down(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    anth.summarizing(fake)
    srv = make_proxy({"compaction": {"context_windows": {anth.MODEL: WINDOW}}})
    edits = {"edits": [{"type": "compact_20260112",
                        "trigger": {"type": "input_tokens", "value": 50000}}]}
    r = anth.post(srv, anth.body(anth.long_session(20), context_management=edits))
    assert r.headers["x-ctxproxy-compacted"] == "0"
    assert len(fake.received) == 1  # no summarizer call
    r2 = anth.post(srv, anth.body(anth.long_session(20)))
    assert r2.headers["x-ctxproxy-compacted"] == "1"


def test_clear_tool_uses_stands_stage_two_down_but_not_stage_one(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    srv = make_proxy({"offload": {"recent_n": 1, "age_policy": "eager"},
                      "compaction": {"enabled": False}})
    mid = anth.big("a", 300)  # ~25 KB: under stage 1, over stage 2
    other = anth.big("b", 300)  # another one (the same one twice would be a duplicate)
    huge = anth.big("h", 3000)  # over stage 1
    messages = [anth.user("go"), *anth.turn(1, mid), *anth.turn(2, other), *anth.turn(3, huge),
                anth.user("and?")]

    def results(extra: dict[str, Any]) -> list[int]:
        anth.post(srv, anth.body(messages, **extra))
        out = fake.received[-1].json()["messages"]
        return [len(m["content"][0]["content"]) for m in out if m["role"] == "user"
                and m["content"][0].get("type") == "tool_result"]

    aged = results({})
    clearing = {"edits": [{"type": "clear_tool_uses_20250919"}]}
    cleared = results({"context_management": clearing})
    assert aged[0] < 4000 and aged[1] < 4000  # stage 2 on its own
    assert cleared[:2] == [len(mid), len(other)]  # the provider clears them: untouched
    assert cleared[2] < len(huge)  # stage 1 still cuts the huge output on arrival
    assert fake.received[-1].json()["context_management"] == clearing


def test_claude_codes_default_edits_pass_through_untouched(
    proxy: Any, fake: FakeUpstream
) -> None:
    payload = anth.body([anth.user("hello")], context_management=CLAUDE_CODE_EDITS)
    del payload["tools"]  # an agent's tools get the proxy's read tool added from the start
    raw = orjson.dumps(payload)
    r = anth.post(proxy, raw)
    assert r.status_code == 200
    assert fake.received[-1].body == raw


# --- the planner, pure --------------------------------------------------------------------------


def planner() -> Planner:
    config = config_from_mapping({})
    return Planner(config.compaction, RequestCounter(TokenCounter()),
                   ContextWindows({"gpt-5.1-codex": WINDOW}), None)


def planned(items: list[dict[str, Any]]) -> tuple[Planner, list[Any], RequestView]:
    raw = orjson.dumps(resp.body(items))
    parsed = RESPONSES.parse(raw, 10_000)
    request = RequestView(model=parsed.model, body=parsed.body, identity=resolve({}, parsed.body),
                          chains=[f"c{i}" for i in range(len(parsed.history))],
                          history=parsed.history, tools=parsed.tools, api="responses")
    return planner(), parsed.history, request


def test_the_plan_starts_after_the_compaction_unit_and_counts_from_the_item() -> None:
    p, history, request = planned(after_compaction(20))
    decision = p.plan(history, request, None)
    assert decision.over and decision.need is not None
    assert decision.need.head == decision.need.start == native.head(history) == 4
    assert decision.tokens == p.counter.request(native.in_context(history), request.model,
                                                request.tool_schemas)
    # A plan prepared when the head was shorter (before the provider compacted) is not used.
    stale = Plan(1, 1, decision.need.cut, decision.need.cut_chain, None)
    assert p.plan(history, request, None, prepared=stale).need == decision.need
    # The trigger: over the threshold, yet nothing to do for ctxproxy.
    p2, history2, request2 = planned([*after_compaction(20), TRIGGER])
    stood_down = p2.plan(history2, request2, None)
    assert stood_down.tokens > stood_down.budget.threshold
    assert not stood_down.over and stood_down.need is None and stood_down.prepare is None

"""The real Codex CLI, headless, through the proxy to the fake upstream: a multi-turn shell-tool
session whose outputs are offloaded, aged and compacted, with the WebSocket attempt refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from harness.codex import Recording, ShellScript, codex_binary, run_codex, write_codex_home
from proxy import rawjson as json
from proxy.app import create_app
from proxy.compaction.guard import parse_ledgers
from proxy.compaction.message import SUMMARY_HEADING
from proxy.demo.fake.own_calls import own_call
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import serve_in_thread
from proxy.model import content_text
from proxy.truncation.notice import parse_notice

from .conftest import proxy_config
from .test_compaction import SUMMARY

CODEX = codex_binary()
pytestmark = pytest.mark.skipif(CODEX is None, reason="Codex CLI not installed (npm ci installs it)")

MODEL = "gpt-5.1-codex"
WINDOW = 24_000
CONFIG: dict[str, Any] = {
    "compaction": {"context_windows": {MODEL: WINDOW}},
    "offload": {"recent_max_bytes": 8000, "old_max_bytes": 1500},
}
COMMANDS = ["seq 1 40000", "seq 100000 140000", "yes codex-line | head -n 30000",
            "seq 200000 230000", "seq 300000 330000", "echo done"]


def pairs_problems(items: list[dict[str, Any]]) -> list[str]:
    calls = [i["call_id"] for i in items if i.get("type") in ("function_call", "custom_tool_call")]
    outputs = [i["call_id"] for i in items
               if i.get("type") in ("function_call_output", "custom_tool_call_output")]
    return [] if calls == outputs else [f"calls {calls} != outputs {outputs}"]


def test_codex_session_is_offloaded_aged_and_compacted(
    fake: FakeUpstream, fake_url: str, tmp_path: Path
) -> None:
    assert CODEX is not None
    script = ShellScript(COMMANDS, SUMMARY)
    fake.responder = script
    app = Recording(create_app(proxy_config(fake_url, tmp_path / "data", CONFIG)))
    with serve_in_thread(app, lifespan="on") as srv:
        write_codex_home(tmp_path / "home", srv.url, MODEL)
        done = run_codex(CODEX, tmp_path / "home", tmp_path / "work", "run the steps")
        srv.drain()
    assert done.returncode == 0, done.stderr[-2000:]
    assert script.final in done.stdout

    # The WebSocket attempt got a 426 and Codex went to HTTPS at once: no reconnect rounds.
    assert app.websocket_attempts == 1
    assert "Reconnecting" not in done.stderr

    forwarded = [r.json() for r in fake.received if r.path.endswith("/responses")
                 and own_call(r.json()) is None]
    assert len(app.turns) == len(forwarded) == len(COMMANDS) + 1
    # Summarized through the Responses API (gpt-5.x-codex is not on chat completions).
    assert script.summaries >= 1 and not [r for r in fake.received if "chat" in r.path]
    budget = int(0.75 * WINDOW)
    for turn, sent in zip(app.turns, forwarded, strict=True):
        assert pairs_problems(sent["input"]) == []
        # Reasoning items travel as Codex sent them (encrypted content untouched) or not at all.
        sent_reasoning = [i for i in sent["input"] if i.get("type") == "reasoning"]
        client_reasoning = [i for i in turn.body["input"] if i.get("type") == "reasoning"]
        assert all(r in client_reasoning for r in sent_reasoning)
        assert all(r.get("encrypted_content") for r in sent_reasoning)
        # Codex's own fields travel unchanged; its tools lead, the read tool may follow.
        assert {k: v for k, v in sent.items() if k not in ("input", "tools")} == \
            {k: v for k, v in turn.body.items() if k not in ("input", "tools")}
        assert sent["tools"][:len(turn.body["tools"])] == turn.body["tools"]
        assert [t.get("name") for t in sent["tools"][len(turn.body["tools"]):]] in \
            ([], ["read_offloaded"])
        assert turn.tokens()[1] <= budget
    offloaded = [sum(1 for i in s["input"] if i.get("type") == "function_call_output"
                     and isinstance(i["output"], str) and parse_notice(i["output"]))
                 for s in forwarded]
    assert max(offloaded) >= 1, "no output was cut"
    summarized = [any(i.get("role") == "developer" and SUMMARY_HEADING in str(i.get("content"))
                      for i in s["input"]) for s in forwarded]
    assert any(summarized), "no forwarded request carried a summary"
    assert [t.headers["x-ctxproxy-compacted"] == "1" for t in app.turns] == summarized
    # The guard pins the user's own request, not Codex's AGENTS.md or environment messages.
    summary = next(content_text(i.get("content")) for i in forwarded[-1]["input"]
                   if i.get("role") == "developer" and SUMMARY_HEADING in str(i.get("content")))
    pinned = parse_ledgers(summary)
    assert pinned is not None and pinned.first == "run the steps"
    tokens_in, tokens_out = app.turns[-1].tokens()
    assert tokens_in > WINDOW > tokens_out  # the history outgrew the window; the request did not
    assert forwarded[-1]["input"][-1]["call_id"] == f"call_step_{len(COMMANDS) - 1}"


def test_codexs_next_request_gets_the_proxys_read_round_back(
    fake: FakeUpstream, fake_url: str, tmp_path: Path
) -> None:
    """Codex resends the answer without the proxy's read round before it: the proxy puts the
    round (its reasoning item, call and output) back in front of the answer, as it sent them."""
    assert CODEX is not None
    steps: list[str] = []

    def model(body: dict[str, Any]) -> Reply:
        if own_call(body) is not None:
            return Reply(content=SUMMARY)
        last = body["input"][-1]
        offered = any(t.get("name") == "read_offloaded" for t in body.get("tools") or [])
        args = {"max_output_tokens": 100_000, "yield_time_ms": 10_000}
        if not steps:
            steps.append("seq")
            return Reply(content=None, reasoning="I count", tool_calls=[
                {"name": "exec_command", "id": "call_step_0", "arguments": {"cmd": "seq 1 40000", **args}}])
        if offered and steps == ["seq"]:
            steps.append("read")
            return Reply(content=None, reasoning="the middle was cut; I read on", tool_calls=[
                {"name": "read_offloaded", "id": "call_ours",
                 "arguments": {"file_path": "tool_result/x.txt"}}])
        if last.get("call_id") == "call_ours":
            steps.append("answer")
            return Reply(content=None, reasoning="one more command", tool_calls=[
                {"name": "exec_command", "id": "call_step_1", "arguments": {"cmd": "echo done", **args}}])
        steps.append("final")
        return Reply(content="All steps done.", reasoning="every step ran")

    fake.responder = model
    app = Recording(create_app(proxy_config(fake_url, tmp_path / "data", CONFIG)))
    with serve_in_thread(app, lifespan="on") as srv:
        write_codex_home(tmp_path / "home", srv.url, MODEL)
        done = run_codex(CODEX, tmp_path / "home", tmp_path / "work", "run the steps")
        srv.drain()
    assert done.returncode == 0, done.stderr[-2000:]
    assert steps == ["seq", "read", "answer", "final"]
    raw = [r.body for r in fake.received if r.path.endswith("/responses")
           and own_call(r.json()) is None]
    items = [[bytes(i) for i in json.array_items(json.members(b)["input"])] for b in raw]
    # The loop's own second round (its input ends with the proxy's read result), the round
    # before it, and Codex's next request holding the answer (found by content: Codex may
    # send other requests in between).
    n = next(k for k, it in enumerate(items) if b'"call_ours"' in it[-1])
    loop = items[n]
    internal = loop[len(items[n - 1]):]
    assert [orjson.loads(i)["type"] for i in internal] == [
        "reasoning", "function_call", "function_call_output"]
    later = next(it for it in items[n + 1:] if b'"call_step_1"' in b"".join(it))
    at = later.index(internal[0])
    assert later[at:at + 3] == internal  # byte for byte
    answer = [orjson.loads(i) for i in later[at + 3:at + 5]]
    assert [(i["type"], i.get("call_id")) for i in answer] == [
        ("reasoning", None), ("function_call", "call_step_1")]  # then the answer Codex has
    assert pairs_problems([orjson.loads(i) for i in later]) == []

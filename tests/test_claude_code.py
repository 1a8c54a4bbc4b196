"""Claude Code 2.x, headless, through the proxy: a multi-turn agent session whose ``Read``
results age and get compacted, with every forwarded request still one the provider accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.compaction.message import SUMMARY_HEADING
from proxy.formats import json
from proxy.pipeline.notice import parse_notice
from proxy.testing.claude_code import FINAL, MODEL, claude_binary, markers, run_session
from proxy.testing.fake_upstream import FakeUpstream, Reply

from .conftest import proxy_config
from .test_messages import check_pairs

BINARY = claude_binary(Path(__file__).resolve().parent.parent)


@pytest.mark.skipif(BINARY is None, reason="Claude Code is not installed (npm ci installs it)")
def test_a_claude_code_session_ages_and_compacts(
    fake: FakeUpstream, fake_url: str, tmp_path: Path
) -> None:
    assert BINARY is not None
    config = proxy_config(fake_url, tmp_path / "data",
                          {"compaction": {"context_windows": {MODEL: 120000}}})
    # ~34 KB per Read: under stage 1's cut, so what shrinks them is ageing and compaction.
    session = run_session(BINARY, config, fake, fake_url.removesuffix("/v1"), reads=10, lines=500)
    assert session.returncode == 0, session.stderr[-2000:]
    assert FINAL in session.stdout
    sent = session.forwarded
    assert len(sent) >= 11  # ten reads and the answer
    # Read results reached the model whole, and aged ones were cut to stage 2's size.
    results = [b["content"] for body in sent for m in body["messages"] if m["role"] == "user"
               and isinstance(m["content"], list) for b in m["content"]
               if b.get("type") == "tool_result" and isinstance(b.get("content"), str)]
    aged = [r for r in results if parse_notice(r) is not None]
    assert aged and all(len(r) < 4000 for r in aged)
    assert any(len(r) > 30_000 for r in results)
    compacted = [b for b in sent if any(isinstance(s, dict) and s.get("text", "").startswith(
        SUMMARY_HEADING) for s in b.get("system") or [])]
    assert compacted and any(t.get("x-ctxproxy-compacted") == "1" for t in session.turns)
    for body in compacted:  # Claude Code's environment (in its first request) is not lost
        assert "Primary working directory" in str(body["system"]) + str(body["messages"])
    for body in sent:
        check_pairs([m for m in body["messages"] if m["role"] != "system"])
        for m in body["messages"]:
            for b in m["content"] if m["role"] == "assistant" else ():
                if b.get("type") == "thinking":  # as the fake signed it, never edited
                    assert b["signature"] in session.signatures
    assert max(markers(session)) <= 4
    # Once compacted, the forwarded session stays near its budget while the client's grows.
    last = session.turns[-1]
    assert int(last["x-ctxproxy-tokens-out"]) < int(last["x-ctxproxy-tokens-in"]) // 2


@pytest.mark.skipif(BINARY is None, reason="Claude Code is not installed (npm ci installs it)")
def test_claude_codes_next_request_gets_the_proxys_read_round_back(
    fake: FakeUpstream, fake_url: str, tmp_path: Path
) -> None:
    """The real client's next request holds the answer but not the proxy's read round before
    it (and has moved its cache_control marker on): the proxy recognises the answer and puts
    the round back in front of it, signed thinking and all."""
    assert BINARY is not None
    steps: list[str] = []

    def model(req: dict[str, Any]) -> Reply:
        last = req["messages"][-1]["content"]
        ours = isinstance(last, list) and any(
            b.get("type") == "tool_result" and b.get("tool_use_id") == "toolu_ours" for b in last)
        offered = any(t.get("name") == "read_offloaded" for t in req["tools"])
        if not steps:  # an output the client cannot read again: offloaded, the tool offered
            steps.append("bash")
            return Reply(content=None, reasoning="I list the records",
                         tool_calls=[{"name": "Bash", "id": "toolu_cat",
                                      "arguments": {"command": "cat data0.txt"}}])
        if offered and steps == ["bash"]:
            steps.append("read")
            return Reply(content=None, reasoning="the middle was cut; I read on",
                         tool_calls=[{"name": "read_offloaded", "id": "toolu_ours",
                                      "arguments": {"file_path": "tool_result/x.txt"}}])
        if ours:
            steps.append("answer")
            return Reply(content="Checking once more.", reasoning="read it; one more command",
                         tool_calls=[{"name": "Bash", "id": "toolu_wc",
                                      "arguments": {"command": "wc -l data0.txt"}}])
        steps.append("final")
        return Reply(content=FINAL, reasoning="done")

    config = proxy_config(fake_url, tmp_path / "data",
                          {"offload": {"recent_max_bytes": 4000, "slack_bytes": 100}})
    # ~19 KB of output: under Claude Code's own limit for keeping it in the conversation.
    session = run_session(BINARY, config, fake, fake_url.removesuffix("/v1"), reads=1,
                          lines=250, model=model)
    assert session.returncode == 0, session.stderr[-2000:]
    assert FINAL in session.stdout and steps == ["bash", "read", "answer", "final"]
    rounds = [n for n, body in enumerate(session.forwarded) if any(
        b.get("type") == "tool_use" and b.get("name") == "read_offloaded"
        for m in body["messages"] if m["role"] == "assistant" for b in m["content"])]
    assert rounds == [2, 3]  # the loop's own second round, then the client's next request
    loop, later = (orjson.loads(session.raw_forwarded[n]) for n in rounds)
    internal = loop["messages"][-2:]
    assert later["messages"][-4:-2] == internal  # the round, then the answer and its result
    raw = [json.array_items(json.members(session.raw_forwarded[n])["messages"]) for n in rounds]
    assert [bytes(i) for i in raw[1][-4:-2]] == [bytes(i) for i in raw[0][-2:]]  # byte for byte
    assert [[b["type"] for b in m["content"]] for m in later["messages"][-2:]] == [
        ["thinking", "thinking", "text", "tool_use"], ["tool_result"]]
    for body in session.forwarded:
        check_pairs([m for m in body["messages"] if m["role"] != "system"])

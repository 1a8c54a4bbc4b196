"""Claude Code 2.x, headless, through the proxy: a multi-turn agent session whose ``Read``
results age and get compacted, with every forwarded request still one the provider accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.compaction.message import SUMMARY_HEADING
from proxy.pipeline.notice import parse_notice
from proxy.testing.claude_code import FINAL, MODEL, claude_binary, markers, run_session
from proxy.testing.fake_upstream import FakeUpstream

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
    compacted = [b for b in sent if any(
        m["role"] == "system" and SUMMARY_HEADING in str(m["content"]) for m in b["messages"])]
    assert not any(SUMMARY_HEADING in str(b.get("system")) for b in sent)  # never edited
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

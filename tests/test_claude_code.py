"""Claude Code 2.x, headless, through the proxy: a multi-turn agent session whose ``Read``
results age and get compacted, with every forwarded request still one the provider accepts;
and the same on a model with preserved thinking, in front of the fake that enforces Anthropic's
prefix check (how many forwarded requests it refuses)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from harness.claude_code import (
    FINAL,
    MODEL,
    PRESERVED_THINKING_MODEL,
    Session,
    claude_binary,
    markers,
    run_prefix_checked_session,
    run_session,
)
from proxy import rawjson as json
from proxy.compaction.guard import parse_ledgers
from proxy.compaction.message import SUMMARY_HEADING
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import serve_in_thread
from proxy.truncation.notice import parse_notice

from .conftest import proxy_config
from .test_messages import check_pairs, lead_summary

BINARY = claude_binary(Path(__file__).resolve().parent.parent)


@pytest.mark.skipif(BINARY is None, reason="Claude Code is not installed (npm ci installs it)")
def test_a_claude_code_session_ages_and_compacts(
    fake: FakeUpstream, fake_url: str, tmp_path: Path
) -> None:
    assert BINARY is not None
    # Quote protection keeps the newest read of edited files only (this session edits none).
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
    compacted = [b for b in sent if lead_summary(b) is not None]
    assert not any(SUMMARY_HEADING in str(b.get("system")) for b in sent)  # never edited
    assert compacted and any(t.get("x-ctxproxy-compacted") == "1" for t in session.turns)
    # The guard pins the user's own request, without the blocks Claude Code wraps around it.
    summary = lead_summary(compacted[-1])
    assert summary is not None
    pinned = parse_ledgers(summary)
    assert pinned is not None and pinned.first is not None
    assert pinned.first.startswith("Read each of the files data0.txt") and "<" not in pinned.first
    for body in compacted:  # Claude Code's environment (in its first request) is not lost
        assert "Primary working directory" in str(body["system"]) + str(body["messages"])
    for body in sent:
        check_pairs(body["messages"])
        for m in body["messages"]:
            for b in m["content"] if m["role"] == "assistant" else ():
                if b.get("type") == "thinking":  # as the fake signed it, never edited
                    assert b["signature"] in session.signatures
    assert max(markers(session)) <= 4
    # Once compacted, the forwarded session stays near its budget while the client's grows.
    last = session.turns[-1]
    assert int(last["x-ctxproxy-tokens-out"]) < int(last["x-ctxproxy-tokens-in"]) // 2


# --- preserved thinking: the prefix-checking fake (proxy/demo/fake/prefix_check.py) -----------


@pytest.fixture(scope="module")
def nine_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    """Claude Code on a model with preserved thinking reading nine 1,200-line files (~88 KB
    each: stage 1 cuts every one) through a default proxy with a 120k window (it compacts
    from the fourth turn), in front of a fake that refuses a thinking block whose prefix
    changed. Its own fake: the two tests below read one session."""
    assert BINARY is not None
    fake = FakeUpstream(prefix_check=True)
    with serve_in_thread(fake) as upstream:
        config = proxy_config(upstream.url + "/v1", tmp_path_factory.mktemp("cc") / "data",
                              {"compaction": {"context_windows": {PRESERVED_THINKING_MODEL:
                                                                  120_000}}})
        yield run_prefix_checked_session(BINARY, config, fake, upstream.url)


def thinking_sent_back(session: Session) -> int:
    """How many forwarded requests carry a thinking block back (so the check had work)."""
    return sum(any(b.get("type") == "thinking" for m in body["messages"]
                   if m["role"] == "assistant" for b in m["content"])
               for body in session.forwarded)


@pytest.mark.skipif(BINARY is None, reason="Claude Code is not installed (npm ci installs it)")
def test_the_nine_file_session_cuts_compacts_and_finishes(nine_files: Session) -> None:
    """What the refusal count below is measured on: every Read cut at stage 1, compaction, a
    thinking block in every answer sent back, and the session finishing."""
    session = nine_files
    assert session.returncode == 0, session.stderr[-2000:]
    assert FINAL in session.stdout
    assert len(session.forwarded) >= 10  # nine reads and the answer (and any retries)
    offloaded = [int(t["x-ctxproxy-offloaded"]) for t in session.turns]
    assert offloaded[1] == 1 and max(offloaded) == 9  # each Read cut as it arrives
    assert any(t.get("x-ctxproxy-compacted") == "1" for t in session.turns)
    # Thinking goes back within each epoch; a compaction (every other turn here: Claude Code's
    # ~30k of system and tools in a 120k window) drops the kept turns' thinking.
    assert thinking_sent_back(session) >= 3
    for body in session.forwarded:
        assert body["model"] == PRESERVED_THINKING_MODEL


@pytest.mark.skipif(BINARY is None, reason="Claude Code is not installed (npm ci installs it)")
def test_preserved_thinking_nine_files_no_request_is_refused(nine_files: Session) -> None:
    """The provider never refuses a forwarded request for a thinking block whose prefix the
    proxy changed (Claude Code would retry it without thinking: one more request each)."""
    session = nine_files
    assert session.returncode == 0 and FINAL in session.stdout
    refused = [f"forwarded[{i}] ({change} changed): {message}" for (i, message), (_, change)
               in zip(session.refused, session.refused_changes, strict=True)]
    assert refused == [], f"{len(refused)} of {len(session.forwarded)} main requests refused"
    assert session.refused_other == []
    assert len(session.forwarded) == 10  # no retries


@pytest.mark.skipif(BINARY is None, reason="Claude Code is not installed (npm ci installs it)")
@pytest.mark.parametrize("model", [PRESERVED_THINKING_MODEL, MODEL])
def test_compacted_requests_are_valid_messages_on_every_model(model: str, tmp_path: Path) -> None:
    """Proxy defaults with an 80k window: from the first compaction on, every forwarded
    request starts with a user turn and carries a system role only where the model takes one
    (Claude Code's own, on claude-opus-5-5, right after the first user turn; none on
    claude-sonnet-4-5); nothing is refused by the prefix check, and Claude Code finishes."""
    assert BINARY is not None
    fake = FakeUpstream(prefix_check=True)
    with serve_in_thread(fake) as upstream:
        config = proxy_config(upstream.url + "/v1", tmp_path / "data",
                              {"compaction": {"context_windows": {model: 80_000}}})
        session = run_session(BINARY, config, fake, upstream.url, reads=9, model=model)
    assert session.returncode == 0 and FINAL in session.stdout, session.stderr[-2000:]
    assert session.refused == [] and session.refused_other == []
    compacted = [b for b in session.forwarded if lead_summary(b) is not None]
    assert len(compacted) >= 3
    for body in session.forwarded:
        check_pairs(body["messages"])
    systems = [m for b in session.forwarded for m in b["messages"] if m["role"] == "system"]
    if model == MODEL:
        assert systems == []
    else:  # Claude Code's environment, kept through every compaction
        assert all(any(m["role"] == "system" for m in b["messages"]) for b in compacted)


@pytest.mark.skipif(BINARY is None, reason="Claude Code is not installed (npm ci installs it)")
def test_claude_code_alone_is_never_refused(fake: FakeUpstream, fake_url: str) -> None:
    """The control: Claude Code talking to the prefix-checking fake itself is append-only (as
    the docs say), so a refusal above is the proxy's doing."""
    assert BINARY is not None
    session = run_prefix_checked_session(BINARY, None, fake, fake_url.removesuffix("/v1"),
                                         reads=4, lines=300)
    assert session.returncode == 0, session.stderr[-2000:]
    assert FINAL in session.stdout
    assert session.refused == [] and session.refused_other == []
    assert len(session.forwarded) == 5 and thinking_sent_back(session) == 4


@pytest.mark.skipif(BINARY is None, reason="Claude Code is not installed (npm ci installs it)")
def test_preserved_thinking_without_compaction_stage_two_refuses_nothing(
    tmp_path: Path,
) -> None:
    """Compaction off: stage 2's batched re-cuts are the only rewrites, each one an epoch of
    its own (pipeline.epoch.ageing_epoch): the turns before it lose their thinking."""
    assert BINARY is not None
    fake = FakeUpstream(prefix_check=True)
    with serve_in_thread(fake) as upstream:
        config = proxy_config(upstream.url + "/v1", tmp_path / "data",
                              {"compaction": {"enabled": False},
                               "offload": {"age_batch_bytes": 65536}})
        session = run_prefix_checked_session(BINARY, config, fake, upstream.url)
    assert session.returncode == 0 and FINAL in session.stdout
    results = [b["content"] for body in session.forwarded for m in body["messages"]
               if m["role"] == "user" and isinstance(m["content"], list) for b in m["content"]
               if b.get("type") == "tool_result" and isinstance(b.get("content"), str)]
    assert any(len(r) < 4000 for r in results)  # stage 2 did re-cut
    assert session.refused == [] and session.refused_other == []
    assert len(session.forwarded) == 10  # no retries


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
                          lines=250, answer=model)
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

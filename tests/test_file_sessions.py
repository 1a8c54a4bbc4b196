"""The real Claude Code and Codex CLIs, headless, re-reading and editing files through ctxproxy
(issue 22): a session of ~50 model turns that compacts several times (proxy/testing/
file_sessions.py has the project, the plan and the model).

Asserted: the session finishes, every edit and write is on disk (the client refuses an edit
whose quote is not in the file: the quoted text reached the model intact), nothing is refused
or retried, the session holds what each file-aware rule acts on, and each rule does what it
promises (re-reads as deltas, repeats as references, superseded reads as markers at a
compaction, a per-tool budget). The rules' tests failed before the rules were integrated (they
were strict xfails until then)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.claude_code import claude_binary
from harness.codex import codex_binary
from harness.file_sessions import FileSession, run_claude_session, run_codex_session, session_config
from proxy.config.offload import OffloadConfig
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import serve_in_thread
from proxy.truncation.notice import parse_notice

from .test_codex import pairs_problems
from .test_messages import check_pairs

ROOT = Path(__file__).resolve().parent.parent
BINARIES = {"claude": claude_binary(ROOT), "codex": codex_binary()}
SHELL_TOOLS = {"claude": "Bash", "codex": "exec_command"}
BUDGETED = "python3 tools/inventory.py"
PROTECTED = "--collect-only"
BUDGET = 1024
OFF = {"supersede_reads": False, "reread_deltas": False, "dedupe": False}


def policies() -> list[dict[str, Any]]:
    """The default policies (the edit tools protected), a stage-1 budget for the inventory
    listing, and the collect-only listing protected, for both clients' shell tools."""
    out = [p.model_dump() for p in OffloadConfig().policies]
    for tool in SHELL_TOOLS.values():
        out.append({"tool": tool, "command": BUDGETED + "*", "offload_max_bytes": BUDGET})
        out.append({"tool": tool, "command": f"*{PROTECTED}*", "protect": True})
    return out


def play(client: str, data_dir: Path, offload: dict[str, Any]) -> FileSession:
    """One session of ``client`` through a proxy with ``offload`` settings, in front of its own
    fake (the suite's shared one is reset per test)."""
    binary = BINARIES[client]
    if binary is None:
        pytest.skip(f"{client} CLI is not installed (npm ci installs it)")
    fake = FakeUpstream()
    with serve_in_thread(fake) as upstream:
        config = session_config(data_dir, upstream.url, {"offload": offload})
        run = run_claude_session if client == "claude" else run_codex_session
        done = run(binary, config, fake, timeout_s=240)
        assert fake.refused == []  # nothing the provider would refuse was forwarded
    return done


@pytest.fixture(scope="module", params=["claude", "codex"])
def session(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[FileSession]:
    """One session per client, the file-aware switches at their defaults and the policies
    above, read by every test below."""
    client = request.param
    yield play(client, tmp_path_factory.mktemp(client) / "data", {"policies": policies()})


@pytest.fixture(scope="module", params=["claude", "codex"])
def session_off(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                ) -> Iterator[FileSession]:
    """The same session with the three file-aware switches off."""
    client = request.param
    yield play(client, tmp_path_factory.mktemp(client + "-off") / "data", OFF)


def step_of(session: FileSession, command: str) -> list[int]:
    return [n for n, s in enumerate(session.plan) if s.kind == "shell" and command in s.command]


# --- what holds today -------------------------------------------------------------------------


def test_the_session_finishes_and_every_edit_lands(session: FileSession) -> None:
    assert session.finished, session.stderr[-3000:]
    assert len(session.sent) >= 50
    assert len(session.forwarded) == len(session.sent)  # no retries, nothing refused
    assert session.edits and all(e.landed for e in session.edits), [
        (e.step, e.path, e.result[:200]) for e in session.edits if not e.landed]
    assert not any(e.refused for e in session.edits)
    # Each edit quoted a line the model was shown: after a forced re-read at worst.
    assert not any(e.blind for e in session.edits)
    assert "ctxproxy-edit" in session.files["src/heap.py"]
    assert session.files["src/notes.py"].startswith('"""Maintenance notes')
    assert session.files["src/settings.py"].startswith('"""Settings for ledgerkit')


def test_every_forwarded_request_is_well_formed(session: FileSession) -> None:
    for body in session.forwarded:
        if session.client == "claude":
            check_pairs([m for m in body["messages"] if m["role"] != "system"])
        else:
            assert pairs_problems(body["input"]) == []


def test_the_session_holds_what_the_file_aware_rules_act_on(session: FileSession) -> None:
    """The cases the rules' tests below check exist in this session (so those fail for a
    rule's absence, not for want of cases), and hold whether or not the rules act: the earlier
    read or output is still forwarded as the client sent it when the repeat arrives."""
    assert len(session.compactions()) >= 2
    rereads = session.rereads()
    assert len(rereads) >= 4
    assert any(r.marks for r in rereads) and any(not r.marks for r in rereads)
    dups = [d for d in session.duplicates() if PROTECTED not in d.command]
    assert dups
    assert len(session.superseded()) >= 2


def test_a_protected_commands_repeat_is_forwarded_whole(session: FileSession) -> None:
    """``protect: true`` for the collect-only listing: never cut, marked or deduplicated (true
    today, and must stay true once deduplication is on)."""
    protected = [d for d in session.duplicates() if PROTECTED in d.command]
    assert protected
    for d in protected:
        assert d.forwarded == d.sent


def test_with_the_switches_off_ctxproxy_slims_as_before(session_off: FileSession) -> None:
    """``supersede_reads``, ``reread_deltas`` and ``dedupe`` off: re-reads and repeated outputs
    go as the client sent them, a superseded read whole or as stage 2 cut it (a notice), and
    every edit still lands."""
    session = session_off
    assert session.finished, session.stderr[-3000:]
    assert all(e.landed and not e.refused for e in session.edits)
    rereads, dups, superseded = session.rereads(), session.duplicates(), session.superseded()
    assert rereads and dups and superseded
    assert [r.step for r in rereads if r.forwarded != r.sent] == []
    assert [d.step for d in dups if d.forwarded != d.sent] == []
    assert [s.step for s in superseded
            if s.forwarded != s.sent and parse_notice(s.forwarded) is None] == []


# --- what the file-aware rules promise (issue 22) ---------------------------------------------


def test_a_reread_is_forwarded_as_a_delta(session: FileSession) -> None:
    """``offload.reread_deltas``: a re-read of a file whose earlier read is still forwarded
    whole goes as a marker (unchanged) or a diff (changed) that shows each edit made since."""
    for r in session.rereads():
        forwarded, sent = len(r.forwarded), len(r.sent)
        assert forwarded <= sent // 4, f"step {r.step}: {forwarded} of {sent} bytes forwarded"
        missing = [m for m in r.marks if m not in r.forwarded]
        assert missing == [], f"step {r.step}: the delta lacks the edits {missing}"


def test_a_repeated_output_is_forwarded_as_a_reference(session: FileSession) -> None:
    """``offload.dedupe``: a command's output repeating an earlier one still forwarded whole
    (the same grep; the test log with one test's result changed) goes with the repeated span
    as a reference; what differs is still there."""
    dups = [d for d in session.duplicates() if PROTECTED not in d.command]
    for d in dups:
        forwarded, sent = len(d.forwarded), len(d.sent)
        assert forwarded <= sent // 2, f"step {d.step}: {forwarded} of {sent} bytes forwarded"
        missing = [ln for ln in d.new_lines if ln not in d.forwarded]
        assert missing == [], f"step {d.step}: what differs is gone: {missing}"


def test_a_superseded_read_is_a_marker_after_a_compaction(session: FileSession) -> None:
    """``offload.supersede_reads``: at a compaction, a read that a later read of the same file
    (the same or a wider range) supersedes, and no edit quotes, is a one-line marker naming
    the file."""
    for s in session.superseded():
        name = session.plan[s.step].path.rsplit("/", 1)[-1]
        forwarded = len(s.forwarded)
        assert forwarded <= 800, f"step {s.step} at request {s.request}: {forwarded} bytes"
        assert name in s.forwarded, f"step {s.step} at request {s.request}: {name} not named"


def test_a_per_tool_budget_cuts_that_commands_output(session: FileSession) -> None:
    """``offload.policies``: the inventory listing (~10 KB) has a 1 KB stage-1 budget."""
    [n] = step_of(session, BUDGETED)
    sent = session.sent_results()[session.step_id(n)]
    first = session.first_forwarded(session.step_id(n))
    assert first is not None and len(sent) > 4 * BUDGET
    forwarded = len(session.forwarded_calls()[first][session.step_id(n)].result or "")
    assert forwarded <= 2 * BUDGET, f"{forwarded} of {len(sent)} bytes forwarded"

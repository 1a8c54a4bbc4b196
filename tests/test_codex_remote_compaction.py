"""The real Codex CLI (0.171.0) compacting remotely through the proxy: the fake provider answers
Codex's ``compaction_trigger`` request with one opaque ``compaction`` item, and the session goes
on, the item forwarded byte for byte in every later request; ctxproxy's own compaction, later,
summarizes only what follows it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from harness.codex import (
    Recording,
    RemoteCompaction,
    ShellScript,
    codex_binary,
    run_codex,
    write_codex_home,
)
from proxy import rawjson as json
from proxy.app import create_app
from proxy.compaction.message import SUMMARY_HEADING
from proxy.demo.fake.own_calls import own_call
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import serve_in_thread

from .conftest import proxy_config
from .test_codex import pairs_problems
from .test_compaction import SUMMARY

CODEX = codex_binary()
pytestmark = pytest.mark.skipif(CODEX is None, reason="Codex CLI not installed (npm ci installs it)")

MODEL = "gpt-5.1-codex"
# Ten small outputs (~1k tokens each): the provider compacts after the second (it reports a full
# context then), ctxproxy's 12k window fills again a few steps later.
COMMANDS = [*[f"seq {k}000 {k}300" for k in range(1, 11)], "echo done"]
WINDOW = 12_000


def is_summary(item: dict[str, Any]) -> bool:
    return item.get("role") == "developer" and SUMMARY_HEADING in str(item.get("content"))


def test_codex_remote_compaction_goes_through_untouched(
    fake: FakeUpstream, fake_url: str, tmp_path: Path
) -> None:
    assert CODEX is not None
    script = ShellScript(COMMANDS, SUMMARY)
    provider = RemoteCompaction(script, full_at=(1,))
    fake.responder = provider
    config: dict[str, Any] = {"compaction": {"context_windows": {MODEL: WINDOW}}}
    app = Recording(create_app(proxy_config(fake_url, tmp_path / "data", config)))
    with serve_in_thread(app, lifespan="on") as srv:
        # A limit no real request reaches: Codex compacts when the fake reports a full context.
        write_codex_home(tmp_path / "home", srv.url, MODEL, remote_compaction_at=1_000_000)
        done = run_codex(CODEX, tmp_path / "home", tmp_path / "work", "run the steps")
        srv.drain()
    assert done.returncode == 0, done.stderr[-2000:]
    assert script.final in done.stdout
    assert "Error running remote compact task" not in done.stderr + done.stdout

    forwarded = [r for r in fake.received if r.path.endswith("/responses")
                 and own_call(r.json()) is None]
    assert len(app.turns) == len(forwarded)
    assert provider.triggers == 1 and len(provider.blobs) == 1
    triggered = [k for k, t in enumerate(app.turns)
                 if t.body["input"][-1] == {"type": "compaction_trigger"}]
    assert len(triggered) == 1
    at = triggered[0]
    # The compaction request: ctxproxy neither compacted it nor changed a byte of its input
    # (nor of anything but ``tools``, where the proxy's read tool may follow Codex's).
    assert app.turns[at].headers["x-ctxproxy-compacted"] == "0"
    client, sent = json.members(app.turns[at].raw), json.members(forwarded[at].body)
    assert bytes(sent["input"]) == bytes(client["input"])
    assert {k: bytes(v) for k, v in sent.items() if k != "tools"} == \
        {k: bytes(v) for k, v in client.items() if k != "tools"}

    blob = provider.blobs[0]
    later = app.turns[at + 1:]
    assert len(later) >= len(COMMANDS) - 2  # the session went on after the compaction
    compacted_after = 0
    for turn, sent in zip(later, forwarded[at + 1:], strict=True):
        client = turn.body["input"]
        items = sent.json()["input"]
        assert pairs_problems(items) == []
        [k] = [i for i, item in enumerate(client) if item.get("type") == "compaction"]
        item = client[k]
        assert item["encrypted_content"] == blob
        # Byte for byte: Codex's serialization of the item is in what the provider got.
        raw_item = orjson.dumps(item)
        assert raw_item in turn.raw and raw_item in sent.body
        # The compaction item and everything before it went out exactly as Codex sent them.
        assert items[: k + 1] == client[: k + 1]
        if turn.headers["x-ctxproxy-compacted"] == "1":
            compacted_after += 1
            [s] = [i for i, x in enumerate(items) if is_summary(x)]
            assert s > k  # ctxproxy's summary only ever covers what follows the compaction
            tail = items[s + 1:]
            assert tail == client[len(client) - len(tail):]
    assert compacted_after >= 1, "ctxproxy never compacted after the provider did"
    assert not any(is_summary(i) for t in forwarded[: at + 1] for i in t.json()["input"])

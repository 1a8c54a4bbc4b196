"""The offload stage: two-stage truncation with lossless, deterministic files (docs/offload.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.inprocess import InProcess
from proxy.catalog.windows import ContextWindows
from proxy.compaction.compactor import NullCompactor
from proxy.compaction.planner import Planner
from proxy.config import Config, config_from_mapping
from proxy.demo.fake.upstream import FakeUpstream
from proxy.model import PipelineResult, RequestView
from proxy.offload.stage import Offloader
from proxy.pipeline.runner import Pipeline
from proxy.services import Services
from proxy.session import Identity
from proxy.store.tool_results import OffloadedFileMissing, ToolResultStore
from proxy.tokens.counter import TokenCounter
from proxy.tokens.request import RequestCounter
from proxy.truncation.cut import read_chunk, utf8_len
from proxy.truncation.notice import parse_notice, split_notice

from .conftest import InProcessFactory, examples

ID = Identity("t-tenant", "sess-1", None)


class SyncStage:
    """The pure stage with its effects carried out (originals saved, cuts whose original could
    not be saved undone), as the pipeline's runner does."""

    def __init__(self, stage: Offloader, store: ToolResultStore, cfg: Config) -> None:
        self.stage = stage
        self.pipeline = Pipeline(
            offloader=stage,
            planner=Planner(cfg.compaction, RequestCounter(TokenCounter()), ContextWindows({}), None),
            compactor=NullCompactor(), counter=RequestCounter(TokenCounter()), originals=store,
            timed_ageing=False, old_max_bytes=cfg.offload.old_max_bytes, stages=[stage],
        )

    def __call__(self, messages: list[dict[str, Any]], request: RequestView) -> PipelineResult:
        return asyncio.run(self.pipeline.run(dataclasses.replace(request, history=messages)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stage, name)


def make_stage(tmp_path: Path, **offload: Any) -> tuple[SyncStage, ToolResultStore, Config]:
    cfg = config_from_mapping({"offload": offload, "storage": {"data_dir": str(tmp_path)}})
    store = ToolResultStore(tmp_path, cfg.storage.tool_result_ttl_days)
    return SyncStage(Offloader(cfg.offload, cfg.retrieval, tmp_path), store, cfg), store, cfg


def view(messages: list[dict[str, Any]]) -> RequestView:
    return RequestView(model="gpt-4o", body={"messages": messages}, identity=ID)


def log_text(lines: int, tag: str = "") -> str:
    return "".join(f"{tag}line {i}: " + "x" * 60 + "\n" for i in range(1, lines + 1))


def turn(call_id: str, name: str, output: str, args: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": orjson.dumps(args or {}).decode()}}]},
        {"role": "tool", "tool_call_id": call_id, "content": output},
    ]


def files(root: Path) -> list[Path]:
    return sorted(root.rglob("tool_result/*.txt"))


def reconstruct(store: ToolResultStore, text: str, budget: int) -> str:
    """Follow the notice's hints chunk after chunk, as the read tool will."""
    excerpt, notice = split_notice(text)  # type: ignore[misc]
    rid = notice.file_path.removeprefix("tool_result/").removesuffix(".txt")
    original = store.read(ID.tenant, ID.session, rid)
    out = excerpt
    line, byte = notice.next_line, notice.next_byte
    while True:
        chunk = read_chunk(original, line, byte, budget, file_path=notice.file_path, tool=notice.tool)
        parsed = split_notice(chunk)
        if parsed is None:
            return out + chunk
        part, n = parsed
        out += part
        line, byte = n.next_line, n.next_byte


def test_stage1_cuts_saves_and_notice_names_the_file(tmp_path: Path) -> None:
    stage, store, cfg = make_stage(tmp_path)
    big = log_text(2000)  # ~140 KB
    msgs = [{"role": "user", "content": "go"}, *turn("c1", "bash", big)]
    out = stage(msgs, view(msgs))
    assert out.changed and out.stats["offloaded"] == 1 and out.stats["files_written"] == 1
    text = out.messages[2]["content"]
    excerpt, notice = split_notice(text)  # type: ignore[misc]
    assert utf8_len(excerpt) <= cfg.offload.recent_max_bytes
    assert notice.total_lines == 2000 and notice.tool == "read_offloaded"
    assert notice.file_path.startswith("tool_result/") and notice.file_path.endswith(".txt")
    [path] = files(tmp_path)
    assert path.read_text() == big
    assert path.parent.parent == tmp_path / ID.tenant / ID.session
    assert "\n<<<TRUNCATED>>>\nThe output above was truncated.\n" in text
    assert reconstruct(store, text, cfg.offload.recent_max_bytes) == big
    assert msgs[2]["content"] == big  # the input is never mutated


def test_small_results_pass_untouched(tmp_path: Path) -> None:
    stage, _, _ = make_stage(tmp_path)
    msgs = [{"role": "user", "content": "go"}, *turn("c1", "bash", "x" * 51200 + "y" * 100)]
    out = stage(msgs, view(msgs))
    assert not out.changed and out.messages is msgs and files(tmp_path) == []


def test_resend_writes_nothing_and_is_byte_identical(tmp_path: Path) -> None:
    stage, _, _ = make_stage(tmp_path)
    msgs = [{"role": "user", "content": "go"}, *turn("c1", "bash", log_text(3000)),
            *turn("c2", "bash", log_text(1500, "b"))]
    first = stage(msgs, view(msgs))
    again = stage(orjson.loads(orjson.dumps(msgs)), view(msgs))
    assert again.stats["files_written"] == 0
    assert orjson.dumps(first.messages) == orjson.dumps(again.messages)
    # A fresh stage (a restarted proxy) produces the same bytes too.
    fresh, _, _ = make_stage(tmp_path)
    third = fresh(orjson.loads(orjson.dumps(msgs)), view(msgs))
    assert third.stats["files_written"] == 0
    assert orjson.dumps(first.messages) == orjson.dumps(third.messages)


def test_same_output_in_other_session_gets_its_own_file(tmp_path: Path) -> None:
    stage, _, _ = make_stage(tmp_path)
    msgs = [{"role": "user", "content": "go"}, *turn("c1", "bash", log_text(2000))]
    stage(msgs, view(msgs))
    other = RequestView("m", {}, Identity("t-tenant", "sess-2", None))
    stage(msgs, other)
    assert len(files(tmp_path)) == 2


def _history(n_turns: int, lines: int = 1200) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
    for t in range(n_turns):
        msgs += turn(f"c{t}", "bash", log_text(lines, f"t{t}-"))
    return msgs


def _sizes(out: list[dict[str, Any]]) -> list[int]:
    return [utf8_len(m["content"]) for m in out if m["role"] == "tool"]


def test_eager_ageing_recuts_outside_recent_n(tmp_path: Path) -> None:
    stage, _, cfg = make_stage(tmp_path, age_policy="eager", recent_n=2)
    out = stage(_history(5), view(_history(5))).messages
    sizes = _sizes(out)
    assert all(s < cfg.offload.old_max_bytes + 1200 for s in sizes[:3])
    assert all(s > cfg.offload.recent_max_bytes for s in sizes[3:])
    assert len(files(tmp_path)) == 5  # one file per original, stage 2 reuses it
    fresh = stage(_history(1), view(_history(1))).messages[2]["content"]
    assert parse_notice(out[2]["content"]).file_path == parse_notice(fresh).file_path  # type: ignore[union-attr]


def test_parallel_results_age_together(tmp_path: Path) -> None:
    stage, _, _ = make_stage(tmp_path, age_policy="eager", recent_n=1)
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "x", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "y", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "b", "content": log_text(1500, "b")},
        {"role": "tool", "tool_call_id": "a", "content": log_text(1500, "a")},
        *turn("c", "z", log_text(1500, "c")),
    ]
    sizes = _sizes(stage(msgs, view(msgs)).messages)
    assert sizes[0] < 5000 and sizes[1] < 5000 and sizes[2] > 51200


def test_batched_ageing_waits_then_recuts_together(tmp_path: Path) -> None:
    # Each aged result saves ~48 KB; with a 130 KB threshold re-cuts happen in batches of 3.
    stage, _, _ = make_stage(tmp_path, recent_n=2, age_batch_bytes=130_000)
    prev: bytes | None = None
    changes = 0
    history_sizes = []
    for n in range(1, 12):
        msgs = _history(n)
        out = stage(msgs, view(msgs)).messages
        history_sizes.append(sum(_sizes(out)))
        forwarded = [orjson.dumps(m) for m in out]
        if prev is not None:
            old = orjson.loads(prev)
            if [orjson.dumps(m) for m in old] != forwarded[: len(old)]:
                changes += 1
        prev = orjson.dumps(out)
        aged = [s < 10_000 for s in _sizes(out)]
        # re-cut turns always form a prefix, and never include the recent_n newest
        assert aged == sorted(aged, reverse=True) and not any(aged[-2:])
    # 11 turns: 9 aged -> 3 batches of 3; the prefix changed only at those jumps
    assert changes == 3


def test_eager_changes_prefix_every_turn(tmp_path: Path) -> None:
    stage, _, _ = make_stage(tmp_path, recent_n=2, age_policy="eager")
    prev = None
    changes = 0
    for n in range(1, 8):
        msgs = _history(n)
        out = [orjson.dumps(m) for m in stage(msgs, view(msgs)).messages]
        if prev is not None and out[: len(prev)] != prev:
            changes += 1
        prev = out
    assert changes == 5  # requests 3..7 each age one more result


def test_markdown_protection(tmp_path: Path) -> None:
    stage, _, _ = make_stage(tmp_path, markdown_max_bytes=100_000, age_policy="eager", recent_n=0)
    md = "# Skill\n" + log_text(1000)  # ~70 KB
    msgs = [{"role": "user", "content": "go"},
            *turn("c1", "read_file", md, {"file_path": "/repo/SKILL.md"}),
            *turn("c2", "read_file", md, {"file_path": "/repo/skill.py"})]
    sizes = _sizes(stage(msgs, view(msgs)).messages)
    assert sizes[0] == utf8_len(md)  # under the markdown floor even though aged
    assert sizes[1] < 5000


def test_client_read_tool_notice_points_back(tmp_path: Path) -> None:
    stage, _, _ = make_stage(tmp_path)
    content = log_text(3000)
    msgs = [{"role": "user", "content": "go"},
            *turn("c1", "Read", content, {"file_path": "/abs/src/app.py", "offset": 101})]
    out = stage(msgs, view(msgs))
    notice = parse_notice(out.messages[2]["content"])
    assert notice is not None and notice.tool == "Read" and notice.file_path == "/abs/src/app.py"
    excerpt = split_notice(out.messages[2]["content"])[0]  # type: ignore[index]
    assert notice.next_line == 101 + excerpt.count("\n")
    assert "call `Read` with file_path=/abs/src/app.py offset=" in out.messages[2]["content"]
    assert len(files(tmp_path)) == 1  # a copy is still kept for /files


def test_existing_notice_is_not_offloaded_again(tmp_path: Path) -> None:
    stage, _, _ = make_stage(tmp_path, age_policy="eager", recent_n=1)
    msgs = [{"role": "user", "content": "go"}, *turn("c1", "bash", log_text(2000))]
    cut = stage(msgs, view(msgs)).messages[2]["content"]
    for f in files(tmp_path):
        f.unlink()
    resent = [{"role": "user", "content": "go"}, *turn("c1", "bash", cut)]
    out = stage(resent, view(resent))
    assert files(tmp_path) == [] and out.messages[2]["content"] == cut  # recent: untouched
    aged = resent + turn("c2", "bash", "small")
    out = stage(aged, view(aged))
    assert files(tmp_path) == []
    new = out.messages[2]["content"]
    assert utf8_len(new) < 5000 and parse_notice(new).file_path == parse_notice(cut).file_path  # type: ignore[union-attr]


def test_text_parts_cut_and_images_untouched(tmp_path: Path) -> None:
    stage, _, _ = make_stage(tmp_path)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [
                {"type": "text", "text": log_text(1000)}, image,
                {"type": "text", "text": log_text(1000, "b")}]}]
    out = stage(msgs, view(msgs)).messages[2]["content"]
    assert [p["type"] for p in out] == ["text", "image_url"]
    assert out[1] is image and parse_notice(out[0]["text"]) is not None


def test_disk_failure_forwards_uncut(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stage, _, _ = make_stage(tmp_path)

    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    msgs = [{"role": "user", "content": "go"}, *turn("c1", "bash", log_text(2000))]
    out = stage(msgs, view(msgs))
    assert out.stats["offload_errors"] == 1 and out.stats["offloaded"] == 0
    assert out.messages[2]["content"] == msgs[2]["content"]
    assert list(tmp_path.rglob("*.tmp")) == []


def test_new_originals_are_written_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes are fsynced (ms each): they run in a worker thread, and before the stage returns
    (the cut is never forwarded ahead of its file); a resend writes nothing."""
    import threading

    stage, store, _ = make_stage(tmp_path)
    threads: list[str] = []
    real_write = store.write

    def recording(*args: Any) -> int:
        threads.append(threading.current_thread().name)
        return real_write(*args)

    monkeypatch.setattr(store, "write", recording)
    msgs = [{"role": "user", "content": "go"}, *turn("c1", "bash", log_text(2000)),
            *turn("c2", "bash", log_text(2000, "n"))]
    out = stage(msgs, view(msgs))
    assert out.stats["files_written"] == 2 and len(files(tmp_path)) == 2
    assert len(threads) == 2 and threading.main_thread().name not in threads
    again = stage(orjson.loads(orjson.dumps(msgs)), view(msgs))
    assert again.stats["files_written"] == 0 and len(threads) == 2
    assert again.messages == out.messages


def test_ttl_gc_and_expired_read(tmp_path: Path) -> None:
    stage, store, _ = make_stage(tmp_path)
    msgs = [{"role": "user", "content": "go"}, *turn("c1", "bash", log_text(2000)),
            *turn("c2", "bash", log_text(2000, "n"))]
    out = stage(msgs, view(msgs))
    old, new = files(tmp_path)
    past = time.time() - 6 * 86400
    os.utime(old, (past, past))
    assert store.gc() == 1 and files(tmp_path) == [new]
    rid = old.stem
    with pytest.raises(OffloadedFileMissing, match="no longer available.*5 days"):
        store.read(ID.tenant, ID.session, rid)
    # The next request that still carries that output writes it again.
    again = stage(msgs, view(msgs))
    assert again.stats["files_written"] == 1 and out.messages == again.messages


def test_gc_cli(tmp_path: Path) -> None:
    stage, _, _ = make_stage(tmp_path)
    msgs = [{"role": "user", "content": "go"}, *turn("c1", "bash", log_text(2000))]
    stage(msgs, view(msgs))
    [f] = files(tmp_path)
    past = time.time() - 10 * 86400
    os.utime(f, (past, past))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"storage: {{data_dir: '{tmp_path}'}}\n")
    proc = subprocess.run([sys.executable, "-m", "proxy", "gc", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0 and "deleted 1 " in proc.stdout
    assert files(tmp_path) == []


@settings(max_examples=examples(40), deadline=None)
@given(
    text=st.lists(st.sampled_from(["a", "é", "中", "😀", "\n", "\r\n", " ", "line\n"]), max_size=2500).map("".join),
    budget=st.integers(min_value=256, max_value=2000),
)
def test_property_lossless_and_within_budget(tmp_path_factory: pytest.TempPathFactory, text: str, budget: int) -> None:
    root = tmp_path_factory.mktemp("p")
    stage, store, _ = make_stage(root, recent_max_bytes=budget, old_max_bytes=256, slack_bytes=0)
    msgs = [{"role": "user", "content": "go"}, *turn("c1", "bash", text)]
    out = stage(msgs, view(msgs)).messages[2]["content"]
    if utf8_len(text) <= budget:
        assert out == text
        return
    excerpt, _ = split_notice(out)  # type: ignore[misc]
    assert utf8_len(excerpt) <= budget
    assert reconstruct(store, out, budget) == text
    again = stage(orjson.loads(orjson.dumps(msgs)), view(msgs)).messages[2]["content"]
    assert again == out


# -- through the proxy (in process) ------------------------------------------------------------


async def test_proxy_offloads_and_resends_identically(
    inproc: InProcess, fake: FakeUpstream, tmp_path: Path
) -> None:
    msgs = [{"role": "user", "content": "go"}, *turn("c1", "bash", log_text(3000))]
    body = orjson.dumps({"model": "gpt-4o", "messages": msgs, "x_extra": 1})
    r1 = await inproc.client.post("/v1/chat/completions", content=body, headers={"authorization": "Bearer k"})
    r2 = await inproc.client.post("/v1/chat/completions", content=body, headers={"authorization": "Bearer k"})
    assert r1.status_code == r2.status_code == 200
    assert r1.headers["x-ctxproxy-offloaded"] == "1"
    a, b = fake.received[-2].body, fake.received[-1].body
    assert a == b and len(a) < len(body) / 2
    assert orjson.loads(a)["x_extra"] == 1
    assert len(files(tmp_path / "data")) == 1


async def test_proxy_disk_failure_still_serves(
    make_inproc: InProcessFactory, fake: FakeUpstream, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the data dir should be")
    app = await make_inproc({"storage": {"data_dir": str(blocker / "data")}})
    msgs = [{"role": "user", "content": "go"}, *turn("c1", "bash", log_text(3000))]
    body = orjson.dumps({"model": "gpt-4o", "messages": msgs})
    r = await app.client.post("/v1/chat/completions", content=body)
    assert r.status_code == 200 and r.headers["x-ctxproxy-offloaded"] == "0"
    assert fake.received[-1].body == body  # forwarded uncut, byte for byte


async def test_server_runs_gc_at_startup(
    make_inproc: InProcessFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    stage, _, _ = make_stage(data)
    msgs = [{"role": "user", "content": "go"}, *turn("c1", "bash", log_text(2000))]
    await asyncio.to_thread(stage, msgs, view(msgs))  # the stage runs a loop of its own
    [f] = files(data)
    past = time.time() - 6 * 86400
    os.utime(f, (past, past))
    # The start-up collection runs in the background; its end is the event to wait for.
    collected = asyncio.Event()
    real = Services.collect_garbage

    async def noting(self: Services) -> None:
        try:
            await real(self)
        finally:
            collected.set()

    monkeypatch.setattr(Services, "collect_garbage", noting)
    await make_inproc()
    await asyncio.wait_for(collected.wait(), 10)
    assert not f.exists()

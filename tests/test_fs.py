"""proxy.store.fs, the one way into data_dir: a symlink planted anywhere below it is never
followed, whichever store reads or writes (offloaded files, the archive, summaries, the read
tool)."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import pytest

from proxy.config import Config
from proxy.retrieval.tool import ReadTool
from proxy.session import Identity
from proxy.store import fs
from proxy.store.db import Database
from proxy.store.dialog import DialogArchive
from proxy.store.tool_results import OffloadedFileMissing, ToolResultStore, result_id

T, S = "t-0123456789abcdef", "sess-1"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside data_dir holding a file nobody may read or overwrite."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "secret.txt").write_text("keep me")
    return d


def test_write_atomic_never_writes_through_a_symlinked_directory(
    data_dir: Path, outside: Path
) -> None:
    (data_dir / T).mkdir(parents=True)
    os.symlink(outside, data_dir / T / S)
    with pytest.raises(fs.Hidden):
        fs.write_atomic(data_dir, (T, S, "secret.txt"), b"overwritten")
    assert (outside / "secret.txt").read_text() == "keep me"
    assert os.listdir(outside) == ["secret.txt"]


def test_write_atomic_replaces_a_planted_symlink_instead_of_following_it(
    data_dir: Path, outside: Path
) -> None:
    fs.write_atomic(data_dir, (T, S, "tool_result", "x.txt"), b"one")
    link = data_dir / T / S / "tool_result" / "y.txt"
    os.symlink(outside / "secret.txt", link)
    fs.write_atomic(data_dir, (T, S, "tool_result", "y.txt"), b"two")
    assert not link.is_symlink() and link.read_bytes() == b"two"
    assert (outside / "secret.txt").read_text() == "keep me"


def test_append_and_read_refuse_a_symlinked_file(data_dir: Path, outside: Path) -> None:
    (data_dir / T / S / "dialog").mkdir(parents=True)
    os.symlink(outside / "secret.txt", data_dir / T / S / "dialog" / "2026-12-02.jsonl")
    with pytest.raises(fs.Hidden):
        fs.append_fd(data_dir, (T, S, "dialog", "2026-12-02.jsonl"))
    with pytest.raises(fs.Hidden):
        fs.read_bytes(data_dir, (T, S, "dialog", "2026-12-02.jsonl"))
    assert (outside / "secret.txt").read_text() == "keep me"


def test_invalid_names_never_reach_the_filesystem(data_dir: Path) -> None:
    for bad in ("..", ".", "a/b", "", "x\x00y", ".hidden"):
        with pytest.raises((fs.Hidden, ValueError)):
            fs.write_atomic(data_dir, (T, bad, "f.txt"), b"x")
        with pytest.raises(fs.Hidden):
            fs.read_bytes(data_dir, (T, bad, "f.txt"))


def test_walk_files_counts_real_files_only(data_dir: Path, outside: Path) -> None:
    fs.write_atomic(data_dir, (T, S, "tool_result", "a.txt"), b"12345")
    fs.write_atomic(data_dir, (T, "s2", "dialog", "2026-12-02.jsonl"), b"123")
    os.symlink(outside, data_dir / T / "linked")
    os.symlink(outside / "secret.txt", data_dir / T / S / "tool_result" / "b.txt")
    found = sorted((d, e.name, e.size) for d, e in fs.walk_files(data_dir, (T,)))
    assert found == [((T, "s2", "dialog"), "2026-12-02.jsonl", 3), ((T, S, "tool_result"), "a.txt", 5)]


def test_offloaded_file_behind_a_symlink_is_missing_not_read(data_dir: Path, outside: Path) -> None:
    store = ToolResultStore(data_dir, 5)
    rid = result_id(T, S, "content")
    store.write(T, S, rid, "content")
    path = store.path(T, S, rid)
    path.unlink()
    os.symlink(outside / "secret.txt", path)
    with pytest.raises(OffloadedFileMissing):
        store.read(T, S, rid)


def test_the_read_tool_refuses_a_symlinked_dialog(data_dir: Path, outside: Path) -> None:
    config = Config.model_validate({"storage": {"data_dir": str(data_dir)}})
    tool = ReadTool(config, ToolResultStore(data_dir, 5))
    (data_dir / T / S / "dialog").mkdir(parents=True)
    os.symlink(outside / "secret.txt", data_dir / T / S / "dialog" / "2026-12-02.jsonl")
    answer = tool.run(Identity(T, S, None), '{"file_path": "dialog/2026-12-02.jsonl"}')
    assert answer.startswith("error:") and "keep me" not in answer


def test_the_archive_never_appends_through_a_symlink(data_dir: Path, outside: Path) -> None:
    now = datetime(2026, 12, 2, tzinfo=UTC)
    (data_dir / T / S / "dialog").mkdir(parents=True)
    os.symlink(outside / "secret.txt", data_dir / T / S / "dialog" / "2026-12-02.jsonl")
    with Database.in_dir(data_dir) as db:
        archive = DialogArchive(data_dir, db)
        with pytest.raises(fs.Hidden):
            archive.record(T, S, [{"role": "user", "content": "hi"}], now=now)
    assert (outside / "secret.txt").read_text() == "keep me"

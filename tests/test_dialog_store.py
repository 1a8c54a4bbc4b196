"""Dialog archive, message index, database and path helpers (proxy.store)."""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.store import fs
from proxy.store.db import Database, SchemaError
from proxy.store.dialog import (
    DialogArchive,
    DigestCache,
    FileSpan,
    chain_hashes,
    chain_step,
    format_spans,
    read,
    read_lines,
)
from proxy.store.migrations import SCHEMA_VERSION
from proxy.store.paths import (
    InvalidName,
    check_name,
    db_path,
    dialog_file,
    session_dir,
    tool_result_file,
)

from .conftest import examples

T, S = "t-0123456789abcdef", "sess-1"
NOW = datetime(2026, 12, 2, 10, 15, 30, tzinfo=UTC)


@pytest.fixture
def archive(data_dir: Path, db: Database) -> DialogArchive:
    return DialogArchive(data_dir, db, digest_cache=DigestCache())


def user(i: int, tag: str = "") -> dict[str, Any]:
    return {"role": "user", "content": f"question {i}{tag}"}


def answer(i: int, tag: str = "") -> dict[str, Any]:
    return {"role": "assistant", "content": f"answer {i}{tag}"}


SYSTEM = {"role": "system", "content": "You are terse."}


def all_lines(data_dir: Path, tenant: str = T, session: str = S) -> list[bytes]:
    out: list[bytes] = []
    directory = session_dir(data_dir, tenant, session) / "dialog"
    for f in sorted(directory.glob("*.jsonl")):
        out.extend(f.read_bytes().splitlines())
    return out


def play(
    archive: DialogArchive, turns: int, history: list[Any] | None = None, tag: str = ""
) -> list[Any]:
    """Client behaviour: each turn resend everything plus a new user message."""
    history = list(history) if history is not None else [SYSTEM]
    for i in range(turns):
        history.append(user(i, tag))
        reply = answer(i, tag)
        archive.record(T, S, history, answer=reply, now=NOW)
        history.append(reply)  # the client resends the answer exactly as received
    return history


# --- chain hashes ----------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=6,
)
messages_st = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"])}).flatmap(
        lambda base: st.dictionaries(st.text(max_size=6), json_values, max_size=3).map(
            lambda extra: {**extra, **base}
        )
    ),
    max_size=12,
)


@settings(max_examples=examples(50), deadline=None)
@given(messages_st, st.integers(0, 12))
def test_chain_hashes_prefix_stable(messages: list[dict[str, Any]], k: int) -> None:
    chains = chain_hashes(messages)
    assert len(chains) == len(messages)
    assert chain_hashes(messages[:k]) == chains[:k]
    assert all(len(c) == 32 and int(c, 16) >= 0 for c in chains)
    parent = None
    for m, c in zip(messages, chains, strict=True):
        assert chain_step(parent, m) == c
        parent = c


@settings(max_examples=examples(50), deadline=None)
@given(messages_st)
def test_digest_cache_never_changes_results(messages: list[dict[str, Any]]) -> None:
    plain = chain_hashes(messages)
    cache = DigestCache(min_bytes=0)
    assert chain_hashes(messages, cache) == plain
    assert chain_hashes(messages, cache) == plain  # now served from the cache
    assert chain_hashes(messages, {}) == plain


def test_digest_cache_distinguishes_json_lookalikes() -> None:
    # Equal in Python, different JSON: a content-keyed cache must not conflate them.
    cache = DigestCache(min_bytes=0)
    variants = [
        {"role": "user", "x": 1},
        {"role": "user", "x": True},
        {"role": "user", "x": 1.0},
        {"role": "user", "x": 0.0},
        {"role": "user", "x": -0.0},
        {"role": "user", "x": "1"},
        {"role": "user", "x": [1]},
        {"role": "user", "x": None},
    ]
    cached = [chain_hashes([v], cache)[0] for v in variants]
    assert cached == [chain_hashes([v])[0] for v in variants]
    assert len(set(cached)) == len(variants)


def test_chains_depend_on_order_and_content() -> None:
    a, b = user(1), user(2)
    assert chain_hashes([a, b])[1] != chain_hashes([b, a])[1]
    assert chain_hashes([a, b])[1] != chain_hashes([a, {**b, "content": "x"}])[1]
    # key order of the client's JSON does not matter (canonical = sorted keys)
    assert chain_hashes([{"content": "c", "role": "user"}]) == chain_hashes(
        [{"role": "user", "content": "c"}]
    )


def test_digest_cache_is_bounded() -> None:
    cache = DigestCache(max_bytes=10_000, min_bytes=100)
    msgs = [{"role": "tool", "content": f"{i}" + "x" * 3000} for i in range(10)]
    chain_hashes(msgs, cache)
    assert 1 <= len(cache) <= 3
    chain_hashes([{"role": "user", "content": "small"}], cache)
    assert len(cache) <= 3


# --- recording -------------------------------------------------------------------------------


def test_resent_histories_write_each_message_once(archive: DialogArchive, data_dir: Path) -> None:
    history = play(archive, 40)
    lines = all_lines(data_dir)
    assert len(lines) == len(history) == 81
    records = [orjson.loads(x) for x in lines]
    assert [r["pos"] for r in records] == list(range(81))
    assert [r["message"] for r in records] == history
    chains = chain_hashes(history)
    assert [r["chain"] for r in records] == chains
    assert [r["parent"] for r in records] == [None, *chains[:-1]]
    assert records[0]["v"] == 1 and records[0]["session"] == S
    assert records[5]["role"] == history[5]["role"]
    assert datetime.fromisoformat(records[0]["ts"]) == NOW
    stats = archive.session_stats(T, S)
    assert stats is not None and stats.messages == 81 and stats.last_chain == chains[-1]


def test_record_result_and_answer_after_request(archive: DialogArchive) -> None:
    history = [SYSTEM, user(0)]
    first = archive.record(T, S, history, now=NOW)  # persisted before forwarding
    assert first.written == 2 and not first.branched
    assert first.first == ("dialog/2026-12-02.jsonl", 1)
    assert first.last == ("dialog/2026-12-02.jsonl", 2)
    assert first.chains == tuple(chain_hashes(history)) and first.answer_chain is None
    second = archive.record(T, S, history, chains=first.chains, answer=answer(0), now=NOW)
    assert second.written == 1 and second.first == second.last == ("dialog/2026-12-02.jsonl", 3)
    assert second.answer_chain == chain_hashes([*history, answer(0)])[-1]
    assert second.last_chain == second.answer_chain
    again = archive.record(T, S, history, answer=answer(0), now=NOW)
    assert again.written == 0 and again.first is None and not again.branched
    assert archive.record(T, S, []).written == 0
    with pytest.raises(ValueError):
        archive.record(T, S, history, chains=first.chains[:1])


def test_branch_links_parent_and_keeps_old_lines(archive: DialogArchive, data_dir: Path) -> None:
    history = play(archive, 10)  # 21 messages
    path = dialog_file(data_dir, T, S, NOW.date())
    before = path.read_bytes()
    old_chains = chain_hashes(history)

    rewound = history[:-3]  # drop the last answer, user and answer
    branch = [*rewound, user(99, " edited")]
    result = archive.record(T, S, branch, answer=answer(99, " edited"), now=NOW)
    assert result.branched and result.written == 2
    assert path.read_bytes().startswith(before)  # old lines untouched
    new_lines = [
        orjson.loads(x) for x in path.read_bytes().splitlines()[len(before.splitlines()) :]
    ]
    assert new_lines[0]["parent"] == old_chains[len(rewound) - 1]
    assert new_lines[0]["pos"] == len(rewound)
    assert new_lines[1]["parent"] == new_lines[0]["chain"] and new_lines[1]["pos"] == len(branch)

    # continuing the branch normally is not a branch again
    nxt = archive.record(T, S, [*branch, answer(99, " edited"), user(100)], now=NOW)
    assert nxt.written == 1 and not nxt.branched
    # resending the old branch writes nothing; extending it is a branch (back to it)
    assert archive.record(T, S, history, now=NOW).written == 0
    back = archive.record(T, S, [*history, user(50)], now=NOW)
    assert back.written == 1 and back.branched
    assert len(all_lines(data_dir)) == 21 + 2 + 1 + 1


def test_index_lines_match_physical_lines(archive: DialogArchive, data_dir: Path) -> None:
    history = play(archive, 5)
    # a second day in the same session
    tomorrow = NOW + timedelta(days=1)
    history.append(user(77))
    archive.record(T, S, history, now=tomorrow)
    for chain in chain_hashes(history):
        entry = archive.lookup(T, S, chain)
        assert entry is not None
        lines = {d.line: d.record for d in read_lines(session_dir(data_dir, T, S) / entry.file)}
        assert lines[entry.line]["chain"] == chain
    assert archive.dialog_files(T, S) == ["2026-12-02.jsonl", "2026-12-03.jsonl"]
    last = archive.lookup(T, S, chain_hashes(history)[-1])
    assert last is not None and (last.file, last.line, last.role) == (
        "dialog/2026-12-03.jsonl",
        1,
        "user",
    )
    assert last.ts == tomorrow and last.position == len(history) - 1
    assert archive.lookup(T, S, "0" * 32) is None


def test_span(archive: DialogArchive) -> None:
    history = play(archive, 5)  # 11 lines in day 1
    history.append(user(5))
    archive.record(T, S, history, now=NOW + timedelta(days=1))
    chains = chain_hashes(history)
    assert archive.span(T, S, chains[1:7]) == [FileSpan("dialog/2026-12-02.jsonl", 2, 7)]
    spans = archive.span(T, S, [*chains[0:3], chains[5], *chains[9:]])
    assert spans == [
        FileSpan("dialog/2026-12-02.jsonl", 1, 11),
        FileSpan("dialog/2026-12-03.jsonl", 1, 1),
    ]
    assert archive.span(T, S, [*chains[0:3], chains[5], *chains[9:]], exact=True) == [
        FileSpan("dialog/2026-12-02.jsonl", 1, 3),
        FileSpan("dialog/2026-12-02.jsonl", 6, 6),
        FileSpan("dialog/2026-12-02.jsonl", 10, 11),
        FileSpan("dialog/2026-12-03.jsonl", 1, 1),
    ]
    assert (
        format_spans(spans) == "dialog/2026-12-02.jsonl lines 1-11, dialog/2026-12-03.jsonl line 1"
    )
    assert archive.span(T, S, []) == [] and archive.span(T, S, ["f" * 32]) == []
    assert archive.known(T, S, [chains[0], "f" * 32]) == {chains[0]}


# --- crash safety ----------------------------------------------------------------------------


def test_torn_last_line_skipped_and_next_append_starts_fresh(
    archive: DialogArchive, data_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    history = play(archive, 3)  # 7 lines
    path = dialog_file(data_dir, T, S, NOW.date())
    # A crash mid-append: half a line reached the disk, the index commit never happened.
    torn = orjson.dumps({"v": 1, "chain": "x" * 32, "message": {"content": "half"}})
    with open(path, "ab") as f:
        f.write(torn[: len(torn) // 2])
    with caplog.at_level(logging.DEBUG, logger="proxy.store"):
        assert [r["message"] for r in read(path)] == history
    assert any("torn" in r.message for r in caplog.records)

    history.append(user(3))
    result = archive.record(T, S, history, now=NOW)
    assert result.first == ("dialog/2026-12-02.jsonl", 9)  # line 8 is the torn fragment
    raw = path.read_bytes().split(b"\n")
    assert raw[7] == torn[: len(torn) // 2] and orjson.loads(raw[8])["message"] == user(3)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="proxy.store"):
        numbered = list(read_lines(path))
    assert [d.record["message"] for d in numbered] == history
    assert [d.line for d in numbered] == [1, 2, 3, 4, 5, 6, 7, 9]
    assert any("corrupt line 8" in r.message for r in caplog.records)


def test_truncated_file_is_recounted(archive: DialogArchive, data_dir: Path) -> None:
    history = play(archive, 2)  # 5 lines
    path = dialog_file(data_dir, T, S, NOW.date())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])  # last line cut short behind our back
    assert [r["message"] for r in read(path)] == history[:-1]
    history.append(user(2))
    result = archive.record(T, S, history, now=NOW)
    assert result.first == ("dialog/2026-12-02.jsonl", 6)
    assert [d.line for d in read_lines(path)][-1] == 6


def test_rewritten_lines_after_lost_commit_are_read_once(
    archive: DialogArchive, data_dir: Path
) -> None:
    history = [SYSTEM, user(0)]
    archive.record(T, S, history, now=NOW)
    path = dialog_file(data_dir, T, S, NOW.date())
    with archive.db.transaction() as conn:  # simulate: lines on disk, index commit lost
        conn.execute("DELETE FROM messages WHERE position = 1")
    archive.record(T, S, history, now=NOW)
    assert len(path.read_bytes().splitlines()) == 3
    assert [r["message"] for r in archive.read_dialog(T, S, "2026-12-02.jsonl")] == history
    assert [d.line for d in archive.read_dialog_lines(T, S, NOW.date())] == [1, 2]


def test_index_survives_reopen(data_dir: Path) -> None:
    db = Database.in_dir(data_dir)
    history = play(DialogArchive(data_dir, db), 4)
    db.close()
    db2 = Database.in_dir(data_dir)
    try:
        archive = DialogArchive(data_dir, db2)
        assert archive.record(T, S, history, now=NOW).written == 0
        entry = archive.lookup(T, S, chain_hashes(history)[3])
        assert entry is not None and entry.line == 4
        history.append(user(9))
        assert archive.record(T, S, history, now=NOW).first == ("dialog/2026-12-02.jsonl", 10)
    finally:
        db2.close()


def test_lost_database_recounts_lines(data_dir: Path) -> None:
    db = Database.in_dir(data_dir)
    play(DialogArchive(data_dir, db), 2)  # 5 lines
    db.close()
    for suffix in ("", "-wal", "-shm"):
        Path(str(db_path(data_dir)) + suffix).unlink(missing_ok=True)
    db2 = Database.in_dir(data_dir)
    try:
        result = DialogArchive(data_dir, db2).record(T, S, [user(7)], now=NOW)
        assert result.first == ("dialog/2026-12-02.jsonl", 6)
    finally:
        db2.close()


# --- concurrency -----------------------------------------------------------------------------


@pytest.mark.parametrize("separate_connections", [False, True])
def test_concurrent_records_do_not_duplicate(data_dir: Path, separate_connections: bool) -> None:
    # Same Database from two threads (the app), or two Databases on one file (two processes).
    dbs = [Database.in_dir(data_dir)]
    if separate_connections:
        dbs.append(Database.in_dir(data_dir))
    archives = [DialogArchive(data_dir, dbs[i % len(dbs)]) for i in range(2)]
    histories: list[list[Any]] = []
    h: list[Any] = [SYSTEM]
    for i in range(25):
        h = [*h, user(i), answer(i)]
        histories.append(h)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def worker(archive: DialogArchive) -> None:
        try:
            barrier.wait()
            for hist in histories:
                archive.record(T, S, hist, now=NOW)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(a,)) for a in archives]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for d in dbs:
        d.close()
    assert not errors
    lines = all_lines(data_dir)
    assert len(lines) == len(histories[-1]) == 51
    assert sorted(orjson.loads(x)["pos"] for x in lines) == list(range(51))


# --- database --------------------------------------------------------------------------------


def test_schema_version_and_pragmas(db: Database) -> None:
    assert db.schema_version == SCHEMA_VERSION >= 1
    with db.connect() as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] > 0


def test_newer_schema_is_refused(data_dir: Path) -> None:
    Database.in_dir(data_dir).close()
    conn = sqlite3.connect(db_path(data_dir))
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(SchemaError):
        Database.in_dir(data_dir)


def test_closed_database_raises(data_dir: Path) -> None:
    db = Database.in_dir(data_dir)
    db.close()
    db.close()  # idempotent
    with pytest.raises(sqlite3.ProgrammingError):
        db.session_stats(T, S)


def test_session_stats(db: Database, archive: DialogArchive) -> None:
    row = db.update_session_stats(T, S, turns=1, tokens_in=1000, tokens_out=400, now=NOW)
    assert (row.turns, row.tokens_in, row.tokens_out, row.compactions) == (1, 1000, 400, 0)
    later = NOW + timedelta(minutes=5)
    row = db.update_session_stats(
        T, S, turns=1, tokens_in=500, compactions=1, offloads=2, now=later
    )
    assert (row.turns, row.tokens_in, row.compactions, row.offloads) == (2, 1500, 1, 2)
    assert row.first_seen == NOW and row.last_seen == later
    assert row.saved_ratio == pytest.approx(1 - 400 / 1500)
    db.update_session_stats(T, "other", turns=1, now=later + timedelta(minutes=1))
    db.update_session_stats("anon", "x", turns=1, now=NOW)
    assert [r.session for r in archive.sessions(T)] == ["other", S]
    assert {(r.tenant, r.session) for r in archive.sessions(None)} == {
        (T, S),
        (T, "other"),
        ("anon", "x"),
    }
    with pytest.raises(ValueError):
        db.update_session_stats(T, S, bogus=1)
    with pytest.raises(TypeError):
        db.update_session_stats(T, S, turns=True)
    with pytest.raises(InvalidName):
        db.update_session_stats("../x", S, turns=1)
    assert db.session_stats(T, "nope") is None


# --- paths -----------------------------------------------------------------------------------

BAD_NAMES = [
    "",
    ".",
    "..",
    "../x",
    "a/b",
    ".hidden",
    "-rf",
    "a..b",
    "x" * 129,
    "a b",
    "a\x00",
    "é",
    "a\\b",
]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_paths_reject_bad_names(bad: str, data_dir: Path, archive: DialogArchive) -> None:
    with pytest.raises(InvalidName):
        check_name(bad)
    with pytest.raises(InvalidName):
        session_dir(data_dir, bad, S)
    with pytest.raises(InvalidName):
        session_dir(data_dir, T, bad)
    with pytest.raises(InvalidName):
        tool_result_file(data_dir, T, S, bad)
    with pytest.raises(InvalidName):
        archive.record(T, bad, [user(0)])
    assert not any(data_dir.glob("*/*/dialog/*"))


def test_paths_accept_good_names(data_dir: Path) -> None:
    for good in ["anon", "t-0123456789abcdef", "s-1.2_3", "A", "x" * 128]:
        assert check_name(good) == good
    assert session_dir(data_dir, "anon", "s1") == data_dir / "anon" / "s1"
    assert dialog_file(data_dir, "anon", "s1", "dialog/2026-01-02.jsonl").name == "2026-01-02.jsonl"
    for bad_file in ["../../x.jsonl", "2026-01-02.txt", "dialog/../2026-01-02.jsonl"]:
        with pytest.raises(InvalidName):
            dialog_file(data_dir, "anon", "s1", bad_file)


def test_symlinked_dialog_is_not_read(
    archive: DialogArchive, data_dir: Path, tmp_path: Path
) -> None:
    play(archive, 1)
    secret = tmp_path / "secret.jsonl"
    secret.write_bytes(b'{"v": 1}\n')
    os.symlink(secret, dialog_file(data_dir, T, S, "2030-01-01.jsonl"))
    assert archive.dialog_files(T, S) == ["2026-12-02.jsonl"]
    with pytest.raises(FileNotFoundError):
        archive.read_dialog(T, S, "2030-01-01.jsonl")


def test_atomic_write(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "file.txt"
    fs.write_atomic(tmp_path, ("a", "b", "file.txt"), b"one")
    fs.write_atomic(tmp_path, ("a", "b", "file.txt"), b"two", fsync=False)
    assert target.read_bytes() == b"two"
    assert os.listdir(target.parent) == ["file.txt"]  # no temp files left behind


def test_many_lines_in_one_record(archive: DialogArchive, data_dir: Path) -> None:
    # More lines than one writev call takes (IOV_MAX parts): still whole, ordered lines.
    history = [SYSTEM] + [user(i) for i in range(1200)]
    result = archive.record(T, S, history, now=NOW)
    assert result.written == 1201 and result.last == ("dialog/2026-12-02.jsonl", 1201)
    records = [orjson.loads(x) for x in all_lines(data_dir)]
    assert [r["message"] for r in records] == history
    entry = archive.lookup(T, S, chain_hashes(history)[777])
    assert entry is not None and entry.line == 778

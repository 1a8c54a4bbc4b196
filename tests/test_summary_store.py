"""Summary cache records (proxy.store.summaries)."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from proxy.store.db import Database
from proxy.store.dialog import DialogArchive, FileSpan, chain_hashes
from proxy.store.migrations import MIGRATIONS, SCHEMA_VERSION
from proxy.store.paths import InvalidName, summaries_dir
from proxy.store.summaries import SummaryRecord, SummaryStore

T, S = "anon", "s-abc"
NOW = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)


@pytest.fixture
def store(db: Database) -> SummaryStore:
    return SummaryStore(db)


def history(n: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "sys"}]
    for i in range(n):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"})
    return msgs


def rec(chains: list[str], upto: int, **kw: Any) -> SummaryRecord:
    fields: dict[str, Any] = {
        "tenant": T,
        "session": S,
        "chain": chains[upto - 1],
        "head": 1,
        "upto": upto,
        "text": f"## Goal\nsummary up to {upto}\n",
        "source": "model",
        "model": "gpt-4o-mini",
        "created_at": NOW + timedelta(minutes=upto),
        "tokens_before": 10 * upto,
        "tokens_after": upto,
    }
    fields.update(kw)
    return SummaryRecord(**fields)


def test_put_get_roundtrip_and_markdown(store: SummaryStore, data_dir: Path) -> None:
    chains = chain_hashes(history(20))
    span = [FileSpan("dialog/2026-12-02.jsonl", 2, 11)]
    r = rec(chains, 11, span=span)
    assert store.get(T, S, r.chain) is None
    assert store.put(r) == r
    got = store.get(T, S, r.chain)
    assert got == r and got is not r
    assert got.span == (FileSpan("dialog/2026-12-02.jsonl", 2, 11),)
    assert got.pointer == "dialog/2026-12-02.jsonl lines 2-11"
    md = summaries_dir(data_dir, T, S) / f"20261202T101100Z-{r.chain[:12]}.md"
    assert store.md_path(r) == md and r.md_relpath == f"summaries/{md.name}"
    text = md.read_text()
    assert "summary up to 11" in text and "dialog/2026-12-02.jsonl lines 2-11" in text
    assert [p.name for p in md.parent.iterdir()] == [md.name]  # no temp file left
    assert store.get(T, "other-session", r.chain) is None
    assert store.get("t-other", S, r.chain) is None


def test_a_fallback_keeps_its_reason(store: SummaryStore, data_dir: Path) -> None:
    chains = chain_hashes(history(20))
    why = "summarizer HTTP 400: Unsupported value: 'temperature' (code=unsupported_value)"
    r = rec(chains, 11, source="fallback", model=None, error=why)
    assert store.put(r) == r
    assert store.get(T, S, r.chain) == r
    md = (summaries_dir(data_dir, T, S) / r.md_name).read_text()
    assert f"- source: fallback, the summarizer failed: {why}" in md
    # A model summary has no reason, and replaces the fallback.
    better = rec(chains, 11, text="## Goal\nthe model's\n")
    assert store.put(better) == better and store.get(T, S, r.chain) == better
    assert better.error is None


def test_a_database_from_before_the_fallback_reasons_upgrades(tmp_path: Path) -> None:
    """The files backend's schema without summaries.error: its rows are kept, their reason
    unknown (None)."""
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path, isolation_level=None)
    before = next(i for i, step in enumerate(MIGRATIONS)
                  if any("summaries ADD COLUMN error" in s for s in step))
    for statement in (s for step in MIGRATIONS[:before] for s in step):
        conn.execute(statement)
    conn.execute(f"PRAGMA user_version={before}")
    chains = chain_hashes(history(20))
    conn.execute("INSERT INTO summaries (tenant, session, chain, v, head, upto, text, source, "
                 "created_at, tokens_before, tokens_after, span, seen) VALUES "
                 "(?, ?, ?, 1, 1, 8, '## Goal', 'fallback', '2026-12-02T10:00:00.000+00:00', "
                 "1, 0, '[]', 8)", (T, S, chains[7]))
    conn.close()
    with Database(path) as db:
        assert db.schema_version == SCHEMA_VERSION
        got = SummaryStore(db, tmp_path).get(T, S, chains[7])
        assert got is not None and got.source == "fallback" and got.error is None


def test_find_latest_returns_newest_matching(store: SummaryStore) -> None:
    msgs = history(30)
    chains = chain_hashes(msgs)
    first = rec(chains, 9)
    second = rec(chains, 21, previous_chain=first.chain)
    store.put(first)
    store.put(second)
    # a later request: same history plus new turns finds the merged (newest) summary
    later = chain_hashes([*msgs, {"role": "user", "content": "new"}])
    assert store.find_latest(T, S, later) == second
    # a request whose history only reaches the first summary's prefix (plus a different tail)
    edited = chain_hashes([*msgs[:15], {"role": "user", "content": "edited"}])
    assert store.find_latest(T, S, edited) == first
    # the client compacted itself: nothing matches
    other = chain_hashes([{"role": "system", "content": "new sys"}, *msgs[1:]])
    assert store.find_latest(T, S, other) is None
    assert store.find_latest(T, S, []) is None
    assert store.find_latest("t-x", S, later) is None


def test_find_latest_over_a_long_history(store: SummaryStore) -> None:
    chains = chain_hashes(history(2000))
    for upto in range(50, 2000, 50):
        store.put(rec(chains, upto))
    found = store.find_latest(T, S, chains)
    assert found is not None and found.upto == 1950
    shorter = store.find_latest(T, S, chains[:1020])  # the newest summary inside that history
    assert shorter is not None and shorter.upto == 1000


def test_history_oldest_first(store: SummaryStore) -> None:
    chains = chain_hashes(history(40))
    for upto in (30, 10, 20):  # stored out of order
        store.put(rec(chains, upto))
    store.put(rec(chains, 5, session="s-other"))
    assert [r.upto for r in store.history(T, S)] == [10, 20, 30]
    assert store.history(T, "nothing") == []


def test_replacement_policy(store: SummaryStore, data_dir: Path) -> None:
    chains = chain_hashes(history(10))
    fallback = rec(chains, 8, source="fallback", model=None, text="fallback text")
    assert store.put(fallback) == fallback
    model = rec(chains, 8, text="model text", created_at=NOW + timedelta(hours=1))
    assert store.put(model) == model  # a model summary replaces a fallback
    names = [p.name for p in summaries_dir(data_dir, T, S).iterdir()]
    assert names == [model.md_name]  # the replaced .md is removed
    rival = rec(chains, 8, text="rival text", created_at=NOW + timedelta(hours=2))
    assert store.put(rival) == model  # first model summary wins
    assert store.put(rec(chains, 8, source="fallback", model=None)) == model
    forced = store.put(rival, replace=True)
    assert forced == rival and store.get(T, S, rival.chain) == rival
    assert len(store.history(T, S)) == 1


def test_records_survive_reopen(data_dir: Path) -> None:
    chains = chain_hashes(history(10))
    db = Database.in_dir(data_dir)
    r = rec(chains, 6, created_at=datetime(2026, 12, 2, 12, 0, tzinfo=timezone(timedelta(hours=2))))
    SummaryStore(db).put(r)
    db.close()
    db2 = Database.in_dir(data_dir)
    try:
        got = SummaryStore(db2, data_dir).find_latest(T, S, chains)
        assert got == r and got.created_at == datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
    finally:
        db2.close()


def test_span_from_archive(db: Database, data_dir: Path, store: SummaryStore) -> None:
    msgs = history(12)
    archive = DialogArchive(data_dir, db)
    archive.record(T, S, msgs, now=NOW)
    chains = chain_hashes(msgs)
    r = rec(chains, 9, span=archive.span(T, S, chains[1:9]))
    store.put(r)
    assert store.get(T, S, r.chain).pointer == "dialog/2026-12-02.jsonl lines 2-9"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "bad",
    [
        {"chain": "nothex"},
        {"tenant": "../x"},
        {"session": ""},
        {"head": 5},
        {"source": "magic"},
        {"previous_chain": "zz"},
    ],
)
def test_invalid_records_rejected(bad: dict[str, Any]) -> None:
    chains = chain_hashes(history(5))
    with pytest.raises((ValueError, InvalidName)):
        rec(chains, 4, **bad)

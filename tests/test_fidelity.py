"""The fidelity harness (harness/fidelity.py, bench/fidelity.py) on a small session per
format: it sees compactions, finds canaries where they are, reports a canary the client never
sent as lost, and -- once the guard is in the tree -- the guarded kinds (the goal, constraints,
files touched) are never lost, even with a summarizer that drops half of what it is given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.fidelity import (
    C1,
    FORMATS,
    GUARDED,
    Fmt,
    Run,
    Script,
    build_script,
    guard_supported,
    replay,
    weak_summary,
)
from proxy.compaction.sections import is_valid_summary
from proxy.demo.fake.upstream import FakeUpstream

WINDOW = 9_000
needs_guard = pytest.mark.skipif(
    not guard_supported(),
    reason="compaction.guard is not in this tree's config yet (branch guard): nothing to test")


@pytest.fixture(scope="module")
def script() -> Script:
    return build_script(scale=1, fillers=1)


async def session(fake: FakeUpstream, url: str, tmp: Path, script: Script, fmt: Fmt, mode: str,
                  **kw: Any) -> Run:
    return await replay(fmt, mode, fake=fake, upstream_url=url, data_dir=tmp / "data",
                        script=script, window=WINDOW, **kw)


@pytest.mark.parametrize("fmt", FORMATS)
async def test_the_harness_sees_compactions_and_finds_canaries(
    fake: FakeUpstream, fake_url: str, tmp_path: Path, script: Script, fmt: Fmt
) -> None:
    run = await session(fake, fake_url, tmp_path, script, fmt, "fallback")
    assert run.compactions >= 3
    where = {o.where for o in run.outcomes}
    assert {"summary", "context", "lost"} <= where  # every outcome the harness can tell
    # The deterministic summary carries the user's words: the goal survives every compaction.
    assert all(o.where == "summary" for o in run.outcomes if o.canary.kind == "goal")
    # The seam for model probes: the client's whole history next to what was forwarded.
    last = run.checkpoints[-1]
    assert last.format == fmt and len(last.canaries) == len(script.canaries)
    assert len(str(last.full_body)) > 2 * len(str(last.forwarded_body))
    assert run.quotes and all(q.quote for q in run.quotes)


async def test_a_canary_the_client_never_sent_is_reported_lost(
    fake: FakeUpstream, fake_url: str, tmp_path: Path, script: Script
) -> None:
    run = await session(fake, fake_url, tmp_path, script, "chat", "fallback",
                        drop=frozenset({C1.text}))
    dropped = [o for o in run.outcomes if o.canary == next(
        c for c in script.canaries if c.text == C1.text)]
    assert dropped and all(o.where == "lost" for o in dropped)


@needs_guard
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["fallback", "weak"])
async def test_with_the_guard_the_guarded_kinds_are_never_lost(
    fake: FakeUpstream, fake_url: str, tmp_path: Path, script: Script, fmt: Fmt, mode: str
) -> None:
    run = await session(fake, fake_url, tmp_path, script, fmt, mode, guard=True)
    assert run.compactions >= 3
    lost = [(o.turn, o.canary.kind, o.canary.text) for o in run.outcomes
            if o.canary.kind in GUARDED and o.where == "lost"]
    assert not lost


def test_the_weak_summarizer_answers_validly_and_drops_about_half() -> None:
    items = [f"fact number {i} about src/mod_{i}.py" for i in range(40)]
    prompt = ("<previous_summary>\n" + "\n".join(f"- {t}" for t in items[:20])
              + "\n</previous_summary>\n<transcript>\n[1] USER:\n" + "\n".join(items[20:])
              + "\n</transcript>")
    body = {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": prompt}]}
    text = weak_summary(body)
    assert is_valid_summary(text) and text == weak_summary(body)  # valid, deterministic
    kept = [t for t in items if t in text]
    assert 10 <= len(kept) <= 30

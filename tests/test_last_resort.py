"""The last resort (docs/compaction.md#last-resort): when even the turns compaction keeps are
over the threshold, every tool result is cut harder, all of them, so that while this lasts the
forwarded prefix is the same from one turn to the next (re-cutting "only as many as needed",
oldest first, moved the cut point every turn and discarded the provider's prompt cache each
time)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson

from proxy.catalog.windows import ContextWindows
from proxy.compaction.planner import Planner
from proxy.config import config_from_mapping
from proxy.model import RequestView
from proxy.offload.stage import Offloader
from proxy.pipeline.runner import Pipeline
from proxy.session import Identity
from proxy.store.chains import chain_hashes
from proxy.store.summaries import SummaryRecord
from proxy.store.tool_results import ToolResultStore
from proxy.tokens.counter import TokenCounter
from proxy.tokens.request import RequestCounter
from proxy.truncation.notice import parse_notice

ID = Identity("t-tenant", "s-last", None)


class KeepsEverything:
    """A compactor with no summary to offer: compaction cannot help, the last resort must."""

    enabled = True

    async def state(self, request: RequestView) -> SummaryRecord | None:
        return None

    def prepared_plan(self, request: RequestView, summary: SummaryRecord | None) -> Any:
        return None

    async def obtain(self, plan: Any, request: RequestView, tokens: int) -> SummaryRecord:
        raise AssertionError("nothing may be evicted: the kept turns fit keep_recent_ratio")

    def prepare(self, plan: Any, request: RequestView, tokens: int) -> None:
        return None


def output(turn: int) -> str:
    return "".join(f"turn {turn} line {i}: value={i * 7919 % 104729}\n" for i in range(400))


def history(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Agent."},
                                  {"role": "user", "content": "run the checks"}]
    for t in range(turns):
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{t}", "type": "function",
                      "function": {"name": "check", "arguments": orjson.dumps({"n": t}).decode()}}]},
                 {"role": "tool", "tool_call_id": f"c{t}", "content": output(t)}]
    return msgs


def test_every_result_is_cut_and_the_prefix_holds(tmp_path: Path) -> None:
    config = config_from_mapping({
        "storage": {"data_dir": str(tmp_path)},
        # ~1,100-token excerpts; nothing ages (recent_n), only the last resort cuts harder.
        "offload": {"recent_max_bytes": 2500, "old_max_bytes": 300, "recent_n": 10},
        # threshold 2,400 tokens, keep 7,200: three results are over the threshold and yet
        # nothing can be evicted.
        "compaction": {"context_windows": {"gpt-4o": 8000}, "threshold_ratio": 0.3,
                       "keep_recent_ratio": 0.9},
    })
    counter = RequestCounter(TokenCounter())
    pipeline = Pipeline(
        offloader=Offloader(config.offload, config.retrieval, tmp_path),
        planner=Planner(config.compaction, counter, ContextWindows(config.compaction.context_windows),
                        "read_offloaded"),
        compactor=KeepsEverything(), counter=counter,
        originals=ToolResultStore(tmp_path, 5), timed_ageing=True, old_max_bytes=300,
    )

    def forward(turns: int) -> list[dict[str, Any]]:
        msgs = history(turns)
        view = RequestView("gpt-4o", {"messages": msgs}, ID, chain_hashes(msgs))
        result = asyncio.run(pipeline.run(view))
        assert result.failed == ()
        assert result.stats["tokens_out"] <= result.stats["tokens_budget"] == 2400
        return result.messages

    first, second, third = forward(3), forward(4), forward(5)
    for forwarded in (first, second, third):
        results = [m for m in forwarded if m["role"] == "tool"]
        notices = [parse_notice(m["content"]) for m in results]
        assert all(n is not None and n.excerpt_bytes <= 300 for n in notices)
    # Each turn's forwarded messages open the next turn's, byte for byte.
    assert [orjson.dumps(m) for m in second[: len(first)]] == [orjson.dumps(m) for m in first]
    assert [orjson.dumps(m) for m in third[: len(second)]] == [orjson.dumps(m) for m in second]

"""The ledger service on scripted sessions with known answers: the counterfactual, cache-break
attribution (compaction, client edit, TTL), estimates without the provider's usage, read rounds,
summarizer calls. The store is an in-memory LedgerStore (harness.ledger); the proxy end to
end is tested in
tests/test_ledger_e2e.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from harness.ledger import MemoryLedger
from proxy.background import Background
from proxy.catalog.prices import Price, Prices
from proxy.config.ledger import LedgerConfig
from proxy.config.offload import OffloadConfig
from proxy.formats.chat.request import CHAT
from proxy.ledger.service import Ledger, RequestCalls
from proxy.metrics import Metrics
from proxy.model import PipelineResult
from proxy.session import Identity
from proxy.store.chains import chain_hashes
from proxy.store.ledger_entry import LedgerEntry
from proxy.store.usage import DiskUsage
from proxy.tokens.counter import TokenCounter
from proxy.tokens.request import RequestCounter
from proxy.upstream.calls import Call
from proxy.usage import Usage
from proxy.writes import Mode, Writes

PRICE = Price.of(input=3, output=15, cache_read=0.3, cache_write=3.75)


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


IDENT = Identity("t1", "s1", None)


class Session:
    """A scripted chat session through the ledger service (no proxy, no network)."""

    def __init__(self, tmp_path: Path, *, shared: bool = False,
                 store: MemoryLedger | None = None) -> None:
        self.clock = Clock()
        self.store = store or MemoryLedger()
        self.background = Background()
        self.metrics = Metrics()
        self.counter = RequestCounter(TokenCounter())
        self.ledger = Ledger(LedgerConfig(), OffloadConfig(), self.store,
                             Prices({"*": PRICE}, use_litellm_map=False), self.counter,
                             self.metrics, self.background, shared=shared, clock=self.clock)
        self.usage = DiskUsage(tmp_path)

    async def send(
        self, messages: list[dict[str, Any]], usages: Sequence[Any], *, epoch: str = "",
        forward: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
        status: int = 200,
        extra: dict[str, Any] | None = None, stats: dict[str, int] | None = None,
        evicted: range | None = None,
    ) -> LedgerEntry | None:
        raw = orjson.dumps({"model": "gpt-4o", "messages": messages, **(extra or {})})
        parsed = CHAT.parse(raw, 1000)
        chains = chain_hashes(parsed.items)
        ticket = self.ledger.begin(IDENT, "chat", "gpt-4o")
        sent = self.counter.request(parsed.history, "gpt-4o", None)
        out = forward(parsed.history) if forward is not None else parsed.history
        fwd = self.counter.request(out, "gpt-4o", None)
        result = PipelineResult(out, out is not parsed.history,
                                {"tokens_in": sent, "tokens_out": fwd, **(stats or {})}, (),
                                0.0, epoch=epoch, evicted=evicted)
        writes = Writes("t1", Mode.NOW, self.usage, lambda t: None, self.background.spawn)
        got: list[Sequence[LedgerEntry]] = []
        self.ledger.finish(ticket, parsed=parsed, chains=chains, raw=raw, result=result,
                           calls=RequestCalls(status, usages, [], None), writes=writes,
                           done=got.append)
        await self.background.drain()
        assert len(got) == 1  # told exactly once
        return got[0][0] if got[0] else None


def chat_usage(prompt: int, cached: int, output: int = 10) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": output,
            "prompt_tokens_details": {"cached_tokens": cached}}


def history(turns: int, size: int = 6000) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"turn {i}: " + "word " * (size // 5)})
        msgs.append({"role": "assistant", "content": f"done {i}"})
    return msgs


async def test_an_append_only_session_reads_its_prefix_directly(tmp_path: Path) -> None:
    s = Session(tmp_path)
    first = await s.send(history(1), [chat_usage(1300, 0)])
    assert first is not None and first.gap_s is None and first.cache_reason is None
    # The first request: nothing cached, everything written (at the input price on OpenAI).
    assert first.direct is not None and first.direct.cache_read == 0
    s.clock.now += 20
    second = await s.send(history(2), [chat_usage(2600, 1280)])
    assert second is not None and second.cache_reason is None and second.gap_s == 20
    assert second.direct is not None
    # The shared prefix is the whole first request, as estimated then (in the provider's
    # count), and what the second added is scaled by its own ratio.
    assert first.direct.prompt == 1300 and first.scale == pytest.approx(1300 / first.tokens_sent)
    assert second.direct.cache_read == first.direct.prompt
    added = (2600 - 1300) / (second.tokens_forwarded - first.tokens_forwarded)
    assert second.scale == pytest.approx(added)
    assert second.direct.prompt == 1300 + round((second.tokens_sent - first.tokens_sent) * added)
    assert second.usage == Usage(input=1320, cache_read=1280, output=10)
    assert second.cost == pytest.approx(PRICE.cost(second.usage))
    assert second.direct_cost == pytest.approx(PRICE.cost(second.direct))


async def test_a_lapsed_ttl_is_the_reason_and_the_direct_side_pays_it_too(tmp_path: Path) -> None:
    s = Session(tmp_path)
    await s.send(history(1), [chat_usage(1300, 0)])
    s.clock.now += 20
    await s.send(history(2), [chat_usage(2600, 1280)])
    s.clock.now += 301
    third = await s.send(history(3), [chat_usage(3900, 0)])
    assert third is not None and third.cache_reason == "ttl"
    assert third.direct is not None and third.direct.cache_read == 0
    assert s.metrics.cache_breaks.labels("ttl")._value.get() == 1


async def test_the_clients_own_edit_is_the_reason(tmp_path: Path) -> None:
    s = Session(tmp_path)
    await s.send(history(2), [chat_usage(2600, 0)])
    s.clock.now += 5
    edited = history(3)
    edited[1] = {"role": "user", "content": "a different first request"}
    entry = await s.send(edited, [chat_usage(2700, 0)])
    assert entry is not None and entry.cache_reason == "client"
    # The direct side shares only the system message: below the cacheable minimum, so nothing.
    assert entry.direct is not None and entry.direct.cache_read == 0


async def test_a_compaction_starting_an_epoch_is_the_reason(tmp_path: Path) -> None:
    s = Session(tmp_path)
    await s.send(history(2), [chat_usage(2600, 0)])
    s.clock.now += 5
    summary = {"role": "system", "content": "# Summary of previous conversation\nEarlier."}

    def compacted(h: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [h[0], summary, *h[-2:]]

    entry = await s.send(history(3), [chat_usage(1400, 0)], epoch="abc:5", forward=compacted,
                         stats={"compactions": 1, "compacted": 1}, evicted=range(1, 5))
    assert entry is not None and entry.cache_reason == "compaction" and entry.compaction
    assert entry.compacted and entry.epoch == "abc:5"
    assert [c.what for c in entry.changes] == ["summary", "evicted"]
    # The client extended its history: directly it would have read the whole previous request.
    assert entry.direct is not None and entry.direct.cache_read > 1000
    s.clock.now += 5
    later = await s.send(history(4), [chat_usage(2700, 1400)], epoch="abc:5",
                         forward=lambda h: [h[0], summary, *h[-4:]], evicted=range(1, 5))
    assert later is not None and later.cache_reason is None and not later.compaction
    assert later.changes == ()  # nothing new: the summary and eviction were the epoch's start
    assert entry.changes_from == 0 and later.changes_from == 7  # its new messages only


async def test_without_the_providers_usage_the_proxy_estimates(tmp_path: Path) -> None:
    s = Session(tmp_path)
    first = await s.send(history(1), [None])
    assert first is not None and first.estimated and first.estimate is not None
    assert first.estimate.prompt == first.tokens_forwarded
    s.clock.now += 5
    second = await s.send(history(2), [None])
    assert second is not None and second.estimate is not None
    assert second.estimate.cache_read == first.tokens_forwarded
    assert second.cache_reason is None
    s.clock.now += 400
    third = await s.send(history(3), [None])
    assert third is not None and third.cache_reason == "ttl"
    assert third.estimate is not None and third.estimate.cache_read == 0


async def test_read_rounds_are_their_own_calls(tmp_path: Path) -> None:
    s = Session(tmp_path)
    entry = await s.send(history(1), [chat_usage(1300, 0), chat_usage(1500, 1280),
                                      chat_usage(1700, 1408)])
    assert entry is not None and entry.rounds == 2
    kinds = [e.kind for e in s.store.entries("t1", "s1")]
    assert kinds == ["request", "read_round", "read_round"]
    assert all(e.request == entry.id for e in s.store.entries("t1", "s1"))
    assert all(e.cache_reason is None for e in s.store.entries("t1", "s1"))
    totals = s.store.totals()[0]
    assert totals.billed.prompt == 1300 + 1500 + 1700 and totals.requests == 1


async def test_errors_and_dropped_writes_record_nothing(tmp_path: Path) -> None:
    s = Session(tmp_path)
    assert await s.send(history(1), [None], status=400) is None
    assert s.store.entries("t1", "s1") == []


async def test_an_unmarked_anthropic_client_is_never_cached_directly(tmp_path: Path) -> None:
    s = Session(tmp_path)
    ttl, cacheable = s.ledger.recorder._rule("messages", b'{"messages": []}')
    assert not cacheable
    ttl, cacheable = s.ledger.recorder._rule(
        "messages", b'{"system": [{"type": "text", "text": "x", "cache_control": '
                    b'{"type": "ephemeral", "ttl": "1h"}}]}')
    assert cacheable and ttl == 3600


async def test_summarizer_calls_are_costs(tmp_path: Path) -> None:
    s = Session(tmp_path)
    s.ledger.record_call(IDENT, Call("summarizer", "chat", "gpt-4o", chat_usage(5000, 0, 700),
                                     s.clock()))
    s.ledger.record_call(IDENT, Call("summarizer", "chat", "gpt-4o", None, s.clock(),
                                     status=500))
    await s.background.drain()
    assert [e.kind for e in s.store.entries("t1", "s1")] == ["summarizer"]
    [summary] = s.store.entries("t1", "s1")
    assert summary.cost == pytest.approx(PRICE.cost(Usage(input=5000, output=700)))


async def test_another_replica_served_the_previous_turn(tmp_path: Path) -> None:
    store = MemoryLedger()
    a, b = Session(tmp_path, shared=True, store=store), Session(tmp_path, shared=True,
                                                                store=store)
    await a.send(history(1), [chat_usage(1300, 0)])
    b.clock.now = a.clock.now + 10
    second = await b.send(history(2), [chat_usage(2600, 1280)])
    assert second is not None and second.gap_s == 10 and second.cache_reason is None
    assert second.direct is not None and second.direct.cache_read > 0

"""The cost ledger's pure parts: prices, entries and totals, the counterfactual and cache-break
attribution (proxy.ledger.cache), and the change list (proxy.ledger.changes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.catalog.prices import Price, Prices, load_price_map
from proxy.config.ledger import LedgerConfig
from proxy.config.offload import OffloadConfig
from proxy.config.retrieval import RetrievalConfig
from proxy.history.epoch import without_thinking
from proxy.ledger.cache import (
    ClientChange,
    attribute,
    cache_fell,
    compare,
    direct_prompt,
    direct_usage,
    local_scale,
)
from proxy.ledger.changes import describe
from proxy.model import RequestView
from proxy.offload.stage import Offloader
from proxy.pipeline.validate import PLACEHOLDER
from proxy.session import Identity
from proxy.store.ledger_entry import (
    Change,
    LedgerEntry,
    LedgerTotals,
    Prefix,
    decode_entry,
    encode_entry,
)
from proxy.store.tool_results import relative_path, result_id
from proxy.usage import Usage

# --- prices ----------------------------------------------------------------------------------

MAP = {
    "claude-x-1": {"input_cost_per_token": 3e-06, "output_cost_per_token": 1.5e-05,
                   "cache_read_input_token_cost": 3e-07,
                   "cache_creation_input_token_cost": 3.75e-06,
                   "litellm_provider": "anthropic"},
    "gpt-y": {"input_cost_per_token": 2.5e-06, "output_cost_per_token": 1e-05,
              "cache_read_input_token_cost": 1.25e-06, "litellm_provider": "openai"},
    "openai/gpt-z": {"input_cost_per_token": 1e-06, "output_cost_per_token": 2e-06},
    "no-price": {"max_input_tokens": 1000},
    "sample_spec": {"input_cost_per_token": "prose"},
}


@pytest.fixture
def price_map(tmp_path: Path) -> Path:
    path = tmp_path / "map.json"
    path.write_bytes(orjson.dumps(MAP))
    return path


def test_map_prices_fill_missing_parts_by_provider_rules(price_map: Path) -> None:
    table = load_price_map(price_map)
    claude = table["claude-x-1"]
    assert (claude.input, claude.cache_read, claude.cache_write_5m, claude.output) == pytest.approx(
        (3.0, 0.3, 3.75, 15.0))
    assert claude.cache_write_1h == pytest.approx(6.0)  # Anthropic: 2x the input price
    gpt = table["gpt-y"]
    assert gpt.cache_write_5m == gpt.input == pytest.approx(2.5)  # OpenAI bills no writes
    assert gpt.cache_write_1h == gpt.input
    assert "no-price" not in table and "sample_spec" not in table


def test_lookup_order_config_exact_glob_map_default(price_map: Path) -> None:
    exact = Price.of(input=1, output=2)
    glob = Price.of(input=5, output=6)
    default = Price.of(input=9, output=9)
    prices = Prices({"claude-x-1": exact, "claude-*": glob}, default=default, map_path=price_map)
    assert prices.price("claude-x-1").source == "config:claude-x-1"  # type: ignore[union-attr]
    assert prices.price("anthropic/claude-x-1").source == "config:claude-x-1"  # type: ignore[union-attr]
    assert prices.price("claude-other").source == "config:claude-*"  # type: ignore[union-attr]
    assert prices.price("gpt-y").source == "map:gpt-y"  # type: ignore[union-attr]
    assert prices.price("gpt-y-2024-08-06").source == "map:gpt-y"  # type: ignore[union-attr]
    assert prices.price("gpt-z").source == "map:openai/gpt-z"  # type: ignore[union-attr]
    assert prices.price("who-knows") is default
    assert Prices(map_path=price_map).price("who-knows") is None
    assert Prices(map_path=price_map).cost("who-knows", Usage(input=10)) is None


def test_the_longest_glob_wins(price_map: Path) -> None:
    prices = Prices({"*": Price.of(input=1, output=1), "claude-*-1": Price.of(input=2, output=2),
                     "claude-*": Price.of(input=3, output=3)}, map_path=price_map)
    assert prices.price("claude-x-1").input == 2  # type: ignore[union-attr]
    assert prices.price("claude-y").input == 3  # type: ignore[union-attr]
    assert prices.price("mistral").input == 1  # type: ignore[union-attr]


def test_cost_prices_every_part() -> None:
    price = Price(input=3, cache_read=0.3, cache_write_5m=3.75, cache_write_1h=6, output=15)
    usage = Usage(input=1_000_000, cache_read=2_000_000, cache_write_5m=1_000_000,
                  cache_write_1h=500_000, output=100_000)
    assert price.cost(usage) == pytest.approx(3 + 0.6 + 3.75 + 3 + 1.5)


def test_the_bundled_map_prices_current_models() -> None:
    prices = Prices()
    assert prices.load() > 100
    sonnet = prices.price("claude-sonnet-4-5")
    assert sonnet is not None and sonnet.cache_read < sonnet.input < sonnet.cache_write_5m
    gpt = prices.price("gpt-4o")
    assert gpt is not None and gpt.cache_read < gpt.input == gpt.cache_write_5m


# --- entries and totals ----------------------------------------------------------------------

usages = st.builds(Usage, *(st.integers(0, 10**7) for _ in range(5)))
reasons = st.sampled_from([None, "compaction", "client", "ttl", "unknown"])


@st.composite
def entries(draw: st.DrawFn) -> LedgerEntry:
    kind = draw(st.sampled_from(["request", "read_round", "summarizer", "memory_fold"]))
    usage = draw(st.none() | usages)
    return LedgerEntry(
        tenant="t", session="s", id=draw(st.uuids()).hex, request="r",
        ts=draw(st.floats(0, 2e9)), kind=kind, api="chat", model="m", usage=usage,
        estimate=draw(usages) if usage is None else None,
        cost=draw(st.none() | st.floats(0, 100)), tokens_sent=draw(st.integers(0, 10**6)),
        tokens_forwarded=draw(st.integers(0, 10**6)), direct=draw(st.none() | usages),
        direct_cost=draw(st.none() | st.floats(0, 100)), cache_reason=draw(reasons),
        changes=tuple(draw(st.lists(st.builds(Change, st.text(max_size=5), st.text(max_size=9),
                                              at=st.none() | st.integers(0, 99)), max_size=3))),
        prefix=draw(st.none() | st.builds(Prefix, st.integers(0, 99), st.text(max_size=4))),
    )


@given(entries())
def test_an_entry_survives_its_json(entry: LedgerEntry) -> None:
    assert decode_entry(encode_entry(entry)) == entry


def test_fields_of_a_newer_schema_are_kept() -> None:
    entry = LedgerEntry(tenant="t", session="s", id="a", request="a", ts=1.0, kind="request",
                        api="chat", model="m")
    body = orjson.loads(encode_entry(entry))
    body["future"] = {"x": 1}
    again = decode_entry(orjson.dumps(body))
    assert again.extra == {"future": {"x": 1}}
    assert orjson.loads(encode_entry(again))["future"] == {"x": 1}
    with pytest.raises(ValueError):
        decode_entry(b'{"tenant": "t"}')


@given(st.lists(entries(), max_size=12))
def test_totals_sum_what_each_entry_counts(batch: list[LedgerEntry]) -> None:
    totals = LedgerTotals.of("t", "s", batch)
    requests = [e for e in batch if e.kind == "request"]
    assert totals.calls == len(batch) and totals.requests == len(requests)
    assert totals.billed.prompt == sum(e.billed.prompt for e in batch)
    assert totals.cost == pytest.approx(sum(e.cost or 0 for e in batch))
    assert totals.unpriced == sum(e.cost is None for e in batch)
    assert totals.direct_cost == pytest.approx(sum(e.direct_cost or 0 for e in requests))
    assert sum(totals.breaks.values()) == sum(bool(e.cache_reason) for e in requests)
    assert totals.saved == pytest.approx(totals.direct_cost - totals.cost)


# --- the counterfactual and attribution ------------------------------------------------------

RULE = Prefix(ttl_s=300, cacheable=True)


def test_direct_reads_the_shared_prefix_within_the_ttl() -> None:
    usage = direct_usage(total=10_000, shared=8_000, rule=RULE, gap_s=30, min_tokens=1024,
                         output=50)
    assert usage == Usage(cache_read=8_000, cache_write_5m=2_000, output=50)
    lapsed = direct_usage(total=10_000, shared=8_000, rule=RULE, gap_s=301, min_tokens=1024,
                          output=50)
    assert lapsed == Usage(cache_write_5m=10_000, output=50)
    short = direct_usage(total=1_500, shared=1_000, rule=RULE, gap_s=1, min_tokens=1024,
                         output=0)
    assert short.cache_read == 0  # under the providers' minimum: never cached
    first = direct_usage(total=5_000, shared=0, rule=RULE, gap_s=None, min_tokens=0, output=0)
    assert first == Usage(cache_write_5m=5_000)
    openai = direct_usage(total=10_000, shared=8_000, rule=RULE, gap_s=30, min_tokens=1024,
                          output=5, writes_billed=False)
    assert openai == Usage(input=2_000, cache_read=8_000, output=5)


def test_direct_follows_the_clients_caching() -> None:
    hour = direct_usage(total=10_000, shared=8_000, rule=Prefix(ttl_s=3600), gap_s=1800,
                        min_tokens=0, output=0)
    assert hour == Usage(cache_read=8_000, cache_write_1h=2_000)
    unmarked = direct_usage(total=10_000, shared=8_000, rule=Prefix(cacheable=False),
                            gap_s=1, min_tokens=0, output=7)
    assert unmarked == Usage(input=10_000, output=7)


def test_calibration_scales_only_what_was_added() -> None:
    # The new content's own ratio: 3,000 provider tokens for 4,000 of the proxy's.
    assert local_scale(10_000, 13_000, 12_000, 16_000) == pytest.approx(0.75)
    assert local_scale(10_000, 10_050, 12_000, 12_100) is None  # too little added to tell
    assert local_scale(10_000, 9_000, 12_000, 16_000) is None
    # A request that appended: the previous estimate kept, the new tokens at the scale.
    assert direct_prompt(sent=20_000, scale=0.5, previous=(12_000, 11_000)) == 15_000
    assert direct_prompt(sent=20_000, scale=0.5, previous=None) == 10_000
    assert direct_prompt(sent=10_000, scale=0.5, previous=(12_000, 11_000)) == 5_000


def test_compare_finds_where_the_client_diverged() -> None:
    prev = Prefix(items=4, last="d", head="h")
    assert compare(None, prev, ["a", "b", "c", "d"]) is None
    assert compare(prev, Prefix(items=6, last="f", head="h"),
                   ["a", "b", "c", "d", "e", "f"]) == ClientChange(True, 4, None)
    edited = compare(prev, Prefix(items=5, last="z", head="h"), ["a", "b", "x", "y", "z"],
                     ["a", "b", "c", "d"])
    assert edited == ClientChange(False, 2, 2)
    unknown = compare(prev, Prefix(items=5, last="z", head="h"), ["a", "b", "x", "y", "z"])
    assert unknown is not None and not unknown.extends and not unknown.known
    assert compare(prev, Prefix(items=6, last="f", head="other"), ["a"] * 6) == ClientChange(
        False, 0, -1)


@given(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(0, 30),
       st.lists(st.integers(0, 3), max_size=30))
def test_compare_bisects_to_the_longest_common_prefix(
    base: list[int], keep: int, tail: list[int]
) -> None:
    def chains(values: list[int]) -> list[str]:
        out, acc = [], ""
        for v in values:
            acc = f"{acc}.{v}"
            out.append(acc)
        return out

    previous = chains(base)
    current_values = base[:keep] + tail
    current = chains(current_values)
    prev = Prefix(items=len(previous), last=previous[-1], head="h")
    change = compare(prev, Prefix(items=len(current), head="h"), current, previous)
    assert change is not None
    common = 0
    for a, b in zip(base, current_values, strict=False):
        if a != b:
            break
        common += 1
    if change.extends:
        assert common == len(base)
    else:
        assert change.items == common


def test_cache_fell_beyond_granularity() -> None:
    anth = Usage(input=10, cache_read=50_000, cache_write_5m=3_000)
    assert not cache_fell(anth, Usage(cache_read=53_000, cache_write_5m=900), writes_billed=True)
    assert not cache_fell(anth, Usage(cache_read=52_950, cache_write_5m=900), writes_billed=True)
    assert cache_fell(anth, Usage(cache_read=4_000, cache_write_5m=40_000), writes_billed=True)
    # A shorter prompt (a compaction) can only read as much as it has.
    assert not cache_fell(anth, Usage(cache_read=20_000, input=5), writes_billed=True)
    openai = Usage(input=800, cache_read=3_200)  # 4,000 prompt: cached whole afterwards
    assert not cache_fell(openai, Usage(input=500, cache_read=3_968), writes_billed=False)
    assert cache_fell(openai, Usage(input=4_500, cache_read=0), writes_billed=False)
    assert not cache_fell(Usage(input=900), Usage(input=1_000), writes_billed=False)  # < 1024
    assert not cache_fell(Usage(input=5_000), Usage(input=6_000), writes_billed=True)  # no cache


def test_attribution_order() -> None:
    edit_late = ClientChange(False, 7, 7)
    edit_head = ClientChange(False, 0, -1)
    assert attribute(gap_s=400, ttl_s=300, epoch_start=True, client=edit_head, head=1) == "ttl"
    assert attribute(gap_s=5, ttl_s=300, epoch_start=True, client=edit_head, head=1) == "client"
    assert attribute(gap_s=5, ttl_s=300, epoch_start=True, client=edit_late, head=1) == (
        "compaction")
    assert attribute(gap_s=5, ttl_s=300, epoch_start=False, client=edit_late, head=1) == "client"
    assert attribute(gap_s=5, ttl_s=300, epoch_start=False, client=None, head=1) == "unknown"
    assert attribute(gap_s=5, ttl_s=300, epoch_start=False,
                     client=ClientChange(True, 9, None), head=1) == "unknown"


# --- the change list -------------------------------------------------------------------------

IDENT = Identity("t1", "s1", None)


def _offloader(tmp_path: Path, **offload: Any) -> Offloader:
    return Offloader(OffloadConfig(**offload), RetrievalConfig(), tmp_path)


def _turns(n: int, size: int) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = [{"role": "system", "content": "sys"},
                                     {"role": "user", "content": "go"}]
    for i in range(n):
        call = {"id": f"c{i}", "type": "function",
                "function": {"name": "run_shell", "arguments": "{}"}}
        history.append({"role": "assistant", "content": None, "tool_calls": [call]})
        body = "".join(f"line {k} of output {i}\n" for k in range(size // 20))
        history.append({"role": "tool", "tool_call_id": f"c{i}", "content": body})
    return history


def test_a_stage_one_cut_is_described_as_a_diff_of_the_original(tmp_path: Path) -> None:
    history = _turns(2, 80_000)
    view = RequestView(model="gpt-4o", body={"messages": history}, identity=IDENT)
    out = _offloader(tmp_path).run(history, view, aged_turns=0).messages
    changes = describe(history, out, tenant="t1", session="s1")
    assert [c.what for c in changes] == ["cut", "cut"]
    first = changes[0]
    original = history[3]["content"]
    assert first.at == 3 and first.call_id == "c0" and first.tool == "run_shell"
    assert first.file == relative_path(result_id("t1", "s1", original))
    assert first.kept_bytes is not None and first.notice is not None
    # The forwarded text is exactly the original's first kept_bytes bytes plus the notice.
    forwarded = out[3]["content"]
    excerpt = original.encode()[:first.kept_bytes].decode()
    assert forwarded.startswith(excerpt) and forwarded.endswith(first.notice)
    assert first.bytes_before == len(original.encode())
    assert first.bytes_after == len(forwarded.encode())
    assert describe(history, history, tenant="t1", session="s1") == []


def test_aged_cuts_and_since(tmp_path: Path) -> None:
    history = _turns(6, 60_000)
    view = RequestView(model="gpt-4o", body={"messages": history}, identity=IDENT)
    out = _offloader(tmp_path, recent_n=2).run(history, view, aged_turns=4).messages
    changes = describe(history, out, tenant="t1", session="s1")
    kinds = {c.at: c.what for c in changes}
    assert [kinds[i] for i in (3, 5, 7, 9)] == ["aged"] * 4
    assert [kinds[i] for i in (11, 13)] == ["cut"] * 2
    assert all(c.kept_bytes is not None and c.kept_bytes <= 3000 for c in changes
               if c.what == "aged")
    newer = describe(history, out, tenant="t1", session="s1", since=10)
    assert [c.at for c in newer] == [11, 13]


def test_inserted_evicted_dropped_thinking_and_placeholders() -> None:
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2", "signed_blocks": 1},
        {"role": "tool", "tool_call_id": "orphan", "content": "x"},
        {"role": "user", "content": "u3"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "open", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]
    summary = {"role": "system",
               "content": "# Summary of previous conversation\nThe earlier turns.\n"}
    memory = {"role": "system", "content": "# Long-term memory\nprefs"}
    forwarded = [history[0], memory, summary, history[3], without_thinking(history[4], 4),
                 history[6], history[7],
                 {"role": "tool", "tool_call_id": "open", "content": PLACEHOLDER}]
    changes = describe(history, forwarded, tenant="t", session="s", evicted=range(1, 3))
    got = [(c.what, c.at, c.upto) for c in changes]
    assert ("memory", None, None) in got
    assert ("thinking", 4, None) in got
    assert ("placeholder", None, None) in got
    assert ("evicted", 1, 3) in got
    assert ("dropped", 5, None) in got
    later = describe(history, forwarded, tenant="t", session="s", evicted=range(1, 3), since=5)
    assert [(c.what, c.at) for c in later] == [("dropped", 5)]


def test_ledger_config_defaults() -> None:
    config = LedgerConfig()
    assert config.enabled and config.cache_ttl_s == 300 and config.prices == {}


@settings(max_examples=30)
@given(st.integers(1, 6), st.integers(0, 6))
def test_describe_is_deterministic(n: int, aged: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        history = _turns(n, 60_000)
        view = RequestView(model="gpt-4o", body={"messages": history}, identity=IDENT)
        out = _offloader(Path(tmp), recent_n=2).run(history, view,
                                                     aged_turns=min(aged, n)).messages
    a = describe(history, out, tenant="t1", session="s1")
    b = describe(history, out, tenant="t1", session="s1")
    assert a == b
    assert all(c.at is not None and history[c.at]["role"] == "tool" for c in a)

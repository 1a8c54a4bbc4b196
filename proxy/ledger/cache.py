"""Prompt caching, as the ledger reasons about it (pure): the counterfactual's cached prefix and
why a call's cached share fell.

**The counterfactual** (docs/ledger.md#the-counterfactual): what the client would have paid
sending its own history directly, under the provider's caching rules. For client request ``i``
of a session:

    T_i  = the tokens the client sent, in the provider's tokens (below)
    P_i  = the tokens of the longest prefix request ``i`` shares with request ``i-1`` (whole
           items, ``cache_control`` markers aside: the provider's cache ignores them): all of
           ``T_{i-1}`` when the client appended to its history; 0 when the gap between the two
           exceeds the cache's TTL or the prefix is under ``min_cacheable_tokens``
    direct usage_i = P_i read from the cache, T_i - P_i written to it (at the write price:
           1.25x for Anthropic's 5-minute TTL, 2x for 1 hour; plain input where writes are not
           billed, OpenAI), plus the output the provider reported for the forwarded request

A client that marks nothing for caching on Anthropic (no ``cache_control`` anywhere) is never
cached directly: ``T_i`` at the input price.

Tokens are counted by the proxy (o200k_base) and providers count their own way (Claude's
tokenizer differs, and a log tokenizes unlike prose), so the proxy's counts are scaled to the
provider's: ``T_i = T_{i-1} + (sent_i - sent_{i-1}) * s_i`` for a client that appended, the
whole request at ``s_i`` otherwise (the first, an edited history). ``s_i`` is the ratio of
what the provider billed to what the proxy counted for the content request ``i`` added to the
forwarded request (both in one epoch: the forwarded request opens with the previous one), or,
when that cannot be told (an epoch's first request, too little added), the previous request's
``s``, or the whole forwarded request's ratio.

**Cache breaks.** A call's cached share *fell* when the provider read fewer tokens from its cache
than the previous call of the session left there (what it read plus what it wrote; on OpenAI,
which reports no writes, its whole prompt once it is 1,024 tokens or more), by more than the
providers' granularity (128 tokens, or 2%). Without the provider's usage, the proxy's own view
decides: the prefix broke when the request starts an epoch, the client changed its history, or
the TTL lapsed. The reason, first that applies:

``ttl``         the gap since the previous call exceeds the TTL: the cache was gone anyway;
``client``      the client changed what precedes its new messages (model, tools, system, an
                earlier message: it edited, rewound or compacted its own history), and its
                change comes first in the bytes;
``compaction``  the request starts a new epoch: ctxproxy rewrote what it had forwarded (a new
                summary, re-cuts, the last resort; :mod:`proxy.history.epoch`);
``client``      the client changed its history after the point the compaction rewrote;
``unknown``     none of these: the provider dropped the prefix on its own (eviction, another
                cache shard).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from proxy.store.ledger_entry import Prefix
from proxy.usage import Usage

__all__ = [
    "ClientChange",
    "attribute",
    "cache_fell",
    "compare",
    "direct_prompt",
    "direct_usage",
    "left_cached",
    "local_scale",
]

# OpenAI caches prompts of at least this many tokens, in increments of 128.
OPENAI_MIN: Final = 1024
GRANULARITY: Final = 128
SLACK: Final = 0.02


@dataclass(frozen=True, slots=True)
class ClientChange:
    """How a client request relates to the session's previous one."""

    extends: bool  # it opens with the whole previous request (markers aside)
    items: int  # leading items it shares with the previous request
    at: int | None  # the first item that differs (None: it extends, or unknown); -1: model, tools
    known: bool = True  # False: the shared prefix could not be measured (``items`` is 0)


def compare(previous: Prefix | None, current: Prefix, chains: Sequence[str],
            previous_chains: Sequence[str] | None = None) -> ClientChange | None:
    """Compare the current request (its marker-free item chains) with the previous one
    (None: there was none). ``previous_chains``, the previous request's chains when still in
    memory, locate where a request that does not extend its predecessor diverged."""
    if previous is None:
        return None
    if previous.head != current.head:
        return ClientChange(False, 0, -1)
    n = previous.items
    if n == 0:
        return ClientChange(True, 0, None)
    if len(chains) >= n and chains[n - 1] == previous.last:
        return ClientChange(True, n, None)
    if (previous_chains is None or len(previous_chains) != n
            or previous_chains[-1] != previous.last):
        return ClientChange(False, 0, None, known=False)
    # Chains are prefix-closed (a chain names its message and everything before it): equal at
    # k means equal at every j < k, so the shared length is found by bisection.
    lo, hi = 0, min(n, len(chains))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chains[mid - 1] == previous_chains[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return ClientChange(False, lo, lo)


def local_scale(previous_prompt: int, prompt: int, previous_forwarded: int,
                forwarded: int, *, min_delta: int = 256) -> float | None:
    """The provider's tokens per proxy token of what a request added to the previous one
    (both forwarded in one epoch, so the later opens with the earlier): the new content's own
    ratio, which a whole request's average misses (a log tokenizes unlike prose). None when
    too little was added to tell."""
    grown, counted = prompt - previous_prompt, forwarded - previous_forwarded
    if counted < min_delta or grown <= 0:
        return None
    return min(4.0, max(0.25, grown / counted))


def direct_prompt(*, sent: int, scale: float, previous: tuple[int, int] | None) -> int:
    """``T_i`` in the provider's tokens: a request extending the previous one (``previous``:
    its tokens sent and its direct prompt) is that prompt plus its new tokens at ``scale``, so
    the estimate of what was sent before is never rescaled; any other, all of it at ``scale``."""
    if previous is not None and sent >= previous[0]:
        return previous[1] + round((sent - previous[0]) * scale)
    return round(sent * scale)


def direct_usage(*, total: int, shared: int, rule: Prefix, gap_s: float | None,
                 min_tokens: int, output: int, writes_billed: bool = True) -> Usage:
    """The counterfactual call's usage (module docstring): ``total`` prompt tokens of which
    ``shared`` are the previous request's (0 when there was none), in the provider's tokens.
    Where writes are not billed (OpenAI) the uncached part is plain input."""
    if not rule.cacheable:
        return Usage(input=total, output=output)
    read = 0
    if gap_s is not None and gap_s <= rule.ttl_s and shared >= min_tokens:
        read = min(shared, total)
    written = total - read
    if not writes_billed:
        return Usage(input=written, cache_read=read, output=output)
    if rule.ttl_s >= 3600:
        return Usage(cache_read=read, cache_write_1h=written, output=output)
    return Usage(cache_read=read, cache_write_5m=written, output=output)


def left_cached(usage: Usage, *, writes_billed: bool) -> int:
    """The tokens a call leaves in the provider's cache for the next one: what it read and
    wrote; where writes are not reported (OpenAI), its whole prompt once it is long enough."""
    if writes_billed:
        return usage.cache_read + usage.cache_write
    return usage.prompt if usage.prompt >= OPENAI_MIN else 0


def cache_fell(previous: Usage, current: Usage, *, writes_billed: bool) -> bool:
    """Whether ``current`` read less from the cache than ``previous`` left there (beyond the
    providers' granularity). A shorter prompt can only read that much."""
    expected = min(left_cached(previous, writes_billed=writes_billed), current.prompt)
    if expected <= 0:
        return False
    slack = max(GRANULARITY, round(SLACK * expected))
    return current.cache_read + slack < expected


def attribute(*, gap_s: float | None, ttl_s: float, epoch_start: bool,
              client: ClientChange | None, head: int) -> str:
    """Why a call's cached share fell (module docstring). ``head``: how many leading items the
    compaction never rewrites (the client's leading system items): a client change before it
    comes first in the bytes."""
    if gap_s is not None and gap_s > ttl_s:
        return "ttl"
    changed = client is not None and not client.extends
    if changed and client is not None and client.at is not None and client.at < head:
        return "client"
    if epoch_start:
        return "compaction"
    if changed:
        return "client"
    return "unknown"

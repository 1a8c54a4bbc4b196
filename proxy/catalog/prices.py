"""What a token costs, per model: the price table the ledger prices every call with (data).

Sources, in priority order (as for context windows, :mod:`proxy.catalog.windows`):

1. ``ledger.prices`` from the config: a model name or a glob (``claude-*``), case-insensitive,
   matched against the name as given and with its provider prefix stripped; exact names before
   globs, longer globs before shorter ones;
2. the model map shipped inside litellm (``model_prices_and_context_window_backup.json``), read
   as plain data (litellm is never imported): ``input_cost_per_token``,
   ``cache_read_input_token_cost``, ``cache_creation_input_token_cost`` and
   ``cache_creation_input_token_cost_above_1hr``, ``output_cost_per_token``;
3. ``ledger.default_price``; without one a model neither lists has no price: its tokens are
   recorded and shown, its cost is not (never a made-up number).

A missing part of a price follows the provider's rule: no cache-read price means no discount;
no cache-write price means writes cost the input price (OpenAI bills none); no 1-hour write
price is twice the input price for Anthropic models (their documented rule) and the 5-minute
price otherwise. Prices are USD per million tokens.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

import orjson

from proxy.catalog.data import litellm_model_map_path
from proxy.catalog.windows import PROVIDER_PREFIXES, fallback_variants, name_variants
from proxy.usage import Usage

__all__ = ["Price", "Prices"]

_MILLION: Final = 1_000_000
_RESOLVED_LIMIT: Final = 4_096


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens of each kind, and where the price came from."""

    input: float
    cache_read: float
    cache_write_5m: float
    cache_write_1h: float
    output: float
    source: str = ""  # "config:<pattern>", "map:<key>", "default"

    def cost(self, usage: Usage) -> float:
        """USD for ``usage``."""
        return (usage.input * self.input + usage.cache_read * self.cache_read
                + usage.cache_write_5m * self.cache_write_5m
                + usage.cache_write_1h * self.cache_write_1h
                + usage.output * self.output) / _MILLION

    @classmethod
    def of(cls, *, input: float, output: float, cache_read: float | None = None,
           cache_write: float | None = None, cache_write_1h: float | None = None,
           anthropic: bool = False, source: str = "") -> Price:
        """A price with its missing parts filled in by the provider's rules (module docstring)."""
        write = input if cache_write is None else cache_write
        if cache_write_1h is None:
            cache_write_1h = 2 * input if anthropic and cache_write is not None else write
        return cls(input=input, cache_read=input if cache_read is None else cache_read,
                   cache_write_5m=write, cache_write_1h=cache_write_1h, output=output,
                   source=source)

    def to_json(self) -> dict[str, Any]:
        return {"input": self.input, "cache_read": self.cache_read,
                "cache_write_5m": self.cache_write_5m, "cache_write_1h": self.cache_write_1h,
                "output": self.output, "source": self.source}


def _per_million(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return float(value) * _MILLION


def load_price_map(path: Path, document: object = None) -> dict[str, Price]:
    """Every model in litellm's map with an input and an output price, names lower-cased
    (``document``: the map already parsed)."""
    if document is None:
        document = orjson.loads(path.read_bytes())
    prices: dict[str, Price] = {}
    if not isinstance(document, dict):
        return prices
    for name, entry in document.items():
        if not isinstance(entry, dict):
            continue
        inp = _per_million(entry.get("input_cost_per_token"))
        out = _per_million(entry.get("output_cost_per_token"))
        if inp is None or out is None:
            continue
        key = name.strip().lower()
        provider = str(entry.get("litellm_provider") or "")
        prices.setdefault(key, Price.of(
            input=inp, output=out,
            cache_read=_per_million(entry.get("cache_read_input_token_cost")),
            cache_write=_per_million(entry.get("cache_creation_input_token_cost")),
            cache_write_1h=_per_million(entry.get("cache_creation_input_token_cost_above_1hr")),
            anthropic=provider == "anthropic" or key.startswith("claude"),
            source=f"map:{key}"))
    return prices


class Prices:
    """Price lookup: config entries, then litellm's bundled map, then the default (or none)."""

    def __init__(
        self,
        overrides: Mapping[str, Price] | None = None,
        *,
        default: Price | None = None,
        map_path: Path | None = None,
        use_litellm_map: bool = True,
    ) -> None:
        self.default = default
        exact: dict[str, Price] = {}
        globs: list[tuple[str, Price]] = []
        for pattern, price in (overrides or {}).items():
            key = pattern.strip().lower()
            price = replace(price, source=f"config:{pattern}")
            if any(c in key for c in "*?["):
                globs.append((key, price))
            else:
                exact[key] = price
        self._exact = exact
        # The most specific pattern first: the longest text outside wildcards.
        self._globs = sorted(globs, key=lambda g: -len(g[0].replace("*", "")))
        self._map_path = map_path
        self._use_map = use_litellm_map
        self._map: dict[str, Price] | None = None
        self._lock = threading.Lock()
        self._resolved: dict[str, Price | None] = {}

    def load(self, document: object = None) -> int:
        """Read the map now (idempotent; ~30 ms: call it off the event loop, at start-up).
        ``document``: litellm's map already parsed, used unless a map of another path was
        given."""
        with self._lock:
            if self._map is None:
                path = self._map_path
                if path is None and self._use_map:
                    path = litellm_model_map_path()
                try:
                    self._map = (load_price_map(path, document if self._map_path is None
                                                else None) if path is not None else {})
                except (OSError, orjson.JSONDecodeError):
                    self._map = {}
            return len(self._map)

    def _table(self) -> dict[str, Price]:
        if self._map is None:
            self.load()
        assert self._map is not None
        return self._map

    def _configured(self, model: str) -> Price | None:
        for name in name_variants(model):
            if name in self._exact:
                return self._exact[name]
        for name in name_variants(model):
            for pattern, price in self._globs:
                if fnmatch.fnmatchcase(name, pattern):
                    return price
        return None

    def _mapped(self, model: str) -> Price | None:
        table = self._table()
        variants = list(name_variants(model))
        for name in variants:
            if name in table:
                return table[name]
        for name in _spellings(variants[-1]):
            if name in table:
                return table[name]
            for prefix in PROVIDER_PREFIXES:
                key = f"{prefix}/{name}"
                if key in table:
                    return table[key]
        return None

    def price(self, model: str | None) -> Price | None:
        """The price of ``model`` (None: nobody knows it and no default is set)."""
        if not model:
            return self.default
        if model in self._resolved:
            return self._resolved[model]
        found = self._configured(model) or self._mapped(model) or self.default
        if len(self._resolved) >= _RESOLVED_LIMIT:
            self._resolved.clear()  # model names come from clients: bounded
        self._resolved[model] = found
        return found

    def cost(self, model: str | None, usage: Usage | None) -> float | None:
        """USD for ``usage`` of ``model``; None when either is unknown."""
        if usage is None:
            return None
        found = self.price(model)
        return found.cost(usage) if found is not None else None


def _spellings(bare: str) -> Iterator[str]:
    yield bare
    yield from fallback_variants(bare)

"""Context window (and max output) per model (docs/compaction.md#budget).

Sources, in priority order:

1. ``compaction.context_windows`` from the config (overrides, always win);
2. the model map shipped inside litellm (``model_prices_and_context_window_backup.json``),
   read as plain data with orjson — litellm itself is never imported (that costs seconds);
3. a default of 128 000 tokens.

The map is ~3.5 MB of pricing data; it is parsed once, lazily on the first lookup, and only
``max_input_tokens`` (fallback ``max_tokens``) and ``max_output_tokens`` are kept, in two small
dicts. The parsed document is dropped right away.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Final

import orjson

from proxy.catalog import data as tokenizer_data

__all__ = [
    "DEFAULT_CONTEXT_WINDOW",
    "PROVIDER_PREFIXES",
    "ContextWindows",
    "fallback_variants",
    "load_model_map",
    "name_variants",
]

DEFAULT_CONTEXT_WINDOW: Final = 128_000

# Tried as "<prefix>/<name>" when the bare name is not in the map (litellm keys many
# non-OpenAI models only under their provider, e.g. "gemini/gemini-2.5-pro"). Order matters
# where providers disagree: first-party APIs before resellers.
PROVIDER_PREFIXES: Final = (
    "openai",
    "anthropic",
    "gemini",
    "vertex_ai",
    "mistral",
    "deepseek",
    "xai",
    "azure",
    "bedrock",
    "groq",
    "openrouter",
    "openrouter/openai",
    "openrouter/anthropic",
    "openrouter/google",
)

# "-20250514" or "-2024-08-06": dated snapshots usually share their alias's window.
_DATE_SUFFIX: Final = re.compile(r"-(?:\d{8}|\d{4}-\d{2}-\d{2})$")
# "claude-sonnet-4.5" (OpenRouter spelling) -> "claude-sonnet-4-5" (litellm spelling).
_DOT_BETWEEN_DIGITS: Final = re.compile(r"(?<=\d)\.(?=\d)")
_RESOLVED_LIMIT: Final = 4_096
# Bedrock-style ids: "us.anthropic.claude-sonnet-4-20250514-v1:0" -> "claude-sonnet-4-20250514".
_VENDOR_DOTTED_PREFIX: Final = re.compile(
    r"^(?:[a-z]{2,6}\.)?(?:anthropic|meta|amazon|mistral|cohere|ai21|deepseek|openai|qwen|writer)\."
)
_VERSION_SUFFIX: Final = re.compile(r"-v\d+(?::\d+)?$")


def _as_tokens(value: object) -> int | None:
    # bool is an int subclass; the sample_spec entry holds prose strings.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    tokens = int(value)
    return tokens if tokens > 0 else None


def _bare_names(key: str) -> tuple[str, ...]:
    """Provider-neutral spellings a map key answers to (for names no provider lists as such)."""
    bare = key.rsplit("/", 1)[-1]
    # Cheap guards first: the regexes are the cost of building the index.
    if "." in bare:
        bare = _VENDOR_DOTTED_PREFIX.sub("", bare)
    if "-v" in bare:
        bare = _VERSION_SUFFIX.sub("", bare)
    if bare[-1:].isdigit():
        undated = _DATE_SUFFIX.sub("", bare)
        if undated != bare:
            return bare, undated
    return (bare,)


def _most_common(values: list[int]) -> int:
    # Resellers cap windows differently; the value most of them list is the model's own.
    # Ties go to the smaller window: compacting early is cheaper than an overflow error.
    counts: dict[int, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return min(counts, key=lambda value: (-counts[value], value))


def _bare_index(
    windows: Mapping[str, int], outputs: Mapping[str, int]
) -> tuple[dict[str, int], dict[str, int]]:
    grouped_windows: dict[str, list[int]] = {}
    grouped_outputs: dict[str, list[int]] = {}
    for key in windows.keys() | outputs.keys():
        names = _bare_names(key)
        window = windows.get(key)
        output = outputs.get(key)
        for bare in names:
            if window is not None:
                grouped_windows.setdefault(bare, []).append(window)
            if output is not None:
                grouped_outputs.setdefault(bare, []).append(output)
    return (
        {bare: _most_common(values) for bare, values in grouped_windows.items()},
        {bare: _most_common(values) for bare, values in grouped_outputs.items()},
    )


def load_model_map(path: Path, document: object = None) -> tuple[dict[str, int], dict[str, int]]:
    """Parse litellm's map into ({name: input window}, {name: max output}), names lower-cased
    (``document``: the map already parsed)."""
    if document is None:
        document = orjson.loads(path.read_bytes())
    windows: dict[str, int] = {}
    outputs: dict[str, int] = {}
    if not isinstance(document, dict):
        return windows, outputs
    for name, entry in document.items():
        if not isinstance(entry, dict):
            continue
        key = name.strip().lower()
        window = _as_tokens(entry.get("max_input_tokens"))
        if window is None:
            window = _as_tokens(entry.get("max_tokens"))
        if window is not None:
            windows.setdefault(key, window)
        output = _as_tokens(entry.get("max_output_tokens"))
        if output is not None:
            outputs.setdefault(key, output)
    return windows, outputs


def name_variants(model: str) -> Iterator[str]:
    """Spellings of ``model`` from most to least specific: as given, then provider-stripped."""
    name = model.strip().lower()
    yield name
    while "/" in name:
        name = name.split("/", 1)[1]
        yield name


def fallback_variants(bare: str) -> Iterator[str]:
    """Last-resort spellings of the bare name: date suffix removed, dots between digits dashed."""
    undated = _DATE_SUFFIX.sub("", bare)
    if undated != bare:
        yield undated
    dashed = _DOT_BETWEEN_DIGITS.sub("-", bare)
    if dashed != bare:
        yield dashed
        undated_dashed = _DATE_SUFFIX.sub("", dashed)
        if undated_dashed != dashed:
            yield undated_dashed


class ContextWindows:
    """Context window lookup: config overrides, then litellm's bundled map, then a default."""

    def __init__(
        self,
        overrides: Mapping[str, int] | None = None,
        *,
        default: int = DEFAULT_CONTEXT_WINDOW,
        map_path: Path | None = None,
        use_litellm_map: bool = True,
    ) -> None:
        """``map_path`` replaces litellm's file (tests); ``use_litellm_map=False`` disables it."""
        self.default = default
        self._overrides: dict[str, int] = {}
        for name, tokens in (overrides or {}).items():
            value = _as_tokens(tokens)
            if value is not None:
                self._overrides[name.strip().lower()] = value
        self._map_path = map_path
        self._use_map = use_litellm_map
        self._windows: dict[str, int] | None = None
        self._outputs: dict[str, int] = {}
        # Provider-neutral index, built on the first lookup that needs it (~10 ms).
        self._bare: tuple[dict[str, int], dict[str, int]] | None = None
        self._lock = threading.Lock()
        self._resolved: dict[str, tuple[int, str]] = {}
        #: Seconds the map took to read and reduce (None until loaded).
        self.load_seconds: float | None = None
        #: File the map was read from (None if unavailable or not loaded yet).
        self.loaded_from: Path | None = None

    # ------------------------------------------------------------------ map

    def load(self, document: object = None) -> int:
        """Read the model map now (idempotent); returns the number of models with a window.

        Call from the app lifespan to keep the ~30 ms parse off the first request. A missing or
        unreadable map leaves only overrides and the default. ``document``: litellm's map
        already parsed (:func:`proxy.tokenizer_data.read_litellm_model_map`), used unless a
        map of another path was given.
        """
        with self._lock:
            if self._windows is not None:
                return len(self._windows)
            started = time.perf_counter()
            windows: dict[str, int] = {}
            outputs: dict[str, int] = {}
            path = self._map_path
            if path is None and self._use_map:
                path = tokenizer_data.litellm_model_map_path()
            if path is not None:
                try:
                    windows, outputs = load_model_map(
                        path, document if self._map_path is None else None)
                    self.loaded_from = path
                except (OSError, orjson.JSONDecodeError):
                    windows, outputs = {}, {}
            self._outputs = outputs
            self._windows = windows
            self.load_seconds = time.perf_counter() - started
            return len(windows)

    def _bare_tables(self) -> tuple[dict[str, int], dict[str, int]]:
        bare = self._bare
        if bare is None:
            self._map()
            with self._lock:
                if self._bare is None:
                    self._bare = _bare_index(self._windows or {}, self._outputs)
                bare = self._bare
        return bare

    def _map(self) -> dict[str, int]:
        windows = self._windows
        if windows is None:
            self.load()
            windows = self._windows
            assert windows is not None
        return windows

    # ------------------------------------------------------------------ lookups

    def _lookup(
        self, table: Mapping[str, int], outputs: bool, model: str
    ) -> tuple[int, str] | None:
        """Map lookup: exact, provider-stripped, "<provider>/<name>", date/dot variants, and
        finally the provider-neutral index (most common window among keys naming the model)."""
        variants = list(name_variants(model))
        for name in variants:
            if name in table:
                return table[name], name
        bare = variants[-1]
        spellings = (bare, *fallback_variants(bare))
        # Provider-listed spellings first (a first-party entry beats any reseller's) ...
        for name in spellings:
            if name in table:
                return table[name], name
            for prefix in PROVIDER_PREFIXES:
                key = f"{prefix}/{name}"
                if key in table:
                    return table[key], key
        # ... then the provider-neutral index, where resellers and Bedrock ids vote.
        bare_table = self._bare_tables()[1 if outputs else 0]
        for name in spellings:
            if name in bare_table:
                return bare_table[name], f"~{name}"
        return None

    def resolve(self, model: str | None) -> tuple[int, str]:
        """(window, source): source is "override:<key>", "map:<key>" (``map:~<name>`` when
        matched through the provider-neutral index) or "default"."""
        if not model:
            return self.default, "default"
        cached = self._resolved.get(model)
        if cached is not None:
            return cached
        result: tuple[int, str]
        # Overrides only by the given name or provider-stripped names: a config entry is exact
        # intent, so it is not subjected to the date/dot heuristics.
        for name in name_variants(model):
            if name in self._overrides:
                result = (self._overrides[name], f"override:{name}")
                break
        else:
            found = self._lookup(self._map(), False, model)
            result = (found[0], f"map:{found[1]}") if found else (self.default, "default")
        if len(self._resolved) >= _RESOLVED_LIMIT:
            # Model names come from clients; bound the memo instead of trusting them.
            self._resolved.clear()
        self._resolved[model] = result
        return result

    def window(self, model: str | None) -> int:
        """Context window (input tokens) of ``model``."""
        return self.resolve(model)[0]

    def max_output(self, model: str | None) -> int | None:
        """``max_output_tokens`` from the map (None when unknown); caps the reserved output."""
        if not model:
            return None
        self._map()
        found = self._lookup(self._outputs, True, model)
        return found[0] if found else None

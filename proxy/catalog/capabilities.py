"""What a model accepts on its provider's API, per model: read from data, never guessed at
run time.

Sources, in priority order (as for context windows and prices):

1. ``catalog.models`` from the config: a model name or a glob (``claude-opus-5*``),
   case-insensitive, matched against the name as given and with its provider prefix stripped;
   exact names before globs, longer globs before shorter ones. A field left unset there falls
   through to the next source;
2. the model map shipped inside litellm, read as plain data: ``supports_sampling_params``, and
   ``mode`` / ``supported_endpoints`` (a model listed with endpoints but not
   ``/v1/chat/completions``, or of ``mode: responses``, is served by the Responses API alone);
3. :data:`BUILTIN`, what the map does not say but the providers document, matched like the
   config's entries: OpenAI's reasoning models (GPT-5 family, o-series) take only the default
   temperature (400 "Unsupported value: 'temperature' does not support 0 with this model. Only
   the default (1) value is supported."; litellm enforces it in code, not in its map:
   github.com/BerriAI/litellm/issues/13781), ``gpt-5-chat*`` (not a reasoning model) any;
4. the default: sampling parameters accepted, chat completions served.

Why each fact matters to the proxy:

* ``sampling_params``: newer Claude models (and the API version ``2026-10-21``) refuse
  ``temperature``, ``top_p`` and ``top_k``; GPT-5-family and o-series models accept only the
  default temperature. The proxy's own calls send none unless configured.
* ``chat_completions``: the ``-codex`` models exist only on ``/v1/responses``.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

import orjson

from proxy.catalog.data import litellm_model_map_path
from proxy.catalog.windows import PROVIDER_PREFIXES, fallback_variants, name_variants

__all__ = ["BUILTIN", "Capabilities", "ModelFacts"]

_RESOLVED_LIMIT: Final = 4_096


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What one model accepts. ``None`` in an override: not said there (the map decides)."""

    sampling_params: bool | None = None
    chat_completions: bool | None = None
    source: str = ""

    def over(self, base: ModelFacts) -> ModelFacts:
        """These facts where set, ``base``'s elsewhere."""
        return ModelFacts(
            sampling_params=(self.sampling_params if self.sampling_params is not None
                             else base.sampling_params),
            chat_completions=(self.chat_completions if self.chat_completions is not None
                              else base.chat_completions),
            source=f"{self.source}+{base.source}" if base.source else self.source,
        )


_DEFAULT: Final = ModelFacts(sampling_params=True, chat_completions=True, source="default")


#: What the providers document and litellm's map leaves out (see the module docstring).
BUILTIN: Final[Mapping[str, ModelFacts]] = {
    "gpt-5*": ModelFacts(sampling_params=False),
    "gpt-5-chat*": ModelFacts(sampling_params=True),
    "o1*": ModelFacts(sampling_params=False),
    "o3*": ModelFacts(sampling_params=False),
    "o4*": ModelFacts(sampling_params=False),
}


class _Patterns:
    """Entries by exact name or glob: exact names first, then longer globs before shorter."""

    def __init__(self, entries: Mapping[str, ModelFacts], source: str) -> None:
        self.exact: dict[str, ModelFacts] = {}
        globs: list[tuple[str, ModelFacts]] = []
        for pattern, facts in entries.items():
            key = pattern.strip().lower()
            facts = replace(facts, source=f"{source}:{pattern}")
            if any(c in key for c in "*?["):
                globs.append((key, facts))
            else:
                self.exact[key] = facts
        self.globs = sorted(globs, key=lambda g: -len(g[0].replace("*", "")))

    def match(self, model: str) -> ModelFacts | None:
        for name in name_variants(model):
            if name in self.exact:
                return self.exact[name]
        for name in name_variants(model):
            for pattern, facts in self.globs:
                if fnmatch.fnmatchcase(name, pattern):
                    return facts
        return None


def _flag(entry: Mapping[str, object], key: str) -> bool | None:
    value = entry.get(key)
    return value if isinstance(value, bool) else None


def _chat_completions(entry: Mapping[str, object]) -> bool | None:
    endpoints = entry.get("supported_endpoints")
    if isinstance(endpoints, list) and endpoints:
        return "/v1/chat/completions" in endpoints
    if entry.get("mode") == "responses":
        return False
    return None


def load_facts(path: Path, document: object = None) -> dict[str, ModelFacts]:
    """Every model of litellm's map that says something the proxy uses, names lower-cased
    (``document``: the map already parsed)."""
    if document is None:
        document = orjson.loads(path.read_bytes())
    facts: dict[str, ModelFacts] = {}
    if not isinstance(document, dict):
        return facts
    for name, entry in document.items():
        if not isinstance(entry, dict):
            continue
        found = ModelFacts(
            sampling_params=_flag(entry, "supports_sampling_params"),
            chat_completions=_chat_completions(entry),
        )
        if found == ModelFacts():
            continue
        key = name.strip().lower()
        facts.setdefault(key, replace(found, source=f"map:{key}"))
    return facts


class Capabilities:
    """Per-model facts: config entries, then litellm's bundled map, then the default."""

    def __init__(
        self,
        overrides: Mapping[str, ModelFacts] | None = None,
        *,
        map_path: Path | None = None,
        use_litellm_map: bool = True,
    ) -> None:
        self._config = _Patterns(overrides or {}, "config")
        self._builtin = _Patterns(BUILTIN, "builtin")
        self._map_path = map_path
        self._use_map = use_litellm_map
        self._map: dict[str, ModelFacts] | None = None
        self._lock = threading.Lock()
        self._resolved: dict[str, ModelFacts] = {}

    def load(self, document: object = None) -> int:
        """Read the map now (idempotent; call it at start-up, off the event loop).
        ``document``: litellm's map already parsed, used unless another path was given."""
        with self._lock:
            if self._map is None:
                path = self._map_path
                if path is None and self._use_map:
                    path = litellm_model_map_path()
                try:
                    self._map = (load_facts(path, document if self._map_path is None else None)
                                 if path is not None else {})
                except (OSError, orjson.JSONDecodeError):
                    self._map = {}
            return len(self._map)

    def _table(self) -> dict[str, ModelFacts]:
        if self._map is None:
            self.load()
        assert self._map is not None
        return self._map

    def _mapped(self, model: str) -> ModelFacts | None:
        table = self._table()
        variants = list(name_variants(model))
        for name in variants:
            if name in table:
                return table[name]
        bare = variants[-1]
        for name in (bare, *fallback_variants(bare)):
            if name in table:
                return table[name]
            for prefix in PROVIDER_PREFIXES:
                key = f"{prefix}/{name}"
                if key in table:
                    return table[key]
        return None

    def of(self, model: str | None) -> ModelFacts:
        """Every fact about ``model``, none left unset."""
        if not model:
            return _DEFAULT
        found = self._resolved.get(model)
        if found is not None:
            return found
        facts = _DEFAULT
        for source in (self._builtin.match(model), self._mapped(model),
                       self._config.match(model)):
            if source is not None:
                facts = source.over(facts)
        if len(self._resolved) >= _RESOLVED_LIMIT:
            self._resolved.clear()  # model names come from clients: bounded
        self._resolved[model] = facts
        return facts

    def sampling_params(self, model: str | None) -> bool:
        return bool(self.of(model).sampling_params)

    def chat_completions(self, model: str | None) -> bool:
        return bool(self.of(model).chat_completions)

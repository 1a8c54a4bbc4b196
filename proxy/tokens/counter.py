"""Token counting for chat-completions requests (docs/tokens.md#counting).

The proxy decides when to compact from these counts, so they have to be close to what the
provider will see, cheap on long histories, and available offline:

* Text is counted with tiktoken, using the model's encoding: ``o200k_base`` for current OpenAI
  models, ``cl100k_base`` for older ones, and ``o200k_base`` as the estimate for other providers
  (Claude, Gemini, unknown names). The BPE files come from litellm's bundled copy
  (:mod:`proxy.catalog.data`); if they are unavailable the counter never lets tiktoken
  download, it falls back to ``ceil(len(utf8) / 4)``.
* Message overhead follows the OpenAI cookbook (``num_tokens_from_messages``): 3 tokens per
  message, the role and every string field counted as text, +1 for ``name``, +3 per request to
  prime the reply. For text-only conversations on OpenAI models the result is exactly the
  cookbook's.
* Images are counted by OpenAI's tile rule, never by base64 length; their size is read from the
  header of a ``data:`` URL by decoding only the few bytes needed.
* Tool calls, tool results, audio, files and the ``tools`` schemas are estimates with the
  overheads documented at the constants below (OpenAI does not publish the exact rendering).
* Counts are cached per message (hash of the canonical JSON + encoding name, bounded LRU), so a
  long history that the client resends every turn only costs hashing for the messages already
  seen.

There is no module-level mutable state: the app creates one :class:`TokenCounter` in its
lifespan and passes it down.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import orjson

from proxy.catalog import data as tokenizer_data
from proxy.lru import LRU
from proxy.tokens.media import FILE_REFERENCE_TOKENS, image_dimensions_from_data_url, image_tokens
from proxy.tokens.rules import (
    CL100K,
    ENUM_INIT,
    ENUM_ITEM,
    ESTIMATE,
    FUNC_END,
    FUNC_INIT,
    O200K,
    PROP_INIT,
    PROP_KEY,
    REPLY_PRIMING,
    TOKENS_PER_MESSAGE,
    TOKENS_PER_NAME,
    TOOL_CALL_OVERHEAD,
    TOOL_RESULT_OVERHEAD,
    TextCounter,
    _count_image_part,
    _count_message,
    _count_part,
    _count_tools,
)

if TYPE_CHECKING:
    from tiktoken import Encoding

__all__ = [
    "CL100K",
    "ENUM_INIT",
    "ENUM_ITEM",
    "FILE_REFERENCE_TOKENS",
    "FUNC_END",
    "FUNC_INIT",
    "PROP_INIT",
    "PROP_KEY",
    "REPLY_PRIMING",
    "TOKENS_PER_MESSAGE",
    "TOKENS_PER_NAME",
    "TOOL_CALL_OVERHEAD",
    "TOOL_RESULT_OVERHEAD",
    "TextCounter",
    "_count_image_part",
    "_count_message",
    "_count_part",
    "_count_tools",
    "ESTIMATE",
    "O200K",
    "TokenCounter",
    "encoding_name_for_model",
    "image_dimensions_from_data_url",
    "image_tokens",
    "strip_provider",
]


DEFAULT_CACHE_SIZE: Final = 50_000
_MODEL_CACHE_LIMIT: Final = 4_096

# Prefix tables, checked in order. o200k first so "gpt-4o" is not caught by the "gpt-4" rule.
_O200K_PREFIXES: Final = (
    "gpt-4o",
    "gpt-4.",  # gpt-4.1, gpt-4.5 and later 4.x
    "gpt-5",
    "gpt-oss",
    "chatgpt-4o",
    "o1",
    "o3",
    "o4",
    "codex-",
    "computer-use-",
)
_CL100K_PREFIXES: Final = (
    "gpt-4",  # gpt-4, gpt-4-turbo, gpt-4-32k, gpt-4-0613, ...
    "gpt-3.5",
    "gpt-35",  # Azure spelling of gpt-3.5-turbo
    "text-embedding-",
    "davinci-002",
    "babbage-002",
)



# ============================================================================================
# Pure helpers
# ============================================================================================


def strip_provider(model: str) -> str:
    """Bare model name: lower-cased, provider prefixes ("openai/", "azure/", ...) and "ft:" removed."""
    name = model.strip().lower()
    if "/" in name:
        name = name.rsplit("/", 1)[1]
    name = name.removeprefix("ft:")
    return name


def encoding_name_for_model(model: str | None) -> str:
    """The tiktoken encoding used to count for ``model`` (before checking availability)."""
    if not model:
        return O200K
    name = strip_provider(model)
    if name.startswith(_O200K_PREFIXES):
        return O200K
    if name.startswith(_CL100K_PREFIXES):
        return CL100K
    # Claude, Gemini, Llama, unknown: o200k is the closest general-purpose estimate.
    return O200K


# ============================================================================================
# Counter
# ============================================================================================


class TokenCounter:
    """Counts tokens of chat messages, tool schemas and whole requests, with a per-message cache.

    Thread-safe: encodings load under a lock, the LRU is guarded by a lock, and tiktoken's
    ``encode_ordinary`` is itself thread-safe, so counting may run in worker threads.
    """

    def __init__(self, *, cache_size: int = DEFAULT_CACHE_SIZE, use_tiktoken: bool = True) -> None:
        """``use_tiktoken=False`` forces the utf8/4 estimate (tests, or a deliberate fast mode)."""
        self._cache_size = max(0, cache_size)
        self._use_tiktoken = use_tiktoken
        self._cache: LRU[tuple[bytes, str], int] = LRU(max(self._cache_size, 1))
        self._stats_lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._encodings: dict[str, Encoding | None] = {}
        self._counters: dict[str, TextCounter] = {}
        self._model_encoding: dict[str, str] = {}
        self._tiktoken_dir: Path | None = None
        self._tiktoken_dir_checked = False
        self.cache_hits = 0
        self.cache_misses = 0
        #: Seconds spent loading each encoding (or failing to), for diagnostics.
        self.load_seconds: dict[str, float] = {}

    # ---------------------------------------------------------------- encodings

    @property
    def tiktoken_dir(self) -> Path | None:
        """Directory the BPE files were loaded from (None before first use or when unavailable)."""
        return self._tiktoken_dir

    def _load_encoding(self, name: str) -> Encoding | None:
        """Load ``name`` without ever downloading; None means "use the estimate"."""
        with self._load_lock:
            if name in self._encodings:
                return self._encodings[name]
            started = time.perf_counter()
            encoding: Encoding | None = None
            try:
                encoding = self._load_encoding_offline(name)
            except Exception:  # noqa: BLE001 - counting must degrade to estimates, never fail
                encoding = None
            self.load_seconds[name] = time.perf_counter() - started
            self._encodings[name] = encoding
            return encoding

    def _load_encoding_offline(self, name: str) -> Encoding | None:
        if not self._use_tiktoken or name not in tokenizer_data.TIKTOKEN_URLS:
            return None
        import tiktoken
        import tiktoken.registry

        # Already built in this process (e.g. by litellm): no file access needed at all.
        existing = tiktoken.registry.ENCODINGS.get(name)
        if existing is not None:
            return existing
        if not self._tiktoken_dir_checked:
            self._tiktoken_dir = tokenizer_data.ensure_tiktoken_offline()
            self._tiktoken_dir_checked = True
        directory = self._tiktoken_dir
        # Without a verified local file, get_encoding would fetch from the network.
        if directory is None or not tokenizer_data.verify_tiktoken_file(directory, name):
            return None
        return tiktoken.get_encoding(name)

    def encoding_name(self, model: str | None) -> str:
        """Name of the encoding actually used for ``model``: o200k_base, cl100k_base or utf8/4."""
        key = model or ""
        cached = self._model_encoding.get(key)
        if cached is not None:
            return cached
        wanted = encoding_name_for_model(model)
        effective = wanted if self._load_encoding(wanted) is not None else ESTIMATE
        if len(self._model_encoding) >= _MODEL_CACHE_LIMIT:
            # Model names come from clients; bound the memo instead of trusting them.
            self._model_encoding.clear()
        self._model_encoding[key] = effective
        return effective

    def resolved(self, model: str | None) -> bool:
        """True once ``model``'s encoding is known (loaded, or settled on the estimate)."""
        return (model or "") in self._model_encoding

    def preload(self, models: Iterable[str] = ("gpt-4o",)) -> dict[str, float]:
        """Load the encodings of ``models`` now (app lifespan) so no request pays for it."""
        for model in models:
            self.encoding_name(model)
        return dict(self.load_seconds)

    def _text_counter(self, encoding: str) -> TextCounter:
        counter = self._counters.get(encoding)
        if counter is not None:
            return counter
        loaded = self._encodings.get(encoding) if encoding != ESTIMATE else None
        if loaded is None:
            return _estimate_text
        encode = loaded.encode_ordinary

        def count(text: str) -> int:
            # encode_ordinary: special-token strings in user text are plain text, and
            # encode() would raise on them.
            return len(encode(text)) if text else 0

        self._counters[encoding] = count
        return count

    def count_text(self, text: str, model: str | None) -> int:
        """Tokens of a bare string (no message overhead)."""
        return self._text_counter(self.encoding_name(model))(text)

    # ---------------------------------------------------------------- cache

    @property
    def cache_len(self) -> int:
        return len(self._cache)

    def clear_cache(self) -> None:
        self._cache.clear()
        with self._stats_lock:
            self.cache_hits = 0
            self.cache_misses = 0

    def _cached(self, kind: bytes, value: object, encoding: str, compute: Callable[[], int]) -> int:
        if self._cache_size == 0:
            return compute()
        try:
            canonical = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        except TypeError:
            # Not JSON (never the case for parsed requests): count without caching.
            return compute()
        key = (hashlib.blake2b(kind + canonical, digest_size=16).digest(), encoding)
        hit = self._cache.get(key)
        with self._stats_lock:
            if hit is not None:
                self.cache_hits += 1
                return hit
            self.cache_misses += 1
        result = compute()
        self._cache.put(key, result)
        return result

    # ---------------------------------------------------------------- messages

    def count_message(self, msg: Mapping[str, Any], model: str | None) -> int:
        """Tokens of one message, cookbook accounting, without the per-request reply priming."""
        encoding = self.encoding_name(model)
        count = self._text_counter(encoding)
        return self._cached(b"m", msg, encoding, lambda: _count_message(msg, count))

    def count_messages(self, messages: Sequence[Mapping[str, Any]], model: str | None) -> int:
        """Sum of :meth:`count_message` (no reply priming, no tools)."""
        # Resolve the encoding once: on a warm history the per-message cost should be the
        # hashing, not repeated lookups.
        encoding = self.encoding_name(model)
        count = self._text_counter(encoding)
        total = 0
        for msg in messages:
            total += self._cached(
                b"m", msg, encoding, functools.partial(_count_message, msg, count)
            )
        return total

    def count_tools(self, tools: Sequence[Mapping[str, Any]] | None, model: str | None) -> int:
        """Estimated tokens of the request's ``tools`` schemas (cookbook ``num_tokens_for_tools``).

        For flat schemas this is the cookbook formula: per function 7 (o200k) / 10 (cl100k) +
        ``name:description``; +3 if it has properties; per property 3 + ``name:type:description``
        (enum: -3 + 3 and the value per item); +12 once. Nested schemas (objects, arrays, anyOf,
        $defs...) add the tokens of their compact JSON, which over-approximates OpenAI's
        TypeScript-like rendering slightly. An estimate: OpenAI does not publish the format.
        """
        if not tools:
            return 0
        encoding = self.encoding_name(model)
        count = self._text_counter(encoding)
        return self._cached(b"t", tools, encoding, lambda: _count_tools(tools, count, encoding))

    def count_request(
        self,
        messages: Sequence[Mapping[str, Any]],
        model: str | None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> int:
        """Prompt tokens of a request: messages + tools + 3 for the reply priming."""
        return self.count_messages(messages, model) + self.count_tools(tools, model) + REPLY_PRIMING


def _estimate_text(text: str) -> int:
    # ~4 bytes per token for English-like text; rounding up keeps the estimate on the safe side.
    return (len(text.encode("utf-8", "surrogatepass")) + 3) // 4 if text else 0

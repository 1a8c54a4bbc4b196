"""Token counting for chat-completions requests (SPEC section 5, "Counting").

The proxy decides when to compact from these counts, so they have to be close to what the
provider will see, cheap on long histories, and available offline:

* Text is counted with tiktoken, using the model's encoding: ``o200k_base`` for current OpenAI
  models, ``cl100k_base`` for older ones, and ``o200k_base`` as the estimate for other providers
  (Claude, Gemini, unknown names). The BPE files come from litellm's bundled copy
  (:mod:`proxy.tokenizer_data`); if they are unavailable the counter never lets tiktoken
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
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import orjson

from proxy import tokenizer_data

from .media import (
    AUDIO_TOKENS_PER_SECOND,
    FILE_REFERENCE_TOKENS,
    _audio_tokens,
    _file_data_tokens,
    image_dimensions_from_data_url,
    image_tokens,
)

if TYPE_CHECKING:
    from tiktoken import Encoding

__all__ = [
    "CL100K",
    "ESTIMATE",
    "O200K",
    "TokenCounter",
    "encoding_name_for_model",
    "image_dimensions_from_data_url",
    "image_tokens",
    "strip_provider",
]

O200K: Final = "o200k_base"
CL100K: Final = "cl100k_base"
# Pseudo-encoding used when tiktoken data is unavailable: ceil(len(utf8) / 4). Part of the
# cache key, so estimates and real counts never mix.
ESTIMATE: Final = "utf8/4"

# --- Message accounting (OpenAI cookbook, "How to count tokens with tiktoken") ---------------
TOKENS_PER_MESSAGE: Final = 3  # <|start|>{role/name}\n ... <|end|>
TOKENS_PER_NAME: Final = 1
REPLY_PRIMING: Final = 3  # every reply is primed with <|start|>assistant<|message|>

# --- Tool-call estimates (not published by OpenAI) -------------------------------------------
# An assistant tool call is rendered roughly as its own message addressed to
# "functions.<name>": a message header (3) plus the recipient/namespace markers (~4).
TOOL_CALL_OVERHEAD: Final = 7
# A tool result is a message whose author is the function it answers; the tool_call_id itself
# is mapped to that author rather than sent as text, so it costs a small constant.
TOOL_RESULT_OVERHEAD: Final = 4

# --- Tool schema accounting (cookbook ``num_tokens_for_tools``) -------------------------------
# Per-function start: 7 for o200k models (gpt-4o family), 10 for cl100k (gpt-4/gpt-3.5).
FUNC_INIT: Final[Mapping[str, int]] = {O200K: 7, CL100K: 10, ESTIMATE: 7}
PROP_INIT: Final = 3  # once per function that has properties
PROP_KEY: Final = 3  # per property
ENUM_INIT: Final = -3  # per property that has an enum
ENUM_ITEM: Final = 3  # per enum value (plus the value's own tokens)
FUNC_END: Final = 12  # once per request with tools

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

# Message keys that are metadata for the proxy/provider SDK, not text the model reads.
_IGNORED_MESSAGE_KEYS: Final = frozenset({"cache_control"})


TextCounter = Callable[[str], int]


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


def _compact_json(value: object) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return str(value)


def _strip_period(text: str) -> str:
    return text.removesuffix(".")


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
        self._cache: OrderedDict[tuple[bytes, str], int] = OrderedDict()
        self._cache_lock = threading.Lock()
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

    def preload(self, models: Iterable[str] = ("gpt-4o", "gpt-4")) -> dict[str, float]:
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
        with self._cache_lock:
            self._cache.clear()
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
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return hit
            self.cache_misses += 1
        result = compute()
        with self._cache_lock:
            self._cache[key] = result
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
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


# ============================================================================================
# Uncached counting (pure functions of the message and a text counter)
# ============================================================================================


def _count_message(msg: Mapping[str, Any], count: TextCounter) -> int:
    if not isinstance(msg, Mapping):
        return TOKENS_PER_MESSAGE + count(_compact_json(msg))
    total = TOKENS_PER_MESSAGE
    for key, value in msg.items():
        if value is None or key in _IGNORED_MESSAGE_KEYS:
            continue
        if key == "content":
            total += _count_content(value, count)
        elif key == "name":
            total += count(str(value)) + TOKENS_PER_NAME
        elif key == "tool_calls":
            total += _count_tool_calls(value, count)
        elif key == "function_call":
            total += _count_function_call(value, count)
        elif key == "tool_call_id":
            total += TOOL_RESULT_OVERHEAD
        elif isinstance(value, str):
            # role, refusal, reasoning_content, ...: the cookbook counts every string field.
            total += count(value)
        elif isinstance(value, bool | int | float):
            continue  # flags such as "prefix": true are not text the model reads
        else:
            total += count(_compact_json(value))
    return total


def _count_content(content: object, count: TextCounter) -> int:
    if isinstance(content, str):
        return count(content)
    if isinstance(content, list):
        return sum(_count_part(part, count) for part in content)
    if content is None:
        return 0
    return count(_compact_json(content))


def _count_part(part: object, count: TextCounter) -> int:
    if isinstance(part, str):
        return count(part)
    if not isinstance(part, Mapping):
        return count(_compact_json(part))
    kind = part.get("type")
    if kind in ("text", "input_text", "output_text"):
        text = part.get("text")
        return count(text) if isinstance(text, str) else 0
    if kind == "refusal":
        refusal = part.get("refusal")
        return count(refusal) if isinstance(refusal, str) else 0
    if kind in ("image_url", "input_image", "image"):
        return _count_image_part(part)
    if kind == "input_audio":
        audio = part.get("input_audio")
        if isinstance(audio, Mapping):
            return _audio_tokens(audio.get("data"), audio.get("format"))
        return AUDIO_TOKENS_PER_SECOND
    if kind in ("file", "input_file"):
        return _count_file_part(part, count)
    text = part.get("text")
    if isinstance(text, str):
        return count(text)
    return count(_compact_json({k: v for k, v in part.items() if k != "cache_control"}))


def _count_image_part(part: Mapping[str, Any]) -> int:
    image = part.get("image_url")
    detail = part.get("detail")
    url: object = image
    if isinstance(image, Mapping):
        url = image.get("url")
        detail = image.get("detail", detail)
    size = image_dimensions_from_data_url(url) if isinstance(url, str) else None
    width, height = size if size is not None else (None, None)
    return image_tokens(width, height, detail if isinstance(detail, str) else "auto")


def _count_file_part(part: Mapping[str, Any], count: TextCounter) -> int:
    file = part.get("file")
    spec: Mapping[str, Any] = file if isinstance(file, Mapping) else part
    data = spec.get("file_data")
    total = 0
    filename = spec.get("filename")
    if isinstance(filename, str):
        total += count(filename)
    if isinstance(data, str) and data:
        return total + _file_data_tokens(data)
    return total + FILE_REFERENCE_TOKENS


def _count_tool_calls(tool_calls: object, count: TextCounter) -> int:
    if not isinstance(tool_calls, list):
        return count(_compact_json(tool_calls))
    total = 0
    for call in tool_calls:
        if not isinstance(call, Mapping):
            total += TOOL_CALL_OVERHEAD + count(_compact_json(call))
            continue
        function = call.get("function")
        if not isinstance(function, Mapping):
            function = call.get("custom")  # custom tools: {"name", "input"}
        if isinstance(function, Mapping):
            total += _count_function_call(function, count)
        else:
            total += TOOL_CALL_OVERHEAD + count(_compact_json(call))
    return total


def _count_function_call(function: object, count: TextCounter) -> int:
    if not isinstance(function, Mapping):
        return TOOL_CALL_OVERHEAD + count(_compact_json(function))
    total = TOOL_CALL_OVERHEAD
    name = function.get("name")
    if isinstance(name, str):
        total += count(name)
    arguments = function.get("arguments", function.get("input"))
    if isinstance(arguments, str):
        total += count(arguments)
    elif arguments is not None:
        total += count(_compact_json(arguments))
    return total


def _count_tools(tools: Sequence[Mapping[str, Any]], count: TextCounter, encoding: str) -> int:
    func_init = FUNC_INIT.get(encoding, FUNC_INIT[O200K])
    total = 0
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping):
            # Non-function tools (custom, web_search, ...): their JSON is the best guess.
            total += func_init + count(_compact_json(tool))
            continue
        total += func_init
        name = function.get("name")
        description = function.get("description")
        line = f"{name if isinstance(name, str) else ''}:"
        if isinstance(description, str):
            line += _strip_period(description)
        total += count(line)
        parameters = function.get("parameters")
        if isinstance(parameters, Mapping):
            total += _count_parameters(parameters, count)
    return total + FUNC_END


def _count_parameters(parameters: Mapping[str, Any], count: TextCounter) -> int:
    total = 0
    properties = parameters.get("properties")
    if isinstance(properties, Mapping) and properties:
        total += PROP_INIT
        for key, schema in properties.items():
            total += PROP_KEY
            total += _count_property(str(key), schema, count)
    # Shared definitions are rendered as extra types; count their JSON.
    for extra in ("$defs", "definitions"):
        if isinstance(parameters.get(extra), Mapping):
            total += count(_compact_json(parameters[extra]))
    return total


def _count_property(name: str, schema: object, count: TextCounter) -> int:
    if not isinstance(schema, Mapping):
        return count(f"{name}::")
    total = 0
    kind = schema.get("type", "")
    if isinstance(kind, list):
        kind = " | ".join(str(k) for k in kind)
    description = schema.get("description", "")
    if not isinstance(description, str):
        description = ""
    enum = schema.get("enum")
    if isinstance(enum, list):
        total += ENUM_INIT
        for item in enum:
            total += ENUM_ITEM + count(item if isinstance(item, str) else _compact_json(item))
    total += count(f"{name}:{kind}:{_strip_period(description)}")
    # Nested structure (items, properties, anyOf, default, ...) beyond the flat cookbook case.
    rest = {k: v for k, v in schema.items() if k not in ("type", "description", "enum")}
    if rest:
        total += count(_compact_json(rest))
    return total

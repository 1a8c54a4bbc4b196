"""How a chat request is counted (OpenAI cookbook accounting), as pure functions of a message
and a text counter; :mod:`proxy.tokens.counter` adds encodings and caching on top."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import orjson

from proxy.model import OPAQUE_TOKENS, WIRE
from proxy.tokens.media import (
    AUDIO_TOKENS_PER_SECOND,
    FILE_REFERENCE_TOKENS,
    _audio_tokens,
    _file_data_tokens,
    anthropic_image_tokens,
    image_dimensions_from_data_url,
    image_tokens,
)

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

# Message keys that are metadata for the proxy/provider SDK, not text the model reads.
# ctxproxy_wire: the wire bytes of a message the pipeline put back (model.WIRE), whose model
# fields are counted already.
_IGNORED_MESSAGE_KEYS: Final = frozenset({"cache_control", WIRE})

TextCounter = Callable[[str], int]


def _compact_json(value: object) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return str(value)


def _strip_period(text: str) -> str:
    return text.removesuffix(".")


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
        elif key == OPAQUE_TOKENS and isinstance(value, int):
            total += value  # an opaque item's estimate, set by the format reader
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
    if kind == "image" and "source" in part:  # an Anthropic image block
        return anthropic_image_tokens(part.get("source"))
    if kind == "document" and isinstance(part.get("source"), Mapping):
        return _count_document(part["source"], count)
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


def _count_document(source: Mapping[str, Any], count: TextCounter) -> int:
    """An Anthropic ``document`` block: inline PDF by its pages, plain text as text."""
    data = source.get("data")
    if source.get("type") == "base64" and isinstance(data, str):
        return _file_data_tokens(data)
    if source.get("type") == "text" and isinstance(data, str):
        return count(data)
    if source.get("type") == "content":
        return _count_content(source.get("content"), count)
    return FILE_REFERENCE_TOKENS


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

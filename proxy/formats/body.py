"""Reading a request body into JSON, with the checks every wire format shares: valid JSON, an
object, a bounded nesting depth, a string ``model``; and the shape checks each format runs on
what it reads (:func:`conform`).

Shapes are msgspec structs (:class:`Shape`) that declare only the fields the proxy reads, each
with the type the provider documents. ``msgspec.convert`` checks a parsed value against one:
unknown fields are ignored (a provider's new field is never refused here), nothing is coerced,
and the struct it builds is thrown away: the pipeline reads the parsed dicts and the forwarded
body is written from the client's bytes, so what was not read survives byte for byte. A
tagged union would refuse a ``type`` it does not list, so a format checks ``type`` is a string
with a generic shape, then looks up the shape of the types it knows (an unknown type rides
along unchecked).

A value that does not conform is a :class:`~proxy.errors.BadRequest` naming the field, worded
as the route's provider words it: OpenAI's ``Invalid type for 'messages[0].role': expected a
string, but got an integer instead.`` with ``param``, or Anthropic's ``messages.0.role: Input
should be a valid string`` (its envelope has no ``param``: the path leads the message, as
in the errors the Messages API returns).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import orjson

from proxy.errors import BadRequest

__all__ = [
    "ANTHROPIC",
    "MAX_DEPTH",
    "OPENAI",
    "Path",
    "Shape",
    "Style",
    "check_objects",
    "conform",
    "json_name",
    "json_type",
    "load_object",
    "require_model",
]

# Deepest JSON nesting a body may have. orjson parses up to 1024 levels but serializes only 254,
# and the proxy re-serializes parts of the body (and each message, for the archive and the
# hashes): deeper bodies are refused up front instead of failing half-way through the pipeline.
MAX_DEPTH: Final = 128
_JSON_NAMES: Final = {str: "string", int: "integer", float: "number", bool: "boolean",
                      list: "array", dict: "object", type(None): "null"}

#: Where a value sits in the body: member names and array indices from the top.
Path = tuple[str | int, ...]


class Shape(msgspec.Struct, kw_only=True):
    """Base of the shapes the formats check: unknown fields are ignored (msgspec's default)."""


def json_name(value: object) -> str:
    """The JSON type of a parsed value: ``string``, ``integer``, ``array``, ..."""
    return _JSON_NAMES.get(type(value), "value")


def json_type(value: object) -> str:
    """The same with its article, as OpenAI words it: ``a string``, ``an integer``, ..."""
    return _OPENAI_WORDS.get(json_name(value), "a value")


@dataclass(frozen=True, slots=True)
class Style:
    """How a provider words a refused field."""

    anthropic: bool

    def where(self, path: Path) -> str:
        """``messages[0].role`` (OpenAI's ``param``), ``messages.0.role`` (Anthropic's)."""
        if self.anthropic:
            return ".".join(str(p) for p in path)
        out = ""
        for p in path:
            out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
        return out

    def invalid(self, path: Path, expected: Sequence[str], got: str) -> BadRequest:
        """``expected``, ``got``: JSON type names (``string``, ``array``, ``object``, ...)."""
        where = self.where(path)
        if self.anthropic:
            words = " or ".join(_ANTHROPIC_WORDS.get(e, e) for e in expected)
            return BadRequest(f"{where}: Input should be a valid {words}", param=where)
        words = " or ".join(_OPENAI_WORDS.get(e, e) for e in expected)
        return BadRequest(f"Invalid type for '{where}': expected {words}, but got "
                          f"{_OPENAI_WORDS.get(got, got)} instead.", param=where)

    def missing(self, path: Path) -> BadRequest:
        where = self.where(path)
        if self.anthropic:
            return BadRequest(f"{where}: Field required", param=where)
        return BadRequest(f"Missing required parameter: '{where}'.", param=where)


#: OpenAI's messages (``Invalid type for 'x': expected a string, but got an integer instead.``)
OPENAI: Final = Style(anthropic=False)
#: Anthropic's (``messages.0.content.1.text.text: Input should be a valid string``, from the
#: errors its API returns: pydantic's wording).
ANTHROPIC: Final = Style(anthropic=True)

_OPENAI_WORDS: Final = {"string": "a string", "integer": "an integer", "number": "a number",
                        "boolean": "a boolean", "array": "an array", "object": "an object",
                        "null": "null"}
_ANTHROPIC_WORDS: Final = {"string": "string", "array": "list", "object": "dictionary",
                           "integer": "integer", "number": "number", "boolean": "boolean"}
# msgspec's names for JSON types in its messages, and the JSON names the styles word.
_MSGSPEC_TYPES: Final = {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
                         "array": "array", "object": "object", "null": "null"}
_EXPECTED: Final = re.compile(r"Expected `([^`]*)`, got `([^`]*)`")
_MISSING: Final = re.compile(r"Object missing required field `([^`]*)`")
_AT: Final = re.compile(r" - at `\$([^`]*)`$")
_STEP: Final = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def conform(value: Any, shape: type[Shape], where: Path = (), style: Style = OPENAI) -> None:
    """Check ``value`` (parsed JSON, at ``where`` in the body) against ``shape``: a
    :class:`BadRequest` naming the first field that does not conform."""
    try:
        msgspec.convert(value, shape)
    except msgspec.ValidationError as exc:
        raise _refusal(str(exc), where, style) from None


def _refusal(text: str, where: Path, style: Style) -> BadRequest:
    """msgspec's message (``Expected `str | null`, got `int` - at `$.messages[0].role```) as
    the style words it."""
    path = list(where)
    at = _AT.search(text)
    if at is not None:
        for name, index in _STEP.findall(at[1]):
            path.append(int(index) if index else name)
        text = text[: at.start()]
    if (found := _MISSING.match(text)) is not None:
        return style.missing((*path, found[1]))
    if (found := _EXPECTED.match(text)) is not None:
        expected = [_MSGSPEC_TYPES.get(t, t) for t in found[1].split(" | ")]
        return style.invalid(tuple(path), [t for t in expected if t != "null"] or expected,
                             _MSGSPEC_TYPES.get(found[2], found[2]))
    where_text = style.where(tuple(path))
    return BadRequest(f"{where_text}: {text}" if where_text else text, param=where_text or None)


def load_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if _deeper_than(body, MAX_DEPTH):
        raise BadRequest(f"request body is nested more than {MAX_DEPTH} levels deep")
    return body


def require_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    return model


def check_objects(
    items: list[Any], field: str, max_items: int, noun: str = "entries", style: Style = OPENAI
) -> None:
    """The conversation array's checks every format shares: at most ``max_items`` entries, each
    an object (a :class:`BadRequest` naming the first that is not)."""
    if len(items) > max_items:
        raise BadRequest(
            f"'{field}' has {len(items)} {noun}; this proxy accepts at most {max_items}",
            param=field,
        )
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise style.invalid((field, i), ["object"], json_name(item))


def _deeper_than(value: dict[str, Any] | list[Any], budget: int) -> bool:
    """Whether `value` nests more than `budget` objects/arrays (itself counted). Only
    containers are visited (a few ms for a 7 MB, 9,000-message body)."""
    if budget <= 0:
        return True
    items: Iterable[Any] = value.values() if isinstance(value, dict) else value
    for item in items:
        kind = type(item)
        if (kind is dict or kind is list) and _deeper_than(item, budget - 1):
            return True
    return False

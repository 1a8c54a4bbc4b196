"""Reading a request body into JSON, with the checks every wire format shares: valid JSON, an
object, a bounded nesting depth, a string ``model``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import orjson

from ..errors import BadRequest

__all__ = ["MAX_DEPTH", "check_objects", "json_type", "load_object", "require_model"]

# Deepest JSON nesting a body may have. orjson parses up to 1024 levels but serializes only 254,
# and the proxy re-serializes parts of the body (and each message, for the archive and the
# hashes): deeper bodies are refused up front instead of failing half-way through the pipeline.
MAX_DEPTH: Final = 128
_JSON_TYPES: Final = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
                      list: "an array", dict: "an object", type(None): "null"}


def json_type(value: object) -> str:
    return _JSON_TYPES.get(type(value), "a value")


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


def check_objects(items: list[Any], field: str, max_items: int, noun: str = "entries") -> None:
    """The conversation array's checks every format shares: at most ``max_items`` entries, each
    an object (a :class:`BadRequest` naming the first that is not)."""
    if len(items) > max_items:
        raise BadRequest(
            f"'{field}' has {len(items)} {noun}; this proxy accepts at most {max_items}",
            param=field,
        )
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"Invalid type for '{field}[{i}]': expected an object, but got "
                             f"{json_type(item)} instead.", param=f"{field}[{i}]")


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

"""Rewriting a JSON body without re-serialising what did not change.

A body the pipeline changed is rebuilt from the client's own bytes: every top-level member and
every item of a rewritten array that the proxy did not touch is copied exactly as it arrived
(msgspec's ``Raw`` hands over each value's bytes without decoding it), and only new or changed
values are serialised (orjson). So unknown fields, number formats, escapes and signed blocks
survive byte for byte; only the whitespace between top-level members may differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec
import orjson

__all__ = ["array_items", "dumps", "join_array", "members", "splice"]

_MEMBERS: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ITEMS: Final = msgspec.json.Decoder(list[msgspec.Raw])


# A raw JSON value: bytes, or msgspec's zero-copy view of the client's bytes.
RawJSON = bytes | msgspec.Raw


def members(raw: bytes) -> dict[str, RawJSON]:
    """The top-level object's members as raw JSON values, in order (raises on invalid JSON or
    a body that is not an object). The values are views of ``raw``: no copy is made."""
    return dict(_MEMBERS.decode(raw))


def array_items(raw: RawJSON) -> list[RawJSON]:
    """The items of a raw JSON array, each exactly as written (views, not copies)."""
    return list(_ITEMS.decode(raw))


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def join_array(items: Sequence[RawJSON]) -> bytes:
    return b"[" + b",".join(items) + b"]"


def splice(
    parts: Mapping[str, RawJSON], replace: Mapping[str, RawJSON], drop: Sequence[str] = ()
) -> bytes:
    """The object of ``parts`` (from :func:`members`) with the named members replaced by the
    given raw values (a new name is added at the end) and the ``drop`` ones removed; every
    other value byte for byte."""
    out = dict(parts)
    for name in drop:
        out.pop(name, None)
    out.update(replace)
    chunks: list[RawJSON] = [b"{"]
    for i, (name, value) in enumerate(out.items()):
        chunks += (b"," if i else b"", orjson.dumps(name), b":", value)
    chunks.append(b"}")
    return b"".join(chunks)

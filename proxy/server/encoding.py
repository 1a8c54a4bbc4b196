"""Request bodies sent compressed: decoded once, bounded, before anything reads them.

Codex compresses its ``/v1/responses`` bodies with zstd when it talks to OpenAI's own backend
(``enable_request_compression``), other clients send gzip; the proxy reads every body, so it
decodes what it can and forwards identity bytes (the transport drops the request's
``Content-Encoding``: it would no longer describe the body). Supported: ``gzip`` (``x-gzip``),
``deflate`` (zlib, or raw deflate as some clients send it), ``zstd``, ``identity``; several
codings apply in the order listed. Anything else is a 415 naming these. A decoded body is
bounded by the same limit as a plain one (a few kilobytes of zstd can expand to gigabytes):
decoding stops one byte past it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Final

import zstandard

from proxy.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

__all__ = ["SUPPORTED", "decode_body", "encodings"]

SUPPORTED: Final = ("gzip", "deflate", "zstd", "identity")
_CHUNK: Final = 1 << 16


def encodings(value: bytes) -> list[str]:
    """The codings a ``Content-Encoding`` value lists, in the order they were applied
    (``identity`` left out)."""
    names = [v.strip().lower() for v in value.decode("latin-1").split(",")]
    return [n for n in names if n and n != "identity"]


def _zlib(data: bytes, limit: int, wbits: int) -> bytes:
    inflater = zlib.decompressobj(wbits)
    out = inflater.decompress(data, limit + 1)
    if len(out) > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes once decoded")
    if not inflater.eof:
        raise BadRequest("the request body's compressed stream is incomplete")
    return out


def _gzip(data: bytes, limit: int) -> bytes:
    return _zlib(data, limit, 16 + zlib.MAX_WBITS)


def _deflate(data: bytes, limit: int) -> bytes:
    # RFC 9110's "deflate" is the zlib format; some clients send raw deflate: try both.
    try:
        return _zlib(data, limit, zlib.MAX_WBITS)
    except zlib.error:
        return _zlib(data, limit, -zlib.MAX_WBITS)


def _zstd(data: bytes, limit: int) -> bytes:
    reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
    parts: list[bytes] = []
    size = 0
    while True:
        part = reader.read(_CHUNK)
        if not part:
            break
        size += len(part)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes once decoded")
        parts.append(part)
    return b"".join(parts)


_DECODERS: Final[dict[str, Callable[[bytes, int], bytes]]] = {
    "gzip": _gzip, "x-gzip": _gzip, "deflate": _deflate, "zstd": _zstd,
}


def decode_body(body: bytes, codings: list[str], limit: int) -> bytes:
    """``body`` with ``codings`` (as :func:`encodings` lists them) undone, at most ``limit``
    bytes; a 415 for a coding not supported, a 400 for a body that does not decode."""
    for name in codings:
        if name not in _DECODERS:
            raise UnsupportedMediaType(
                f"Content-Encoding {name!r} is not supported; send the body as one of "
                f"{', '.join(SUPPORTED)}", param="content-encoding")
    for name in reversed(codings):  # the last coding applied is undone first
        try:
            body = _DECODERS[name](body, limit)
        except (zlib.error, zstandard.ZstdError):
            raise BadRequest(f"the request body is not valid {name} data",
                             param="content-encoding") from None
    return body

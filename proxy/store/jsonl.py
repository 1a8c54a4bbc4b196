"""Appending JSONL lines in order with few syscalls: the write side of the dialog archive
(:mod:`proxy.store.dialog`; the read side is :mod:`proxy.store.dialog_read`)."""

from __future__ import annotations

import json
import os
from typing import Any, Final

import orjson

_COUNT_CHUNK: Final = 1 << 20
# Parts per writev call; POSIX guarantees at least 16, Linux allows 1024.
_IOV_MAX: Final = max(16, min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16))


def line_json(obj: dict[str, Any]) -> bytes:
    """One archive line without its terminator. Both encoders escape control characters, so
    the only b"\n" in the file is the terminator the writer adds."""
    try:
        return orjson.dumps(obj)
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(obj, ensure_ascii=True, default=str).encode("ascii")


def write_all(fd: int, parts: list[bytes]) -> int:
    """Write ``parts`` in order with as few syscalls as possible; returns the byte count.

    ``writev`` instead of joining: a history carrying megabytes of tool output would otherwise
    be copied twice more (``+ b"\n"``, ``join``) before reaching the kernel. With ``O_APPEND``
    each writev lands as one append; more parts than IOV_MAX take several, still whole lines in
    order. A short write (disk full, signal) finishes with plain writes of the remainder.
    """
    total = 0
    for start in range(0, len(parts), _IOV_MAX):
        chunk = parts[start : start + _IOV_MAX]
        want = sum(len(p) for p in chunk)
        done = os.writev(fd, chunk)
        if done < want:
            rest = memoryview(b"".join(chunk))[done:]
            while rest:
                rest = rest[os.write(fd, rest) :]
        total += want
    return total


def count_newlines(fd: int, size: int) -> int:
    """Newlines in the first `size` bytes of `fd`, read in 1 MiB chunks."""
    count = 0
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(_COUNT_CHUNK, size - offset), offset)
        if not chunk:
            break
        count += chunk.count(b"\n")
        offset += len(chunk)
    return count

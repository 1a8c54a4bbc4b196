"""Reading dialog archive files: torn or corrupt lines are skipped (see proxy.store.dialog)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson

log = logging.getLogger("proxy.store")


@dataclass(frozen=True, slots=True)
class DialogLine:
    line: int  # 1-based physical line number in its file
    record: dict[str, Any]


def parse_record(raw: bytes) -> dict[str, Any] | None:
    """One archive line as its record, or None when it is not a JSON object (torn, damaged)."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def read_handle(handle: BinaryIO, name: str) -> Iterator[DialogLine]:
    """Parsed lines of an open archive file (closed when the iteration ends)."""
    with handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            obj = parse_record(raw)
            if obj is not None:
                yield DialogLine(number, obj)
            elif not raw.endswith(b"\n"):
                log.debug("%s: skipping torn last line %d", name, number)
            else:
                log.warning("%s: skipping corrupt line %d", name, number)


def read_lines(path: Path) -> Iterator[DialogLine]:
    """Parsed lines of one archive file with their line numbers (see module docstring for
    what is skipped). Opens eagerly, so a missing file raises here, not on first ``next``."""
    return read_handle(open(path, "rb"), str(path))  # noqa: SIM115 - closed by the generator


def read(path: Path) -> Iterator[dict[str, Any]]:
    """The records of one archive file."""
    return (entry.record for entry in read_lines(path))


# --- the archive -----------------------------------------------------------------------------


def unique(lines: Iterator[DialogLine]) -> Iterator[DialogLine]:
    seen: set[str] = set()
    for entry in lines:
        chain = entry.record.get("chain")
        if isinstance(chain, str):
            if chain in seen:
                continue
            seen.add(chain)
        yield entry

"""The proxy's log lines: one formatter for every handler the CLI installs.

A message is bounded (:data:`MAX_MESSAGE_CHARS`): several log lines quote what a client sent
(a repair list, a path, an error), and a client controls how long that is; one request once
wrote a 1.45 MB line. The cut says how much was left out. Tracebacks are not cut.
"""

from __future__ import annotations

import logging
from typing import Final

__all__ = ["MAX_MESSAGE_CHARS", "BoundedFormatter"]

MAX_MESSAGE_CHARS: Final = 4096


class BoundedFormatter(logging.Formatter):
    """A :class:`logging.Formatter` whose messages are at most ``max_chars`` long."""

    def __init__(self, fmt: str | None = None, *, max_chars: int = MAX_MESSAGE_CHARS) -> None:
        super().__init__(fmt)
        self.max_chars = max_chars

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        message = record.message
        if len(message) > self.max_chars:
            cut = len(message) - self.max_chars
            record.message = f"{message[: self.max_chars]}... [{cut} more characters]"
            try:
                return super().formatMessage(record)
            finally:
                record.message = message
        return super().formatMessage(record)

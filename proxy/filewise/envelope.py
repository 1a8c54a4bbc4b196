"""The envelope a client wraps around a tool's output, told apart from the output itself (pure).

Two reads of an unchanged file are never the same bytes as the client sends them back: Claude
Code appends ``<system-reminder>`` blocks to tool results (``<total_tokens>N tokens left``,
different on every call; task reminders), and Codex opens every ``exec_command`` output with a
header of its own (a random ``Chunk ID``, the ``Wall time``, the exit code, a token count). What
the file-aware rules compare (a re-read against the earlier read, an output against an earlier
one) is the body; what is forwarded keeps the envelope as the client wrote it around the
transformed body, so the model still gets what the client meant to tell it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = ["Envelope", "split_envelope"]

# Codex's exec_command / shell / apply_patch output header: its lines, in either order, up to
# "Output:".
_CODEX_HEAD: Final = re.compile(
    r"\A(?:(?:Chunk ID|Wall time|Original token count): [^\n]*\n"
    r"|(?:Process exited with code|Exit code:) -?\d+[^\n]*\n){1,6}Output:\n"
)
_OPEN: Final = "<system-reminder>"
_CLOSE: Final = "</system-reminder>"


@dataclass(frozen=True, slots=True)
class Envelope:
    head: str
    body: str
    tail: str

    def wrap(self, body: str) -> str:
        """``body`` in this envelope."""
        return self.head + body + self.tail


def split_envelope(text: str) -> Envelope:
    """``text`` as head + body + tail (``head + body + tail == text``); no envelope found: the
    whole text is the body."""
    head = ""
    m = _CODEX_HEAD.match(text)
    if m is not None:
        head = m.group(0)
    rest = text[len(head):]
    # Claude Code's reminders at the end (one or more, and the blank lines before them),
    # peeled off from the end: linear, and never into the body.
    end = len(rest)
    while True:
        stripped = rest[:end].rstrip()
        if not stripped.endswith(_CLOSE):
            break
        start = stripped.rfind(_OPEN)
        if start < 0:
            break
        end = len(rest[:start].rstrip())
    return Envelope(head, rest[:end], rest[end:])

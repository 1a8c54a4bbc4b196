"""One-line ``[ctxproxy: ...]`` markers: the grammar shared by the file-aware rules (pure).

A marker stands in the forwarded history for something ctxproxy left out (a superseded read,
an unchanged re-read, a repeated span: :mod:`.rereads`, :mod:`.dedupe`). It is one line, and
it parses back exactly, so a client that stores the forwarded text and sends it again is
recognised and never marked twice (as notices are: :func:`.notice.parse_notice`).

Free text in a marker (paths, tool names, call ids, argument values) is written as a *token*:
as it is when it is non-empty and holds no whitespace, no ``"`` and none of ``()[],;`` (the
characters the grammars put right after a token), else as a JSON string with the characters
:meth:`str.splitlines` would break at escaped. A token therefore never spans two lines and
never runs into the text after it, and the readable common case (``/repo/src/app.py``,
``toolu_01``) is written as it is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Final

__all__ = ["KEY", "PREFIX", "TOKEN", "Pointer", "as_pointer", "pointer", "read_pointer", "token",
           "untoken"]

PREFIX: Final = "[ctxproxy: "

_RAW: Final = re.compile(r'[^\s"()\[\],;]+')
# The line breaks json.dumps(ensure_ascii=False) leaves as they are (it escapes < 0x20).
_BREAKS: Final = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_BREAKS_RE: Final = re.compile("[\x85\u2028\u2029]")
#: A token in a marker's regular expression (one group-free alternative).
TOKEN: Final = r'(?:"(?:[^"\\\n]|\\.)*"|[^\s"()\[\],;]+)'
#: A key of ``key=value``: a token that holds no ``=`` (so the first ``=`` ends it).
KEY: Final = r'(?:"(?:[^"\\\n]|\\.)*"|[^\s"()\[\],;=]+)'
_RAW_KEY: Final = re.compile(r'[^\s"()\[\],;=]+')


def token(text: str, *, key: bool = False) -> str:
    """``text`` as a marker token (see the module docstring); ``key``: also quoted when it
    holds ``=``."""
    if (_RAW_KEY if key else _RAW).fullmatch(text):
        return text
    quoted = json.dumps(text, ensure_ascii=False)
    return _BREAKS_RE.sub(lambda m: _BREAKS[m[0]], quoted)


def untoken(text: str) -> str:
    """The text a token stands for (raises ValueError on a malformed quoted token)."""
    if text.startswith('"'):
        value = json.loads(text)
        if not isinstance(value, str):
            raise ValueError("not a string token")
        return value
    return text


@dataclass(frozen=True, slots=True)
class Pointer:
    """Where the proxy kept an original and how the model reads it: a call of ``tool`` with
    ``path_arg=path`` (and ``line_arg=N`` to start at line N). The offload stage's
    ``_target`` gives these by retrieval mode: ``read_offloaded file_path=tool_result/<id>.txt``,
    the client's tool and an absolute path, or ``GET url=...``."""

    path: str
    tool: str = "read_offloaded"
    path_arg: str = "file_path"
    line_arg: str = "start_line"

    def render(self, line: int | None = None) -> str:
        text = f"{token(self.tool)} {token(self.path_arg, key=True)}={token(self.path)}"
        if line is not None:
            text += f" {token(self.line_arg, key=True)}={line}"
        return text


def pointer(p: str, *, line: bool = False) -> str:
    """A rendered pointer's regular expression, groups named ``{p}tool``, ``{p}parg``,
    ``{p}path`` (and ``{p}larg``, ``{p}line`` with ``line``)."""
    rx = rf"(?P<{p}tool>{TOKEN}) (?P<{p}parg>{KEY})=(?P<{p}path>{TOKEN})"
    if line:
        rx += rf" (?P<{p}larg>{KEY})=(?P<{p}line>[0-9]+)"
    return rx


def as_pointer(saved: str | Pointer | None) -> Pointer | None:
    """A plain path is a ``read_offloaded`` pointer."""
    return Pointer(saved) if isinstance(saved, str) else saved


def read_pointer(m: re.Match[str], p: str) -> Pointer:
    """The pointer matched by :func:`pointer` groups ``p``. A pointer rendered without a line
    does not show its ``line_arg``: it reads back as ``"start_line"``."""
    larg = m.groupdict().get(f"{p}larg")
    return Pointer(untoken(m[f"{p}path"]), untoken(m[f"{p}tool"]), untoken(m[f"{p}parg"]),
                   untoken(larg) if larg is not None else "start_line")

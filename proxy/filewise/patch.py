"""The ``apply_patch`` grammar: the file changes of a patch text (``*** Add File:``,
``*** Update File:`` and its hunks, ``*** Delete File:``, ``*** Move to:``) and of an
``apply_patch_call`` item's operation (``create_file``, ``update_file`` with its ``diff``,
``delete_file``); an update quotes each hunk's context and removed lines as the file had them
(pure, no I/O; paths as written).

Codex sends a patch as a custom tool's raw input, a JSON function's argument, an
``apply_patch_call`` item, a shell heredoc or an ``["apply_patch", patch]`` argv:
:mod:`proxy.filewise.provenance` and :mod:`proxy.filewise.shell` find it there, and
:func:`proxy.filewise.provenance.patch_edits` gives a patch text's edits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Final

from proxy.filewise.calls import _Change, _Kind, _ok_path
from proxy.model import normalise_newlines

_PATCH_RE: Final = re.compile(r"^\*\*\* (Add|Update|Delete) File: (.+)$|^\*\*\* Move to: (.+)$")


def _patch_changes(text: str) -> list[_Change]:
    """The changes of an ``apply_patch`` text, paths as written: ``*** Add File:`` (write),
    ``*** Update File:`` (edit, quoting each hunk's context and ``-`` lines as the file had
    them), ``*** Delete File:``, ``*** Move to:`` (the updated file moved there)."""
    out: list[_Change] = []
    updating: _Change | None = None  # the update whose hunks follow
    hunk: list[str] = []
    for line in normalise_newlines(text).split("\n"):
        stripped = line.strip()
        if not stripped.startswith("***"):
            if updating is not None:
                hunk.append(line)
            continue
        if stripped == "*** End of File":
            continue
        if updating is not None:
            updating.quotes += _hunks(hunk)
            hunk = []
        m = _PATCH_RE.match(stripped)
        if m is None:  # *** Begin Patch, *** End Patch
            updating = None
        elif m[3] is not None:
            dst = _ok_path(m[3])
            if updating is not None and dst is not None:
                out += [_Change("move", updating.path, to=dst), _Change("edit", dst)]
            # the hunks after a move still quote the updated file
        elif (path := _ok_path(m[2])) is None:
            updating = None
        else:
            change = _Change(_PATCH_KINDS[m[1]], path)
            out.append(change)
            updating = change if m[1] == "Update" else None
    if updating is not None:
        updating.quotes += _hunks(hunk)
    return out


_PATCH_KINDS: Final[Mapping[str, _Kind]] = {"Add": "write", "Update": "edit", "Delete": "delete"}


def _hunks(lines: Sequence[str]) -> list[str]:
    """The text each hunk of an update quotes: its context (`` ``) and removed (``-``) lines,
    joined (hunks start at ``@@`` lines; a blank line is blank context)."""
    out: list[str] = []
    quoted: list[str] = []
    for line in (*lines, "@@"):
        if line.startswith("@@"):
            while quoted and not quoted[-1]:
                quoted.pop()  # the blank lines ending a patch are no context
            if quoted:
                out.append("\n".join(quoted))
            quoted = []
        elif line.startswith((" ", "-")):
            quoted.append(line[1:])
        elif not line:
            quoted.append("")
    return out


def _operation(op: object) -> list[_Change]:
    """An ``apply_patch_call`` item's operation (``create_file``, ``update_file`` with its
    ``diff``, ``delete_file``)."""
    if not isinstance(op, Mapping) or (path := _ok_path(op.get("path"))) is None:
        return []
    kind = op.get("type")
    if kind == "create_file":
        return [_Change("write", path)]
    if kind == "delete_file":
        return [_Change("delete", path)]
    if kind == "update_file":
        diff = op.get("diff")
        return [_Change("edit", path, quotes=_hunks(diff.split("\n")) if isinstance(diff, str)
                        else [])]
    return []

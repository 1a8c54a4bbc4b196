"""File provenance: which tool calls read which file (and which lines of it), and which wrote,
edited or deleted which (pure, no I/O).

Coding agents spend most of their context on file content, and much of it goes dead: a file
read again later, or changed after it was read. ctxproxy's file-aware rules work from this one
parse of the history (:func:`provenance`), in the pipeline's message model (chat-shaped
``tool_calls``, whatever the wire format), for every client's tools; quote protection
(:mod:`.quotes`) and the compaction guard's file ledger (:mod:`proxy.compaction.guard`, from
:func:`call_files`, paths as written) use it too:

* reads: Claude Code ``Read(file_path, offset, limit)`` (``offset`` the first line, 1-based;
  ``limit`` a count; neither: the whole file, as far as its own cap goes), chat clients'
  ``read_file(file_path|path, start_line, end_line)``, the configured ``offload.read_tools``
  (``path_arg``, ``line_arg``: a first line or a ``[first, last]`` range), the editor's
  ``view`` (``view_range``, last -1: to the end), and shell reads in Codex's
  ``exec_command`` / ``shell`` / ``local_shell_call`` / ``shell_call`` (and Claude Code's
  ``Bash``): the lines a command line prints (:mod:`proxy.filewise.shell`);
* writes and edits: ``Write``, ``Edit``, ``MultiEdit``, ``NotebookEdit``, ``apply_patch`` (a
  custom tool, a JSON function, an ``apply_patch_call`` item, a shell heredoc or argv:
  :mod:`proxy.filewise.patch`), chat ``write_file`` / ``edit_file`` / ``create_file`` /
  ``delete_file`` / ``move_file`` and the editor's ``create`` / ``str_replace`` / ``insert``,
  and shell changes where obvious (:mod:`proxy.filewise.shell`), each with the text it quotes
  from the file (:class:`proxy.filewise.calls.FileEdit`).

Paths are normalised (``posixpath.normpath``; a shell call's relative paths joined to its
``workdir``, then to each ``cd``); a path that names no file (a glob, a variable, a device) is
left out; :func:`same_file` tells two spellings of one file apart from two files (a Codex
patch names ``src/x.py`` where a read named ``/repo/src/x.py``). Line numbers are 1-based.
The reads, edits and line ranges are values of :mod:`proxy.filewise.calls`.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import orjson

from proxy.config.offload import ReadTool
from proxy.filewise.calls import FileEdit, FileRead, LineRange, _Change, _Kind, _ok_path, _Read
from proxy.filewise.patch import _operation, _patch_changes
from proxy.filewise.shell import _shell_call
from proxy.lru import LRU
from proxy.model import Message, tool_calls

__all__ = [
    "CallCache",
    "Provenance",
    "call_files",
    "first_line",
    "json_args",
    "patch_edits",
    "provenance",
    "same_file",
    "shell_tool",
    "tool_path",
]


@dataclass(frozen=True, slots=True)
class Provenance:
    """Every file read and edit of a history, in call order."""

    reads: tuple[FileRead, ...] = ()
    edits: tuple[FileEdit, ...] = ()
    # tool_call_id -> the reads that call made (a ``cat a b`` reads two files).
    by_call: Mapping[str, tuple[FileRead, ...]] = field(default_factory=dict)

    def reads_of(self, result_index: int) -> tuple[FileRead, ...]:
        """The reads whose result is history message ``result_index``."""
        return tuple(r for r in self.reads if r.result_index == result_index)


def same_file(a: str, b: str) -> bool:
    """Whether two normalised spellings name one file: equal, or a relative one is the other's
    tail."""
    if a == b:
        return True
    if not a.startswith("/") and b.endswith("/" + a):
        return True
    return not b.startswith("/") and a.endswith("/" + b)



# -- the history -----------------------------------------------------------------------------


def _parsed_size(key: tuple[str, str],
                 value: tuple[tuple[FileRead, ...], tuple[FileEdit, ...]]) -> int:
    reads, edits = value
    quotes = sum(len(q) for e in edits for q in e.quotes)
    return len(key[0]) + len(key[1]) + quotes + 200 * (1 + len(reads) + len(edits))


class CallCache:
    """:func:`call_files` of each distinct call (name and arguments), kept: a resent history's
    provenance then costs a dictionary probe per call instead of parsing its arguments (shell
    scripts, patches) again on every request. Bounded; safe across threads."""

    def __init__(self, read_tools: Mapping[str, ReadTool],
                 cache_bytes: int = 16 * 1024 * 1024) -> None:
        self.read_tools = read_tools
        # Sized by what an entry pins: the call's arguments (a Write holds a whole file) and
        # the quotes parsed out of them (an Edit's old_string, a patch's lines).
        self._parsed: LRU[tuple[str, str], tuple[tuple[FileRead, ...], tuple[FileEdit, ...]]] = (
            LRU(cache_bytes, _parsed_size))

    def files(self, name: str, arguments: str, call_id: str, call_index: int,
              ) -> tuple[tuple[FileRead, ...], tuple[FileEdit, ...]]:
        key = (name, arguments)
        found = self._parsed.get(key)
        if found is None:
            found = call_files(name, arguments, self.read_tools)
            self._parsed.put(key, found)
        reads, edits = found
        if not reads and not edits:
            return found
        return (tuple(replace(r, call_id=call_id, call_index=call_index) for r in reads),
                tuple(replace(e, call_id=call_id, call_index=call_index) for e in edits))


def provenance(history: Sequence[Message], read_tools: Mapping[str, ReadTool], *,
               cache: CallCache | None = None) -> Provenance:
    """Every file read and edit the tool calls of ``history`` make, in call order, each read
    with the index of the result answering it. Depends on each call and its own result
    only, so the provenance of a prefix of a history is that of the whole for the calls the
    prefix holds (results after it aside). ``cache`` (for ``read_tools``) keeps each call's
    parse."""
    reads: list[FileRead] = []
    edits: list[FileEdit] = []
    waiting: dict[str, range] = {}  # call id -> its reads' positions, until its result
    answered: dict[int, int] = {}  # read position -> result index
    for i, m in enumerate(history):
        role = m.get("role")
        if role == "assistant":
            for cid, name, args in tool_calls(m):
                found, changed = (
                    cache.files(name, args, cid, i) if cache is not None
                    else call_files(name, args, read_tools, call_id=cid, call_index=i))
                if found and cid:
                    waiting[cid] = range(len(reads), len(reads) + len(found))
                reads += found
                edits += changed
        elif role == "tool" and waiting:
            answers = m.get("tool_call_id")
            for k in waiting.pop(answers, ()) if isinstance(answers, str) else ():
                answered[k] = i
    if answered:
        reads = [replace(r, result_index=answered[k]) if k in answered else r
                 for k, r in enumerate(reads)]
    by_call: dict[str, tuple[FileRead, ...]] = {}
    for r in reads:
        if r.call_id:
            by_call[r.call_id] = (*by_call.get(r.call_id, ()), r)
    return Provenance(tuple(reads), tuple(edits), by_call)


# -- one call --------------------------------------------------------------------------------

# Tool names are matched without an MCP-style namespace and case (:func:`_tool_key`).
_WRITE_TOOLS: Final = frozenset({
    "write", "write_file", "create_file", "file_write", "save_file", "writefile", "createfile",
    "write_to_file", "create",
})
_EDIT_TOOLS: Final = frozenset({
    "edit", "multiedit", "notebookedit", "edit_file", "str_replace", "replace_in_file",
    "patch_file", "modify_file", "append_file", "append_to_file", "editfile", "insert",
    "edit_notebook",
})
_DELETE_TOOLS: Final = frozenset({"delete_file", "remove_file", "deletefile", "delete", "rm"})
_MOVE_TOOLS: Final = frozenset({"move_file", "rename_file", "movefile", "rename"})
_EDITOR_TOOLS: Final = frozenset({"str_replace_based_edit_tool", "str_replace_editor"})
_SHELL_TOOLS: Final = frozenset({
    "bash", "shell", "exec_command", "local_shell_call", "shell_call", "container.exec",
    "run_shell_command", "run_terminal_cmd", "terminal", "execute_command", "shell_command",
    "run_command", "exec",
})
_PATH_ARGS: Final = ("file_path", "path", "notebook_path", "filepath", "filename", "target_file",
                     "file", "filePath")
# The text an edit replaces, in the argument spellings clients use.
_OLD_ARGS: Final = ("old_string", "old_str", "oldText", "old_text")
# Read tools every client of that name has, whatever ``offload.read_tools`` says: Claude
# Code's ``Read`` (``offset`` the first line, 1-based, ``limit`` a count) and chat clients'
# ``read_file`` (``start_line``, ``end_line``).
_READS: Final = {
    "Read": ReadTool(path_arg="file_path", line_arg="offset"),
    "read_file": ReadTool(path_arg="file_path", line_arg="start_line"),
}
_VIEW: Final = ReadTool(path_arg="path", line_arg="view_range")

_EDITOR_KINDS: Final[Mapping[str, _Kind]] = {"create": "write", "str_replace": "edit",
                                             "insert": "edit", "undo_edit": "edit"}


def call_files(
    name: str,
    arguments: str,
    read_tools: Mapping[str, ReadTool] | None = None,
    *,
    call_id: str = "",
    call_index: int = 0,
    resolve: bool = True,
) -> tuple[tuple[FileRead, ...], tuple[FileEdit, ...]]:
    """The reads and edits one tool call makes, from its name and arguments (a JSON text, or
    a custom tool's raw input). ``resolve``: paths normalised and a shell call's relative ones
    joined to its directory (its ``workdir``, then each ``cd``); otherwise as written."""
    reads, changes = _parse(name, arguments, read_tools or {})
    return (
        tuple(FileRead(call_id, name, _resolved(p, base, resolve), lines, call_index)
              for p, base, lines in reads),
        tuple(FileEdit(call_id, name, _resolved(c.path, c.base, resolve), c.kind, call_index,
                       tuple(c.quotes), None if c.to is None else _resolved(c.to, c.base, resolve))
              for c in changes),
    )


def _resolved(path: str, base: str | None, resolve: bool) -> str:
    if not resolve:
        return path
    if base and not path.startswith("/"):
        path = posixpath.join(base, path)
    return posixpath.normpath(path)


def _tool_key(name: str) -> str:
    """A tool name without an MCP-style namespace (``mcp__fs__write_file``), casefolded."""
    return name.rsplit("__", 1)[-1].casefold()


def shell_tool(name: str) -> bool:
    """Whether calls of tool ``name`` are shell commands (``Bash``, ``exec_command``, ...)."""
    return _tool_key(name) in _SHELL_TOOLS


def json_args(raw: str) -> dict[str, Any]:
    """A call's JSON arguments as an object ({} when they are not one)."""
    try:
        value = orjson.loads(raw or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_path(args: Mapping[str, Any], path_arg: str | None = None) -> str | None:
    """The file a tool call names: ``path_arg``, else the usual argument names."""
    for key in (path_arg, *_PATH_ARGS) if path_arg else _PATH_ARGS:
        value = args.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def first_line(value: Any) -> int:
    """A read tool's first-line argument (a number, digits, or a ``[first, last]`` range) as
    a 1-based line number; 1 when it says none."""
    if isinstance(value, list) and value:
        value = value[0]
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return 1


def _count(value: Any) -> int | None:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return None


def _tool_lines(spec: ReadTool, args: Mapping[str, Any]) -> LineRange:
    """The lines a read tool's call asks for: from its ``line_arg`` (a first line, or a
    ``[first, last]`` range, last -1: to the end), to its ``limit`` (a count) or
    ``end_line``; to the end (or the tool's own cap) when it names none."""
    value = args.get(spec.line_arg) if spec.line_arg else None
    start = first_line(value)
    if isinstance(value, list):
        last = _count(value[1]) if len(value) > 1 else None
        return LineRange(start, last if last is not None and last >= start else None)
    if (limit := _count(args.get("limit"))) is not None:
        return LineRange(start, start + limit - 1)
    end = _count(args.get("end_line"))
    return LineRange(start, end if end is not None and end >= start else None)


def _parse(
    name: str, raw: str, read_tools: Mapping[str, ReadTool]
) -> tuple[list[_Read], list[_Change]]:
    spec = read_tools.get(name) or _READS.get(name) or _READS.get(_tool_key(name))
    key = _tool_key(name)
    if key == "apply_patch":
        args = _loads(raw)
        text: object = raw if args is _NOT_JSON else args
        if isinstance(args, Mapping):
            text = next((v for k in ("input", "patch", "diff") if isinstance(v := args.get(k), str)),
                        None)
        return [], _patch_changes(text) if isinstance(text, str) else []
    obj = json_args(raw)
    if spec is not None:
        path = _ok_path(tool_path(obj, spec.path_arg))
        return ([(path, None, _tool_lines(spec, obj))] if path else []), []
    if key == "apply_patch_call":
        return [], _operation(obj.get("operation"))
    if key in _SHELL_TOOLS:
        return _shell_call(key, obj)
    path = _ok_path(tool_path(obj))
    if key in _MOVE_TOOLS:
        src = _ok_path(obj.get("source", obj.get("src", obj.get("old_path", path))))
        dst = _ok_path(obj.get("destination", obj.get("dst", obj.get("new_path"))))
        return [], [_Change("move", src, to=dst), _Change("write", dst)] if src and dst else []
    if path is None:
        return [], []
    if key in _EDITOR_TOOLS:
        command = obj.get("command")
        if command == "view":
            return [(path, None, _tool_lines(_VIEW, obj))], []
        kind = _EDITOR_KINDS.get(str(command))
        quotes = _old_texts(obj) if command == "str_replace" else []
        return [], [_Change(kind, path, quotes=quotes)] if kind else []
    if key in _WRITE_TOOLS:
        return [], [_Change("write", path)]
    if key in _EDIT_TOOLS:
        return [], [_Change("edit", path, quotes=_old_texts(obj))]
    if key in _DELETE_TOOLS:
        return [], [_Change("delete", path)]
    return [], []


_NOT_JSON: Final = object()


def _loads(raw: str) -> object:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _NOT_JSON


def _old_texts(args: Mapping[str, Any]) -> list[str]:
    """The texts an edit call replaces: its own ``old_string`` (or ``old_str``, ``oldText``)
    and each of its ``edits``'."""
    out: list[str] = []
    for item in (args, *(e for e in args.get("edits") or () if isinstance(e, Mapping))):
        old = next((v for k in _OLD_ARGS if isinstance(v := item.get(k), str)), None)
        if old:
            out.append(old)
    return out


def patch_edits(patch: str) -> list[FileEdit]:
    """The edits of an ``apply_patch`` text (paths as written)."""
    return list(call_files("apply_patch", patch, resolve=False)[1])

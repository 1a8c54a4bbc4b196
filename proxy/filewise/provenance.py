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
  ``Bash``): ``cat``, ``nl``, ``sed -n 'A,Bp'`` (``'Ap'``, ``'A,$p'``, ``'$p'``, ``Nq``),
  ``head -n N``, ``tail -n N`` (``tail=N``), ``tail -n +K``, in each command of a chain; in a
  pipe the first command's file, narrowed by later commands that only select lines (``head``,
  ``tail``, ``sed -n``; ``cat``/``nl``/``tee`` pass it on); another filter (``grep``, ``wc``)
  or output sent into a file makes it no read, since which lines were shown is not known;
* writes and edits: ``Write``, ``Edit``, ``MultiEdit``, ``NotebookEdit``, ``apply_patch`` (a
  custom tool, a JSON function, an ``apply_patch_call`` item, a shell heredoc or argv), chat
  ``write_file`` / ``edit_file`` / ``create_file`` / ``delete_file`` / ``move_file`` and the
  editor's ``create`` / ``str_replace`` / ``insert``, and shell changes where obvious (``>``,
  ``>>``, ``tee [-a]``, ``sed -i``, ``rm``, ``mv``, ``cp``, ``touch``), each with the text it
  quotes from the file (:class:`FileEdit`).

Paths are normalised (``posixpath.normpath``; a shell call's relative paths joined to its
``workdir``, then to each ``cd``); a path that names no file (a glob, a variable, a device) is
left out; :func:`same_file` tells two spellings of one file apart from two files (a Codex
patch names ``src/x.py`` where a read named ``/repo/src/x.py``). Line numbers are 1-based.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

import orjson

from proxy.config import ReadTool
from proxy.lru import LRU
from proxy.model import Message, normalise_newlines, tool_calls

__all__ = [
    "WHOLE",
    "CallCache",
    "FileEdit",
    "FileRead",
    "LineRange",
    "Provenance",
    "call_files",
    "first_line",
    "json_args",
    "patch_edits",
    "provenance",
    "same_file",
    "shell_reads",
    "shell_script",
    "shell_tool",
    "tool_path",
]


@dataclass(frozen=True, slots=True)
class LineRange:
    """The lines of a file a read showed: ``start`` to ``end`` inclusive (``end`` None: to the
    end of the file, or as far as the tool's own limit went); a ``tail -n N`` read is
    ``tail=N`` (its first line is not known from the call)."""

    start: int = 1
    end: int | None = None
    tail: int | None = None

    def covers(self, other: LineRange) -> bool:
        """Whether every line ``other`` showed is shown by this range too."""
        if self.tail is not None or other.tail is not None:
            return self == other or (self.start == 1 and self.end is None and self.tail is None)
        if self.start > other.start:
            return False
        if self.end is None:
            return True
        return other.end is not None and other.end <= self.end


WHOLE = LineRange()


@dataclass(frozen=True, slots=True)
class FileRead:
    """A tool call whose result shows (part of) a file."""

    call_id: str
    tool: str
    path: str  # normalised
    lines: LineRange = WHOLE
    call_index: int = 0  # history index of the assistant message making the call
    result_index: int | None = None  # history index of its result (None: not answered yet)


@dataclass(frozen=True, slots=True)
class FileEdit:
    """A tool call that changed a file, with the text it quotes from the file as it was (an
    ``Edit``'s ``old_string``, an ``apply_patch`` hunk's context and removed lines).

    ``write`` replaced the whole file (or made it), ``edit`` changed part of it, ``delete``
    removed it, ``touch`` may have made it empty and left an existing one as it was. A
    ``move`` (``path`` moved to ``to``) is followed by the destination's own entry: ``write``
    (``mv``, ``move_file``), or ``edit`` after a patch's ``*** Move to:`` (the updated file's
    lines end up there)."""

    call_id: str
    tool: str
    path: str  # normalised
    kind: Literal["write", "edit", "delete", "move", "touch"]
    call_index: int = 0
    quotes: tuple[str, ...] = ()
    to: str | None = None  # a move's destination


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

_Kind = Literal["write", "edit", "delete", "move", "touch"]


@dataclass(slots=True)
class _Change:
    """An edit found in a call, its path as written and the directory it is relative to."""

    kind: _Kind
    path: str
    base: str | None = None
    quotes: list[str] = field(default_factory=list)
    to: str | None = None


_Read = tuple[str, str | None, LineRange]  # path as written, its directory, the lines
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


def _ok_path(path: object) -> str | None:
    """``path`` stripped, unless it is no file's name (a glob, a variable, a device, ...)."""
    if not isinstance(path, str):
        return None
    path = path.strip()
    if (not path or len(path) > 300 or "`" in path or any(c in path for c in "\n\r\t*?$")
            or path.startswith(("-", "&", "/dev/")) or path in (".", "..", "/")):
        return None
    return path


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


# -- apply_patch -----------------------------------------------------------------------------

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


def patch_edits(patch: str) -> list[FileEdit]:
    """The edits of an ``apply_patch`` text (paths as written)."""
    return list(call_files("apply_patch", patch, resolve=False)[1])


# -- shell -----------------------------------------------------------------------------------

# A shell binary running its ``-c`` script (``bash -lc '...'``), by its argv[0]'s base name.
_SHELL_BINARIES: Final = frozenset({"bash", "sh", "zsh", "dash", "env"})
_SCRIPT_FLAGS: Final = frozenset({"-c", "-lc", "-ic", "-l"})
_HEREDOC_RE: Final = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][\w]*)\1")
_PREFIXES: Final = frozenset({"sudo", "command", "exec", "nohup", "time"})
_OPERATOR_CHARS: Final = frozenset("();<>|&")
_PIPES: Final = frozenset({"|", "|&"})
_OUTPUTS: Final = frozenset({">", ">>", ">|", "&>", "&>>"})
_TAKES_WORD: Final = frozenset({"<", ">&", "<&", "<<", "<<-", "<<<"})
_NL_VALUED: Final = frozenset({"-b", "-d", "-f", "-h", "-i", "-l", "-n", "-s", "-v", "-w"})
_COUNT_RE: Final = re.compile(r"([+-]?)(\d+)")
_SED_COMMAND_RE: Final = re.compile(
    r"\s*(?:(?P<a>\d+)\s*(?:,\s*(?P<b>\d+|\$)\s*)?p|(?P<last>\$)\s*p|(?P<q>\d+)\s*q)\s*")


@dataclass(slots=True)
class _Stage:
    """One command of a pipeline: its words and where its output goes."""

    words: list[str] = field(default_factory=list)
    outputs: list[tuple[str, str, bool]] = field(default_factory=list)  # op, target, stdout


def shell_script(args: Mapping[str, Any], key: str = "") -> tuple[str | None, str | None]:
    """A shell call's script and working directory: ``command``/``cmd``/``script`` as a string,
    ``commands`` lines (and a ``shell_call`` item's argv) one per line, an argv with ``bash -lc
    <script>`` unwrapped, any other argv as a command line. ``key``: the tool's name."""
    action = args.get("action")
    if isinstance(action, Mapping):  # local_shell_call / shell_call items
        args = {**args, **action}
    cwd = next((v for k in ("workdir", "working_directory", "cwd")
                if isinstance(v := args.get(k), str) and v), None)
    name, value = next(((k, args[k]) for k in ("command", "cmd", "script", "commands")
                        if args.get(k) is not None), ("", None))
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        argv = [str(v) for v in value]
        if key == "shell_call" or name == "commands":
            value = "\n".join(argv)
        elif (posixpath.basename(argv[0]) in _SHELL_BINARIES and len(argv) >= 3
              and argv[-2] in _SCRIPT_FLAGS):
            value = argv[-1]
        else:
            value = shlex.join(argv)
    return (value if isinstance(value, str) else None), cwd


def _shell_call(key: str, args: Mapping[str, Any]) -> tuple[list[_Read], list[_Change]]:
    """A shell call's reads and changes (``["apply_patch", patch]`` is a patch)."""
    action = args.get("action")
    merged = {**args, **action} if isinstance(action, Mapping) else args
    argv = next((merged[k] for k in ("command", "cmd") if isinstance(merged.get(k), list)), None)
    if (argv and len(argv) == 2 and all(isinstance(v, str) for v in argv)
            and posixpath.basename(argv[0]) == "apply_patch"):
        cwd = next((v for k in ("workdir", "working_directory", "cwd")
                    if isinstance(v := merged.get(k), str) and v), None)
        return [], _based(_patch_changes(argv[1]), cwd)
    script, cwd = shell_script(args, key)
    return _script(script, cwd) if script is not None else ([], [])


def _based(changes: list[_Change], cwd: str | None) -> list[_Change]:
    for c in changes:
        c.base = cwd
    return changes


def shell_reads(script: str) -> list[tuple[str, LineRange]]:
    """The files a shell script prints, paths as written, with their lines (module
    docstring)."""
    return [(path, lines) for path, _, lines in _script(script, None)[0]]


def _script(script: str, cwd: str | None) -> tuple[list[_Read], list[_Change]]:
    """Reads and the obvious file changes of a shell script: each command of its lines (split
    at ``;``, ``&&``, ``||``, ``&``), heredoc bodies left out; an ``apply_patch`` heredoc is
    the patch's changes alone."""
    if "*** Begin Patch" in script:
        return [], _based(_patch_changes(script), cwd)
    reads: list[_Read] = []
    changes: list[_Change] = []
    for line in _strip_heredocs(normalise_newlines(script)).split("\n"):
        for stages in _pipelines(line):
            for stage in stages:
                for op, target, _ in stage.outputs:
                    if (path := _ok_path(target)) is not None:
                        changes.append(_Change("edit" if op.endswith(">>") else "write", path,
                                               cwd))
                words = _command(stage.words)
                if words:
                    changes += _based(_command_changes(words[0], words[1:]), cwd)
            reads += [(path, cwd, lines) for path, lines in _pipeline_reads(stages)]
            words = _command(stages[0].words)
            if len(stages) == 1 and words and words[0] == "cd":
                cwd = _cd(cwd, words[1:])
    return reads, changes


def _strip_heredocs(script: str) -> str:
    """``script`` without heredoc bodies (their text is data, not commands)."""
    out: list[str] = []
    ending: str | None = None
    for line in script.split("\n"):
        if ending is not None:
            if line.strip() == ending:
                ending = None
            continue
        out.append(line)
        m = _HEREDOC_RE.search(line)
        if m is not None:
            ending = m[2]
    return "\n".join(out)


def _pipelines(line: str) -> Iterator[list[_Stage]]:
    """The pipelines of one shell line (operators split them), each as its stages."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:
        return
    stages = [_Stage()]
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if not tok or not set(tok) <= _OPERATOR_CHARS:
            stages[-1].words.append(tok)
        elif tok in _OUTPUTS and i < len(tokens):
            words = stages[-1].words
            fd = words.pop() if words and words[-1].isdigit() else None  # 2> names a stream
            stages[-1].outputs.append((tok, tokens[i], fd in (None, "1") or tok.startswith("&")))
            i += 1
        elif tok in _TAKES_WORD:
            i += 1
        elif tok in _PIPES:
            stages.append(_Stage())
        else:  # ; && || & ( ) and the like end the pipeline
            if any(s.words or s.outputs for s in stages):
                yield stages
            stages = [_Stage()]
    if any(s.words or s.outputs for s in stages):
        yield stages


def _command(words: list[str]) -> list[str]:
    """A command's words from the program on (``FOO=1``, ``sudo``, ``time`` ... dropped;
    ``git rm``/``git mv`` as ``rm``/``mv``), the program by its base name."""
    k = 0
    while k < len(words) and ("=" in words[k] and not words[k].startswith("=")
                              or words[k] in _PREFIXES):
        k += 1
    if k + 1 < len(words) and words[k] == "git" and words[k + 1] in ("rm", "mv"):
        k += 1
    return [words[k].rsplit("/", 1)[-1], *words[k + 1:]] if k < len(words) else []


def _cd(cwd: str | None, args: Sequence[str]) -> str | None:
    target = next((a for a in args if not a.startswith("-")), None)
    if target is None or target.startswith("~") or _ok_path(target) is None:
        return None  # home, the previous directory, a variable: not known here
    return target if target.startswith("/") or cwd is None else posixpath.join(cwd, target)


def _command_changes(cmd: str, args: list[str]) -> list[_Change]:
    """What ``rm``, ``mv a b``, ``cp a b``, ``touch``, ``tee`` and ``sed -i`` change."""
    plain = [p for a in args if not a.startswith("-") and (p := _ok_path(a)) is not None]
    if cmd in ("rm", "unlink"):
        return [_Change("delete", p) for p in plain]
    if cmd in ("mv", "cp"):
        named = [a for a in args if not a.startswith("-")]
        if len(named) != 2 or len(plain) != 2 or any(a.startswith("-t") for a in args):
            return []
        src, dst = plain
        return ([_Change("move", src, to=dst)] if cmd == "mv" else []) + [_Change("write", dst)]
    if cmd == "touch":
        return [_Change("touch", p) for p in plain]
    if cmd == "tee":
        append = any(a in ("-a", "--append") for a in args)
        return [_Change("edit" if append else "write", p) for p in plain]
    if cmd == "sed" and any(a.startswith(("-i", "--in-place")) or (
            a.startswith("-") and not a.startswith("--") and "i" in a[1:]) for a in args):
        given = any(a in ("-e", "-f") or a.startswith(("--expression", "--file")) for a in args)
        files = _sed_operands(args) if given else [a for a in args if not a.startswith("-")][1:]
        return [_Change("edit", p) for a in files if (p := _ok_path(a)) is not None]
    return []


def _sed_operands(args: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a in ("-e", "-f"):
            skip = True
        elif not a.startswith("-"):
            out.append(a)
    return out


# Shell reads: a pipeline whose first command prints files (``cat``, ``nl``, ``head``,
# ``tail``, ``sed -n``) and whose other commands only select lines of it (``head``, ``tail``,
# ``sed -n``, ``cat``, ``nl``); what another filter (``grep``, ``wc``) shows is no read.

_Lines = list[LineRange]


def _pipeline_reads(stages: list[_Stage]) -> list[tuple[str, LineRange]]:
    if any(stdout for s in stages for _, _, stdout in s.outputs):
        return []  # printed into a file, not shown
    words = _command(stages[0].words)
    found = _source(words[0], words[1:]) if words else None
    if not found:
        return []
    if len(stages) > 1:
        if len(found) != 1:
            return []  # the files' lines run together: which are which is not known
        path, lines = found[0]
        for stage in stages[1:]:
            words = _command(stage.words)
            narrowed = _filter(words[0], words[1:], lines) if words else None
            if not narrowed:
                return []
            lines = narrowed
        found = [(path, lines)]
    return [(path, r) for path, lines in found for r in lines]


def _source(cmd: str, args: list[str]) -> list[tuple[str, _Lines]] | None:
    """The files a command prints, each with its lines; None when it prints none (a filter
    reading its input, or no reader)."""
    if cmd in ("cat", "nl"):
        files = _operands(args, _NL_VALUED if cmd == "nl" else frozenset())
        lines: _Lines | None = [WHOLE]
    elif cmd in ("head", "tail"):
        parsed = _head_tail(cmd, args)
        if parsed is None:
            return None
        files, lines = parsed[1], _narrow_count(parsed[0], [WHOLE])
    elif cmd == "sed":
        script = _sed(args)
        if script is None or len(script[1]) != 1:
            return None  # several files run together under one line count
        files, lines = script[1], _narrow_sed(script[0], WHOLE)
    else:
        return None
    if not lines:
        return None
    paths = [p for f in files if f != "-" and (p := _ok_path(f)) is not None]
    return [(p, lines) for p in paths] or None


def _filter(cmd: str, args: list[str], lines: _Lines) -> _Lines | None:
    """The lines of ``lines`` that a filter command keeps (None: not a line selection)."""
    if cmd in ("cat", "nl", "tee"):
        if cmd != "tee" and _operands(args, _NL_VALUED if cmd == "nl" else frozenset()):
            return None  # prints its own files, not its input
        return lines
    if cmd in ("head", "tail"):
        parsed = _head_tail(cmd, args)
        return _narrow_count(parsed[0], lines) if parsed is not None and not parsed[1] else None
    if cmd == "sed":
        script = _sed(args)
        if script is None or script[1] or len(lines) != 1:
            return None
        return _narrow_sed(script[0], lines[0])
    return None


def _operands(args: list[str], valued: frozenset[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a.startswith("-") and a != "-":
            skip = a in valued
        else:
            out.append(a)
    return out


def _head_tail(cmd: str, args: list[str]) -> tuple[tuple[str, int], list[str]] | None:
    """``head``/``tail`` options: ``("head", n)``, ``("tail", n)`` or ``("from", k)`` (``tail
    -n +k``), and the files; None for byte counts, ``-f`` or ``head -n -k``."""
    count = "10"
    files: list[str] = []
    it = iter(args)
    for a in it:
        if a in ("-n", "--lines"):
            count = next(it, "")
        elif a.startswith("--lines="):
            count = a.split("=", 1)[1]
        elif a.startswith(("-c", "--bytes", "-f", "-F", "--follow")):
            return None
        elif a.startswith("-n"):
            count = a[2:]
        elif a.startswith("-") and a[1:].isdigit():
            count = a[1:]
        elif not a.startswith("-") or a == "-":
            files.append(a)
    m = _COUNT_RE.fullmatch(count)
    if m is None or (cmd == "head" and m[1] == "-"):
        return None
    n = int(m[2])
    return ("from" if cmd == "tail" and m[1] == "+" else cmd, n), files


def _narrow_count(op: tuple[str, int], lines: _Lines) -> _Lines | None:
    """``lines`` after ``head -n``/``tail -n``/``tail -n +k``."""
    how, n = op
    if any(r.tail is not None for r in lines):
        if how == "tail" and len(lines) == 1 and lines[0].start == 1:
            return [LineRange(tail=min(n, lines[0].tail or n))]
        return None
    if how == "head":
        out: _Lines = []
        left = n
        for r in lines:
            if left <= 0:
                break
            end = r.start + left - 1 if r.end is None else min(r.end, r.start + left - 1)
            out.append(LineRange(r.start, end))
            left -= end - r.start + 1
        return out
    if len(lines) != 1:
        return None
    r = lines[0]
    if how == "from":
        start = r.start + max(n, 1) - 1
        return [LineRange(start, r.end)] if r.end is None or start <= r.end else []
    if n <= 0:
        return []
    if r.end is not None:
        return [LineRange(max(r.start, r.end - n + 1), r.end)]
    return [LineRange(tail=n)] if r.start == 1 else None


def _sed(args: list[str]) -> tuple[_Lines, list[str]] | None:
    """A ``sed`` that only prints lines by number (``-n 'A,Bp'``, ``'Ap'``, ``'A,$p'``,
    ``'$p'``, ``Nq``, several joined by ``;``): the lines (relative to its input) and its
    files; None for any other script or ``-i``."""
    quiet = False
    scripts: list[str] = []
    files: list[str] = []
    it = iter(args)
    for a in it:
        if a in ("-n", "--quiet", "--silent"):
            quiet = True
        elif a in ("-e", "--expression"):
            scripts.append(next(it, ""))
        elif a.startswith("--expression="):
            scripts.append(a.split("=", 1)[1])
        elif a.startswith(("--in-place", "--file")):
            return None
        elif a.startswith("--"):
            continue
        elif a.startswith("-") and a != "-":
            letters = a[1:]
            if "i" in letters or "f" in letters:
                return None
            quiet = quiet or "n" in letters
            if letters.endswith("e"):
                scripts.append(next(it, ""))
        else:
            files.append(a)
    if not scripts:
        if not files:
            return None
        scripts, files = files[:1], files[1:]
    lines: _Lines = []
    quit_at: int | None = None
    for command in re.split(r"[;\n]", "\n".join(scripts)):
        if not command.strip():
            continue
        m = _SED_COMMAND_RE.fullmatch(command)
        if m is None:
            return None
        if m["q"] is not None:
            quit_at = int(m["q"]) if quit_at is None else min(quit_at, int(m["q"]))
        elif not quiet:
            return None  # every line is printed anyway, some twice
        elif m["last"] is not None:
            lines.append(LineRange(tail=1))
        else:
            first = int(m["a"])
            last = None if m["b"] == "$" else int(m["b"] or first)
            if first < 1:
                return None
            lines.append(LineRange(first, None if last is None else max(first, last)))
    if quit_at is not None:
        if not quiet:
            lines = [LineRange(1, quit_at)]
        elif any(r.tail is not None for r in lines):
            return None
        else:
            lines = [LineRange(r.start, quit_at if r.end is None else min(r.end, quit_at))
                     for r in lines if r.start <= quit_at]
    return (lines, files) if lines else None


def _narrow_sed(picked: _Lines, r: LineRange) -> _Lines | None:
    """The lines of ``r`` that ``sed`` prints, ``picked`` counting from ``r``'s first."""
    if r.tail is not None:
        return None
    out: _Lines = []
    for p in picked:
        if p.tail is not None:
            if r.end is not None:
                out.append(LineRange(r.end, r.end))
            elif r.start == 1:
                out.append(p)
            else:
                return None
            continue
        start = r.start + p.start - 1
        end = None if p.end is None else r.start + p.end - 1
        if r.end is not None:
            end = r.end if end is None else min(end, r.end)
        if end is None or start <= end:
            out.append(LineRange(start, end))
    return out

"""Quote protection: file reads a coming edit will quote are not aged below what it needs. Pure.

Coding agents edit by quoting: Claude Code's ``Edit``/``MultiEdit`` (``old_string``), Codex's
``apply_patch`` (context and ``-`` lines), chat agents' ``str_replace``/``edit_file``
(``old_str``). A read aged to ``old_max_bytes`` no longer holds the lines to quote byte for
byte, and the edit fails. The rule (README "Offload"), decided on the history as it was when
the ageing was decided (``seen`` messages: the compaction's request, :func:`.ageing.aged_at`),
so it holds for the whole epoch:

* a *hot* path is one the agent has edited (any edit call on it so far) or read in the newest
  ``recent_turns`` tool-call turns;
* the newest read of each hot path is exempt from stage 2 (kept at its stage-1 cut), newest
  first while their stage-1 sizes fit ``budget`` bytes: the oldest lose protection first.

Reads are the client's read tools (``offload.read_tools``) and shell reads (``cat``, ``sed``,
``head``, ``tail``, ``nl`` in Codex's ``exec_command``/``shell``/``local_shell_call``).
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

import orjson

from ..config import ReadTool
from .ageing import tool_turns
from .model import Message

__all__ = ["choose", "edited_paths", "file_reads", "patch_paths", "protected_reads",
           "shell_read_paths", "working_set"]

# Commands whose output is (a slice of) the files they name.
_READERS: Final = frozenset({"cat", "sed", "head", "tail", "nl"})
# Options of those commands that take a value as the next word.
_VALUED: Final = {"head": {"-n", "-c"}, "tail": {"-n", "-c"}, "sed": {"-e", "-f"},
                  "nl": {"-b", "-w", "-s", "-v", "-i"}, "cat": set()}
_SHELLS: Final = frozenset({"exec_command", "shell", "local_shell_call", "shell_call",
                            "container.exec"})
_SEPARATORS: Final = re.compile(r"&&|\|\||[;\n]")
# apply_patch headers naming a file whose lines the patch quotes (an added or deleted file
# quotes none, and is not quoted afterwards).
_PATCH_FILE: Final = re.compile(r"^\*\*\* Update File: (.+?)\s*$", re.M)
_EDIT_TOOLS: Final = frozenset({"Edit", "MultiEdit", "edit_file", "str_replace", "edit"})
_EDITOR_TOOLS: Final = frozenset({"str_replace_based_edit_tool", "str_replace_editor"})
_EDITOR_EDITS: Final = frozenset({"str_replace", "insert"})


def _calls(messages: Iterable[Message]) -> Iterator[tuple[str, str, str]]:
    """(call id, tool name, raw arguments) of every tool call."""
    for m in messages:
        if m.get("role") != "assistant":
            continue
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(call.get("id"), str):
                name, args = fn.get("name"), fn.get("arguments")
                if isinstance(name, str):
                    yield call["id"], name, args if isinstance(args, str) else ""


def _json(raw: str) -> dict[str, Any]:
    try:
        value = orjson.loads(raw or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _join(workdir: Any, path: str) -> str:
    if isinstance(workdir, str) and workdir and not path.startswith("/"):
        path = posixpath.join(workdir, path)
    return posixpath.normpath(path)


def _script(args: dict[str, Any]) -> tuple[str, Any]:
    """The shell text of a shell call and its working directory."""
    action = args.get("action")
    if isinstance(action, dict):  # local_shell_call / shell_call items
        args = {**args, **action}
    workdir = args.get("workdir", args.get("working_directory", args.get("cwd")))
    for key in ("cmd", "command", "commands"):
        value = args.get(key)
        if isinstance(value, str):
            return value, workdir
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            if len(value) >= 3 and value[1] in ("-c", "-lc") and value[0].endswith("sh"):
                return value[2], workdir  # ["bash", "-lc", script]
            if key == "commands":
                return "\n".join(value), workdir
            return shlex.join(value), workdir
    return "", workdir


def shell_read_paths(script: str) -> list[str]:
    """The files a shell script prints with ``cat``/``sed``/``head``/``tail``/``nl``: each
    command of the script (split at ``&&``, ``||``, ``;``, newlines), first stage of a pipe."""
    if "*** Begin Patch" in script:
        return []
    paths: list[str] = []
    for command in _SEPARATORS.split(script):
        command = command.split("|", 1)[0]
        try:
            words = shlex.split(command)
        except ValueError:
            continue
        if not words or posixpath.basename(words[0]) not in _READERS:
            continue
        prog = posixpath.basename(words[0])
        valued = _VALUED[prog]
        operands: list[str] = []
        has_script = False
        skip = False
        for word in words[1:]:
            if skip:
                skip = False
                continue
            if word in (">", ">>", "<", "2>", "2>&1") or word.startswith((">", "2>")):
                break
            if word.startswith("-") and word != "-":
                if word in valued:
                    skip = True
                    has_script = has_script or word in ("-e", "-f")
                continue
            operands.append(word)
        if prog == "sed" and not has_script:
            operands = operands[1:]  # the first operand is the sed script
        paths += [w for w in operands if w != "-"]
    return paths


def patch_paths(patch: str) -> list[str]:
    """The files an ``apply_patch`` patch quotes (the updated ones)."""
    return [p for p in _PATCH_FILE.findall(patch) if p]


def file_reads(
    messages: Sequence[Message], tools: Mapping[str, ReadTool]
) -> dict[str, tuple[str, ...]]:
    """tool_call_id -> the (normalised) paths whose content that call's result shows."""
    found: dict[str, tuple[str, ...]] = {}
    for cid, name, raw in _calls(messages):
        spec = tools.get(name)
        if spec is not None:
            args = _json(raw)
            path = args.get(spec.path_arg, args.get("path", args.get("file_path")))
            if isinstance(path, str) and path:
                found[cid] = (posixpath.normpath(path),)
        elif name in _EDITOR_TOOLS:
            args = _json(raw)
            if args.get("command") == "view" and isinstance(args.get("path"), str):
                found[cid] = (posixpath.normpath(args["path"]),)
        elif name in _SHELLS:
            script, workdir = _script(_json(raw))
            paths = tuple(_join(workdir, p) for p in shell_read_paths(script))
            if paths:
                found[cid] = paths
    return found


def edited_paths(messages: Sequence[Message]) -> set[str]:
    """Every path an edit call in ``messages`` quotes from."""
    out: set[str] = set()
    for _, name, raw in _calls(messages):
        if name == "apply_patch" and not raw.lstrip().startswith("{"):
            out.update(posixpath.normpath(p) for p in patch_paths(raw))  # a custom tool: raw
            continue
        args = _json(raw)
        if name in _EDIT_TOOLS:
            path = args.get("file_path", args.get("path"))
            if isinstance(path, str) and path:
                out.add(posixpath.normpath(path))
        elif name in _EDITOR_TOOLS:
            if args.get("command") in _EDITOR_EDITS and isinstance(args.get("path"), str):
                out.add(posixpath.normpath(args["path"]))
        elif name in ("apply_patch", "apply_patch_call"):
            op = args.get("operation")
            if isinstance(op, dict) and op.get("type") == "update_file" and isinstance(
                op.get("path"), str
            ):
                out.add(posixpath.normpath(op["path"]))
            patch = args.get("input", args.get("patch"))
            if isinstance(patch, str):
                out.update(posixpath.normpath(p) for p in patch_paths(patch))
        elif name in _SHELLS:
            script, workdir = _script(args)
            out.update(_join(workdir, p) for p in patch_paths(script))
    return out


def _same_file(a: str, b: str) -> bool:
    """Whether two spellings name one file: equal, or a relative one is the other's tail (a
    Codex patch names ``src/x.py`` where a read named ``/repo/src/x.py``)."""
    if a == b:
        return True
    if not a.startswith("/") and b.endswith("/" + a):
        return True
    return not b.startswith("/") and a.endswith("/" + b)


def working_set(
    history: Sequence[Message], seen: int, tools: Mapping[str, ReadTool], *, recent_turns: int,
) -> Mapping[int, str]:
    """The newest read of each hot path in ``history[:seen]`` (an edited path, or one read in
    the newest ``recent_turns`` tool-call turns): its result's index -> the path. Depends on
    ``history[:seen]`` alone, so a caller may keep it for the epoch."""
    if seen <= 0:
        return {}
    then = history[:seen]
    reads = file_reads(then, tools)
    if not reads:
        return {}
    edited = edited_paths(then)
    turn_of, turns = tool_turns(then)
    newest: dict[str, int] = {}  # path -> index of its newest read's result
    recent: set[str] = set()
    for i, m in enumerate(then):
        cid = m.get("tool_call_id") if m.get("role") in ("tool", "function") else None
        paths = reads.get(cid) if isinstance(cid, str) else None
        for p in paths or ():
            newest[p] = i
            if turn_of.get(i, 0) >= turns - recent_turns:
                recent.add(p)
    return {i: p for p, i in newest.items()
            if p in recent or any(_same_file(p, e) for e in edited)}


def choose(working: Mapping[int, str], candidates: Mapping[int, int], budget: int
           ) -> frozenset[int]:
    """Of the working set's reads that stage 2 would cut (``candidates``: index -> the bytes
    its stage-1 form keeps), the newest first while their sizes fit ``budget``."""
    chosen: set[int] = set()
    spent = 0
    for i in sorted((i for i in working if i in candidates), reverse=True):
        size = candidates[i]
        if spent + size > budget:
            break
        chosen.add(i)
        spent += size
    return frozenset(chosen)


def protected_reads(
    history: Sequence[Message],
    seen: int,
    candidates: Mapping[int, int],
    tools: Mapping[str, ReadTool],
    *,
    recent_turns: int,
    budget: int,
) -> frozenset[int]:
    """The indices of ``candidates`` (result index -> the bytes its stage-1 form keeps: the
    results stage 2 would cut) that are the newest read of a hot path in ``history[:seen]``,
    newest first while their sizes fit ``budget``."""
    if not candidates or budget <= 0:
        return frozenset()
    return choose(working_set(history, seen, tools, recent_turns=recent_turns), candidates,
                  budget)

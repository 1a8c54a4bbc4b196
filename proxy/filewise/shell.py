"""Shell command lines as file reads and changes: which lines of which file a shell call
shows, and which files it plainly changes (pure, no I/O). :mod:`proxy.filewise.provenance`
asks it for the calls of every shell tool (Codex's ``exec_command`` / ``shell`` /
``local_shell_call`` / ``shell_call``, Claude Code's ``Bash``, ...):

* reads: ``cat``, ``nl``, ``sed -n 'A,Bp'`` (``'Ap'``, ``'A,$p'``, ``'$p'``, ``Nq``),
  ``head -n N``, ``tail -n N`` (``tail=N``), ``tail -n +K``, in each command of a chain; in a
  pipe the first command's file, narrowed by later commands that only select lines (``head``,
  ``tail``, ``sed -n``; ``cat``/``nl``/``tee`` pass it on); another filter (``grep``, ``wc``)
  or output sent into a file makes it no read, since which lines were shown is not known;
* changes where obvious: ``>``, ``>>``, ``tee [-a]``, ``sed -i``, ``rm``, ``mv``, ``cp``,
  ``touch``; an ``apply_patch`` heredoc or argv is the patch's changes
  (:mod:`proxy.filewise.patch`).

Paths as written, each with the directory it is relative to (the call's ``workdir``, then
each ``cd``); heredoc bodies are data, not commands.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from proxy.filewise.calls import WHOLE, LineRange, _Change, _ok_path, _Read
from proxy.filewise.patch import _patch_changes
from proxy.model import normalise_newlines

__all__ = [
    "shell_reads",
    "shell_script",
]


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

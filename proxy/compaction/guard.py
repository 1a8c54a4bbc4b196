"""The compaction guard (issue 20): ledgers the proxy keeps itself, so no compaction can lose
them. Pure, no I/O.

Three ledgers are computed from the evicted turns by the proxy (never by the model), carried
byte-exact from summary to summary, capped, and rendered after the model's sections, before the
user-requests block (:mod:`.requests`)::

    ## Pinned by ctxproxy
    <one intro line>

    ### Goal
    **First request**
    > Fix the failing test in tests/test_app.py.

    **Restated in turn 7**
    > New task: port the CLI to click.

    ### Constraints & Preferences (verbatim)
    - Never push to main.
    *[... 2 constraints omitted here for space; they are in the dialog archive named above ...]*
    - Please use pytest, not unittest.

    ### Files
    - `src/app.py`: edited (turns 2, 5)
    - `old.py`: moved to `new.py` (turn 4)

Rules (the *user's words* are the text parts of ``user`` messages, newlines normalised, minus
blocks a client injects: ``<system-reminder>``, ``<environment_context>``, ``<user_instructions>``,
``<INSTRUCTIONS>``, ``<command-*>``, ``<local-command-*>``; a user message left empty is not a
turn. Turns are numbered over the whole history, 1 for the first such message):

* Goal: the session's first user request (cut to 60% of ``goal_bytes``) and the newest
  :data:`MAX_RESTATEMENTS` restatements: later messages whose start says the task is replaced
  (:data:`RESTATE_RE`: "new task", "change of plan", "scratch that", "forget that", "instead,",
  "actually, let's", "let's switch to", "the task is now", ...). A previous summary without a
  guard block gives its first verbatim user request as the first request.
* Constraints: sentences (split after ``.``, ``!``, ``?``) of the user's lines outside code fences
  and ``>`` quotes matching :data:`CUE_RE` (never, always, must, don't / do not, avoid, prefer,
  should not, make sure, please use / keep / stick to, keep ... unchanged / intact / as is /
  untouched, only + a verb of work, use only), verbatim (a sentence over 300 bytes is cut with
  ``…``), deduplicated ignoring case and spacing, first-seen order. Over ``constraints_bytes`` the
  oldest entries that fit half the cap stay, then the newest that fit; the run between goes, its
  count written where it was (as the user-requests block does).
* Files: from the tool calls (see :func:`file_events`): one line per path, its latest state
  (``written``, ``edited``, ``touched``, ``deleted``, ``moved to `x```) and the turns that touched
  it (the first and the newest five; ``…`` marks a gap). Over ``files_bytes`` the files touched
  least recently go, counted in a note.

The block is parsed back from the previous summary's text (:func:`parse_ledgers`, the last line
reading exactly ``## Pinned by ctxproxy`` up to the next level 1-2 heading) and merged with the new
turns; rendering what was parsed gives the same bytes. Any block under that heading in the
model's answer is removed first (:func:`strip_guard`), so the model can neither remove nor alter
the proxy's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

from proxy.compaction.prompt import Message, shorten
from proxy.compaction.requests import parse_user_block
from proxy.compaction.sections import close_fences, join_sections, parse_heading, split_sections
from proxy.config.compaction import GuardConfig
from proxy.filewise.provenance import call_files
from proxy.model import content_text, normalise_newlines, tool_calls

__all__ = [
    "CUE_RE",
    "GUARD_HEADING",
    "MAX_RESTATEMENTS",
    "RESTATE_RE",
    "FileState",
    "Ledgers",
    "constraint_sentences",
    "file_events",
    "guard_block",
    "merge_ledgers",
    "parse_ledgers",
    "render_ledgers",
    "strip_guard",
    "user_text",
    "user_turns",
]

GUARD_HEADING: Final = "## Pinned by ctxproxy"
MAX_RESTATEMENTS: Final = 3
_TURNS_KEPT: Final = 6  # the first turn and the newest five
_ITEM_BYTES: Final = 300
_FIRST_SHARE: Final = 0.6

_INTRO: Final = (
    "Kept by the proxy from the user's own words and the tool calls, carried unchanged from "
    "compaction to compaction; the user's rules below stand unless the user changed them."
)
_GOAL_H: Final = "### Goal"
_CONSTRAINTS_H: Final = "### Constraints & Preferences (verbatim)"
_FILES_H: Final = "### Files"
_NONE: Final = "*(none yet)*"
_FIRST: Final = "**First request**"
_RESTATED_RE: Final = re.compile(r"^\*\*Restated in turn (\d+)\*\*$")
_C_OMITTED_RE: Final = re.compile(
    r"^\*\[\.\.\. (\d+) constraints? omitted here for space; they are in the dialog archive "
    r"named above \.\.\.\]\*$"
)
_F_OMITTED_RE: Final = re.compile(
    r"^\*\[\.\.\. (\d+) older files? omitted for space; their calls are in the dialog archive "
    r"named above \.\.\.\]\*$"
)
_FILE_RE: Final = re.compile(
    r"^- `([^`\n]+)`: (written|edited|touched|deleted|moved to `[^`\n]+`) "
    r"\(turns? ((?:\d+|…)(?:, (?:\d+|…))*)\)$"
)

# Blocks clients inject into user messages: not the user's words.
_INJECTED_RE: Final = re.compile(
    r"<(system-reminder|environment_context|user_instructions|INSTRUCTIONS|command-[\w-]+"
    r"|local-command-[\w-]+|user-prompt-submit-hook)>.*?</\1>"
    r"|^# AGENTS\.md instructions for [^\n]*$",
    re.DOTALL | re.MULTILINE,
)
_APOS: Final = r"[’']"
CUE_RE: Final = re.compile(
    rf"\b(?:never|always|must|mustn{_APOS}t|don{_APOS}t|do not|avoid|prefer(?:s|red)?"
    rf"|shouldn{_APOS}t|should not|make sure|use only)\b"
    r"|\bplease (?:use|keep|stick to)\b"
    r"|\bkeep\b.{0,80}?\b(?:unchanged|intact|as[ -]is|untouched)\b"
    r"|\bonly (?:use|touch|change|modify|edit|run|write|create|commit|read|test|return|output"
    r"|reply|respond|answer|work|add|fix|do)\b",
    re.IGNORECASE,
)
RESTATE_RE: Final = re.compile(
    r"^(?:(?:ok(?:ay)?|alright|so|now|well|hey|hi)[,.!]?\s+)*"
    r"(?:new (?:task|goal|plan)\b|next task\b|change of plans?\b|scratch that\b"
    r"|forget (?:that|it|about|the previous|what i said|everything)\b|never ?mind\b"
    rf"|instead,|actually,? (?:let{_APOS}?s|let us|i want|we need|please)\b"
    rf"|let{_APOS}?s (?:switch|move on|pivot|start over)\b|start over\b"
    r"|(?:the|your|our) (?:new |main |real )?(?:task|goal) is (?:now )?)",
    re.IGNORECASE,
)
_SENTENCE_SPLIT_RE: Final = re.compile(r"(?<=[.!?])\s+")
_FENCE_RE: Final = re.compile(r"^ {0,3}(`{3,}|~{3,})")


# -- the user's words ----------------------------------------------------------------------


def user_text(msg: object) -> str:
    """The user's own words in ``msg`` ("" for other roles): text parts, newlines normalised,
    injected client blocks removed, stripped."""
    if not isinstance(msg, Mapping) or msg.get("role") != "user":
        return ""
    text = normalise_newlines(content_text(msg.get("content"), placeholders=False))
    return _INJECTED_RE.sub("", text).strip()


def user_turns(messages: Iterable[Message]) -> int:
    """How many user turns ``messages`` hold (user messages with words of their own)."""
    return sum(1 for m in messages if user_text(m))


def constraint_sentences(text: str) -> list[str]:
    """The sentences of ``text`` that state a rule or preference (module docstring)."""
    out: list[str] = []
    fence = False
    for line in text.split("\n"):
        if _FENCE_RE.match(line):
            fence = not fence
            continue
        if fence or line.lstrip().startswith(">"):
            continue
        for sentence in _SENTENCE_SPLIT_RE.split(line.strip()):
            sentence = sentence.strip()
            if sentence and CUE_RE.search(sentence):
                out.append(_cut_bytes(sentence, _ITEM_BYTES))
    return out


def _nbytes(text: str) -> int:
    return len(text.encode())


def _cut_bytes(text: str, limit: int) -> str:
    """``text`` if it fits ``limit`` UTF-8 bytes, else its head and ``…`` within them."""
    if _nbytes(text) <= limit:
        return text
    head = text.encode()[: max(0, limit - len("…".encode()))].decode(errors="ignore")
    return head.rstrip() + "…"


def _cut_request(text: str, limit: int) -> str:
    """A long request cut in the middle (head and tail kept, :func:`shorten`) to ``limit``
    bytes, rendered as a quote (two bytes a line more)."""
    def size(t: str) -> int:
        return _nbytes(_quote(t))
    if size(text) <= limit:
        return text
    chars = limit
    while chars > 0:
        cut = shorten(text, chars)
        if size(cut) <= limit:
            return cut
        if chars <= 100:  # shorten's floor: cut by bytes instead
            break
        chars = max(100, chars - max(1, size(cut) - limit))
    return _cut_bytes(" ".join(text.split()), max(0, limit - 2))


def _quote(text: str) -> str:
    return "\n".join(f"> {line}" if line else ">" for line in text.split("\n"))


# -- files ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FileState:
    path: str
    state: str  # written | edited | touched | deleted | moved to `dst`
    turns: tuple[int, ...]  # the first turn and the newest ones
    gap: bool = False  # turns between the first and the newest were dropped
    order: int = field(default=0, compare=False)  # first-seen position, not rendered


_STATES: Final = {"write": "written", "edit": "edited", "delete": "deleted", "touch": "touched"}


def file_events(name: str, args: str) -> list[tuple[str, str]]:
    """``(path, state)`` changes one tool call makes, from its name and arguments, paths as
    written: its edits (:func:`proxy.pipeline.files.call_files`: Claude Code
    ``Write``/``Edit``/``NotebookEdit``, Codex ``apply_patch`` in every shape, shell calls,
    chat tools such as ``write_file``/``edit_file``/``create_file``/``delete_file``/
    ``move_file``, the text-editor tool), a move as ``moved to `dst```."""
    return [(e.path, f"moved to `{e.to}`" if e.kind == "move" else _STATES[e.kind])
            for e in call_files(name, args, resolve=False)[1]]


# -- the ledgers ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ledgers:
    first: str | None = None  # the session's first request, verbatim (cut)
    restated: tuple[tuple[int, str], ...] = ()  # (turn, text), oldest first
    constraints: tuple[str, ...] = ()
    constraints_head: int = 0  # entries before the omission note
    constraints_omitted: int = 0
    files: tuple[FileState, ...] = ()
    files_omitted: int = 0


def _dedup_key(text: str) -> str:
    return " ".join(text.split()).casefold()


def _add_turn(fs: FileState, turn: int) -> FileState:
    if fs.turns and fs.turns[-1] == turn:
        return fs
    turns = (*fs.turns, turn)
    gap = fs.gap
    if len(turns) > _TURNS_KEPT:
        turns, gap = (turns[0], *turns[-(_TURNS_KEPT - 1):]), True
    return replace(fs, turns=turns, gap=gap)


def merge_ledgers(
    previous: Ledgers,
    evicted: Sequence[Message],
    *,
    turn_base: int,
    config: GuardConfig,
    first_fallback: str | None = None,
) -> Ledgers:
    """``previous`` merged with what ``evicted`` adds (its first message is in turn
    ``turn_base + 1`` at the earliest), then capped (module docstring)."""
    first = previous.first
    restated = list(previous.restated)
    constraints = list(previous.constraints)
    seen = {_dedup_key(c) for c in constraints}
    new_constraints: list[str] = []
    files = {fs.path: replace(fs, order=i) for i, fs in enumerate(previous.files)}
    order = len(files)
    if first is None and first_fallback:
        first = _cut_request(first_fallback, int(config.goal_bytes * _FIRST_SHARE))
    turn = turn_base
    for msg in evicted:
        if not isinstance(msg, Mapping):
            continue
        text = user_text(msg)
        if text:
            turn += 1
            if first is None:
                first = _cut_request(text, int(config.goal_bytes * _FIRST_SHARE))
            elif RESTATE_RE.match(text):
                restated.append((turn, text))
            for sentence in constraint_sentences(text):
                k = _dedup_key(sentence)
                if k not in seen:
                    seen.add(k)
                    new_constraints.append(sentence)
        if msg.get("role") != "assistant":
            continue
        for _, name, args in tool_calls(msg):
            for path, state in file_events(name, args):
                fs = files.get(path)
                if fs is None:
                    fs = FileState(path, state, (), False, order)
                    order += 1
                files[path] = _add_turn(replace(fs, state=state), turn)
    kept_restated = _fit_restated(first, restated, config.goal_bytes)
    head, cons, omitted = _fit_constraints(
        constraints, previous.constraints_head, new_constraints, previous.constraints_omitted,
        config.constraints_bytes,
    )
    kept_files, files_omitted = _fit_files(
        sorted(files.values(), key=lambda f: f.order), previous.files_omitted, config.files_bytes
    )
    return Ledgers(first, tuple(kept_restated), tuple(cons), head, omitted,
                   tuple(kept_files), files_omitted)


def _goal_lines(first: str | None, restated: Sequence[tuple[int, str]]) -> list[str]:
    lines: list[str] = []
    if first is not None:
        lines += [_FIRST, _quote(first)]
    for turn, text in restated:
        if lines:
            lines.append("")
        lines += [f"**Restated in turn {turn}**", _quote(text)]
    return lines or [_NONE]


def _fit_restated(
    first: str | None, restated: Sequence[tuple[int, str]], cap: int
) -> list[tuple[int, str]]:
    """The newest restatements (each cut) that fit ``cap`` with the first request."""
    kept: list[tuple[int, str]] = []
    each = max(100, cap // 5)
    for turn, text in reversed(restated[-MAX_RESTATEMENTS:]):
        candidate = [(turn, _cut_request(text, each)), *kept]
        if _nbytes("\n".join(_goal_lines(first, candidate))) > cap:
            break
        kept = candidate
    return kept


def _constraint_lines(entries: Sequence[str], head: int, omitted: int) -> list[str]:
    lines = [f"- {e}" for e in entries[:head]]
    if omitted:
        s = "s" if omitted != 1 else ""
        lines.append(f"*[... {omitted} constraint{s} omitted here for space; they are in the "
                     "dialog archive named above ...]*")
    lines += [f"- {e}" for e in entries[head:]]
    return lines or [_NONE]


def _fit_constraints(
    previous: Sequence[str], head: int, new: Sequence[str], omitted: int, cap: int
) -> tuple[int, list[str], int]:
    """``(head, entries, omitted)``: the oldest entries fitting half of ``cap`` stay (a head
    already fixed stays fixed), then the newest that fit; the run between is counted."""
    entries = [*previous, *new]
    if _nbytes("\n".join(_constraint_lines(entries, head, omitted))) <= cap:
        return (head if omitted else len(entries)), entries, omitted
    if not omitted:  # fix the head: the oldest entries that fit half the cap
        used, head = 0, 0
        for e in entries:
            if used + _nbytes(e) + 3 > cap // 2:
                break
            used += _nbytes(e) + 3
            head += 1
    fixed, rest = entries[:head], entries[head:]
    total = omitted + len(rest)
    keep = 0
    while keep < len(rest):
        trial = rest[len(rest) - keep - 1 :]
        dropped = total - len(trial)
        if _nbytes("\n".join(_constraint_lines([*fixed, *trial], head, dropped))) > cap:
            break
        keep += 1
    kept = rest[len(rest) - keep :] if keep else []
    return head, [*fixed, *kept], total - keep


def _file_line(fs: FileState) -> str:
    turns = [str(t) for t in fs.turns]
    if fs.gap and len(turns) > 1:
        turns.insert(1, "…")
    word = "turn" if len(turns) == 1 else "turns"
    return f"- `{fs.path}`: {fs.state} ({word} {', '.join(turns)})"


def _file_lines(files: Sequence[FileState], omitted: int) -> list[str]:
    lines = [_file_line(f) for f in files]
    if omitted:
        s = "s" if omitted != 1 else ""
        lines.append(f"*[... {omitted} older file{s} omitted for space; their calls are in the "
                     "dialog archive named above ...]*")
    return lines or [_NONE]


def _fit_files(
    files: Sequence[FileState], omitted: int, cap: int
) -> tuple[list[FileState], int]:
    """Files in first-seen order; over ``cap`` the least recently touched go first."""
    kept = list(files)
    while kept and _nbytes("\n".join(_file_lines(kept, omitted))) > cap:
        victim = min(kept, key=lambda f: (f.turns[-1] if f.turns else 0, f.order))
        kept.remove(victim)
        omitted += 1
    return kept, omitted


def render_ledgers(ledgers: Ledgers) -> str:
    """The ``## Pinned by ctxproxy`` block (format in the module docstring)."""
    lines = [GUARD_HEADING, _INTRO, "", _GOAL_H]
    lines += _goal_lines(ledgers.first, ledgers.restated)
    lines += ["", _CONSTRAINTS_H]
    lines += _constraint_lines(ledgers.constraints, ledgers.constraints_head,
                               ledgers.constraints_omitted)
    lines += ["", _FILES_H]
    lines += _file_lines(ledgers.files, ledgers.files_omitted)
    return "\n".join(lines)


# -- parsing back --------------------------------------------------------------------------


def _block_span(lines: Sequence[str]) -> tuple[int, int] | None:
    """Where the proxy's block is: the last heading line, up to the next level 1-2 heading
    (found without regard to fences, as the user-requests block is)."""
    last = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].rstrip() == GUARD_HEADING),
                None)
    if last is None:
        return None
    end = next(
        (j for j in range(last + 1, len(lines)) if (h := parse_heading(lines[j])) and h[0] <= 2),
        len(lines),
    )
    return last, end


def _parse_quotes(lines: Sequence[str], i: int) -> tuple[str, int]:
    out: list[str] = []
    while i < len(lines) and lines[i].startswith(">"):
        out.append(lines[i][2:] if lines[i].startswith("> ") else lines[i][1:])
        i += 1
    return "\n".join(out), i


def parse_ledgers(summary: str | None) -> Ledgers | None:
    """The ledgers of the proxy's block in ``summary``; None when it has none."""
    if not summary:
        return None
    lines = normalise_newlines(summary).split("\n")
    span = _block_span(lines)
    if span is None:
        return None
    block = lines[span[0] + 1 : span[1]]
    part = ""
    first: str | None = None
    restated: list[tuple[int, str]] = []
    constraints: list[str] = []
    head: int | None = None
    c_omitted = f_omitted = 0
    files: list[FileState] = []
    i = 0
    while i < len(block):
        line = block[i]
        if line in (_GOAL_H, _CONSTRAINTS_H, _FILES_H):
            part = line
            i += 1
            continue
        if part == _GOAL_H and (line == _FIRST or _RESTATED_RE.match(line)):
            text, i = _parse_quotes(block, i + 1)
            if line == _FIRST:
                first = text
            elif (m := _RESTATED_RE.match(line)) is not None:
                restated.append((int(m[1]), text))
            continue
        if part == _CONSTRAINTS_H:
            if (m := _C_OMITTED_RE.match(line)) is not None:
                c_omitted += int(m[1])
                head = len(constraints) if head is None else head
            elif line.startswith("- "):
                constraints.append(line[2:])
        elif part == _FILES_H:
            if (m := _F_OMITTED_RE.match(line)) is not None:
                f_omitted += int(m[1])
            elif (m := _FILE_RE.match(line)) is not None:
                items = m[3].split(", ")
                turns = tuple(int(t) for t in items if t != "…")
                files.append(FileState(m[1], m[2], turns, "…" in items, len(files)))
        i += 1
    return Ledgers(first, tuple(restated), tuple(constraints),
                   len(constraints) if head is None else head, c_omitted, tuple(files), f_omitted)


def strip_guard(text: str) -> str:
    """``text`` without any ``## Pinned by ctxproxy`` section (and the ``###`` sections under
    it): only the proxy's own block, rendered after the model's, counts."""
    preamble, sections = split_sections(normalise_newlines(text))
    key = parse_heading(GUARD_HEADING)
    kept = []
    inside = False
    for s in sections:
        if (s.level, s.key) == key:
            inside = True
            continue
        if inside and s.level >= 3:
            continue
        inside = False
        kept.append(s)
    return "\n".join(close_fences(join_sections(preamble, kept).strip().split("\n")))


def guard_block(
    previous: str | None,
    evicted: Sequence[Message],
    *,
    turn_base: int,
    config: GuardConfig,
) -> str:
    """The block for a new summary: ``previous``'s ledgers merged with ``evicted``'s. A
    previous summary written without the guard gives its first verbatim user request as the
    session's first."""
    prev = parse_ledgers(previous)
    first = None
    if prev is None and previous:
        entries = parse_user_block(previous)[1].entries
        first = entries[0] if entries else None
    return render_ledgers(merge_ledgers(prev or Ledgers(), evicted, turn_base=turn_base,
                                        config=config, first_fallback=first))

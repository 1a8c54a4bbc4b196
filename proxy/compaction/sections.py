"""Summary structure: the required sections, validating and normalising a summary's markdown.

Validation (:func:`summary_problems`, :func:`is_valid_summary`). Headings are ATX lines (up to
three leading spaces, ``#`` marks, text) outside fenced code blocks; setext headings and lines in
fences or block quotes are content. A heading matches a required one when its level is the same
and its text is, after ignoring case, surrounding ``*``/``_`` (bold or italic), a trailing colon,
a closing ``#`` sequence, a leading number (``1.``), extra whitespace, and ``and`` written for
``&``. Required: each heading exactly once, in order, the three ``###`` ones inside
``## Progress`` (no other ``#``/``##`` heading between), a non-empty ``## Goal``, and at least
:data:`MIN_CONTENT_CHARS` non-blank characters under the required headings. Extra sections
anywhere are tolerated. Accepted model answers are rewritten with the exact headings.

Model answers (:func:`clean_answer`): everything before the first ``## Goal`` heading is dropped
(preamble, a ``# Summary`` title, an opening code fence), as is a closing fence that matches an
opening one in the dropped part (and chatter after it). Any ``## User Requests (verbatim)``
section the model wrote is removed: only the proxy's own block counts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from proxy.compaction.prompt import SECTIONS, USER_REQUESTS_HEADING

__all__ = [
    "MIN_CONTENT_CHARS",
    "REQUIRED",
    "USER_KEY",
    "Section",
    "clean_answer",
    "close_fences",
    "is_valid_summary",
    "join_sections",
    "normalize_summary",
    "parse_heading",
    "split_sections",
    "summary_problems",
]

MIN_CONTENT_CHARS: Final = 40

# -- markdown scanning ----------------------------------------------------------------------

_HEADING_RE: Final = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?[ \t]*$")
_CLOSING_HASHES_RE: Final = re.compile(r"(?:^|[ \t]+)#+$")
_FENCE_RE: Final = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
_NUMBERING_RE: Final = re.compile(r"^\d{1,2}[.)][ \t]+")


def _key(title: str) -> str:
    """A heading's text, normalised for matching (see the module docstring)."""
    t = _CLOSING_HASHES_RE.sub("", title.strip())
    for _ in range(2):  # "**Goal:**" and "**Goal**:" alike
        t = t.strip().rstrip(":").strip().strip("*_").strip()
        t = _NUMBERING_RE.sub("", t)
    t = " ".join(t.split()).casefold()
    return t.replace(" and ", " & ")


def parse_heading(line: str) -> tuple[int, str] | None:
    m = _HEADING_RE.match(line)
    if m is None:
        return None
    return len(m[1]), _key(m[2] or "")


@dataclass(frozen=True, slots=True)
class _Fence:
    char: str
    width: int

    def closes(self, line: str) -> bool:
        m = _FENCE_RE.match(line)
        return bool(m and m[1][0] == self.char and len(m[1]) >= self.width and not m[2].strip())


def _opens(line: str) -> _Fence | None:
    m = _FENCE_RE.match(line)
    if m is None or (m[1][0] == "`" and "`" in m[2]):  # backtick info strings hold no backtick
        return None
    return _Fence(m[1][0], len(m[1]))


def _open_fence(lines: Iterable[str]) -> tuple[_Fence, int] | None:
    """The fence left open at the end of ``lines`` and the index of its opening line."""
    fence: tuple[_Fence, int] | None = None
    for i, line in enumerate(lines):
        if fence is not None:
            if fence[0].closes(line):
                fence = None
        else:
            opened = _opens(line)
            if opened is not None:
                fence = (opened, i)
    return fence


def close_fences(lines: list[str]) -> list[str]:
    """``lines`` with a closing fence appended if one is left open, so text placed after them
    (the next section, the user-requests block) is not swallowed by a code block."""
    fence = _open_fence(lines)
    if fence is None:
        return lines
    return [*lines, fence[0].char * fence[0].width]


@dataclass(frozen=True, slots=True)
class Section:
    level: int
    key: str
    heading: str  # the heading line as written
    lines: tuple[str, ...]  # the content up to the next level 1-3 heading


def split_sections(text: str) -> tuple[list[str], list[Section]]:
    """Preamble lines and the sections of ``text``, split at level 1-3 headings outside fences.

    ``split("\\n")`` rather than ``splitlines()``: the latter also breaks at form feeds and
    Unicode separators, which would make parsing disagree with rendering.
    """
    preamble: list[str] = []
    sections: list[Section] = []
    current: tuple[int, str, str, list[str]] | None = None
    fence: _Fence | None = None
    for line in text.split("\n"):
        target = current[3] if current is not None else preamble
        if fence is not None:
            target.append(line)
            if fence.closes(line):
                fence = None
            continue
        head = parse_heading(line)
        if head is not None and head[0] <= 3:
            if current is not None:
                sections.append(Section(current[0], current[1], current[2], tuple(current[3])))
            current = (head[0], head[1], line, [])
            continue
        fence = _opens(line)
        target.append(line)
    if current is not None:
        sections.append(Section(current[0], current[1], current[2], tuple(current[3])))
    return preamble, sections


def join_sections(preamble: Sequence[str], sections: Iterable[Section]) -> str:
    lines = list(preamble)
    for s in sections:
        lines.append(s.heading)
        lines.extend(s.lines)
    return "\n".join(lines)


REQUIRED: Final = tuple((h.count("#"), _key(h.lstrip("#")), h) for h in SECTIONS)
_REQUIRED_BY_KEY: Final = {key: (level, canon) for level, key, canon in REQUIRED}
_PROGRESS_KEY: Final = _key("Progress")
_GOAL_KEY: Final = _key("Goal")
USER_KEY: Final = _key(USER_REQUESTS_HEADING.lstrip("#"))


def _content_chars(lines: Iterable[str]) -> int:
    return sum(len("".join(line.split())) for line in lines)


def summary_problems(text: str) -> list[str]:
    """What keeps ``text`` from being a valid summary, as phrases for the retry reminder
    (missing headings quoted exactly); empty when valid. Rules in the module docstring."""
    _, sections = split_sections(text.replace("\r\n", "\n"))
    where: dict[str, list[int]] = {}
    wrong_level: dict[str, str] = {}
    for i, s in enumerate(sections):
        req = _REQUIRED_BY_KEY.get(s.key)
        if req is None:
            continue
        if s.level == req[0]:
            where.setdefault(s.key, []).append(i)
        else:
            wrong_level.setdefault(s.key, s.heading.strip())
    problems: list[str] = []
    missing = []
    for _, key, canon in REQUIRED:
        if key not in where:
            hint = f" (found `{wrong_level[key]}` instead)" if key in wrong_level else ""
            missing.append(f"`{canon}`{hint}")
    if missing:
        problems.append("missing sections: " + ", ".join(missing))
    dups = [canon for _, key, canon in REQUIRED if len(where.get(key, ())) > 1]
    if dups:
        problems.append("sections written more than once: " + ", ".join(f"`{d}`" for d in dups))
    present = [(where[key][0], canon) for _, key, canon in REQUIRED if key in where]
    for (pos_a, a), (pos_b, b) in zip(present, present[1:], strict=False):
        if pos_b < pos_a:
            problems.append(f"`{b}` must come after `{a}`")
    for level, key, canon in REQUIRED:
        if level != 3 or key not in where:
            continue
        parent = next(
            (s for s in reversed(sections[: where[key][0]]) if s.level <= 2), None
        )
        if parent is None or parent.key != _PROGRESS_KEY:
            problems.append(f"`{canon}` must be inside `## Progress`")
    if _GOAL_KEY in where and not _content_chars(sections[where[_GOAL_KEY][0]].lines):
        problems.append("`## Goal` is empty")
    chars = sum(_content_chars(sections[idx[0]].lines) for idx in where.values())
    if chars < MIN_CONTENT_CHARS:
        problems.append("the sections are (almost) empty")
    return problems


def is_valid_summary(text: str) -> bool:
    return not summary_problems(text)


def normalize_summary(text: str) -> str:
    """``text`` with the required headings written exactly as in :data:`SECTIONS`, any
    user-requests section removed, fences closed, outer blank lines stripped."""
    preamble, sections = split_sections(text.replace("\r\n", "\n"))
    out: list[Section] = []
    for s in sections:
        if s.key == USER_KEY:
            continue
        req = _REQUIRED_BY_KEY.get(s.key)
        heading = req[1] if req is not None and req[0] == s.level else s.heading
        out.append(Section(s.level, s.key, heading, s.lines))
    return "\n".join(close_fences(join_sections(preamble, out).strip().split("\n")))


def clean_answer(answer: str) -> str:
    """A model answer without preamble before ``## Goal`` and without a wrapping code fence
    (see the module docstring); unchanged apart from stripping when it has no Goal heading."""
    lines = answer.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    # Found without regard to fences: a fenced answer has its Goal heading inside one.
    start = next((i for i, line in enumerate(lines) if parse_heading(line) == (2, _GOAL_KEY)), None)
    if start is None:
        return "\n".join(lines).strip()
    dropped_fence = _open_fence(lines[:start]) is not None
    rest = lines[start:]
    tail = _open_fence(rest)
    if tail is not None:
        _, idx = tail
        opening = _FENCE_RE.match(rest[idx])
        bare = opening is not None and not opening[2].strip()
        if bare and (dropped_fence or not any(line.strip() for line in rest[idx + 1 :])):
            rest = rest[:idx]
    return "\n".join(rest).strip()

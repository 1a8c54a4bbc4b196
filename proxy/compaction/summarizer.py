"""The compactor's summarizer logic (SPEC section 5, "Summary", "Insertion", "Cache").

Everything but the network call, which is injected as ``complete(prompt) -> answer``.

Summary format. Markdown with the headings of :data:`SECTIONS` in that order, then the
``## User Requests (verbatim)`` block, which the proxy writes itself from the user's messages
(never the model), so no stated constraint can be lost to a paraphrase.

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

User-requests block (:func:`render_user_requests`, :func:`parse_user_block`)::

    ## User Requests (verbatim)
    The user's own messages from the compacted turns, oldest first (long ones cut in the middle).

    **Request 1**
    > Fix the failing test in tests/test_app.py.
    > Do not touch src/legacy/.

    *[... 3 requests omitted here ...]*

    **Request 5**
    > continue

Every line of an entry is quoted (``>`` for an empty line), so an entry can hold any text,
including markdown headings or fences, and parses back exactly. Entries are the text parts of
``user`` messages, newlines normalised to ``\\n``, stripped, empty ones skipped, each cut to
``per_message_chars`` by :func:`~proxy.compaction.prompt.shorten`. Over ``total_chars`` (the sum
of the entries' lengths), the first entry (usually the task statement) and the newest always stay;
the newest others are kept while they fit and the rest, always the run right after the first
entry, are counted as omitted. Numbers are the requests' ordinals, so the gap shows.

Fallback (:func:`fallback_summary`), used when the model fails: deterministic and model-free.
Every required section keeps the previous summary's content (a bare placeholder like "None" is
replaced) and appends the new items it does not already hold. Goal: the previous goal, else the
first user request (one line, at most 500 chars). Constraints: user lines saying must, never,
don't, only, ... Done: one item per tool call, ``name(args…) → first line of its result`` (the
newest 30). In Progress: the latest user request. Blocked: the first error line of the last tool
result. Next Steps: the assistant's last text. Critical Context: error lines of tool outputs
(tracebacks, ``*Error``, ``FAILED``, ``error:``, ...) verbatim, the newest 12 distinct, at most
300 chars each; the paths named in tool-call arguments; a note that this is a fallback. Other
sections of the previous summary follow Critical Context. Every generated item is a one-line
bullet, so none can turn into a heading or a fence and break the structure.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from .prompt import (
    SECTIONS,
    USER_REQUESTS_HEADING,
    Message,
    build_prompt,
    content_text,
    retry_prompt,
    shorten,
    tool_calls,
)

__all__ = [
    "MIN_CONTENT_CHARS",
    "SECTIONS",
    "SUMMARY_HEADING",
    "USER_REQUESTS_HEADING",
    "Complete",
    "SummaryOutcome",
    "UserRequests",
    "build_prompt",
    "clean_answer",
    "fallback_summary",
    "find_summary_message",
    "is_summary_message",
    "is_valid_summary",
    "merge_user_requests",
    "normalize_summary",
    "parse_user_block",
    "previous_from_messages",
    "render_user_requests",
    "split_user_block",
    "summarize",
    "summary_body",
    "summary_message",
    "summary_problems",
    "user_requests",
    "user_requests_block",
]

Complete = Callable[[list[dict[str, Any]]], Awaitable[str]]

MIN_CONTENT_CHARS: Final = 40
SUMMARY_HEADING: Final = "# Summary of previous conversation"
CLOSING_LINE: Final = (
    "Use this summary for continuity: continue the task from where it left off, without "
    "re-asking the user for anything already known from it."
)
_POINTER_PREFIX: Final = "The earlier part of this conversation was compacted"

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


def _heading(line: str) -> tuple[int, str] | None:
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


def _close_fences(lines: list[str]) -> list[str]:
    """``lines`` with a closing fence appended if one is left open, so text placed after them
    (the next section, the user-requests block) is not swallowed by a code block."""
    fence = _open_fence(lines)
    if fence is None:
        return lines
    return [*lines, fence[0].char * fence[0].width]


@dataclass(frozen=True, slots=True)
class _Section:
    level: int
    key: str
    heading: str  # the heading line as written
    lines: tuple[str, ...]  # the content up to the next level 1-3 heading


def _split(text: str) -> tuple[list[str], list[_Section]]:
    """Preamble lines and the sections of ``text``, split at level 1-3 headings outside fences.

    ``split("\\n")`` rather than ``splitlines()``: the latter also breaks at form feeds and
    Unicode separators, which would make parsing disagree with rendering.
    """
    preamble: list[str] = []
    sections: list[_Section] = []
    current: tuple[int, str, str, list[str]] | None = None
    fence: _Fence | None = None
    for line in text.split("\n"):
        target = current[3] if current is not None else preamble
        if fence is not None:
            target.append(line)
            if fence.closes(line):
                fence = None
            continue
        head = _heading(line)
        if head is not None and head[0] <= 3:
            if current is not None:
                sections.append(_Section(current[0], current[1], current[2], tuple(current[3])))
            current = (head[0], head[1], line, [])
            continue
        fence = _opens(line)
        target.append(line)
    if current is not None:
        sections.append(_Section(current[0], current[1], current[2], tuple(current[3])))
    return preamble, sections


def _join(preamble: Sequence[str], sections: Iterable[_Section]) -> str:
    lines = list(preamble)
    for s in sections:
        lines.append(s.heading)
        lines.extend(s.lines)
    return "\n".join(lines)


_REQUIRED: Final = tuple((h.count("#"), _key(h.lstrip("#")), h) for h in SECTIONS)
_REQUIRED_BY_KEY: Final = {key: (level, canon) for level, key, canon in _REQUIRED}
_PROGRESS_KEY: Final = _key("Progress")
_GOAL_KEY: Final = _key("Goal")
_USER_KEY: Final = _key(USER_REQUESTS_HEADING.lstrip("#"))


def _content_chars(lines: Iterable[str]) -> int:
    return sum(len("".join(line.split())) for line in lines)


def summary_problems(text: str) -> list[str]:
    """What keeps ``text`` from being a valid summary, as phrases for the retry reminder
    (missing headings quoted exactly); empty when valid. Rules in the module docstring."""
    _, sections = _split(text.replace("\r\n", "\n"))
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
    for _, key, canon in _REQUIRED:
        if key not in where:
            hint = f" (found `{wrong_level[key]}` instead)" if key in wrong_level else ""
            missing.append(f"`{canon}`{hint}")
    if missing:
        problems.append("missing sections: " + ", ".join(missing))
    dups = [canon for _, key, canon in _REQUIRED if len(where.get(key, ())) > 1]
    if dups:
        problems.append("sections written more than once: " + ", ".join(f"`{d}`" for d in dups))
    present = [(where[key][0], canon) for _, key, canon in _REQUIRED if key in where]
    for (pos_a, a), (pos_b, b) in zip(present, present[1:], strict=False):
        if pos_b < pos_a:
            problems.append(f"`{b}` must come after `{a}`")
    for level, key, canon in _REQUIRED:
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
    preamble, sections = _split(text.replace("\r\n", "\n"))
    out: list[_Section] = []
    for s in sections:
        if s.key == _USER_KEY:
            continue
        req = _REQUIRED_BY_KEY.get(s.key)
        heading = req[1] if req is not None and req[0] == s.level else s.heading
        out.append(_Section(s.level, s.key, heading, s.lines))
    return "\n".join(_close_fences(_join(preamble, out).strip().split("\n")))


def clean_answer(answer: str) -> str:
    """A model answer without preamble before ``## Goal`` and without a wrapping code fence
    (see the module docstring); unchanged apart from stripping when it has no Goal heading."""
    lines = answer.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    # Found without regard to fences: a fenced answer has its Goal heading inside one.
    start = next((i for i, line in enumerate(lines) if _heading(line) == (2, _GOAL_KEY)), None)
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


# -- user requests --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UserRequests:
    """Quoted user requests, oldest first; ``omitted`` were dropped right after the first."""

    entries: tuple[str, ...] = ()
    omitted: int = 0


_REQUEST_RE: Final = re.compile(r"^\*\*Request (\d+)\*\*$")
_OMITTED_RE: Final = re.compile(r"^\*\[\.\.\. (\d+) requests? omitted here \.\.\.\]\*$")
_USER_INTRO: Final = (
    "The user's own messages from the compacted turns, oldest first (long ones cut in the middle)."
)
_NO_REQUESTS: Final = "*(no user messages in the compacted turns)*"


def _normalise_newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _span_requests(evicted: Sequence[Message], per_message_chars: int) -> list[str]:
    out: list[str] = []
    for msg in evicted:
        if not isinstance(msg, Mapping) or msg.get("role") != "user":
            continue
        text = _normalise_newlines(content_text(msg.get("content"), placeholders=False)).strip()
        if text:
            out.append(shorten(text, per_message_chars))
    return out


def merge_user_requests(
    previous: UserRequests, new: Sequence[str], *, total_chars: int = 8000
) -> UserRequests:
    """``previous`` followed by ``new``, bounded by ``total_chars`` (module docstring)."""
    entries = [*previous.entries, *new]
    omitted = previous.omitted
    if len(entries) <= 2 or sum(len(e) for e in entries) <= total_chars:
        return UserRequests(tuple(entries), omitted)
    first, middle, last = entries[0], entries[1:-1], entries[-1]
    used = len(first) + len(last)
    keep = 0
    for entry in reversed(middle):
        if used + len(entry) > total_chars:
            break
        used += len(entry)
        keep += 1
    kept = middle[len(middle) - keep :]
    return UserRequests((first, *kept, last), omitted + len(middle) - keep)


def user_requests(
    evicted: Sequence[Message], *, per_message_chars: int = 2000, total_chars: int = 8000
) -> list[str]:
    """The user's messages in ``evicted``, verbatim (text parts only), each cut to
    ``per_message_chars``, bounded by ``total_chars`` keeping the first and the newest (the
    count of the dropped ones is in :func:`merge_user_requests`' result)."""
    span = _span_requests(evicted, per_message_chars)
    return list(merge_user_requests(UserRequests(), span, total_chars=total_chars).entries)


def render_user_requests(requests: UserRequests | Sequence[str]) -> str:
    """The ``## User Requests (verbatim)`` block (format in the module docstring)."""
    if not isinstance(requests, UserRequests):
        requests = UserRequests(tuple(requests))
    lines = [USER_REQUESTS_HEADING, _USER_INTRO]
    omitted = requests.omitted
    note = f"*[... {omitted} request{'s' if omitted != 1 else ''} omitted here ...]*"
    if not requests.entries:
        lines += ["", _NO_REQUESTS]
    for i, entry in enumerate(requests.entries):
        number = 1 if i == 0 else i + 1 + omitted
        lines += ["", f"**Request {number}**"]
        lines += [f"> {line}" if line else ">" for line in entry.split("\n")]
        if i == 0 and omitted:
            lines += ["", note]
    return "\n".join(lines)


def _parse_entries(lines: Iterable[str]) -> tuple[list[str], int]:
    entries: list[list[str]] = []
    open_entry = False
    omitted = 0
    for line in lines:
        if _REQUEST_RE.match(line):
            entries.append([])
            open_entry = True
        elif open_entry and line.startswith(">"):
            entries[-1].append(line[2:] if line.startswith("> ") else line[1:])
        else:
            open_entry = False
            m = _OMITTED_RE.match(line)
            if m:
                omitted += int(m[1])
    return ["\n".join(e) for e in entries if any(x.strip() for x in e)], omitted


def _previous_text(previous: str | None) -> str:
    """``previous`` as a summary body: a whole inserted summary message (a client may hand one
    back) is unwrapped, so its heading and pointer line never nest into a new summary."""
    if previous is None:
        return ""
    if _is_summary_text(previous):
        return summary_body(previous) or ""
    return previous


def parse_user_block(summary: str) -> tuple[str, UserRequests]:
    """``(body, requests)``: the summary without its user-requests block(s), and their entries
    (several blocks, as in a hand-merged text, are concatenated; omissions add up).

    The proxy's own block, the last line reading exactly ``## User Requests (verbatim)`` up to
    the next heading, is found without regard to code fences, so a body that left a fence open
    (a client-edited summary) cannot hide it.
    """
    lines = _normalise_newlines(_previous_text(summary)).split("\n")
    last = next(
        (i for i in range(len(lines) - 1, -1, -1) if lines[i].rstrip() == USER_REQUESTS_HEADING),
        None,
    )
    tail: tuple[list[str], int] = ([], 0)
    if last is not None:
        end = next(
            (j for j in range(last + 1, len(lines)) if (h := _heading(lines[j])) and h[0] <= 3),
            len(lines),
        )
        tail = _parse_entries(lines[last + 1 : end])
        lines = lines[:last] + lines[end:]
    preamble, sections = _split("\n".join(lines))
    kept: list[_Section] = []
    entries: list[str] = []
    omitted = 0
    for s in sections:
        if s.key == _USER_KEY:
            found, n = _parse_entries(s.lines)
            entries += found
            omitted += n
        else:
            kept.append(s)
    entries += tail[0]
    omitted += tail[1]
    return _join(preamble, kept).strip(), UserRequests(tuple(entries), omitted)


def split_user_block(summary: str) -> tuple[str, list[str]]:
    """``(body, entries)`` of a summary; :func:`parse_user_block` also gives the omitted count."""
    body, requests = parse_user_block(summary)
    return body, list(requests.entries)


def user_requests_block(
    previous: str | None,
    evicted: Sequence[Message],
    *,
    per_message_chars: int = 2000,
    total_chars: int = 8000,
) -> str:
    """The block for a new summary: ``previous``'s entries merged with ``evicted``'s."""
    _, prev = parse_user_block(previous) if previous else ("", UserRequests())
    new = _span_requests(evicted, per_message_chars)
    return render_user_requests(merge_user_requests(prev, new, total_chars=total_chars))


def _compose(body: str, block: str) -> str:
    lines = _close_fences(body.rstrip().split("\n"))
    return "\n".join(lines).rstrip() + "\n\n" + block


# -- deterministic fallback -----------------------------------------------------------------

# Line-level and deliberately narrower than the offload notice's markers: only a dozen lines fit,
# so they should be real failures (tracebacks, exception names, test and compiler failures).
_ERROR_RE: Final = re.compile(
    r"Traceback \(most recent call last\)|\b\w*(?:Error|Exception)\b|\bFAILED\b|--- FAIL\b"
    r"|\bFAIL:|\bERROR\b|\berror(?:\[\w+\])?:|\bfatal:|\bpanic(?:ked)?\b|\bSegmentation fault\b"
    r"|exit (?:code|status) [1-9]"
)
_CONSTRAINT_RE: Final = re.compile(
    r"\b(?:don't|do not|never|always|must|mustn't|should|shouldn't|avoid|without|make sure"
    r"|ensure|prefer|only)\b",
    re.IGNORECASE,
)
_PATH_KEYS: Final = frozenset({
    "path", "file", "filename", "file_path", "filepath", "target_file", "notebook_path",
    "directory", "dir", "cwd", "source", "destination", "old_path", "new_path",
})
_PLACEHOLDERS: Final = frozenset({
    "none", "none recorded", "none yet", "nothing", "n/a", "na", "-", "tbd", "unknown",
})
_MAX_CALLS: Final = 30
_MAX_ERRORS: Final = 12
_MAX_CONSTRAINTS: Final = 8
_MAX_PATHS: Final = 40
_ERROR_LINE_CHARS: Final = 300
_NONE: Final = "- None recorded."
_GOAL_UNKNOWN: Final = (
    "- Not stated in the compacted turns; see User Requests (verbatim) and the dialog archive."
)
_FALLBACK_NOTE: Final = (
    "- This summary was written without the summarizer model (deterministic fallback): details "
    "may be missing; the full turns are in the dialog archive."
)
_WORDS_NOTE: Final = "- The user's exact words are under User Requests (verbatim) below."


def _flat(text: str, limit: int) -> str:
    """One line (so it can never become a heading or a fence), at most ``limit`` chars."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


def _is_placeholder(lines: Sequence[str]) -> bool:
    text = " ".join(" ".join(lines).split()).strip("-*_.()[] ").casefold()
    return not text or text in _PLACEHOLDERS or " ".join(lines).strip() == _GOAL_UNKNOWN


def _trim_blank(lines: Sequence[str]) -> list[str]:
    out = list(lines)
    while out and not out[0].strip():
        out.pop(0)
    while out and not out[-1].strip():
        out.pop()
    return out


def _merge(previous: Sequence[str], new: Iterable[str], placeholder: str = _NONE) -> list[str]:
    """Previous content (fences closed) then the new items it does not already hold."""
    base = [] if _is_placeholder(previous) else _close_fences(_trim_blank(previous))
    seen = {line.strip() for line in base}
    out = list(base)
    for item in new:
        if item.strip() not in seen:
            seen.add(item.strip())
            out.append(item)
    return out or [placeholder]


def _error_lines(text: str) -> list[str]:
    out = []
    for line in text.split("\n"):
        if _ERROR_RE.search(line):
            line = line.strip()
            out.append(line if len(line) <= _ERROR_LINE_CHARS else line[: _ERROR_LINE_CHARS - 1] + "…")
    return out


def _paths(args: str) -> list[str]:
    try:
        value = json.loads(args)
    except ValueError:
        return []
    found: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            if (
                isinstance(key, str)
                and (key.casefold() in _PATH_KEYS or key.casefold().endswith("path"))
                and isinstance(item, str)
                and item.strip()
                and "\n" not in item
                and len(item) <= 300
            ):
                found.append(item.strip())
    return found


def _code(text: str) -> str:
    return f"`{text}`" if "`" not in text else text


@dataclass(slots=True)
class _Facts:
    users: list[str]
    done: list[str]
    errors: list[str]
    paths: list[str]
    last_assistant: str
    last_tool_errors: list[str]


def _facts(evicted: Sequence[Message]) -> _Facts:
    messages = [m for m in evicted if isinstance(m, Mapping)]
    results: dict[str, str] = {}
    for m in messages:
        call_id = m.get("tool_call_id")
        if m.get("role") in ("tool", "function") and isinstance(call_id, str):
            results.setdefault(call_id, content_text(m.get("content")))
    facts = _Facts([], [], [], [], "", [])
    for m in messages:
        role = m.get("role")
        if role == "user":
            text = content_text(m.get("content"), placeholders=False).strip()
            if text:
                facts.users.append(text)
        elif role == "assistant":
            text = content_text(m.get("content"), placeholders=False).strip()
            if text:
                facts.last_assistant = text
            for call_id, name, args in tool_calls(m):
                result = results.get(call_id) if call_id else None
                if result is None:
                    outcome = "(no result in these turns)"
                else:
                    first = next((ln for ln in result.split("\n") if ln.strip()), "(empty)")
                    outcome = _flat(first, 120)
                facts.done.append(f"- {_flat(name, 60)}({_flat(args, 100)}) → {outcome}")
                facts.paths += _paths(args)
        elif role in ("tool", "function"):
            errors = _error_lines(content_text(m.get("content")))
            facts.errors += errors
            facts.last_tool_errors = errors
    return facts


def _section_content(prev_body: str) -> tuple[dict[str, list[str]], list[str], list[_Section]]:
    """The previous summary's content per required key, its preamble and other sections."""
    preamble, sections = _split(_normalise_newlines(prev_body))
    content: dict[str, list[str]] = {key: [] for _, key, _ in _REQUIRED}
    extras: list[_Section] = []
    for s in sections:
        if s.key in content:  # duplicates and wrong levels are merged rather than lost
            lines = _trim_blank(s.lines)
            if content[s.key] and lines:
                content[s.key].append("")
            content[s.key] += lines
        elif s.key != _USER_KEY:
            extras.append(s)
    return content, _trim_blank(preamble), extras


def _fallback_body(prev_body: str, evicted: Sequence[Message]) -> str:
    prev, preamble, extras = _section_content(prev_body)
    f = _facts(evicted)

    (goal_key, constraints_key, progress_key, done_key, in_progress_key, blocked_key,
     decisions_key, next_key, critical_key) = (key for _, key, _ in _REQUIRED)
    # The goal rarely changes: a previous one stands, later requests go to In Progress.
    goal = _merge(prev[goal_key], [], "") if not _is_placeholder(prev[goal_key]) else (
        [f"- {_flat(f.users[0], 500)}"] if f.users else [_GOAL_UNKNOWN]
    )
    constraints: list[str] = []
    for text in f.users:
        for line in text.split("\n"):
            if _CONSTRAINT_RE.search(line) and len(constraints) < _MAX_CONSTRAINTS:
                constraints.append(f"- {_flat(line, 240)}")
    if f.users:
        constraints.append(_WORDS_NOTE)
    done = f.done
    if len(done) > _MAX_CALLS:
        done = [f"- [... {len(done) - _MAX_CALLS} earlier tool calls omitted ...]",
                *done[-_MAX_CALLS:]]
    in_progress = [f"- Latest user request: {_flat(f.users[-1], 300)}"] if f.users else []
    blocked = (
        [f"- The last tool result in these turns reported: {f.last_tool_errors[0]}"]
        if f.last_tool_errors else []
    )
    if f.last_assistant:
        next_steps = [f"- Continue from the assistant's last message: {_flat(f.last_assistant, 400)}"]
    elif f.users:
        next_steps = ["- Continue with the latest user request."]
    else:
        next_steps = []
    critical: list[str] = []
    errors = list(dict.fromkeys(f.errors))[-_MAX_ERRORS:]
    # One self-describing item per line, so merging a later fallback cannot strand items
    # under another item's header.
    critical += [f"- Error in tool output: {line}" for line in errors]
    paths = list(dict.fromkeys(f.paths))[:_MAX_PATHS]
    if paths:
        critical.append("- Files referenced by tool calls: " + ", ".join(_code(p) for p in paths))
    if preamble:
        critical.append("- Notes from the earlier summary:")
        critical += [f"  > {line}" for line in shorten("\n".join(preamble), 2000).split("\n")]
    critical.append(_FALLBACK_NOTE)

    body: list[str] = [SECTIONS[0], *goal, ""]
    body += [SECTIONS[1], *_merge(prev[constraints_key], constraints), ""]
    body += [SECTIONS[2]]
    if not _is_placeholder(prev[progress_key]):
        body += [*_close_fences(_trim_blank(prev[progress_key])), ""]
    body += [SECTIONS[3], *_merge(prev[done_key], done), ""]
    body += [SECTIONS[4], *_merge(prev[in_progress_key], in_progress), ""]
    body += [SECTIONS[5], *_merge(prev[blocked_key], blocked), ""]
    body += [SECTIONS[6], *_merge(prev[decisions_key], []), ""]
    body += [SECTIONS[7], *_merge(prev[next_key], next_steps), ""]
    body += [SECTIONS[8], *_merge(prev[critical_key], critical)]
    for s in extras:
        # A level-1 heading would outrank the summary's own sections; demote it.
        heading = s.heading if s.level > 1 else "## " + s.heading.strip().lstrip("#").strip()
        body += ["", heading, *_close_fences(_trim_blank(s.lines))]
    return "\n".join(body)


def fallback_summary(
    previous: str | None,
    evicted: Sequence[Message],
    *,
    per_message_chars: int = 2000,
    total_chars: int = 8000,
) -> str:
    """A deterministic summary of ``previous`` plus ``evicted`` without any model: the
    required sections (previous content kept, new items appended) and the user-requests block.
    Always passes :func:`is_valid_summary`."""
    prev_body, _ = parse_user_block(previous) if previous else ("", UserRequests())
    block = user_requests_block(
        previous, evicted, per_message_chars=per_message_chars, total_chars=total_chars
    )
    return _compose(_fallback_body(prev_body, evicted), block)


# -- the summarizer call --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SummaryOutcome:
    text: str  # final markdown, the user-requests block included
    source: Literal["model", "fallback"]
    attempts: int  # calls of `complete` made: 1 or 2
    error: str | None  # why the fallback was used (None for a model summary)


async def summarize(
    complete: Complete,
    previous: str | None,
    evicted: Sequence[Message],
    *,
    tool_output_chars: int = 2000,
    max_input_chars: int = 200_000,
    per_message_chars: int = 2000,
    total_chars: int = 8000,
    timeout: float | None = None,
) -> SummaryOutcome:
    """Summarize ``evicted`` merged with ``previous`` in one call of ``complete``.

    An answer that is not a valid summary (after :func:`clean_answer`) is retried once, the
    rejected answer followed by a reminder naming its problems; a second invalid answer, or
    ``complete`` raising any ``Exception`` (a timeout included; ``timeout`` bounds each call when
    given), gives the deterministic :func:`fallback_summary` instead, and the request is still
    served. A raising call is not retried: the caller's client owns transport retries.
    ``asyncio.CancelledError`` is not an ``Exception`` and propagates, so an abandoned request
    does not wait for a fallback. Both paths append the same merged user-requests block.
    """
    previous = _previous_text(previous) or None
    block = user_requests_block(
        previous, evicted, per_message_chars=per_message_chars, total_chars=total_chars
    )
    prompt = build_prompt(
        previous, evicted, tool_output_chars=tool_output_chars, max_input_chars=max_input_chars
    )
    messages = prompt
    attempts = 0
    error: str | None = None
    for attempt in (1, 2):
        attempts += 1
        try:
            async with asyncio.timeout(timeout):
                answer = await complete(messages)
        except Exception as exc:
            error = f"summarizer call failed: {type(exc).__name__}: {exc}"
            break
        if not isinstance(answer, str):  # a buggy completer must not crash the request
            error = f"summarizer returned {type(answer).__name__}, not text"
            break
        body = clean_answer(answer)
        problems = summary_problems(body)
        if not problems:
            return SummaryOutcome(_compose(normalize_summary(body), block), "model", attempts, None)
        error = f"invalid summary after {attempt} attempt{'s' if attempt > 1 else ''}: " + (
            "; ".join(problems)
        )
        if attempt == 1:
            messages = retry_prompt(prompt, answer, problems)
    prev_body, _ = parse_user_block(previous) if previous else ("", UserRequests())
    return SummaryOutcome(
        _compose(_fallback_body(prev_body, evicted), block), "fallback", attempts, error
    )


# -- insertion ------------------------------------------------------------------------------

_SPAN_RE: Final = re.compile(r"^(\S+) lines? (\d+)(?:-(\d+))?$")
# How far before the end of the range the suggested first read starts (dialog lines are whole
# messages, so about the last twenty).
_READ_BACK: Final = 19


def _pointer_line(pointer: str, tool_name: str | None) -> str:
    pointer = " ".join(pointer.split())  # the line must stay one line
    if not pointer:
        return f"{_POINTER_PREFIX} into the summary below."
    line = (
        f"{_POINTER_PREFIX} into the summary below; its full messages are saved in {pointer}. "
        "If you need details the summary lacks, read them from the end backwards"
    )
    if not tool_name:
        return line + "."
    m = _SPAN_RE.match(pointer.rsplit(",", 1)[-1].strip())
    if m is None:
        return line + f" with `{tool_name}`, starting near the end of the range."
    file, first = m[1], int(m[2])
    last = int(m[3]) if m[3] else first
    start = max(first, last - _READ_BACK)
    return line + (
        f": call `{tool_name}` with file_path={file} and a start_line near the end "
        f"(e.g. start_line={start}), then earlier lines as needed."
    )


def summary_message(text: str, *, pointer: str, tool_name: str | None) -> dict[str, str]:
    """The system message inserted after the leading system messages::

        # Summary of previous conversation
        The earlier part of this conversation was compacted into the summary below; its full
        messages are saved in <pointer>. If you need details the summary lacks, read them from
        the end backwards: call `<tool>` with file_path=<last file> and a start_line near the end
        (e.g. start_line=<last-19>), then earlier lines as needed.
        <blank line>
        <summary text, stripped>
        <blank line>
        Use this summary for continuity: ...

    (the second line is one line.) Without ``tool_name`` the advice ends after "backwards";
    with an empty ``pointer`` the line only says that the turns were compacted.
    """
    content = (
        f"{SUMMARY_HEADING}\n{_pointer_line(pointer, tool_name)}\n\n{text.strip()}\n\n"
        f"{CLOSING_LINE}"
    )
    return {"role": "system", "content": content}


def _is_summary_text(text: str) -> bool:
    return text.lstrip().split("\n", 1)[0].rstrip() == SUMMARY_HEADING


def is_summary_message(msg: object) -> bool:
    """Whether ``msg`` is a summary message made by :func:`summary_message` (as a client may
    send it back: role system or developer, content a string or text parts)."""
    if not isinstance(msg, Mapping) or msg.get("role") not in ("system", "developer"):
        return False
    return _is_summary_text(content_text(msg.get("content"), placeholders=False))


def summary_body(content: str) -> str | None:
    """The summary text inside a summary message's content (heading, pointer line and closing
    line removed), or None when there is none."""
    lines = content.strip().split("\n")
    if not lines or lines[0].rstrip() != SUMMARY_HEADING:
        return None
    lines = lines[1:]
    if lines and lines[0].startswith(_POINTER_PREFIX):
        lines = lines[1:]
    body = "\n".join(lines).strip()
    if body.endswith(CLOSING_LINE):
        body = body[: -len(CLOSING_LINE)].rstrip()
    return body or None


def find_summary_message(messages: Sequence[object]) -> int | None:
    """Index of the last summary message in ``messages``."""
    for i in range(len(messages) - 1, -1, -1):
        if is_summary_message(messages[i]):
            return i
    return None


def previous_from_messages(messages: Sequence[object]) -> str | None:
    """The summary a client sent back inside its history (the last one), so the next
    compaction merges it instead of summarizing a summary; None when there is none."""
    i = find_summary_message(messages)
    if i is None:
        return None
    msg = messages[i]
    assert isinstance(msg, Mapping)
    return summary_body(content_text(msg.get("content"), placeholders=False))

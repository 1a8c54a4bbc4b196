"""The deterministic summary used when the summarizer model fails (docs/compaction.md#fallback).

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

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from proxy.compaction.guard import guard_block, strip_guard
from proxy.compaction.prompt import SECTIONS, Message, shorten
from proxy.compaction.requests import (
    UserRequests,
    compose_summary,
    parse_user_block,
    user_requests_block,
)
from proxy.compaction.sections import REQUIRED, USER_KEY, Section, close_fences, split_sections
from proxy.config.compaction import GuardConfig
from proxy.model import content_text, normalise_newlines, tool_calls

__all__ = ["fallback_body", "fallback_summary"]

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
    base = [] if _is_placeholder(previous) else close_fences(_trim_blank(previous))
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


def _section_content(prev_body: str) -> tuple[dict[str, list[str]], list[str], list[Section]]:
    """The previous summary's content per required key, its preamble and other sections."""
    preamble, sections = split_sections(normalise_newlines(prev_body))
    content: dict[str, list[str]] = {key: [] for _, key, _ in REQUIRED}
    extras: list[Section] = []
    for s in sections:
        if s.key in content:  # duplicates and wrong levels are merged rather than lost
            lines = _trim_blank(s.lines)
            if content[s.key] and lines:
                content[s.key].append("")
            content[s.key] += lines
        elif s.key != USER_KEY:
            extras.append(s)
    return content, _trim_blank(preamble), extras


def fallback_body(prev_body: str, evicted: Sequence[Message]) -> str:
    prev, preamble, extras = _section_content(prev_body)
    f = _facts(evicted)

    (goal_key, constraints_key, progress_key, done_key, in_progress_key, blocked_key,
     decisions_key, next_key, critical_key) = (key for _, key, _ in REQUIRED)
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
        body += [*close_fences(_trim_blank(prev[progress_key])), ""]
    body += [SECTIONS[3], *_merge(prev[done_key], done), ""]
    body += [SECTIONS[4], *_merge(prev[in_progress_key], in_progress), ""]
    body += [SECTIONS[5], *_merge(prev[blocked_key], blocked), ""]
    body += [SECTIONS[6], *_merge(prev[decisions_key], []), ""]
    body += [SECTIONS[7], *_merge(prev[next_key], next_steps), ""]
    body += [SECTIONS[8], *_merge(prev[critical_key], critical)]
    for s in extras:
        # A level-1 heading would outrank the summary's own sections; demote it.
        heading = s.heading if s.level > 1 else "## " + s.heading.strip().lstrip("#").strip()
        body += ["", heading, *close_fences(_trim_blank(s.lines))]
    return "\n".join(body)


def fallback_summary(
    previous: str | None,
    evicted: Sequence[Message],
    *,
    per_message_chars: int = 2000,
    total_chars: int = 8000,
    guard: GuardConfig | None = None,
    turn_base: int = 0,
) -> str:
    """A deterministic summary of ``previous`` plus ``evicted`` without any model: the
    required sections (previous content kept, new items appended), the guard's block when
    ``guard`` is given (:mod:`.guard`) and the user-requests block.
    Always passes :func:`is_valid_summary`."""
    prev_body, _ = parse_user_block(previous) if previous else ("", UserRequests())
    block = user_requests_block(
        previous, evicted, per_message_chars=per_message_chars, total_chars=total_chars
    )
    if guard is not None:
        prev_body = strip_guard(prev_body)
        block = guard_block(previous, evicted, turn_base=turn_base, config=guard) + "\n\n" + block
    return compose_summary(fallback_body(prev_body, evicted), block)

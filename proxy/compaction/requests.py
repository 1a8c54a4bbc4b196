"""The verbatim user-requests block a summary ends with (docs/compaction.md#summary).

The proxy writes it itself from the user's messages (never the model), so no stated constraint
can be lost to a paraphrase.

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
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from proxy.compaction.message import previous_text
from proxy.compaction.prompt import USER_REQUESTS_HEADING, Message, shorten
from proxy.compaction.sections import (
    USER_KEY,
    Section,
    close_fences,
    join_sections,
    parse_heading,
    split_sections,
)
from proxy.model import content_text, normalise_newlines

__all__ = [
    "UserRequests",
    "compose_summary",
    "merge_user_requests",
    "parse_user_block",
    "render_user_requests",
    "split_user_block",
    "user_requests",
    "user_requests_block",
]


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


def _span_requests(evicted: Sequence[Message], per_message_chars: int) -> list[str]:
    out: list[str] = []
    for msg in evicted:
        if not isinstance(msg, Mapping) or msg.get("role") != "user":
            continue
        text = normalise_newlines(content_text(msg.get("content"), placeholders=False)).strip()
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


def parse_user_block(summary: str) -> tuple[str, UserRequests]:
    """``(body, requests)``: the summary without its user-requests block(s), and their entries
    (several blocks, as in a hand-merged text, are concatenated; omissions add up).

    The proxy's own block, the last line reading exactly ``## User Requests (verbatim)`` up to
    the next heading, is found without regard to code fences, so a body that left a fence open
    (a client-edited summary) cannot hide it.
    """
    lines = normalise_newlines(previous_text(summary)).split("\n")
    last = next(
        (i for i in range(len(lines) - 1, -1, -1) if lines[i].rstrip() == USER_REQUESTS_HEADING),
        None,
    )
    tail: tuple[list[str], int] = ([], 0)
    if last is not None:
        end = next(
            (
                j
                for j in range(last + 1, len(lines))
                if (h := parse_heading(lines[j])) and h[0] <= 3
            ),
            len(lines),
        )
        tail = _parse_entries(lines[last + 1 : end])
        lines = lines[:last] + lines[end:]
    preamble, sections = split_sections("\n".join(lines))
    kept: list[Section] = []
    entries: list[str] = []
    omitted = 0
    for s in sections:
        if s.key == USER_KEY:
            found, n = _parse_entries(s.lines)
            entries += found
            omitted += n
        else:
            kept.append(s)
    entries += tail[0]
    omitted += tail[1]
    return join_sections(preamble, kept).strip(), UserRequests(tuple(entries), omitted)


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


def compose_summary(body: str, block: str) -> str:
    lines = close_fences(body.rstrip().split("\n"))
    return "\n".join(lines).rstrip() + "\n\n" + block

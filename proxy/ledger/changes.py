"""What ctxproxy did to a forwarded request, message by message, with the reason (pure).

The pipeline never mutates a message: an unchanged one is forwarded as the very object the
client's history holds, a changed one is a new dict, and what the proxy inserts is recognisable
(a summary, a memory message, replayed rounds, a placeholder result). So the forwarded list can
be aligned with the client's history in one walk, and each difference named:

=============  ==========================================================================
``cut``        a tool result over ``recent_max_bytes`` cut on arrival (stage 1), original saved
``aged``       a tool result re-cut to ``old_max_bytes`` at a compaction (stage 2)
``harder``     a tool result cut to 1 KB by the last resort
``evicted``    a range of turns replaced by the summary (one change per range)
``dropped``    a message the validator removed (an orphaned tool result)
``summary``    the summary message inserted after the leading system messages
``memory``     the long-term memory message inserted there
``replayed``   the proxy's read rounds put back before the answer they led to
``placeholder``  a result inserted for a tool call the history left unanswered
``thinking``   an assistant turn forwarded without its signed thinking blocks
``superseded`` a read forwarded as a one-line marker at a compaction: read again since
``stale``      ... or its file changed since
``unchanged``  a re-read forwarded as "unchanged since" the earlier read still in context
``delta``      a re-read forwarded as a unified diff against that read
``duplicate``  an output forwarded with its repeated part as a reference to an earlier one
``changed``    any other rewrite of a message
=============  ==========================================================================

A cut's excerpt is always the original's first ``kept_bytes`` bytes (:mod:`proxy.pipeline.
truncate`), so with the notice and the original's file the whole diff can be shown without
storing the forwarded text.

Between two compactions a session's forwarded history only grows (:mod:`proxy.history.epoch`),
so :func:`describe` can be asked for what is new since the previous request (``since``): the
changes to the messages the client added, and at an epoch's start (``since=0``) everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from proxy.compaction.message import is_summary_message
from proxy.filewise.delta import parse_delta
from proxy.filewise.envelope import split_envelope
from proxy.filewise.markers import PREFIX
from proxy.filewise.rereads import parse_marker
from proxy.history.epoch import THINKING_DROPPED
from proxy.history.turns import RESULT_ROLES
from proxy.memory.inject import is_memory_message
from proxy.model import WIRE, Message, result_text
from proxy.pipeline.validate import PLACEHOLDER
from proxy.store.ledger_entry import Change
from proxy.store.tool_results import relative_path, result_id
from proxy.truncation.notice import split_notice, utf8_len

__all__ = ["OWN_FORMS", "describe"]

#: The kinds whose forwarded text the proxy wrote in place of the content it stands for (the
#: docs/file-aware.md).
OWN_FORMS: Final = frozenset({"superseded", "stale", "unchanged", "delta", "duplicate"})

# A 1 KB last-resort cut leaves at most this many bytes of excerpt (the budget itself).
_HARDER = 1024


def _tool_names(history: Sequence[Message]) -> dict[str, str]:
    """call id -> the name of the tool it called."""
    names: dict[str, str] = {}
    for m in history:
        for call in m.get("tool_calls") or () if m.get("role") == "assistant" else ():
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                fn = call.get("function")
                if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                    names[call["id"]] = fn["name"]
    return names


def _size(message: Message) -> int:
    content = message.get("content")
    if isinstance(content, str):
        return utf8_len(content)
    text = result_text(content)
    return utf8_len(text) if text is not None else 0


def _cut(
    original: Message, forwarded: Message, index: int, *, tenant: str, session: str,
    tools: dict[str, str], old_max_bytes: int, recent_max_bytes: int,
) -> Change:
    before = result_text(original.get("content"))
    after = result_text(forwarded.get("content"))
    call_id = original.get("tool_call_id")
    common: dict[str, Any] = {
        "at": index, "role": original.get("role"),
        "call_id": call_id if isinstance(call_id, str) else None,
        "tool": tools.get(call_id) if isinstance(call_id, str) else None,
        "bytes_before": _size(original), "bytes_after": _size(forwarded),
    }
    if before is not None and after is not None:
        form = _file_form(before, after)
        if form is not None:
            what, reason = form
            return Change(what, reason, file=relative_path(result_id(tenant, session, before)),
                          **common)
    split = split_notice(after) if after is not None else None
    if before is None or split is None:
        return Change("changed", "tool result rewritten", **common)
    excerpt, notice = split
    kept = utf8_len(excerpt)
    if not before.startswith(excerpt):
        return Change("changed", "tool result rewritten", **common)
    file = relative_path(result_id(tenant, session, before))
    total = utf8_len(before)
    if kept <= _HARDER < old_max_bytes:
        what, reason = "harder", (
            f"last resort: the kept turns alone were over the compaction threshold, so every "
            f"tool result was cut to 1 KB ({kept:,} of {total:,} bytes kept)")
    elif kept <= old_max_bytes < recent_max_bytes:
        what, reason = "aged", (
            f"aged: no longer among the newest tool-call turns at a compaction, re-cut to "
            f"{kept:,} of {total:,} bytes")
    else:
        what, reason = "cut", (
            f"over {recent_max_bytes:,} bytes on arrival: cut to {kept:,} of {total:,} bytes "
            f"(lines {notice.next_line:,}+ of {notice.total_lines:,} offloaded)")
    return Change(what, reason, kept_bytes=kept, notice=notice.render(), file=file, **common)


def _file_form(before: str, after: str) -> tuple[str, str] | None:
    """A file-aware form (docs/file-aware.md) of ``before``: its kind and reason."""
    mark = parse_marker(after)
    if mark is not None:
        s = mark[0]
        if s.kind == "superseded":
            return "superseded", (f"superseded at a compaction: {s.path} was read again in turn "
                                  f"{s.by_turn} (call {s.by_call}) showing these lines too")
        return "stale", (f"stale at a compaction: {s.path} was changed since, in turn "
                         f"{s.by_turn} (call {s.by_call})")
    envelope = split_envelope(before)
    if not (after.startswith(envelope.head) and after.endswith(envelope.tail)):
        return None
    body = after[len(envelope.head): len(after) - len(envelope.tail)]
    delta = parse_delta(body)
    if delta is not None:
        if delta.unchanged:
            return "unchanged", (f"a re-read of {delta.path} unchanged since the read in turn "
                                 f"{delta.base_turn} (call {delta.base_call}), still forwarded "
                                 "whole: one line in its place")
        return "delta", (f"a re-read of {delta.path} forwarded as a unified diff against the "
                         f"read in turn {delta.base_turn} (call {delta.base_call})")
    if body.startswith(PREFIX) or "\n" + PREFIX in body:
        return "duplicate", ("repeats an earlier output still forwarded whole: the repeated "
                             "part is a reference to it")
    return None


def describe(
    history: Sequence[Message],
    forwarded: Sequence[Message],
    *,
    tenant: str,
    session: str,
    evicted: range | None = None,
    since: int = 0,
    old_max_bytes: int = 3000,
    recent_max_bytes: int = 51200,
) -> list[Change]:
    """The changes that turn the client's ``history`` into ``forwarded``, for the history's
    messages at index ``since`` and later (inserted messages only when ``since`` is 0).
    ``evicted``: the range of history the summary in use replaced."""
    position = {id(m): i for i, m in enumerate(history)}
    tools = _tool_names(history)
    changes: list[Change] = []
    seen: set[int] = set()
    cursor = 0
    whole = since == 0

    def note(change: Change) -> None:
        if change.at is None and whole or change.at is not None and change.at >= since:
            changes.append(change)

    for m in forwarded:
        i = position.get(id(m))
        if i is not None and history[i] is m:
            seen.add(i)
            cursor = i + 1
            continue
        if THINKING_DROPPED in m and isinstance(m[THINKING_DROPPED], int):
            i = m[THINKING_DROPPED]
            seen.add(i)
            cursor = i + 1
            note(Change("thinking", "kept turn produced before the compaction: its signed "
                        "thinking blocks are bound to the old prefix, so they are left out",
                        at=i, role="assistant"))
            continue
        if WIRE in m:
            note(Change("replayed", "the proxy's read-tool round the model saw before this "
                        "answer, put back so the history is what the model saw",
                        role=m.get("role")))
            continue
        if is_summary_message(m) and not any(is_summary_message(h) for h in history):
            note(Change("summary", "summary of the compacted turns, inserted after the leading "
                        "system messages", role=m.get("role"), bytes_after=_size(m)))
            continue
        if is_memory_message(m):
            note(Change("memory", "long-term memory (MEMORY.md), inserted after the leading "
                        "system messages", role=m.get("role"), bytes_after=_size(m)))
            continue
        role = m.get("role")
        if role in RESULT_ROLES and m.get("content") == PLACEHOLDER:
            note(Change("placeholder", "a result for a tool call the history left unanswered "
                        "(the provider refuses an unanswered call)", role=role,
                        call_id=m.get("tool_call_id")))
            continue
        j = _match(history, cursor, m, seen)
        if j is None:
            note(Change("changed", "message inserted by the proxy", role=role))
            continue
        seen.add(j)
        cursor = j + 1
        if role in RESULT_ROLES:
            note(_cut(history[j], m, j, tenant=tenant, session=session, tools=tools,
                      old_max_bytes=old_max_bytes, recent_max_bytes=recent_max_bytes))
        else:
            note(Change("changed", "message rewritten", at=j, role=role,
                        bytes_before=_size(history[j]), bytes_after=_size(m)))
    changes.extend(_missing(history, seen, evicted, since))
    return changes


def _match(history: Sequence[Message], cursor: int, message: Message,
           seen: set[int]) -> int | None:
    """The history message a changed ``message`` stands for: the next one not yet matched with
    its role (and, for a result, its call id)."""
    role = message.get("role")
    call_id = message.get("tool_call_id")
    for j in range(cursor, len(history)):
        if j in seen:
            continue
        h = history[j]
        if h.get("role") != role:
            continue
        if role in RESULT_ROLES and h.get("tool_call_id") != call_id:
            continue
        return j
    return None


def _missing(history: Sequence[Message], seen: set[int], evicted: range | None,
             since: int) -> list[Change]:
    """Ranges of history not forwarded: evicted into the summary, or dropped by the validator."""
    out: list[Change] = []
    i = 0
    n = len(history)
    while i < n:
        if i in seen:
            i += 1
            continue
        j = i
        inside = evicted is not None and i in evicted
        while j < n and j not in seen and (evicted is not None and j in evicted) == inside:
            j += 1
        if inside and since == 0:
            out.append(Change("evicted", f"compacted: messages {i}-{j - 1} are in the summary "
                              "(and verbatim in the dialog archive)", at=i, upto=j,
                              bytes_before=sum(_size(history[k]) for k in range(i, j))))
        elif not inside:
            for k in range(max(i, since), j):
                out.append(Change("dropped", "removed by the validator (a tool result whose "
                                  "call is not in the forwarded history)", at=k,
                                  role=history[k].get("role"),
                                  call_id=history[k].get("tool_call_id"),
                                  bytes_before=_size(history[k])))
        i = j
    return out

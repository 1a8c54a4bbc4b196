"""The compactor's summarizer.

See docs/compaction.md#summary, docs/compaction.md#insertion and docs/compaction.md#cache.

Everything but the network call, which is injected as ``complete(prompt) -> answer``.
:func:`summarize` asks the model for a summary of the evicted turns merged with the previous
summary, validates it and falls back to a deterministic one when the model fails.

Summary format. Markdown with the headings of :data:`SECTIONS` in that order, then (guard on)
the ``## Pinned by ctxproxy`` block of ledgers and the ``## User Requests (verbatim)`` block,
both written by the proxy itself (never the model), so no stated constraint can be lost to a
paraphrase. The parts live in:

- :mod:`.prompt`: the summarizer prompt, :data:`SECTIONS`;
- :mod:`.sections`: validating and normalising a summary (:func:`summary_problems`,
  :func:`is_valid_summary`, :func:`normalize_summary`, :func:`clean_answer`);
- :mod:`.requests`: the verbatim user-requests block (:class:`UserRequests`,
  :func:`render_user_requests`, :func:`parse_user_block`, ...);
- :mod:`.fallback`: the deterministic :func:`fallback_summary`;
- :mod:`.guard`: the pinned goal, constraints and file-state ledgers;
- :mod:`.message`: the inserted summary message (:func:`summary_message`) and finding one in a
  client's history (:func:`previous_from_messages`).

Their public names (as listed in ``__all__``, plus the prompt helpers) are importable from here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from proxy.compaction.facts import split_facts, with_facts
from proxy.compaction.fallback import fallback_body, fallback_summary
from proxy.compaction.guard import guard_block, strip_guard
from proxy.compaction.message import CLOSING_LINE as CLOSING_LINE
from proxy.compaction.message import (
    SUMMARY_HEADING,
    find_summary_message,
    is_summary_message,
    previous_from_messages,
    previous_text,
    summary_body,
    summary_message,
)
from proxy.compaction.prompt import (
    SECTIONS,
    USER_REQUESTS_HEADING,
    Message,
    build_prompt,
    retry_prompt,
)
from proxy.compaction.prompt import shorten as shorten
from proxy.compaction.requests import (
    UserRequests,
    compose_summary,
    merge_user_requests,
    parse_user_block,
    render_user_requests,
    split_user_block,
    user_requests,
    user_requests_block,
)
from proxy.compaction.sections import (
    MIN_CONTENT_CHARS,
    clean_answer,
    is_valid_summary,
    normalize_summary,
    summary_problems,
)
from proxy.config.compaction import GuardConfig
from proxy.errors import SummarizerError

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


@dataclass(frozen=True, slots=True)
class SummaryOutcome:
    text: str  # final markdown, the user-requests block included
    source: Literal["model", "fallback"]
    attempts: int  # calls of `complete` made: 1 or 2
    error: str | None  # why the fallback was used (None for a model summary)
    facts: str | None = None  # the durable-facts section, when asked for and given


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
    facts: bool = False,
    guard: GuardConfig | None = None,
    turn_base: int = 0,
) -> SummaryOutcome:
    """Summarize ``evicted`` merged with ``previous`` in one call of ``complete``.

    An answer that is not a valid summary (after :func:`clean_answer`) is retried once, the
    rejected answer followed by a reminder naming its problems; a second invalid answer, or
    ``complete`` raising any ``Exception`` (a timeout included; ``timeout`` bounds each call when
    given), gives the deterministic :func:`fallback_summary` instead, and the request is still
    served. A raising call is not retried: the caller's client owns transport retries.
    ``asyncio.CancelledError`` is not an ``Exception`` and propagates, so an abandoned request
    does not wait for a fallback. Both paths append the same merged user-requests block.

    ``facts`` (long-term memory on): the same call also asks for the durable-facts section
    (:mod:`.facts`), returned apart from the summary; a fallback has none.

    ``guard`` (enabled): both paths also carry the proxy's pinned ledgers (:mod:`.guard`),
    ``previous``'s merged with ``evicted``'s (``turn_base``: the user turns before ``evicted``),
    placed after the body and before the user-requests block; any such block the model wrote
    is removed from its answer first.
    """
    previous = previous_text(previous) or None
    block = user_requests_block(
        previous, evicted, per_message_chars=per_message_chars, total_chars=total_chars
    )
    if guard is not None:
        pinned = guard_block(previous, evicted, turn_base=turn_base, config=guard)
        block = pinned + "\n\n" + block
    prompt = build_prompt(
        previous, evicted, tool_output_chars=tool_output_chars, max_input_chars=max_input_chars
    )
    if facts:
        prompt = with_facts(prompt)
    messages = prompt
    attempts = 0
    error: str | None = None
    for attempt in (1, 2):
        attempts += 1
        try:
            async with asyncio.timeout(timeout):
                answer = await complete(messages)
        except SummarizerError as exc:  # the client's own account (status, provider message)
            error = str(exc)
            break
        except Exception as exc:
            error = f"summarizer call failed: {type(exc).__name__}: {exc}"
            break
        if not isinstance(answer, str):  # a buggy completer must not crash the request
            error = f"summarizer returned {type(answer).__name__}, not text"
            break
        body = clean_answer(answer)
        if guard is not None:
            body = strip_guard(body)
        problems = summary_problems(body)
        if not problems:
            summary, found = normalize_summary(body), None
            if facts:
                summary, found = split_facts(summary)
            text = compose_summary(summary, block)
            return SummaryOutcome(text, "model", attempts, None, found)
        error = f"invalid summary after {attempt} attempt{'s' if attempt > 1 else ''}: " + (
            "; ".join(problems)
        )
        if attempt == 1:
            messages = retry_prompt(prompt, answer, problems)
    prev_body, _ = parse_user_block(previous) if previous else ("", UserRequests())
    if guard is not None:
        prev_body = strip_guard(prev_body)
    return SummaryOutcome(
        compose_summary(fallback_body(prev_body, evicted), block), "fallback", attempts, error
    )


"""Durable facts: the extra section a compaction's summarizer call writes when long-term memory
is on, so memory costs no model call of its own at compaction time
(docs/memory.md#writing-with-no-extra-model-call).

With ``facts`` the summarizer's instructions (:data:`FACTS_INSTRUCTIONS`) ask for one more
section after ``## Critical Context``::

    ## Durable Facts
    - Preference: "always use tabs, never spaces" (the user's own words, verbatim)
    - Lesson: `pip install foo` failed with `error: externally-managed-environment`; fixed by
      creating a venv first

:func:`split_facts` takes it out of the answer (the summary is the same as without memory) and
:func:`stamp_facts` dates each bullet for the scope's daily notes. An answer without the
section, or with "None" under it, yields no facts: nothing is written, nothing fails.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Final

from proxy.compaction.sections import Section, join_sections, parse_heading, split_sections

__all__ = ["FACTS_HEADING", "FACTS_INSTRUCTIONS", "split_facts", "stamp_facts", "with_facts"]

FACTS_HEADING: Final = "## Durable Facts"
_FACTS_KEY: Final = parse_heading(FACTS_HEADING)
_NONE: Final = frozenset({"none", "none.", "- none", "n/a", "-"})

FACTS_INSTRUCTIONS: Final = f"""Long-term memory: after `## Critical Context`, add one more \
section, `{FACTS_HEADING}`, with what should outlive this conversation and help in future \
sessions with the same user, taken from the turns in the transcript only (the previous summary's \
facts were recorded already):
- `- Preference: ...` for each preference or standing instruction the user stated (style, tools, \
workflows, things to always or never do), quoting the user's own words verbatim in double quotes;
- `- Lesson: ...` for each attempt that failed and what fixed it: the exact command or change, \
the exact error message, and the fix that worked.
One bullet per fact, no dates or session names (the proxy adds them). Task progress and details \
that only matter to this task are not durable facts. Write "None" under the heading when there \
is nothing durable."""


def split_facts(summary: str) -> tuple[str, str | None]:
    """``summary`` without its ``## Durable Facts`` section, and the section's content (None
    when there is no section, or nothing durable in it)."""
    preamble, sections = split_sections(summary)
    kept: list[Section] = []
    found: list[str] | None = None
    for s in sections:
        if (s.level, s.key) == _FACTS_KEY:
            found = (found or []) + list(s.lines)
            continue
        kept.append(s)
    if found is None:
        return summary, None
    facts = "\n".join(found).strip()
    body = join_sections(preamble, kept).strip()
    if not facts or facts.casefold() in _NONE:
        return body, None
    return body, facts


def stamp_facts(facts: str, when: datetime, session: str) -> str:
    """The facts as a block of the day's notes: each top-level bullet carries the absolute
    date and the session it came from (continuation lines are kept as written)."""
    tag = f"[{when:%Y-%m-%d} · session {session}]"
    lines: list[str] = []
    for line in facts.strip().split("\n"):
        if line[:2] in ("- ", "* "):
            lines.append(f"- {tag} {line[2:].strip()}")
        elif line.strip() and not lines:
            lines.append(f"- {tag} {line.strip()}")  # a fact written without a bullet
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def with_facts(prompt: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A summarizer prompt (:func:`.prompt.build_prompt`) that also asks for the facts: the
    instructions appended to its system message, a reminder to its last user message."""
    out = [dict(m) for m in prompt]
    out[0]["content"] = f"{out[0]['content']}\n\n{FACTS_INSTRUCTIONS}"
    out[-1]["content"] = (f"{out[-1]['content']} Then add the `{FACTS_HEADING}` section as "
                          "your instructions describe.")
    return out

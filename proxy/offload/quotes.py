"""Quote protection: file reads a coming edit will quote are not aged below what it needs. Pure.

Coding agents edit by quoting: Claude Code's ``Edit``/``MultiEdit`` (``old_string``), Codex's
``apply_patch`` (context and ``-`` lines), chat agents' ``str_replace``/``edit_file``
(``old_str``). A read aged to ``old_max_bytes`` no longer holds the lines to quote byte for
byte, and the edit fails. The rule (docs/offload.md#quote-protection), decided on the history as
it was when the ageing was decided (``seen`` messages: the compaction's request,
:func:`.ageing.aged_at`), so it holds for the whole epoch:

* a *hot* path is one the agent has edited (any edit call on it so far) or read in the newest
  ``recent_turns`` tool-call turns;
* the newest read of each hot path is exempt from stage 2 (kept at its stage-1 cut), newest
  first while their stage-1 sizes fit ``budget`` bytes: the oldest lose protection first.

Reads and edits are those of :func:`.files.provenance` (an edit here: a call changing part of
a file, what it quotes from).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from proxy.config.offload import ReadTool
from proxy.filewise.provenance import Provenance, patch_edits, provenance, same_file
from proxy.filewise.shell import shell_reads
from proxy.model import Message
from proxy.offload.ageing import tool_turns

__all__ = ["choose", "edited_paths", "file_reads", "patch_paths", "protected_reads",
           "shell_read_paths", "working_set"]


def shell_read_paths(script: str) -> list[str]:
    """The files a shell script prints (:func:`.files.shell_reads`), each once."""
    return list(dict.fromkeys(path for path, _ in shell_reads(script)))


def patch_paths(patch: str) -> list[str]:
    """The files an ``apply_patch`` patch edits (the updated ones, not added or deleted)."""
    return [e.path for e in patch_edits(patch) if e.kind == "edit"]


def file_reads(
    messages: Sequence[Message], tools: Mapping[str, ReadTool]
) -> dict[str, tuple[str, ...]]:
    """tool_call_id -> the (normalised) paths whose content that call's result shows."""
    return {cid: tuple(dict.fromkeys(r.path for r in reads))
            for cid, reads in provenance(messages, tools).by_call.items()}


def edited_paths(messages: Sequence[Message]) -> set[str]:
    """Every path an edit call in ``messages`` changes part of (what it quotes from)."""
    return _edited(provenance(messages, {}))


def _edited(prov: Provenance) -> set[str]:
    return {e.path for e in prov.edits if e.kind == "edit"}


def working_set(
    history: Sequence[Message], seen: int, tools: Mapping[str, ReadTool], *, recent_turns: int,
) -> Mapping[int, str]:
    """The newest read of each hot path in ``history[:seen]`` (an edited path, or one read in
    the newest ``recent_turns`` tool-call turns): its result's index -> the path. Depends on
    ``history[:seen]`` alone, so a caller may keep it for the epoch."""
    if seen <= 0:
        return {}
    then = history[:seen]
    prov = provenance(then, tools)
    if not prov.reads:
        return {}
    edited = _edited(prov)
    turn_of, turns = tool_turns(then)
    newest: dict[str, int] = {}  # path -> index of its newest read's result
    recent: set[str] = set()
    for r in prov.reads:
        i = r.result_index
        if i is None:
            continue
        newest[r.path] = max(i, newest.get(r.path, i))
        if turn_of.get(i, 0) >= turns - recent_turns:
            recent.add(r.path)
    return {i: p for p, i in newest.items()
            if p in recent or any(same_file(p, e) for e in edited)}


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

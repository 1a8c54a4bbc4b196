"""``offload``: the two-stage truncation of tool results, the client's read tools, and the
file-aware rules (superseded reads, re-read deltas, dedupe) with their per-tool policies.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from proxy.config.section import _Section

__all__ = [
    "OffloadConfig",
    "ReadTool",
    "ToolPolicy",
]


class ReadTool(_Section):
    path_arg: str = Field(description="Argument of the call that holds the file path.")
    line_arg: str | None = Field(
        None, description="Argument holding the first line read (1-based), if the tool has one."
    )


def _default_read_tools() -> dict[str, ReadTool]:
    return {
        "read_file": ReadTool(path_arg="file_path", line_arg="start_line"),
        "Read": ReadTool(path_arg="file_path", line_arg="offset"),
        "view": ReadTool(path_arg="path", line_arg="view_range"),
    }


class ToolPolicy(_Section):
    tool: str = Field(
        description="Tool name or glob (fnmatch, case-sensitive): Bash, mcp__*, read_file.")
    command: str | None = Field(
        None, description="Shell tools only: a glob the call's command must match (grep*, "
        "'git diff*'); null: any command.")
    protect: bool = Field(
        False, description="Never cut, mark or deduplicate this tool's results (the last "
        "resort's 1 KB pass aside: a request the provider refuses is worse).")
    offload_max_bytes: int | None = Field(
        None, ge=256, description="Stage-1 budget for its results instead of recent_max_bytes.")
    old_max_bytes: int | None = Field(
        None, ge=256, description="Stage-2 budget for its results instead of old_max_bytes.")
    dedupe: bool = Field(
        True, description="Its results may be forwarded as a re-read delta or a reference to "
        "a duplicate; false: always whole (or cut).")


# Stage 2's budget for the edit tools' results: the same as stage 1's (never aged below it).
_EDIT_RESULT_BYTES = 51200


def _default_policies() -> tuple[ToolPolicy, ...]:
    # The edit working set: an edit tool's result is the agent's view of the file right after
    # its change (Claude Code's Edit answers with a cat -n snippet of the edited region), small,
    # and what the next edit quotes from: never aged below its stage-1 form, never forwarded
    # as a delta or a reference. Not ``protect``: a huge one is still cut on arrival, as the
    # window must hold. (Not the editor tools: one of them also views files.)
    edits = ("Edit", "MultiEdit", "Write", "NotebookEdit", "apply_patch", "edit_file",
             "write_file", "create_file")
    return tuple(ToolPolicy(tool=name, old_max_bytes=_EDIT_RESULT_BYTES, dedupe=False)
                 for name in edits)


class OffloadConfig(_Section):
    recent_max_bytes: int = Field(
        51200, ge=256, description="Stage 1: tool results above this size (UTF-8 bytes) are cut."
    )
    old_max_bytes: int = Field(
        3000, ge=256, description="Stage 2: aged tool results are re-cut to this size."
    )
    markdown_max_bytes: int = Field(
        51200,
        ge=256,
        description="Floor for results of reading .md/.mdx/.markdown files, in both stages.",
    )
    slack_bytes: int = Field(
        100, ge=0, description="Tolerance above recent_max_bytes before stage 1 cuts."
    )
    recent_n: int = Field(
        2, ge=0, description="Tool-call turns counted as recent (not aged by stage 2)."
    )
    age_policy: Literal["batched", "eager"] = Field(
        "batched",
        description="With compaction off: batched re-cuts aged results together once enough "
        "bytes can be saved; eager re-cuts as soon as a result ages. With compaction on, aged "
        "results are re-cut at compactions (the epoch rule) whatever the policy.",
    )
    age_batch_bytes: int = Field(
        131072,
        ge=0,
        description="batched policy: aged results are re-cut only once re-cutting all of them "
        "saves at least this many bytes (each re-cut discards the provider's prompt cache).",
    )
    protect_edit_bytes: int = Field(
        131072,
        ge=0,
        description="Quote protection: the newest read of each file the agent edits (or read in "
        "the newest protect_recent_turns tool-call turns) keeps its stage-1 cut, newest first "
        "up to this many bytes per request (never more than the window's keep_recent_ratio "
        "share); 0 turns it off.",
    )
    protect_recent_turns: int = Field(
        0, ge=0, description="Quote protection: reads in this many newest tool-call turns "
        "count as files being worked on, edited or not."
    )
    read_tools: dict[str, ReadTool] = Field(
        default_factory=_default_read_tools,
        description="The client's own file-reading tools (name -> argument names): their cut "
        "results point back to that tool and the original path instead of a proxy file, and "
        "their calls are file reads (Read and read_file are, listed or not).",
    )
    supersede_reads: bool = Field(
        True, description="At a compaction, a file read superseded by a later read of the same "
        "or a wider range, or stale (the file was written after it), is forwarded as a one-line "
        "marker naming the path, the turn that supersedes it and how to read it again; the "
        "newest read of each file and any read a later edit quotes stay verbatim.")
    reread_deltas: bool = Field(
        True, description="A new read of a file whose earlier read of the same range is still "
        "forwarded whole is forwarded as a delta against it when smaller: a marker when "
        "unchanged, a unified diff with line numbers when changed (the original is kept).")
    dedupe: bool = Field(
        True, description="A tool result repeating an earlier one still forwarded whole (the "
        "same bytes, or a span of at least dedupe_min_bytes) is forwarded with that part as a "
        "reference to it (the original is kept).")
    dedupe_min_bytes: int = Field(
        4096, ge=256, description="The smallest result, or repeated span, deduplicated.")
    policies: tuple[ToolPolicy, ...] = Field(
        default_factory=_default_policies,
        description="Per-tool policies, the first that matches a result's call wins (by tool "
        "name or glob, and for shell tools by command): protect, budgets, dedupe. The "
        "defaults keep the edit tools' results (the edit working set) at their stage-1 form "
        "and never forward them as a delta or a reference; a list you set replaces them.")

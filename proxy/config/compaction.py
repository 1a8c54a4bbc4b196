"""``compaction``: summaries of old turns near the window's limit, and the guard's ledgers
pinned in every summary.
"""

from __future__ import annotations

from pydantic import Field

from proxy.config.section import _Section

__all__ = [
    "CompactionConfig",
    "GuardConfig",
]


class GuardConfig(_Section):
    enabled: bool = Field(
        True,
        description="Pin, in every summary, ledgers the proxy computes itself and carries "
        "byte-exact from compaction to compaction: the session's goal (its first request and "
        "restatements), the user's constraints and preferences (verbatim), and the files the "
        "tool calls changed (docs/compaction.md#guard).",
    )
    goal_bytes: int = Field(
        1200, ge=400, description="Cap (UTF-8 bytes) on the pinned goal: the first request "
        "(cut in the middle to 60%) and the newest restatements that fit."
    )
    constraints_bytes: int = Field(
        1600, ge=400, description="Cap (UTF-8 bytes) on the constraints ledger; over it the "
        "oldest entries fitting half the cap stay, then the newest, and the run between is "
        "counted as omitted (it is in the dialog archive)."
    )
    files_bytes: int = Field(
        1200, ge=200, description="Cap (UTF-8 bytes) on the file-state ledger; over it the "
        "files touched least recently are counted as omitted."
    )


class CompactionConfig(_Section):
    enabled: bool = Field(True, description="Compact old turns into a summary near the limit.")
    threshold_ratio: float = Field(
        0.75, gt=0, le=1, description="Compact when the request passes this share of the window."
    )
    keep_recent_ratio: float = Field(
        0.2, gt=0, lt=1, description="Share of the window kept verbatim as the newest messages."
    )
    model: str | None = Field(
        None, description="Model used to summarize chat-completions and Responses sessions "
        "(Messages sessions: anthropic.summarizer_model); null uses the request's own model. "
        "A model_list route's name goes through litellm, for every format."
    )
    temperature: float | None = Field(
        None, ge=0, le=2,
        description="Sampling temperature of the proxy's own calls (summarizer, memory fold); "
        "null sends none, the model's default. Sent only to a model the catalogue says accepts "
        "sampling parameters (catalog.models over litellm's map: not GPT-5 or o-series, not the "
        "newer Claude models) and never with anthropic-version 2026-10-21 or later; otherwise "
        "left out, with one log line per model."
    )
    precompact_ratio: float = Field(
        0.6, gt=0, le=1, description="From this share of the window, compute the summary early."
    )
    summarizer_timeout_s: float = Field(
        120, gt=0, description="Longest wait for one summarizer call before the fallback."
    )
    context_windows: dict[str, int] = Field(
        default_factory=dict, description="Context window per model name, overriding the map."
    )
    guard: GuardConfig = Field(
        default_factory=GuardConfig,
        description="The compaction guard: ledgers pinned in every summary by the proxy.",
    )

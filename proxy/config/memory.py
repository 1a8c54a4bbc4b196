"""``memory``: long-term memory across sessions (facts recorded at compactions, folded into
MEMORY.md).
"""

from __future__ import annotations

from pydantic import Field

from proxy.config.section import _Section

__all__ = [
    "MemoryConfig",
]


class MemoryConfig(_Section):
    enabled: bool = Field(
        False,
        description="Long-term memory per tenant (or narrower scope): compactions also record "
        "durable facts (preferences, standing instructions, lessons from failures) in the same "
        "summarizer call, a daily fold merges them into MEMORY.md, and MEMORY.md is forwarded "
        "as a system message after the leading system messages. Needs compaction.enabled. A "
        "client names a narrower scope than the tenant with the header "
        "x-ctxproxy-memory-scope or body metadata.memory_scope (safe names kept, others "
        "hashed, as for sessions); without one the scope is 'default', the whole tenant.",
    )
    max_bytes: int = Field(
        8192,
        ge=512,
        description="Cap on MEMORY.md (UTF-8 bytes): the fold is asked to stay under it and its "
        "answer is cut at a line boundary to it. This is what each request carries (about a "
        "quarter as many tokens); it is added after the compaction budget, inside the headroom "
        "between compaction.threshold_ratio and the window.",
    )
    fold_interval_hours: float = Field(
        24,
        gt=0,
        description="Least time between two folds of one scope: a fold runs when new facts "
        "were recorded since the last one and this much time has passed (the first fold runs "
        "as soon as there are facts).",
    )
    fold_lease_s: float = Field(
        600,
        gt=0,
        description="How long a claimed fold holds the scope's lock (one fold per scope at a "
        "time, across processes sharing the store). A fold that fails keeps the lock until "
        "then, so a failing summarizer is retried at most this often. Keep it above "
        "compaction.summarizer_timeout_s.",
    )
    fold_input_chars: int = Field(
        100_000,
        ge=1000,
        description="Most characters of daily notes one fold reads (the newest days first).",
    )
    model: str | None = Field(
        None,
        description="Model that folds; null: compaction.model, else the model of the request "
        "that triggers the fold. Asked like the summarizer: in the request's own wire format, "
        "on that format's upstream, with that request's credentials (a Messages session's "
        "fold goes to Anthropic with anthropic.summarizer_model unless this names a "
        "model_list route).",
    )

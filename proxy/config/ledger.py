"""``ledger``: the cost ledger, and the prices it bills by.
"""

from __future__ import annotations

from pydantic import Field

from proxy.config.section import _Section

__all__ = [
    "LedgerConfig",
    "PriceConfig",
]


class PriceConfig(_Section):
    input: float = Field(ge=0, description="USD per million input tokens neither read from nor "
                         "written to the prompt cache.")
    output: float = Field(ge=0, description="USD per million output tokens (reasoning included).")
    cache_read: float | None = Field(
        None, ge=0, description="USD per million input tokens read from the prompt cache; null: "
        "the input price (no discount).")
    cache_write: float | None = Field(
        None, ge=0, description="USD per million input tokens written to the cache with the "
        "5-minute TTL; null: the input price (OpenAI bills no writes).")
    cache_write_1h: float | None = Field(
        None, ge=0, description="USD per million input tokens written with the 1-hour TTL; "
        "null: cache_write.")


class LedgerConfig(_Section):
    enabled: bool = Field(
        True,
        description="Record every billed call (client requests, read-tool rounds, summarizer "
        "and memory-fold calls) with the provider's own usage, its cost, the counterfactual "
        "cost of sending the client's history directly, and why the cached share fell; shown "
        "on /files and counted in /metrics.",
    )
    prices: dict[str, PriceConfig] = Field(
        default_factory=dict,
        description="Price per model name or glob (claude-*), case-insensitive, winning over "
        "the prices in litellm's bundled model map.",
    )
    default_price: PriceConfig | None = Field(
        None, description="Price of a model neither prices nor the map list; null: such calls "
        "are recorded with their tokens and no cost.")
    cache_ttl_s: float = Field(
        300, gt=0, description="The prompt cache's TTL the counterfactual assumes (Anthropic's "
        "default, 5 minutes); a client whose cache_control markers say ttl 1h gets 3600.")
    min_cacheable_tokens: int = Field(
        1024, ge=0, description="A prefix shorter than this is never cached (the providers' "
        "minimum), in the counterfactual.")

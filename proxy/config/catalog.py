"""``catalog``: per-model facts over litellm's bundled model map (what each model's API
accepts).
"""

from __future__ import annotations

from pydantic import Field

from proxy.config.section import _Section

__all__ = [
    "CatalogConfig",
    "ModelFactsConfig",
]


class ModelFactsConfig(_Section):
    sampling_params: bool | None = Field(
        None, description="Whether the model accepts temperature/top_p/top_k. Unset: litellm's "
        "model map decides, else yes.")
    chat_completions: bool | None = Field(
        None, description="Whether the model is served on /v1/chat/completions (the -codex "
        "models are on /v1/responses only). Unset: litellm's model map decides, else yes.")


class CatalogConfig(_Section):
    models: dict[str, ModelFactsConfig] = Field(
        default_factory=dict,
        description="What a model accepts, by name or glob (e.g. 'claude-opus-5*'), over what "
        "litellm's bundled model map says. Exact names before globs, longer globs first.")

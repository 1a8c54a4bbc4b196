"""The per-model catalogue: config entries over litellm's map over the default."""

from __future__ import annotations

from pathlib import Path

import orjson

from proxy.catalog import Capabilities, ModelFacts
from proxy.config import config_from_mapping
from proxy.services import capabilities_of

_MAP = {
    "claude-opus-5-5": {"supports_sampling_params": False},
    "claude-opus-5-1": {"supports_sampling_params": False},
    "claude-sonnet-4-5": {"supports_prompt_caching": True},
    "gpt-5-codex": {"mode": "responses", "supported_endpoints": ["/v1/responses"]},
    "gpt-5.4": {"supported_endpoints": ["/v1/chat/completions", "/v1/responses"]},
    "o3-pro": {"mode": "responses"},
}


def _caps(tmp_path: Path, overrides: dict[str, ModelFacts] | None = None) -> Capabilities:
    path = tmp_path / "map.json"
    path.write_bytes(orjson.dumps(_MAP))
    return Capabilities(overrides, map_path=path)


def test_the_map_says_what_each_model_accepts(tmp_path: Path) -> None:
    caps = _caps(tmp_path)
    assert not caps.sampling_params("claude-opus-5-5")
    # Dated snapshots and provider prefixes find their alias.
    assert not caps.sampling_params("anthropic/claude-opus-5-5-20261001")
    assert caps.sampling_params("claude-sonnet-4-5")
    assert not caps.chat_completions("gpt-5-codex")
    assert not caps.chat_completions("o3-pro")
    assert caps.chat_completions("gpt-5.4")


def test_an_unknown_model_gets_the_conservative_default(tmp_path: Path) -> None:
    facts = _caps(tmp_path).of("some-local-model")
    assert facts == ModelFacts(sampling_params=True, chat_completions=True, source="default")


def test_config_entries_win_field_by_field(tmp_path: Path) -> None:
    caps = _caps(tmp_path, {
        "claude-opus-5*": ModelFacts(sampling_params=True),
        "claude-opus-5-5": ModelFacts(chat_completions=False),
        "my-model": ModelFacts(chat_completions=False),
    })
    # The exact entry wins over the glob; the map fills what the entry leaves unset.
    facts = caps.of("claude-opus-5-5")
    assert facts.chat_completions is False and facts.sampling_params is False
    assert caps.of("claude-opus-5-1").sampling_params is True  # the map says False
    assert not caps.chat_completions("my-model")


def test_the_config_section_builds_the_catalogue() -> None:
    config = config_from_mapping(
        {"catalog": {"models": {"claude-x": {"sampling_params": False}}}})
    caps = capabilities_of(config)
    assert not caps.sampling_params("claude-x")
    assert caps.of("claude-x").source.startswith("config:claude-x")


def test_openais_reasoning_models_take_no_sampling_parameters(tmp_path: Path) -> None:
    """What litellm's map leaves out: GPT-5 family (but gpt-5-chat) and o-series accept only the
    default temperature; the map and the config still win where they say something."""
    caps = _caps(tmp_path)
    for model in ("gpt-5", "gpt-5.2", "openai/gpt-5-mini", "gpt-5-codex", "o1", "o3-pro",
                  "o4-mini"):
        assert not caps.sampling_params(model), model
    for model in ("gpt-5-chat-latest", "gpt-4o", "gpt-4.1", "claude-sonnet-4-5"):
        assert caps.sampling_params(model), model
    assert caps.of("gpt-5.2").source.startswith("builtin:gpt-5*")
    assert not caps.chat_completions("gpt-5-codex")  # the map's fact next to the built-in one
    configured = _caps(tmp_path, {"gpt-5.2": ModelFacts(sampling_params=True)})
    assert configured.sampling_params("gpt-5.2")

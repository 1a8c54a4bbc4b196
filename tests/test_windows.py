"""Tests for proxy.compaction.windows.ContextWindows (docs/compaction.md#budget)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.catalog import data as tokenizer_data
from proxy.catalog.windows import DEFAULT_CONTEXT_WINDOW, ContextWindows


@pytest.fixture(scope="module")
def shipped() -> dict[str, Any]:
    """litellm's bundled map, read independently of the code under test."""
    path = tokenizer_data.litellm_model_map_path()
    assert path is not None, "litellm's model map should be installed in the venv"
    data = orjson.loads(path.read_bytes())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def windows() -> ContextWindows:
    cw = ContextWindows()
    cw.load()
    return cw


def shipped_window(shipped: dict[str, Any], key: str) -> int:
    entry = shipped[key]
    value = entry.get("max_input_tokens") or entry.get("max_tokens")
    assert isinstance(value, int)
    return value


def test_map_found_without_importing_litellm() -> None:
    already = "litellm" in sys.modules
    path = tokenizer_data.litellm_model_map_path()
    assert path is not None and path.name == "model_prices_and_context_window_backup.json"
    if not already:
        assert "litellm" not in sys.modules


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4.1", "gpt-4o-mini", "gpt-5", "o3", "gpt-4"])
def test_openai_models_match_shipped_map(
    windows: ContextWindows, shipped: dict[str, Any], model: str
) -> None:
    assert windows.window(model) == shipped_window(shipped, model)
    assert windows.max_output(model) == shipped[model].get("max_output_tokens")


def test_well_known_values(windows: ContextWindows) -> None:
    assert windows.window("gpt-4o") == 128_000
    assert 1_000_000 <= windows.window("gpt-4.1") <= 1_100_000
    assert windows.max_output("gpt-4o") == 16_384


def test_provider_prefixes_are_stripped(windows: ContextWindows, shipped: dict[str, Any]) -> None:
    assert windows.window("openai/gpt-4.1") == shipped_window(shipped, "gpt-4.1")
    assert windows.window("openrouter/openai/gpt-4o") == shipped_window(shipped, "gpt-4o")
    assert windows.window("OpenAI/GPT-4o ") == shipped_window(shipped, "gpt-4o")


def test_provider_prefix_added(windows: ContextWindows, shipped: dict[str, Any]) -> None:
    # Models keyed only under their provider ("deepseek/deepseek-r1", "mistral/devstral-latest",
    # ...): a bare request name finds them through "<provider>/<name>".
    candidates = [
        key
        for key, entry in shipped.items()
        if key.split("/", 1)[0] in ("deepseek", "mistral", "gemini", "xai")
        and key.count("/") == 1
        and key.split("/", 1)[1] not in shipped
        and isinstance(entry.get("max_input_tokens"), int)
    ]
    assert candidates, "the shipped map should have provider-only keys"
    for key in candidates[:20]:
        window, source = windows.resolve(key.split("/", 1)[1])
        assert source.startswith("map:")
        assert window > 0
    if "deepseek/deepseek-r1" in candidates:
        assert windows.resolve("deepseek-r1") == (
            shipped_window(shipped, "deepseek/deepseek-r1"),
            "map:deepseek/deepseek-r1",
        )


def test_claude_models(windows: ContextWindows, shipped: dict[str, Any]) -> None:
    # Names litellm lists directly.
    for key in ("claude-sonnet-4-5", "claude-3-5-sonnet-20241022", "claude-opus-4-1"):
        if key in shipped and shipped[key].get("max_input_tokens"):
            assert windows.window(key) == shipped_window(shipped, key)
            assert windows.window(f"anthropic/{key}") == shipped_window(shipped, key)
    # claude-sonnet-4 is listed only by resellers/Bedrock ids in this map; the window most of
    # them list is used, never the 128k default.
    listing = [
        entry["max_input_tokens"]
        for key, entry in shipped.items()
        if key.endswith("claude-sonnet-4-20250514-v1:0") and entry.get("max_input_tokens")
    ]
    window, source = windows.resolve("claude-sonnet-4-20250514")
    if listing:
        assert window == max(set(listing), key=listing.count)
        assert source != "default"
    assert windows.window("claude-sonnet-4") >= 200_000 or not listing


def test_openrouter_dot_spelling(windows: ContextWindows, shipped: dict[str, Any]) -> None:
    if "claude-sonnet-4-5" in shipped:
        assert windows.window("openrouter/anthropic/claude-sonnet-4.5") == shipped_window(
            shipped, "claude-sonnet-4-5"
        )


def test_unknown_model_gets_default(windows: ContextWindows) -> None:
    assert windows.resolve("my-local-llama-finetune-xyz") == (DEFAULT_CONTEXT_WINDOW, "default")
    assert windows.window("") == 128_000
    assert windows.window(None) == 128_000
    assert windows.max_output("my-local-llama-finetune-xyz") is None


def test_overrides_win() -> None:
    cw = ContextWindows({"gpt-4o": 50_000, "Local-Model": 32_768, "openai/gpt-4.1": 200_000})
    assert cw.resolve("gpt-4o") == (50_000, "override:gpt-4o")
    assert cw.window("azure/gpt-4o") == 50_000  # override by provider-stripped name
    assert cw.window("local-model") == 32_768  # case-insensitive
    assert cw.window("ollama/local-model") == 32_768
    assert cw.window("openai/gpt-4.1") == 200_000  # exact override with prefix
    assert cw.window("gpt-4.1") > 1_000_000  # that override does not leak to the bare name
    assert cw.max_output("gpt-4o") == 16_384  # max_output still comes from the map


def test_custom_default_and_no_map(tmp_path: Path) -> None:
    cw = ContextWindows(default=64_000, use_litellm_map=False)
    assert cw.window("gpt-4o") == 64_000
    assert cw.max_output("gpt-4o") is None
    broken = tmp_path / "map.json"
    broken.write_bytes(b"{not json")
    assert ContextWindows(map_path=broken).window("gpt-4o") == DEFAULT_CONTEXT_WINDOW


def test_small_custom_map(tmp_path: Path) -> None:
    path = tmp_path / "map.json"
    path.write_bytes(
        orjson.dumps(
            {
                "sample_spec": {"max_input_tokens": "prose", "max_output_tokens": "prose"},
                "model-a": {"max_input_tokens": 1000, "max_output_tokens": 100},
                "model-b": {"max_tokens": 2000},
                "vendor/model-c": {"max_input_tokens": 3000},
                "model-d": {"max_input_tokens": None, "max_output_tokens": True},
            }
        )
    )
    cw = ContextWindows(map_path=path)
    assert cw.load() == 3
    assert cw.window("model-a") == 1000
    assert cw.max_output("model-a") == 100
    assert cw.window("model-b") == 2000  # max_tokens fallback
    assert cw.window("model-c") == 3000  # provider-neutral index
    assert cw.window("model-d") == DEFAULT_CONTEXT_WINDOW
    assert cw.max_output("model-d") is None
    assert cw.window("sample_spec") == DEFAULT_CONTEXT_WINDOW
    assert cw.window("model-a-20250101") == 1000  # dated snapshot of a known alias


def test_lazy_load() -> None:
    cw = ContextWindows()
    assert cw.load_seconds is None  # nothing read at construction
    cw.window("gpt-4o")
    assert cw.load_seconds is not None and cw.loaded_from is not None
    assert cw.load() > 1000  # idempotent; thousands of models with a window


def test_without_litellm(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == "litellm" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    cw = ContextWindows({"x": 10})
    assert cw.window("gpt-4o") == DEFAULT_CONTEXT_WINDOW
    assert cw.window("x") == 10
    assert cw.loaded_from is None

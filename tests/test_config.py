from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from proxy.config import Config, config_from_mapping, load_config
from proxy.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def _leaf_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _leaf_paths(ann, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def _lookup(data: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def test_example_config_loads_and_equals_defaults() -> None:
    cfg = load_config(ROOT / "config.example.yaml")
    assert cfg == Config()


def test_example_documents_every_field() -> None:
    data = yaml.safe_load((ROOT / "config.example.yaml").read_text())
    missing = [p for p in _leaf_paths(Config) if not _lookup(data, p)]
    assert missing == []


def test_every_field_has_a_description() -> None:
    def walk(model: type[BaseModel]) -> list[str]:
        bad = []
        for name, field in model.model_fields.items():
            if not field.description:
                bad.append(f"{model.__name__}.{name}")
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                bad += walk(ann)
        return bad

    assert walk(Config) == []


def test_config_is_frozen() -> None:
    cfg = Config()
    with pytest.raises(ValidationError):
        cfg.server.port = 1  # type: ignore[misc]


def test_unknown_key_names_the_field() -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_mapping({"offload": {"recent_max_byte": 10}})
    assert "offload.recent_max_byte" in exc.value.message


def test_wrong_type_names_the_field() -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_mapping({"server": {"port": "many"}})
    assert exc.value.message.startswith("server.port:")


def test_environment_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTX_TEST_KEY", "sk-from-env")
    cfg = config_from_mapping(
        {
            "upstream": {"api_key": "os.environ/CTX_TEST_KEY"},
            "model_list": [
                {"model_name": "c", "litellm_params": {"model": "x", "api_key": "os.environ/CTX_TEST_KEY"}}
            ],
        }
    )
    assert cfg.upstream.api_key == "sk-from-env"
    assert cfg.model_list[0].litellm_params["api_key"] == "sk-from-env"


def test_missing_environment_variable_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CTX_NOPE", raising=False)
    with pytest.raises(ConfigError) as exc:
        config_from_mapping({"upstream": {"api_key": "os.environ/CTX_NOPE"}})
    assert "upstream.api_key" in exc.value.message and "CTX_NOPE" in exc.value.message


@pytest.mark.parametrize(
    "text, field",
    [
        ("server: {port: 99999}\n", "server.port"),
        ("bogus: 1\n", "bogus"),
        ("offload: {age_policy: sometimes}\n", "offload.age_policy"),
        ("- a\n- b\n", "(root)"),
    ],
)
def test_cli_exits_2_with_one_line(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0]


def test_cli_bad_usage_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "frobnicate"], capture_output=True, timeout=30
    )
    assert proc.returncode == 2

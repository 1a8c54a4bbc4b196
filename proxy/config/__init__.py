"""The one configuration object: frozen, validated, loaded once at start-up.

:class:`Config` is one frozen pydantic model; each of its sections (a top-level key of
``config.yaml``) is a model in the module of this package named for it: :mod:`.server`,
:mod:`.upstream` (``upstream``, ``anthropic``, ``model_list``), :mod:`.storage`,
:mod:`.offload`, :mod:`.compaction`, :mod:`.retrieval`, :mod:`.auth`, :mod:`.memory`,
:mod:`.ledger`, :mod:`.telemetry`, :mod:`.catalog`. Here: the whole, loading it
(:func:`load_config`, :func:`config_from_mapping`, ``os.environ/NAME`` values) and the check
that refuses to expose the operator's provider key (:func:`exposure_problem`).
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError

from proxy.config.auth import AuthConfig
from proxy.config.catalog import CatalogConfig
from proxy.config.compaction import CompactionConfig
from proxy.config.ledger import LedgerConfig
from proxy.config.memory import MemoryConfig
from proxy.config.offload import OffloadConfig
from proxy.config.retrieval import RetrievalConfig
from proxy.config.section import _Section
from proxy.config.server import ServerConfig
from proxy.config.storage import StorageConfig
from proxy.config.telemetry import TelemetryConfig
from proxy.config.upstream import AnthropicConfig, ModelRoute, UpstreamConfig
from proxy.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "Config",
    "config_from_mapping",
    "exposure_problem",
    "is_loopback",
    "load_config",
    "resolve_env",
]

ENV_PREFIX = "os.environ/"


class Config(_Section):
    server: ServerConfig = Field(default_factory=ServerConfig, description="Listening socket.")
    upstream: UpstreamConfig = Field(
        default_factory=UpstreamConfig, description="The OpenAI-compatible provider."
    )
    anthropic: AnthropicConfig = Field(
        default_factory=AnthropicConfig,
        description="The Anthropic provider (/v1/messages and its sub-paths).",
    )
    model_list: tuple[ModelRoute, ...] = Field(
        (), description="Routes to non-OpenAI providers through litellm."
    )
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Data on disk.")
    offload: OffloadConfig = Field(
        default_factory=OffloadConfig, description="Two-stage truncation of tool results."
    )
    compaction: CompactionConfig = Field(
        default_factory=CompactionConfig, description="Summaries of old turns."
    )
    retrieval: RetrievalConfig = Field(
        default_factory=RetrievalConfig, description="How the model reads offloaded content."
    )
    auth: AuthConfig = Field(
        default_factory=AuthConfig, description="Who may call the proxy, and as which tenant."
    )
    memory: MemoryConfig = Field(
        default_factory=MemoryConfig,
        description="Long-term memory across sessions (off by default).",
    )
    ledger: LedgerConfig = Field(
        default_factory=LedgerConfig,
        description="The cost ledger: what each call was billed, and what it would have cost "
        "without ctxproxy.",
    )
    telemetry: TelemetryConfig = Field(
        default_factory=TelemetryConfig,
        description="OpenTelemetry spans per request, exported over OTLP (off by default).",
    )
    catalog: CatalogConfig = Field(
        default_factory=CatalogConfig,
        description="Per-model facts the proxy relies on (what each model's API accepts).",
    )


def resolve_env(value: Any, where: str = "") -> Any:
    """Replace every `os.environ/NAME` string with that variable's value."""
    if isinstance(value, dict):
        return {k: resolve_env(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_env(v, f"{where}.{i}") for i, v in enumerate(value)]
    if isinstance(value, str) and value.startswith(ENV_PREFIX):
        name = value[len(ENV_PREFIX) :]
        if name not in os.environ:
            raise ConfigError(f"{where}: environment variable {name} is not set")
        return os.environ[name]
    return value


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(root)"
    return f"{loc}: {err['msg']}"


def config_from_mapping(data: Any) -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("(root): the configuration must be a mapping")
    try:
        return Config.model_validate(resolve_env(data))
    except ValidationError as exc:
        raise ConfigError(_first_error(exc)) from None


def load_config(path: str | Path | None) -> Config:
    """Load and validate a YAML file; no path gives the defaults."""
    if path is None:
        return Config()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    return config_from_mapping(data)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


def exposure_problem(config: Config) -> str | None:
    """Why this configuration must not start, or None: the operator's provider key would be
    open to anyone who reaches a non-loopback port."""
    auth = config.auth
    if auth.keys or auth.allow_unauthenticated or is_loopback(config.server.host):
        return None
    held = [
        name for name, present in [("upstream.api_key", config.upstream.api_key is not None),
                                   ("anthropic.api_key", config.anthropic.api_key is not None)] + [
            (f"model_list route {r.model_name!r}", "api_key" in r.litellm_params)
            for r in config.model_list
        ] if present
    ]
    if not held:
        return None
    return (
        f"server.host {config.server.host} is not loopback and {held[0]} is set, but no "
        "auth.keys are: anyone who reaches the port would spend that key. Add auth.keys, or "
        "set auth.allow_unauthenticated: true to allow it explicitly"
    )

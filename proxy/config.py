"""The one configuration object: frozen, validated, loaded once at start-up."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from proxy.errors import ConfigError

ENV_PREFIX = "os.environ/"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Section):
    host: str = Field("127.0.0.1", description="Interface to listen on.")
    port: int = Field(4000, ge=0, le=65535, description="TCP port to listen on.")
    max_body_mb: float = Field(
        64, gt=0, description="Largest request body accepted, in MiB; larger bodies get 413."
    )
    max_messages: int = Field(
        100_000, ge=1, description="Most messages one chat request may carry; more gets 400."
    )
    public_url: str | None = Field(
        None,
        description="Base URL people and models reach the proxy at (for /files links in "
        "notices with retrieval.mode none); null: http://host:port.",
    )
    cache_mb: int = Field(
        512,
        ge=8,
        description="Memory (MiB) for the in-process caches keyed by message content (token "
        "counts 35%, cuts 35%, message digests 20%, read rounds 5%, the file-aware rules' "
        "memos 5%), each bounded by what its entries pin (the originals they hold). Size it "
        "to the tool outputs of the sessions active at once: below that, resent histories are "
        "re-tokenized. The process's resident memory is about this plus the requests in "
        "flight (docs/errors.md#limits).",
    )
    pipeline_budget: int = Field(
        64_000_000,
        ge=0,
        description="Work units (about one per character of text a stage looks at) one "
        "request's pipeline may spend before it degrades: the file-aware rules give the results "
        "not decided yet their stage-1 form (counted over the epoch, so every request of it "
        "forwards the same prefix), token counts become estimates. A count, not a time: the "
        "same history degrades the same way on any machine. 0: degrade at once.",
    )
    shutdown_timeout_s: float = Field(
        30,
        ge=0,
        description="On SIGTERM/SIGINT, how long requests and streams already in flight may "
        "run to completion (new connections are refused at once); what is still running then "
        "is cut off. Keep the orchestrator's kill deadline above it.",
    )
    header_timeout_s: float = Field(
        30, gt=0,
        description="Longest a client may take from opening a connection (or from the first "
        "byte of a request on a kept-alive one) to the end of the request's headers; the "
        "connection is closed after it.")
    body_timeout_s: float = Field(
        60, gt=0,
        description="Longest wait for the next part of a request body; a 408 after it.")
    keepalive_s: float = Field(
        5, gt=0, description="How long an idle kept-alive client connection stays open.")


class UpstreamConfig(_Section):
    base_url: str = Field(
        "https://api.openai.com/v1",
        description="OpenAI-compatible base URL requests are forwarded to (including /v1).",
    )
    api_key: str | None = Field(
        None,
        description="Key sent upstream; null forwards the client's own Authorization header.",
    )
    timeout_s: float = Field(
        600,
        gt=0,
        description="Longest wait for the upstream's next byte (connect, first byte, or between "
        "stream chunks) before the request fails with 504.",
    )
    connect_timeout_s: float = Field(
        10, gt=0, description="Longest wait to open a connection to the upstream."
    )
    max_connections: int = Field(
        512, ge=1, description="Concurrent connections the pooled upstream client may open."
    )
    keepalive_s: float = Field(
        4,
        gt=0,
        description="Idle pooled connections are closed after this many seconds. Keep it below "
        "the upstream's own idle timeout (uvicorn, vLLM: 5 s): a connection the upstream closes "
        "while the proxy reuses it fails after the request was sent, and a POST is never "
        "retried (it may have been billed). Raise it for providers that keep connections for "
        "minutes (OpenAI, Anthropic) to save TLS handshakes.",
    )


class AnthropicConfig(UpstreamConfig):
    """The Anthropic upstream ``/v1/messages`` is forwarded to, natively (no translation)."""

    base_url: str = Field(
        "https://api.anthropic.com",
        description="Anthropic Messages API base URL, without /v1 (as ANTHROPIC_BASE_URL is "
        "written): /v1/messages and its sub-paths are forwarded below it.",
    )
    api_key: str | None = Field(
        None,
        description="Key sent upstream as x-api-key; null forwards the client's own x-api-key "
        "(or Authorization) header.",
    )
    summarizer_model: str | None = Field(
        None,
        description="Model that summarizes (and folds the memory of) Messages sessions, asked "
        "through this upstream in Messages format with the client's key; null: the request's "
        "own model. A compaction.model (memory.model for the fold) that names a model_list "
        "route takes precedence.",
    )


class ModelRoute(_Section):
    model_name: str = Field(description="Model name clients send that selects this route.")
    litellm_params: dict[str, Any] = Field(
        description="Parameters for litellm (model: 'anthropic/...', api_key, api_base, ...)."
    )


class StorageConfig(_Section):
    data_dir: Path = Field(
        Path("./ctxproxy-data"), description="Directory holding offloaded files and archives."
    )
    url: str | None = Field(
        None,
        description="Shared database for many replicas: a postgresql://user:pass@host/db URL "
        "(or os.environ/NAME). Then summaries, session counters, the dialog archive and "
        "offloaded originals all live in PostgreSQL and data_dir is not used for them; null: "
        "files and SQLite under data_dir (one process).",
    )
    pool_size: int = Field(
        10, ge=1, le=200, description="With url: most database connections of one replica."
    )
    statement_timeout_s: float = Field(
        5, gt=0, description="With url: longest wait for one database call (connection or "
        "query); past it the request goes on without the store (forwarded uncut, not archived).",
    )
    tool_result_ttl_days: float = Field(
        5, gt=0, description="Offloaded tool results older than this many days are deleted."
    )
    max_tenant_mb: float | None = Field(
        10240,
        gt=0,
        description="Disk quota per tenant in MiB (its files under data_dir: offloaded "
        "results, dialog archive, summaries); null: none. Over it, requests are still "
        "forwarded but nothing new is written for the tenant, and the answer carries "
        "x-ctxproxy-quota: exceeded. Measured by the periodic gc and counted as writes happen.",
    )
    dialog_ttl_days: float | None = Field(
        None,
        gt=0,
        description="Dialog archive files and summaries older than this many days are deleted "
        "(with their index rows) by the periodic gc and `ctxproxy gc`, and so are cost ledger "
        "entries (their sessions' totals recomputed); null: kept forever.",
    )

    @field_validator("url")
    @classmethod
    def _postgres_only(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL (or null for files and SQLite)")
        return value


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


class RetrievalConfig(_Section):
    mode: Literal["proxy", "client", "none"] = Field(
        "proxy",
        description="proxy: the proxy runs the read tool; client: notices name the client's "
        "own read tool; none: notices give the /files URL.",
    )
    tool_name: str = Field("read_offloaded", description="Name of the proxy's read tool.")
    max_rounds: int = Field(5, ge=0, description="Most read-tool rounds per client request.")
    client_tool: ReadTool = Field(
        default_factory=lambda: ReadTool(path_arg="file_path", line_arg="start_line"),
        description="mode client: the argument names of the client's read tool.",
    )
    client_tool_name: str = Field(
        "read_file", description="mode client: the name of the client's own read tool."
    )


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


# The OpenTelemetry SDK's own variables, honoured when telemetry.endpoint is null.
OTLP_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


class TelemetryConfig(_Section):
    enabled: bool = Field(
        False,
        description="Send one OpenTelemetry span per conversation request (GenAI semantic "
        "conventions plus ctxproxy.* attributes: tokens sent and forwarded, offloads, "
        "compaction, cost, why the cache broke) over OTLP/HTTP. Needs the otel extra (pip "
        "install 'ctxproxy[otel]'). Off: opentelemetry is never imported.",
    )
    endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces URL, path included (http://127.0.0.1:4318/v1/traces); "
        "null: the SDK's OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT "
        "plus /v1/traces. Enabled with none of the three set is a configuration error.",
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        repr=False,
        description="Headers sent with every export, for collectors that need auth "
        "(authorization: os.environ/OTLP_TOKEN); added to OTEL_EXPORTER_OTLP_HEADERS. Never "
        "logged.",
    )
    service_name: str = Field(
        "ctxproxy", min_length=1, description="The resource's service.name."
    )
    timeout_s: float = Field(
        10, gt=0, description="Longest time one export (retries included) may take; exports "
        "run in the SDK's own thread, never on a request's path."
    )
    sample_ratio: float = Field(
        1.0, ge=0, le=1, description="Share of requests traced (by trace id); a request that "
        "carries a W3C traceparent follows its caller's sampling decision instead."
    )

    @field_validator("endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL (OTLP/HTTP)")
        return value

    @model_validator(mode="after")
    def _has_endpoint(self) -> TelemetryConfig:
        if self.enabled and self.endpoint is None and not any(
                os.environ.get(name) for name in OTLP_ENDPOINT_VARS):
            raise ValueError("enabled needs an endpoint: set telemetry.endpoint or "
                             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT")
        return self


DIGEST_PREFIX = "sha256:"
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MASTER_TENANT = "master"


def key_digest(key: str) -> str:
    """How a configured key is held: ``sha256:<hex>`` of its UTF-8 bytes."""
    return DIGEST_PREFIX + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def _as_digest(value: str | None) -> str | None:
    # A key given as its digest stays one; a plain key is hashed at once, so the config object
    # (which lives as long as the app) never holds it.
    if value is None:
        return None
    if not value:
        raise ValueError("must not be empty")
    return value if _DIGEST.fullmatch(value) else key_digest(value)


class ClientKey(_Section):
    key: str = Field(
        repr=False,
        description="A key clients present (Authorization: Bearer, x-api-key or api-key), or "
        "its digest written as sha256:<64 hex> so the plain key need not be in the file. Only "
        "the digest is kept in memory.",
    )
    tenant: str = Field(
        description="The tenant requests with this key act as: their sessions, /files view and "
        "disk quota. Several keys may name one tenant (rotation). A safe name: "
        "[A-Za-z0-9][A-Za-z0-9._-]{0,127}; 'master' is reserved for auth.master_key.",
    )
    max_disk_mb: float | None = Field(
        None, gt=0, description="This tenant's disk quota in MiB; null: storage.max_tenant_mb."
    )

    _digest = field_validator("key")(_as_digest)

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, value: str) -> str:
        if not _TENANT.fullmatch(value) or ".." in value:
            raise ValueError("must be a safe name: [A-Za-z0-9][A-Za-z0-9._-]{0,127}, no '..'")
        if value == MASTER_TENANT:
            raise ValueError("'master' is reserved for auth.master_key")
        return value


class AuthConfig(_Section):
    master_key: str | None = Field(
        None,
        repr=False,
        description="A key that may call every route and sees every tenant in /files (or its "
        "digest, sha256:<64 hex>). Without auth.keys it guards /files only.",
    )
    keys: tuple[ClientKey, ...] = Field(
        (),
        description="The clients allowed in, each with its tenant. When any are set, every "
        "proxied route (/v1/*, /chat/completions, /files) needs one of them (or the master "
        "key): a missing or wrong key gets 401 before the body is read. Their keys are the "
        "proxy's, never forwarded upstream: set upstream.api_key for the provider.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Listen beyond loopback without auth.keys even though upstream.api_key (or "
        "anthropic.api_key, or a model_list route's api_key) is set: anyone who reaches the port spends that key. "
        "Off: such a configuration refuses to start.",
    )

    _master_digest = field_validator("master_key")(_as_digest)

    @model_validator(mode="after")
    def _consistent(self) -> AuthConfig:
        seen: dict[str, str] = {}
        quota: dict[str, float | None] = {}
        for entry in self.keys:
            if entry.key in seen or entry.key == self.master_key:
                raise ValueError(f"keys: the key of tenant {entry.tenant!r} is listed twice")
            seen[entry.key] = entry.tenant
            if entry.tenant in quota and quota[entry.tenant] != entry.max_disk_mb:
                raise ValueError(f"keys: tenant {entry.tenant!r} has two different max_disk_mb")
            quota[entry.tenant] = entry.max_disk_mb
        return self


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

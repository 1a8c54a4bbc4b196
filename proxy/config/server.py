"""``server``: the listening socket, request limits, in-process caches and the per-request
work budget.
"""

from __future__ import annotations

from pydantic import Field

from proxy.config.section import _Section

__all__ = [
    "ServerConfig",
]


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

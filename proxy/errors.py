"""The one exception tree. Every error the proxy raises on purpose is a :class:`ProxyError`;
those that reach a client become OpenAI's error envelope with the class's status::

    ProxyError (500)
    ├── BadRequest (400)
    ├── Unauthorized (401)
    │   └── AuthRequired                 also asks a browser to log in
    ├── NotFound (404)
    ├── RequestTimeout (408)             a client too slow sending its body
    ├── PayloadTooLarge (413)
    ├── UnsupportedMediaType (415)       a Content-Encoding the proxy cannot decode
    ├── UpgradeRequired (426)            a WebSocket upgrade: clients fall back to HTTPS
    ├── ClientDisconnected (499)
    ├── UpstreamError (502)
    │   └── UpstreamTimeout (504)
    ├── UpstreamStatusError              an error answer translated from litellm
    ├── ConfigError                      exit status 2 from the CLI
    ├── SummarizerError                  the compactor falls back to a deterministic summary
    └── StoreError                       state on disk or in the database
        ├── InvalidName (+ ValueError)   a name that is not one safe path component
        ├── Hidden (+ FileNotFoundError) a path refused or absent below data_dir
        ├── OffloadedFileMissing (+ LookupError)   expired or never written
        ├── SchemaError                  a database written by a newer ctxproxy
        └── StoreUnavailable (+ OSError) the shared database is down or too slow

The internal ones also derive from the builtin their callers have always caught.
"""

from __future__ import annotations

from typing import Any

import orjson


class ProxyError(Exception):
    """Base of every error the proxy raises on purpose."""

    status: int = 500
    type: str = "server_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def envelope(self) -> dict[str, Any]:
        return envelope(self.message, self.type, self.param, self.code)

    def body(self) -> bytes:
        return orjson.dumps(self.envelope())

    def anthropic_body(self) -> bytes:
        """The error in Anthropic's envelope, for the clients of ``/v1/messages``."""
        return orjson.dumps(anthropic_envelope(self.message, self.status))


class BadRequest(ProxyError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(ProxyError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class AuthRequired(Unauthorized):
    """401 that also asks a browser for credentials (``WWW-Authenticate: Basic``)."""

    headers = {"WWW-Authenticate": 'Basic realm="ctxproxy", charset="UTF-8"'}


class NotFound(ProxyError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class RequestTimeout(ProxyError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(ProxyError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(ProxyError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_content_encoding"


class UpgradeRequired(ProxyError):
    """A WebSocket upgrade the proxy does not take: 426 tells a client (Codex) to use HTTPS."""

    status = 426
    type = "invalid_request_error"
    code = "websocket_not_supported"


class ClientDisconnected(ProxyError):
    """The client went away; nobody is left to read an answer (nginx's 499)."""

    status = 499
    type = "client_closed_request"
    code = "client_disconnected"


class UpstreamError(ProxyError):
    """The upstream could not be reached or answered something unusable."""

    status = 502
    type = "upstream_error"
    code = "upstream_unavailable"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class UpstreamStatusError(ProxyError):
    """An upstream (or provider reached through litellm) answered with an error status.

    Raw upstreams pass their body through untouched; this class carries a translated one.
    """

    type = "upstream_error"
    code = "upstream_error"


class ConfigError(ProxyError):
    """Bad configuration; the CLI turns it into one line and exit status 2."""

    code = "config_error"


def envelope(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# Anthropic's error type per status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}


def anthropic_envelope(message: str, status: int) -> dict[str, Any]:
    return {"type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


class SummarizerError(ProxyError):
    """The summarizer call failed; the compactor falls back to a deterministic summary.
    ``provider_status``: the provider's HTTP status (0: no answer came, or it was unusable)."""

    type = "upstream_error"
    code = "summarizer_failed"

    def __init__(self, message: str, *, provider_status: int = 0) -> None:
        super().__init__(message)
        self.provider_status = provider_status


class StoreError(ProxyError):
    """Something about state on disk or in the database."""

    code = "store_error"


class InvalidName(StoreError, ValueError):
    """A tenant, session, id or path component that is not a safe single path component."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_name"


class Hidden(StoreError, FileNotFoundError):
    """Missing, not a regular file/directory, a symlink, or an invalid name: all look alike to
    the caller, so a refused path reveals nothing about what is there. ``absent`` says a component
    simply does not exist (no symlink, no type mismatch): the honest case for an offloaded file
    that expired."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"

    def __init__(self, name: str, *, absent: bool = False) -> None:
        super().__init__(name)
        self.absent = absent


class OffloadedFileMissing(StoreError, LookupError):
    """The file is gone: expired (TTL) or never written. The message says what to do instead."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class SchemaError(StoreError):
    """The database was written by a newer ctxproxy (or is not ours)."""

    code = "schema_error"


class StoreUnavailable(StoreError, OSError):
    """The shared database (PostgreSQL) cannot be reached or did not answer in time. An
    OSError, so every path that survives a failing disk (forward uncut, skip the archive write)
    survives it the same way."""

    status = 503
    code = "store_unavailable"

"""Tenant and session resolution (docs/sessions.md)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

ANON = "anon"
# The tenant-wide memory scope (docs/memory.md#scope), when the client names none.
DEFAULT_MEMORY_SCOPE = "default"
MEMORY_SCOPE_HEADER = "x-ctxproxy-memory-scope"
# A session may not be called like the tenant's memory directory (proxy.store.paths.MEMORY_DIR):
# a client naming its session so gets the hashed form.
_RESERVED = frozenset({"memory"})
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# In order of precedence; "session-id" is what Codex sends.
SESSION_HEADERS = ("x-ctxproxy-session", "x-session-id", "x-claude-code-session-id", "session-id")


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str
    session: str
    api_key: str | None  # never persisted or logged; kept to forward and compare
    memory_scope: str = DEFAULT_MEMORY_SCOPE  # long-term memory scope (a safe name)


def client_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else auth.strip()
        if token:
            return token
    return headers.get("x-api-key") or headers.get("api-key") or None


def tenant_of(key: str | None) -> str:
    """A short, stable, one-way name for an API key; the key itself is never stored."""
    if not key:
        return ANON
    return "t-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def safe_name(raw: str) -> str:
    """Client-chosen ids become directory names: keep safe ones, hash anything else."""
    if _SAFE.fullmatch(raw) and ".." not in raw:
        return raw
    return _hashed(raw)


def _hashed(raw: str) -> str:
    return "h-" + hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _session_name(raw: str) -> str:
    return _hashed(raw) if raw in _RESERVED else safe_name(raw)


def memory_scope(headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
    """The memory scope a client names (header, then ``metadata.memory_scope``), validated like
    a session name; the tenant-wide ``default`` otherwise."""
    value = headers.get(MEMORY_SCOPE_HEADER)
    if not value:
        meta = body.get("metadata")
        found = meta.get("memory_scope") if isinstance(meta, dict) else None
        value = found if isinstance(found, str) else None
    return safe_name(value) if value else DEFAULT_MEMORY_SCOPE


def _first(messages: list[Any], roles: tuple[str, ...]) -> Any:
    for m in messages:
        if isinstance(m, dict) and m.get("role") in roles:
            return m.get("content")
    return None


# Claude Code before 2.1 wrote metadata.user_id as "user_<hash>_account_<uuid>_session_<uuid>".
_USER_ID_SESSION = re.compile(r"_session_([0-9A-Za-z-]+)$")


def _user_id_session(user_id: str) -> str | None:
    """The session inside Anthropic's ``metadata.user_id`` as Claude Code writes it: a JSON
    string holding ``session_id`` (2.1), or ending in ``_session_<uuid>`` (before)."""
    if user_id.startswith("{"):
        try:
            data = orjson.loads(user_id)
        except orjson.JSONDecodeError:
            return None
        sid = data.get("session_id") if isinstance(data, dict) else None
        return sid if isinstance(sid, str) and sid else None
    found = _USER_ID_SESSION.search(user_id)
    return found[1] if found else None


def _body_session(body: Mapping[str, Any]) -> str | None:
    meta = body.get("metadata")
    if isinstance(meta, dict):
        sid = meta.get("session_id")
        if isinstance(sid, str) and sid:
            return sid
        user_id = meta.get("user_id")
        if isinstance(user_id, str) and user_id:
            sid = _user_id_session(user_id)
            if sid is not None:
                return sid
    for field in ("prompt_cache_key", "user"):
        value = body.get(field)
        if isinstance(value, str) and value:
            return value
    return None


def derived_session(tenant: str, messages: list[Any]) -> str:
    """Same for every turn of one conversation: only its first system and user message count."""
    seed = orjson.dumps(
        [tenant, _first(messages, ("system", "developer")), _first(messages, ("user",))],
        option=orjson.OPT_SORT_KEYS,
        default=str,
    )
    return "s-" + hashlib.sha256(seed).hexdigest()[:20]


def resolve(
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    *,
    tenant: str | None = None,
    history: Sequence[Any] | None = None,
) -> Identity:
    """The request's tenant (``tenant``, as the gate decided; else from the client's key) and
    session; ``history``: the conversation in the pipeline's model (default: the body's
    ``messages``), for a session derived from its first system and user messages."""
    key = client_key(headers)
    if tenant is None:
        tenant = tenant_of(key)
    scope = memory_scope(headers, body)
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return Identity(tenant, _session_name(value), key, scope)
    sid = _body_session(body)
    if sid is not None:
        return Identity(tenant, _session_name(sid), key, scope)
    if history is None:
        found = body.get("messages")
        history = found if isinstance(found, list) else []
    return Identity(tenant, derived_session(tenant, list(history)), key, scope)

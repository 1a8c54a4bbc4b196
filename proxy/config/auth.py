"""``auth``: who may call the proxy, and as which tenant (client keys held as their digests,
the master key).
"""

from __future__ import annotations

import hashlib
import re

from pydantic import Field, field_validator, model_validator

from proxy.config.section import _Section

__all__ = [
    "DIGEST_PREFIX",
    "MASTER_TENANT",
    "AuthConfig",
    "ClientKey",
    "key_digest",
]


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

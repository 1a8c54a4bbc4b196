"""Who is calling, and as which tenant (docs/sessions.md#tenant, docs/security.md#who-may-call).

The key comes from ``Authorization: Bearer KEY``, ``Authorization: Basic base64(user:KEY)``
(what a browser sends after its login prompt to ``/files``), ``x-api-key`` or ``api-key``.

* With ``auth.keys`` the proxy is closed: a request needs one of those keys or the master key.
  The tenant is the key's configured name; the key is the proxy's and never goes upstream.
* Without them the proxy is open: the tenant is a short hash of whatever key the client sent
  (``anon`` without one) and that key is forwarded, so the provider judges it
  (:class:`KeyVerifier` holds the tenant's writes until it has).

Keys are held only as SHA-256 digests (the config hashes them when it loads) and a presented key
is hashed once, then compared with every configured digest by ``hmac.compare_digest`` with no
early exit: neither the position of a match nor a near miss shows in the timing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from proxy.config.auth import DIGEST_PREFIX, MASTER_TENANT, AuthConfig
from proxy.errors import AuthRequired, BadRequest
from proxy.session import ANON, client_key, tenant_of

__all__ = ["Caller", "Gate", "key_headers", "presented_key"]

_KEY_HEADERS: Final = frozenset({b"authorization", b"x-api-key", b"api-key"})


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str  # the caller's own tenant
    master: bool  # the master key: sees every tenant in /files
    gated: bool  # admitted by auth.keys / the master key: its key is the proxy's, not forwarded
    key: str | None  # the presented key; never persisted or logged
    max_disk_mb: float | None = None  # this key's own quota, overriding storage.max_tenant_mb

    def may_see(self, tenant: str) -> bool:
        return self.master or tenant == self.tenant

    @property
    def scope(self) -> str | None:
        """The tenant filter for listings; ``None`` means every tenant (master key)."""
        return None if self.master else self.tenant


def key_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The headers a key may come in, lower-cased (the gate needs nothing else). One of them
    sent twice is a 400: which copy the gate, ``/files`` and the provider would each read is
    anyone's guess (HTTP lets a server take either), so none is taken."""
    found: dict[str, str] = {}
    for k, v in raw:
        name = k.lower()
        if name in _KEY_HEADERS:
            key = name.decode("latin-1")
            if key in found:
                raise BadRequest(f"more than one {key!r} header: send the key once",
                                 param=key)
            found[key] = v.decode("latin-1")
    return found


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key the request carries, or ``None``."""
    auth = headers.get("authorization", "").strip()
    scheme, _, rest = auth.partition(" ")
    if scheme.lower() != "basic":
        return client_key(headers)
    try:
        decoded = base64.b64decode(rest.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        # Deliberately no detail: the credentials must not be echoed back.
        raise AuthRequired("malformed Basic credentials") from None
    user, _, password = decoded.partition(":")
    # The key normally goes in the password field; a key typed as user name works too.
    return password or user or None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _raw(digest: str) -> bytes:
    return bytes.fromhex(digest.removeprefix(DIGEST_PREFIX))


@dataclass(frozen=True, slots=True)
class _Key:
    digest: bytes
    tenant: str
    max_disk_mb: float | None


class Gate:
    """Decides the caller of every request; built once from ``auth``."""

    def __init__(self, auth: AuthConfig) -> None:
        self._keys = tuple(_Key(_raw(k.key), k.tenant, k.max_disk_mb) for k in auth.keys)
        self._master = _raw(auth.master_key) if auth.master_key is not None else None

    @property
    def closed(self) -> bool:
        """Whether requests need a configured key (``auth.keys`` is set)."""
        return bool(self._keys)

    def _is_master(self, digest: bytes) -> bool:
        return self._master is not None and hmac.compare_digest(digest, self._master)

    def _match(self, digest: bytes) -> _Key | None:
        found = None
        for entry in self._keys:  # every entry, match or not: constant time in the position
            if hmac.compare_digest(digest, entry.digest):
                found = entry
        return found

    def caller(
        self, headers: Mapping[str, str], *, files: bool = False, login: bool = False
    ) -> Caller:
        """The caller; raises :class:`AuthRequired` (401) when a key is needed and missing or
        unknown. A key is needed everywhere when the proxy is closed; for ``/files`` (``files``)
        also when a master key is set, or when ``login`` asks for credentials (a browser sends
        Basic credentials only after a 401)."""
        key = presented_key(headers)
        if key is None:
            if self.closed or (files and (login or self._master is not None)):
                raise AuthRequired("an API key is required: send it as a Bearer token or log in")
            return Caller(ANON, False, False, None)
        digest = _digest(key)
        if self._is_master(digest):
            tenant = MASTER_TENANT if self.closed else tenant_of(key)
            return Caller(tenant, True, self.closed, key)
        if not self.closed:
            return Caller(tenant_of(key), False, False, key)
        entry = self._match(digest)
        if entry is None:
            raise AuthRequired("invalid API key")
        return Caller(entry.tenant, False, True, key, entry.max_disk_mb)

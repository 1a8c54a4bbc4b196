"""The pooled raw-bytes client for OpenAI-compatible upstreams."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import aiohttp

from ..config import UpstreamConfig
from ..errors import UpstreamError, UpstreamTimeout

log = logging.getLogger("proxy.upstream")

# RFC 9110 hop-by-hop headers plus those the transport recomputes.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "accept-encoding",
        "expect",
    }
)
_RESPONSE_DROP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "transfer-encoding",
        "trailer",
        "upgrade",
        "content-length",
        "content-encoding",  # aiohttp decompresses; the client gets identity bytes
    }
)
_KEY_HEADERS = frozenset({"authorization", "x-api-key", "api-key"})


class Upstream:
    """One aiohttp session for the process, opened and closed by the app's lifespan."""

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self.base_url = config.base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        # Retries go through a session that never reuses a connection: the pool may hold more
        # connections the upstream closed at the same moment as the one that just failed.
        self._fresh: aiohttp.ClientSession | None = None
        self._auth = f"Bearer {config.api_key}" if config.api_key else None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self.config.max_connections, ttl_dns_cache=300, keepalive_timeout=30
        )
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self.config.connect_timeout_s,
            sock_read=self.config.timeout_s,
        )
        self._session = self._open(connector, timeout)
        self._fresh = self._open(
            aiohttp.TCPConnector(limit=self.config.max_connections, force_close=True), timeout
        )

    @staticmethod
    def _open(connector: aiohttp.TCPConnector, timeout: aiohttp.ClientTimeout) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=True,
            # A proxy must not keep cookies: one tenant's would be sent with another's requests.
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None

    def url(self, subpath: str, query: bytes = b"") -> str:
        url = f"{self.base_url}/{subpath.lstrip('/')}"
        return f"{url}?{query.decode('latin-1')}" if query else url

    def request_headers(self, client: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for raw_name, raw_value in client:
            name = raw_name.decode("latin-1").lower()
            if name in _HOP or name.startswith("x-ctxproxy-"):
                continue
            if self._auth is not None and name in _KEY_HEADERS:
                continue
            out.append((name, raw_value.decode("latin-1")))
        if self._auth is not None:
            out.append(("authorization", self._auth))
        return out

    async def send(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes
    ) -> aiohttp.ClientResponse:
        """Open the request and return the response with its body unread."""
        if self._session is None or self._fresh is None:
            raise UpstreamError("upstream client is not running")
        # A pooled keep-alive connection the upstream closed while it sat idle (servers time
        # them out after a few seconds) fails on first use, before any response byte: the
        # upstream never answered, so one retry on a fresh connection is safe and hides it.
        # The openai SDK itself retries such connection errors twice.
        try:
            try:
                return await self._request(self._session, method, url, headers, body)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if isinstance(exc, aiohttp.ClientConnectorError):
                    raise  # nothing was sent: refused, not dropped
                log.info("upstream dropped the connection before answering (%s); retrying "
                         "once on a new connection", type(exc).__name__)
                return await self._request(self._fresh, method, url, headers, body)
        except TimeoutError:
            raise UpstreamTimeout(f"upstream did not answer within {self.config.timeout_s:g} s") from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(f"upstream unreachable: {exc.os_error or exc}") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"upstream request failed: {type(exc).__name__}: {exc}") from None

    @staticmethod
    async def _request(
        session: aiohttp.ClientSession, method: str, url: str, headers: list[tuple[str, str]],
        body: bytes,
    ) -> aiohttp.ClientResponse:
        return await session.request(
            method, url, headers=headers, data=body or None, allow_redirects=False
        )

def response_headers(resp: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []
    for name, value in resp.raw_headers:
        if name.decode("latin-1").lower() not in _RESPONSE_DROP:
            out.append((name.lower(), value))
    return out

"""The pooled raw-bytes client for an upstream: OpenAI-compatible, or Anthropic's."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import aiohttp
from yarl import URL

from proxy.config.upstream import UpstreamConfig
from proxy.errors import UpstreamError, UpstreamTimeout

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
        # The proxy decodes a compressed request body (proxy.server.encoding): what it forwards is
        # identity bytes, which this header would no longer describe.
        "content-encoding",
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

    def __init__(
        self, config: UpstreamConfig, *, forward_client_key: bool = True,
        key_header: str = "authorization",
    ) -> None:
        """``forward_client_key`` off: the client's key headers are never sent on (they hold
        the proxy's own keys, ``auth.keys``). ``key_header``: where ``config.api_key`` goes
        (``authorization`` as a Bearer token, or Anthropic's ``x-api-key`` as it is)."""
        self.config = config
        self._strip_keys = not forward_client_key or config.api_key is not None
        self.base_url = config.base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self._auth: tuple[str, str] | None = None
        if config.api_key:
            bearer = key_header == "authorization"
            self._auth = (key_header, f"Bearer {config.api_key}" if bearer else config.api_key)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self.config.max_connections, ttl_dns_cache=300,
            keepalive_timeout=self.config.keepalive_s,
        )
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self.config.connect_timeout_s,
            sock_read=self.config.timeout_s,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=True,
            # A proxy must not keep cookies: one tenant's would be sent with another's requests.
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._session = None

    def url(self, subpath: str, query: bytes = b"") -> URL:
        """``base_url/subpath?query`` taken as already encoded: yarl would otherwise normalise
        it, resolving ``%2e%2e`` into a real ``..`` (the passthrough refuses those first, see
        :func:`proxy.routes.passthrough_subpath`) and re-quoting what the client sent."""
        url = f"{self.base_url}/{subpath.lstrip('/')}"
        return URL(f"{url}?{query.decode('latin-1')}" if query else url, encoded=True)

    def request_headers(self, client: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for raw_name, raw_value in client:
            name = raw_name.decode("latin-1").lower()
            if name in _HOP or name.startswith("x-ctxproxy-"):
                continue
            if self._strip_keys and name in _KEY_HEADERS:
                continue
            out.append((name, raw_value.decode("latin-1")))
        if self._auth is not None:
            out.append(self._auth)
        return out

    async def send(
        self, method: str, url: URL, headers: list[tuple[str, str]], body: bytes
    ) -> aiohttp.ClientResponse:
        """Open the request and return the response with its body unread.

        A POST is never retried: a connection that breaks after the request was written may
        have delivered it, and the upstream may be generating (and billing) the answer. Stale
        pooled connections are prevented instead: the pool drops idle connections after
        ``upstream.keepalive_s``, below the idle timeout of common servers. Idempotent methods
        (GET, HEAD, ...) get aiohttp's own single retry on a reused connection (RFC 9112 9.3.1).
        """
        if self._session is None:
            raise UpstreamError("upstream client is not running")
        try:
            return await self._session.request(
                method, url, headers=headers, data=body or None, allow_redirects=False
            )
        except TimeoutError:
            raise UpstreamTimeout(f"upstream did not answer within {self.config.timeout_s:g} s") from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(f"upstream unreachable: {exc.os_error or exc}") from None
        except aiohttp.ServerDisconnectedError:
            raise UpstreamError(
                "upstream closed the connection before answering; not retried, since it may "
                "have received the request"
            ) from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"upstream request failed: {type(exc).__name__}: {exc}") from None


def response_headers(resp: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []
    for name, value in resp.raw_headers:
        if name.decode("latin-1").lower() not in _RESPONSE_DROP:
            out.append((name.lower(), value))
    return out

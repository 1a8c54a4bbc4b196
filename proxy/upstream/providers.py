"""Which provider a wire format's calls go to, and which of a client's headers go with them.

The one place where the proxy picks an upstream: the client's own requests (forwarded, and the
read-tool rounds after them), its sub-paths passed through (count_tokens, /v1/models, ...), and
the calls the proxy makes of its own on a request's behalf (the compaction summarizer, the
memory fold) all ask :class:`Upstreams` by the request's wire format. A credential is sent only
to the upstream of the format it came with: a Messages request's ``x-api-key`` or OAuth token
goes to ``anthropic.base_url``, never to ``upstream.base_url``, and an OpenAI client's key never
to Anthropic.

The proxy's own calls send none of the client's headers but those that authenticate it to
that provider (:data:`CREDENTIALS`): the call is the proxy's, not the client's, and another
provider's headers (``anthropic-*`` to OpenAI, ``openai-*`` to Anthropic) have nothing to do
there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Final, Literal

from proxy.upstream.forward import Forwarder
from proxy.upstream.http import Upstream

__all__ = ["CREDENTIALS", "Provider", "Upstreams", "provider_of"]

Provider = Literal["openai", "anthropic"]

#: The client headers a proxy-made call carries, per provider: what authenticates the caller
#: (and qualifies the key: an OAuth token is accepted by Anthropic only with its beta named).
CREDENTIALS: Final[Mapping[Provider, frozenset[bytes]]] = MappingProxyType({
    "openai": frozenset({b"authorization", b"api-key", b"openai-organization",
                         b"openai-project"}),
    "anthropic": frozenset({b"authorization", b"x-api-key", b"anthropic-version",
                            b"anthropic-beta"}),
})


def provider_of(api: str) -> Provider:
    """The provider of wire format ``api``: Anthropic's for Messages, else the OpenAI one
    (chat completions, Responses, and the passthrough of an OpenAI client)."""
    return "anthropic" if api == "messages" else "openai"


class Upstreams:
    """The two upstreams and their forwarders, chosen by wire format."""

    def __init__(self, openai: Upstream, anthropic: Upstream) -> None:
        self._upstreams: dict[Provider, Upstream] = {"openai": openai, "anthropic": anthropic}
        self._forwarders: dict[Provider, Forwarder] = {
            "openai": Forwarder(openai), "anthropic": Forwarder(anthropic)}

    def of(self, api: str) -> Upstream:
        """The upstream wire format ``api``'s calls go to."""
        return self._upstreams[provider_of(api)]

    def forwarder(self, api: str) -> Forwarder:
        return self._forwarders[provider_of(api)]

    @staticmethod
    def credentials(api: str, headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The headers of a client request in format ``api`` that a call the proxy makes of
        its own to the same provider carries (names lower-case, as ASGI gives them)."""
        kept = CREDENTIALS[provider_of(api)]
        return [(k, v) for k, v in headers if k.lower() in kept]

    @property
    def openai(self) -> Upstream:
        return self._upstreams["openai"]

    @property
    def anthropic(self) -> Upstream:
        return self._upstreams["anthropic"]

    async def start(self) -> None:
        for up in self._upstreams.values():
            await up.start()

    async def close(self) -> None:
        for up in self._upstreams.values():
            await up.close()

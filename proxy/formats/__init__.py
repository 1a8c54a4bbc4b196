"""Wire formats, read into the pipeline's message model and written back changing only what the
pipeline changed.

A :class:`Format` turns a request body into a :class:`Parsed` request: the client's own items
(what the archive keeps, exactly as sent), the pipeline's messages (chat-completions dicts: the
one model every stage works on) and which items each message stands for. After the pipeline it
writes the forwarded body from the client's bytes, re-serialising only the items behind changed
messages (:mod:`.json`). Formats: :mod:`.chat` (chat completions).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.model import Message

__all__ = ["Format", "Parsed", "Tap"]


@dataclass(frozen=True, slots=True)
class Parsed:
    """A request body read by its format."""

    body: dict[str, Any]
    model: str
    items: list[Any]  # the conversation as the client sent it: what is archived and hashed
    history: list[Message]  # the pipeline's model of it
    # For each history message, the items it stands for (``range(i, i + 1)`` when 1:1).
    spans: Sequence[range] = ()
    tools: Sequence[Mapping[str, Any]] | None = None  # tool schemas in chat shape, for counting
    stream: bool = False
    # The history lives upstream (a stored previous response): only the new items are here,
    # so they are slimmed but never compacted.
    continued: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)  # format-private

    def message_chains(self, item_chains: Sequence[str]) -> list[str]:
        """The chain of each history message: the chain of the last item it stands for (a
        summary replacing messages up to ``i`` is found by ``chains[i]``)."""
        if not self.spans:
            return list(item_chains)
        if len(item_chains) != len(self.items):
            return []
        return [item_chains[span[-1]] for span in self.spans]


class Tap(Protocol):
    """Watches an answer's bytes as they are relayed, to archive it and bill it."""

    def stream(self, chunk: bytes) -> None: ...

    def whole(self, body: bytes) -> None: ...

    def answer(self) -> dict[str, Any] | list[Any] | None: ...

    def error_event(self, message: str, code: str) -> bytes:
        """The event a stream the upstream broke off ends with, in the format's own shape
        (chat: an OpenAI error envelope as data; Messages: ``event: error``; Responses: an
        ``error`` event numbered after the last one relayed)."""
        ...

    def complete(self) -> bool:
        """Whether the answer came whole: a body, or a stream that reached its format's end
        (chat's ``[DONE]``, Messages' ``message_stop``, a Responses terminal event). A broken
        stream's answer is archived marked incomplete."""
        ...

    def usage(self) -> Any:
        """The answer's ``usage`` object as the provider sent it (None when none was seen):
        :func:`proxy.ledger.usage.parse_usage` reads it in the format's name."""
        ...


class Format(Protocol):
    name: str  # "chat", ...
    subpath: str  # the upstream endpoint below the base URL

    def tap(self) -> Tap: ...

    def parse(self, raw: bytes, max_items: int) -> Parsed: ...

    def write(
        self, raw: bytes, parsed: Parsed, messages: Sequence[Message] | None, *,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> bytes: ...

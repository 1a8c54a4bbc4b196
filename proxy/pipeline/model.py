"""The pipeline's message model and the values its stages exchange.

A :data:`Message` is a chat-completions message dict, whatever wire format the request came in
(a format adapter, :mod:`proxy.formats`, reads a body into this model and writes back only what
changed). Stages never mutate a message: a changed one is a new dict, an unchanged one is the
very same object, which is how a format writer tells them apart.

A stage is a pure function ``(messages, view) -> StageOutcome``: no network, no disk. What must
happen in the world for its output to be valid (an original saved before a cut that points at it
is forwarded) is returned as effects (:class:`FileWrite`), carried out by the pipeline's runner
through the services (:mod:`proxy.pipeline.runner`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

if TYPE_CHECKING:
    from proxy.pipeline.work import Work
    from proxy.session import Identity
    from proxy.writes import Writes

__all__ = [
    "NATIVE",
    "OPAQUE_TOKENS",
    "WIRE",
    "FileWrite",
    "Message",
    "PipelineResult",
    "RequestView",
    "Stage",
    "StageOutcome",
    "result_text",
]

Message = dict[str, Any]

# Keys a format reader sets on a message standing for provider-native state (proxy.pipeline.native):
# NATIVE names it ("compaction": it holds a provider's compaction item); OPAQUE_TOKENS is what its
# opaque content (encrypted, not in the message's text) counts as (proxy.pipeline.token_rules).
NATIVE = "native"
OPAQUE_TOKENS = "opaque_tokens"
# A message the pipeline put in that stands for wire items it has the exact bytes of (the
# proxy's own read rounds, put back by proxy.pipeline.replay): the JSON text of each item, in
# order. The format writes those bytes as they are; counting ignores the key (the message's
# model fields are counted as for any message).
WIRE: Final = "ctxproxy_wire"


@dataclass(frozen=True, slots=True)
class RequestView:
    """What a stage may read about the request besides its messages."""

    model: str
    body: Mapping[str, Any]  # as the client sent it
    identity: Identity
    chains: Sequence[str] = ()  # chain hash per original message (see store.chains)
    headers: Sequence[tuple[bytes, bytes]] = ()  # the client's, for calls made on its behalf
    writes: Writes | None = None  # what the request may write (None: everything, now)
    history: Sequence[Message] | None = None  # the originals in the model; None: body messages
    tools: Sequence[Mapping[str, Any]] | None = None  # tool schemas (chat shape), for counting
    large: bool = False  # big enough that new cutting or tokenizing moves off the event loop
    api: str = "chat"  # the wire format (proxy.formats): "chat", "responses", "messages"
    work: Work | None = None  # the request's work count, budget and cancellation (pipeline.work)

    @property
    def messages(self) -> Sequence[Message]:
        """The client's original messages, in the pipeline's model."""
        if self.history is not None:
            return self.history
        found = self.body.get("messages")
        return found if isinstance(found, list) else ()

    @property
    def tool_schemas(self) -> Sequence[Mapping[str, Any]] | None:
        if self.tools is not None:
            return self.tools
        found = self.body.get("tools")
        return found if isinstance(found, list) else None

    @property
    def reserved_output(self) -> int:
        """The output tokens the request reserves (``max_completion_tokens``/``max_tokens``)."""
        for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
            value = self.body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return 0


@dataclass(frozen=True, slots=True)
class FileWrite:
    """An original that must be on disk before the cut of message ``index`` is forwarded."""

    index: int
    rid: str
    text: str


@dataclass(frozen=True, slots=True)
class StageOutcome:
    messages: list[Message]
    changed: bool
    stats: Mapping[str, int] = field(default_factory=dict)
    files: tuple[FileWrite, ...] = ()  # effects: originals to keep (see FileWrite)


class Stage(Protocol):
    name: str

    def __call__(self, messages: list[Message], request: RequestView) -> StageOutcome: ...


@dataclass(frozen=True, slots=True)
class PipelineResult:
    messages: list[Message]
    changed: bool
    stats: Mapping[str, int]
    failed: tuple[str, ...]
    elapsed_ms: float
    # The epoch the request was forwarded in (proxy.pipeline.epoch): the summary in use and
    # the history index its rewrites began at ("lr" under the last resort); "" before any.
    epoch: str = ""
    # The history range the summary in use replaced (None: no summary).
    evicted: range | None = None


def result_text(content: Any) -> str | None:
    """A tool result's text as offload cuts and saves it (text parts joined by newlines); None
    when it has none or a part is not text-typed text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                if not isinstance(part.get("text"), str):
                    return None
                texts.append(part["text"])
        return "\n".join(texts) if texts else None
    return None

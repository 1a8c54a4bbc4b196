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

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

if TYPE_CHECKING:
    from proxy.session import Identity
    from proxy.work import Work
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

# Keys a format reader sets on a message standing for provider-native state (proxy.history.native):
# NATIVE names it ("compaction": it holds a provider's compaction item); OPAQUE_TOKENS is what its
# opaque content (encrypted, not in the message's text) counts as (proxy.tokens.rules).
NATIVE = "native"
OPAQUE_TOKENS = "opaque_tokens"
# A message the pipeline put in that stands for wire items it has the exact bytes of (the
# proxy's own read rounds, put back by proxy.retrieval.replay): the JSON text of each item, in
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
    # The epoch the request was forwarded in (proxy.history.epoch): the summary in use and
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

# --- accessors: what a message holds, whatever shape its parts take -----------------------

_TEXT_PARTS: Final = frozenset({"text", "input_text", "output_text"})
_IMAGE_PARTS: Final = frozenset({"image_url", "input_image", "image"})


def content_text(content: object, *, placeholders: bool = True) -> str:
    """The text of a message ``content`` (a string or a list of parts).

    With ``placeholders`` non-text parts become ``[image]``, ``[audio]``, ``[file: name]`` or
    ``[<type>]``; without, only text (and refusal) parts count. Parts are joined by newlines.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        return str(content) if placeholders else ""
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind in _TEXT_PARTS or (kind is None and isinstance(part.get("text"), str)):
            value = part.get("text")
            if isinstance(value, str):
                texts.append(value)
        elif kind == "refusal":
            value = part.get("refusal")
            if isinstance(value, str):
                texts.append(value)
        elif not placeholders:
            continue
        elif kind in _IMAGE_PARTS:
            texts.append("[image]")
        elif kind in ("input_audio", "audio"):
            texts.append("[audio]")
        elif kind == "file":
            file = part.get("file")
            name = file.get("filename") if isinstance(file, Mapping) else None
            texts.append(f"[file: {name}]" if isinstance(name, str) and name else "[file]")
        else:
            texts.append(f"[{kind}]")
    return "\n".join(texts)


def _args_text(args: object) -> str:
    if args is None:
        return ""
    if isinstance(args, str):
        return args
    try:
        return json.dumps(args, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(args)


def tool_calls(msg: Message) -> list[tuple[str, str, str]]:
    """``(id, name, arguments)`` of an assistant message's calls: ``tool_calls`` entries
    (function or custom) and a legacy ``function_call`` (id ``""``)."""
    out: list[tuple[str, str, str]] = []
    calls = msg.get("tool_calls")
    if isinstance(calls, Sequence) and not isinstance(calls, str):
        for call in calls:
            if not isinstance(call, Mapping):
                continue
            call_id = call.get("id")
            fn = call.get("function")
            if not isinstance(fn, Mapping):
                fn = call.get("custom")
            if not isinstance(fn, Mapping):
                fn = {}
            name = fn.get("name")
            args = fn.get("arguments", fn.get("input"))
            out.append((
                call_id if isinstance(call_id, str) else "",
                name if isinstance(name, str) and name else "?",
                _args_text(args),
            ))
    legacy = msg.get("function_call")
    if isinstance(legacy, Mapping):
        name = legacy.get("name")
        out.append(("", name if isinstance(name, str) and name else "?",
                    _args_text(legacy.get("arguments"))))
    return out


def normalise_newlines(text: str) -> str:
    """``text`` with CRLF and lone CR line ends as LF."""
    return text.replace("\r\n", "\n").replace("\r", "\n")

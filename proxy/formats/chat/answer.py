"""Assemble a streamed chat completion (SSE ``chat.completion.chunk`` events) into one message.

The proxy relays an upstream stream to the client byte for byte; this module watches the same
bytes on the side so that the answer can be archived as one assistant message and its tool calls
inspected. It is pure (no I/O), cheap, and never raises from ``feed``: a broken stream must never
break the relay.

Framing is :class:`proxy.upstream.sse.SSEDecoder`'s (the WHATWG rules: CRLF, LF or CR line
ends, also split across chunks; comments; ``data`` lines joined with ``"\\n"``; a leading BOM
dropped; an event not closed by a blank line when the stream ends is never dispatched, and
``buffered`` tells how many such bytes are pending; an event longer than ``max_event_bytes``,
default 16 MiB, is dropped and counted in ``malformed``). Of the fields, only ``event: error``
matters here. Data is decoded per event, so chunks may split a UTF-8 character anywhere; invalid
UTF-8 becomes U+FFFD, as an SSE client decodes it.

Events. ``data: [DONE]`` sets ``done``. Any other data is parsed as JSON: a non-object or
unparseable payload is counted in ``malformed`` and skipped. An error (``event: error``, or an
object with a non-null top-level ``"error"``) is recorded in ``error`` (the first one wins: it is
the cause, later ones tend to echo it) and not accumulated. An event with empty data (``data:``)
is a keep-alive some providers send; it is counted in ``events`` and otherwise ignored.

Accumulation, per choice ``index``: ``role``; ``content``, ``refusal``, ``reasoning_content``
and ``reasoning`` (the two names providers use for thinking text) concatenated; ``tool_calls``
keyed by their ``index`` (``id``, ``type`` and ``function.name`` taken from the first delta that
carries them, ``function.arguments`` concatenated; a delta without ``index`` joins the call with
its ``id``, else the latest call); the legacy ``function_call`` likewise; the last non-null
``finish_reason``; ``logprobs`` lists concatenated. Top level: the last non-null ``usage`` (the
``include_usage`` chunk carries it with ``choices: []``); the first ``id``, ``model``,
``created``, ``system_fingerprint``, ``service_tier`` (every chunk repeats them; they are read
until a chunk has brought both ``id`` and ``model``). Values of the wrong JSON type are ignored.

The message (``message()``), as the non-stream answer would carry it: ``role`` (``"assistant"``
unless the stream said otherwise) and ``content``: the text, or ``None`` when no text arrived
and the message has tool calls, a function call or a refusal, else ``""`` if any (empty) content
delta arrived and ``None`` if none did; then ``refusal``, ``reasoning_content``, ``reasoning``
only when non-empty, ``tool_calls`` (in index order, each ``{"id", "type", "function": {"name",
"arguments"}}``) and ``function_call`` only when present. It may be called at any time, also
mid-stream, and returns a fresh dict each time.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import orjson

from proxy.formats.chat.choices import (
    Choice,
    apply_delta,
    apply_logprobs,
    build_message,
    message_from_completion,
)
from proxy.sse import DEFAULT_MAX_EVENT_BYTES, SSEDecoder

__all__ = ["DEFAULT_MAX_EVENT_BYTES", "StreamAssembler", "message_from_completion"]

log = logging.getLogger("proxy.formats.chat.answer")

_DONE: Final = b"[DONE]"
_META: Final = (
    ("id", str), ("model", str), ("created", int), ("system_fingerprint", str), ("service_tier", str)
)


class StreamAssembler:
    """Feed it the raw bytes of an SSE chat-completion stream; read the assembled answer."""

    __slots__ = (
        "done",
        "error",
        "events",
        "usage",
        "id",
        "model",
        "created",
        "system_fingerprint",
        "service_tier",
        "_malformed",
        "_sse",
        "_choices",
        "_need_meta",
    )

    def __init__(self, *, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.done = False
        self.error: Any = None
        self.events = 0  # dispatched events that had data, [DONE] and malformed ones included
        self._malformed = 0
        self.usage: dict[str, Any] | None = None
        self.id: str | None = None
        self.model: str | None = None
        self.created: int | None = None
        self.system_fingerprint: str | None = None
        self.service_tier: str | None = None
        self._sse = SSEDecoder(max_event_bytes=max_event_bytes)
        self._choices: dict[int, Choice] = {}
        self._need_meta = True

    # -- events ----------------------------------------------------------------------------

    @property
    def malformed(self) -> int:
        """Events dropped: oversized (the decoder's count), unparseable or not a JSON object,
        plus chunks that made ``feed`` fail."""
        return self._malformed + self._sse.malformed

    @property
    def buffered(self) -> int:
        """Bytes received but not yet dispatched (an event the stream has not closed yet)."""
        return self._sse.buffered

    def feed(self, chunk: bytes | bytearray) -> None:
        """Take the next bytes of the stream, exactly as they arrived. Never raises: an internal
        error (a bug, or a chunk of the wrong type) is logged and counted in ``malformed``."""
        try:
            # _feed, inlined: one Python call less per chunk, a fair share of a tiny chunk's cost.
            for event in self._sse.feed(chunk):
                self._event(event.data, event.event == "error")
        except Exception:
            self._malformed += 1
            log.warning("stream assembler failed on a chunk", exc_info=True)

    def _feed(self, chunk: bytes | bytearray) -> None:
        """``feed`` without its safety net, so that a bug surfaces (in tests)."""
        for event in self._sse.feed(chunk):
            self._event(event.data, event.event == "error")

    def _event(self, data: bytes, is_error: bool) -> None:
        """One dispatched event's data; ``is_error``: it came as ``event: error``."""
        self.events += 1
        if not data:
            return
        if data[0] == 0x5B and data.strip() == _DONE:  # "[": only [DONE] starts so
            self.done = True
            return
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            obj = _loads_lossy(data)
            if obj is None:
                if is_error:
                    self._record_error(data.decode("utf-8", "replace"))
                else:
                    self._malformed += 1
                return
        if type(obj) is not dict:
            if is_error:
                self._record_error(obj)
            else:
                self._malformed += 1
            return
        err = obj.get("error")
        if is_error or err is not None:
            self._record_error(obj if err is None else err)
            return
        self._chunk(obj)

    def _record_error(self, err: Any) -> None:
        if self.error is None:
            self.error = err

    # -- accumulation ----------------------------------------------------------------------

    def _chunk(self, obj: dict[str, Any]) -> None:
        usage = obj.get("usage")
        if type(usage) is dict:
            self.usage = usage
        if self._need_meta:
            self._take_meta(obj)
        choices = obj.get("choices")
        if type(choices) is not list:
            return
        for c in choices:
            if type(c) is not dict:
                continue
            idx = c.get("index", 0)
            if type(idx) is not int:
                continue  # checked first: a list or dict index is not even hashable
            st = self._choices.get(idx)
            if st is None:
                st = self._choices[idx] = Choice()
            delta = c.get("delta")
            if type(delta) is dict and delta:
                content = delta.get("content")
                if len(delta) == 1 and type(content) is str:
                    st.content.append(content)  # the common case: one text piece
                    st.saw_content = True
                else:
                    apply_delta(st, delta)
            fr = c.get("finish_reason")
            if type(fr) is str:
                st.finish_reason = fr
            lp = c.get("logprobs")
            if type(lp) is dict:
                apply_logprobs(st, lp)

    def _take_meta(self, obj: dict[str, Any]) -> None:
        # First value wins: every chunk repeats the same ones, so they are read only until a
        # chunk has brought the id and the model.
        for name, kind in _META:
            if getattr(self, name) is None:
                v = obj.get(name)
                if type(v) is kind:
                    setattr(self, name, v)
        self._need_meta = self.id is None or self.model is None

    # -- results ---------------------------------------------------------------------------

    def indices(self) -> list[int]:
        """The choice indices seen so far, ascending."""
        return sorted(self._choices)

    def finish_reason(self, index: int = 0) -> str | None:
        st = self._choices.get(index)
        return None if st is None else st.finish_reason

    def message(self, index: int = 0) -> dict[str, Any] | None:
        """The assistant message of choice ``index`` as assembled so far; None if never seen."""
        st = self._choices.get(index)
        return None if st is None else build_message(st)

    def completion(self) -> dict[str, Any]:
        """The ``chat.completion`` object the non-stream request would have returned."""
        choices: list[dict[str, Any]] = []
        for idx in sorted(self._choices):
            st = self._choices[idx]
            logprobs: dict[str, Any] | None = None
            if st.has_lp:
                logprobs = {
                    "content": list(st.lp_content) or None,
                    "refusal": list(st.lp_refusal) or None,
                }
            choices.append(
                {
                    "index": idx,
                    "message": build_message(st),
                    "logprobs": logprobs,
                    "finish_reason": st.finish_reason,
                }
            )
        out: dict[str, Any] = {
            "id": self.id or "",
            "object": "chat.completion",
            "created": self.created if self.created is not None else 0,
            "model": self.model or "",
            "choices": choices,
            "usage": self.usage,
        }
        if self.system_fingerprint is not None:
            out["system_fingerprint"] = self.system_fingerprint
        if self.service_tier is not None:
            out["service_tier"] = self.service_tier
        return out


def _loads_lossy(data: bytes | bytearray) -> Any:
    """Parse again after replacing invalid UTF-8, as an SSE client decodes the stream; None if
    the bytes were valid UTF-8 anyway (then the JSON itself is broken) or still do not parse."""
    try:
        data.decode("utf-8")
        return None
    except UnicodeDecodeError:
        pass
    try:
        return orjson.loads(data.decode("utf-8", "replace"))
    except orjson.JSONDecodeError:
        return None

"""A Responses answer as the archive keeps it: its output items, from the JSON body or from the
SSE stream (``response.output_item.done`` events, or ``response.completed`` which carries them
all); and its ``usage``, from the body or the terminal event (``response.completed``, or
``response.incomplete`` / ``response.failed``, which carry it too when the model ran).

A stream that breaks before its terminal event still leaves what the client saw: the items done
so far, and each item begun but not done as it stood (its text and argument deltas applied),
``"status": "incomplete"``; the archive marks such an answer incomplete."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.sse import SSEDecoder

__all__ = ["ResponsesTap"]

# The events whose response carries usage; any other is not read ("": an unnamed event).
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
_TEXT_DELTA = "response.output_text.delta"
_ARGS_DELTA = "response.function_call_arguments.delta"
_PART_ADDED = "response.content_part.added"
_WATCHED = frozenset({"response.output_item.done", "response.output_item.added", _TEXT_DELTA,
                      _ARGS_DELTA, _PART_ADDED, "", *_TERMINAL})


class ResponsesTap:
    """Sees the answer's bytes as they pass to the client."""

    __slots__ = ("_decoder", "_done", "_ended", "_events", "_items", "_partial", "_usage")

    def __init__(self) -> None:
        self._decoder: SSEDecoder | None = None
        self._items: dict[int, Any] = {}
        self._partial: dict[int, dict[str, Any]] = {}  # begun, not done: as streamed so far
        self._done: list[Any] | None = None
        self._usage: Any = None
        self._ended = False  # a terminal event, or a whole body
        self._events = 0  # events relayed: the next one's sequence_number

    def stream(self, chunk: bytes) -> None:
        if self._decoder is None:
            self._decoder = SSEDecoder()
        for event in self._decoder.feed(chunk):
            self._events += 1
            if event.event not in _WATCHED:
                continue
            try:
                data = orjson.loads(event.data)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(data, dict):
                continue
            kind = data.get("type")
            index = data.get("output_index")
            at = index if isinstance(index, int) and not isinstance(index, bool) else None
            if kind == "response.output_item.done" and isinstance(data.get("item"), dict):
                self._items[at if at is not None else len(self._items)] = data["item"]
                if at is not None:
                    self._partial.pop(at, None)
            elif kind == "response.output_item.added" and isinstance(data.get("item"), dict):
                if at is not None:
                    self._partial[at] = dict(data["item"])
            elif kind in (_TEXT_DELTA, _ARGS_DELTA, _PART_ADDED) and at is not None:
                if at in self._partial:
                    self._delta(self._partial[at], kind, data)
            elif kind in _TERMINAL:
                self._ended = True
                if kind == "response.completed":
                    self._completed(data.get("response"))
                elif isinstance(data.get("response"), dict):
                    self._usage_of(data["response"])

    @staticmethod
    def _delta(item: dict[str, Any], kind: Any, data: dict[str, Any]) -> None:
        if kind == _ARGS_DELTA:
            piece = data.get("delta")
            if isinstance(piece, str):
                item["arguments"] = str(item.get("arguments") or "") + piece
            return
        content = item.get("content")
        content = list(content) if isinstance(content, list) else []
        part = data.get("content_index")
        if not isinstance(part, int) or isinstance(part, bool) or part < 0 or part > 1024:
            return
        while len(content) <= part:
            content.append({"type": "output_text", "text": ""})
        if kind == _PART_ADDED:
            if isinstance(data.get("part"), dict):
                content[part] = dict(data["part"])
        else:
            piece = data.get("delta")
            if isinstance(piece, str) and isinstance(content[part], dict):
                content[part] = {**content[part],
                                 "text": str(content[part].get("text") or "") + piece}
        item["content"] = content

    def whole(self, body: bytes) -> None:
        self._ended = True
        try:
            self._completed(orjson.loads(body))
        except orjson.JSONDecodeError:
            return

    def _completed(self, response: Any) -> None:
        if not isinstance(response, dict):
            return
        self._usage_of(response)
        if isinstance(response.get("output"), list):
            self._done = [i for i in response["output"] if isinstance(i, dict)]

    def _usage_of(self, response: dict[str, Any]) -> None:
        if response.get("usage") is not None:
            self._usage = response["usage"]

    def error_event(self, message: str, code: str) -> bytes:
        """The Responses API's ``error`` event, numbered after the last event relayed (the
        API numbers every event of a stream from 0)."""
        data = {"type": "error", "code": code, "message": message, "param": None,
                "sequence_number": self._events}
        return b"event: error\ndata: " + orjson.dumps(data) + b"\n\n"

    def complete(self) -> bool:
        return self._ended

    def answer(self) -> list[Any] | None:
        """The output items, in order (None when nothing was seen); of a broken stream, the
        items begun but not done too, marked incomplete."""
        if self._done is not None:
            return self._done
        items = dict(self._items)
        for k, item in self._partial.items():
            items.setdefault(k, {**item, "status": "incomplete"})
        if items:
            return [items[k] for k in sorted(items)]
        return None

    def usage(self) -> Any:
        """The response's ``usage`` as it came (None when none was seen)."""
        return self._usage

"""A Responses answer as the archive keeps it: its output items, from the JSON body or from the
SSE stream (``response.output_item.done`` events, or ``response.completed`` which carries them
all); and its ``usage``, from the body or the terminal event (``response.completed``, or
``response.incomplete`` / ``response.failed``, which carry it too when the model ran)."""

from __future__ import annotations

from typing import Any

import orjson

from ..upstream.sse import SSEDecoder

__all__ = ["ResponsesTap"]

# The events whose response carries usage; any other is not read ("": an unnamed event).
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
_WATCHED = frozenset({"response.output_item.done", "", *_TERMINAL})


class ResponsesTap:
    """Sees the answer's bytes as they pass to the client."""

    __slots__ = ("_decoder", "_done", "_items", "_usage")

    def __init__(self) -> None:
        self._decoder: SSEDecoder | None = None
        self._items: dict[int, Any] = {}
        self._done: list[Any] | None = None
        self._usage: Any = None

    def stream(self, chunk: bytes) -> None:
        if self._decoder is None:
            self._decoder = SSEDecoder()
        for event in self._decoder.feed(chunk):
            if event.event not in _WATCHED:
                continue
            try:
                data = orjson.loads(event.data)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(data, dict):
                continue
            kind = data.get("type")
            if kind == "response.output_item.done" and isinstance(data.get("item"), dict):
                index = data.get("output_index")
                self._items[index if isinstance(index, int) else len(self._items)] = data["item"]
            elif kind == "response.completed":
                self._completed(data.get("response"))
            elif kind in _TERMINAL and isinstance(data.get("response"), dict):
                self._usage_of(data["response"])

    def whole(self, body: bytes) -> None:
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

    def answer(self) -> list[Any] | None:
        """The output items, in order (None when nothing was seen)."""
        if self._done is not None:
            return self._done
        if self._items:
            return [self._items[k] for k in sorted(self._items)]
        return None

    def usage(self) -> Any:
        """The response's ``usage`` as it came (None when none was seen)."""
        return self._usage

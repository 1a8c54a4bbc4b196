"""A Responses answer as the archive keeps it: its output items, from the JSON body or from the
SSE stream (``response.output_item.done`` events, or ``response.completed`` which carries them
all)."""

from __future__ import annotations

from typing import Any

import orjson

from ..upstream.sse import SSEDecoder

__all__ = ["ResponsesTap"]


class ResponsesTap:
    """Sees the answer's bytes as they pass to the client."""

    __slots__ = ("_decoder", "_done", "_items")

    def __init__(self) -> None:
        self._decoder: SSEDecoder | None = None
        self._items: dict[int, Any] = {}
        self._done: list[Any] | None = None

    def stream(self, chunk: bytes) -> None:
        if self._decoder is None:
            self._decoder = SSEDecoder()
        for event in self._decoder.feed(chunk):
            if event.event not in ("response.output_item.done", "response.completed", ""):
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

    def whole(self, body: bytes) -> None:
        try:
            self._completed(orjson.loads(body))
        except orjson.JSONDecodeError:
            return

    def _completed(self, response: Any) -> None:
        if isinstance(response, dict) and isinstance(response.get("output"), list):
            self._done = [i for i in response["output"] if isinstance(i, dict)]

    def answer(self) -> list[Any] | None:
        """The output items, in order (None when nothing was seen)."""
        if self._done is not None:
            return self._done
        if self._items:
            return [self._items[k] for k in sorted(self._items)]
        return None

"""A Messages answer as the archive keeps it: the assistant message the client will send back
(``{"role": "assistant", "content": [blocks]}``), from the JSON body or assembled from the SSE
stream: text, ``tool_use`` input from its JSON fragments, thinking with its signature,
redacted thinking and server-tool blocks as they started. Its ``usage``: the body's, or
``message_start``'s merged with ``message_delta``'s (whose counts are cumulative, and which
alone carries ``iterations`` after server-side compaction: its fields win)."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.sse import SSEDecoder

__all__ = ["MessagesAssembler", "MessagesTap"]

# delta type -> (the block field it extends, the delta field holding the piece)
_DELTAS = {
    "text_delta": ("text", "text"),
    "thinking_delta": ("thinking", "thinking"),
    "signature_delta": ("signature", "signature"),
}


class MessagesAssembler:
    """Folds a stream's events into the message it streams."""

    __slots__ = ("blocks", "json", "message", "stopped")

    def __init__(self) -> None:
        self.message: dict[str, Any] | None = None
        self.blocks: dict[int, dict[str, Any]] = {}
        self.json: dict[int, str] = {}  # tool inputs, as their fragments arrive
        self.stopped = False  # message_stop came: the stream reached its end

    def feed(self, data: dict[str, Any]) -> None:
        kind = data.get("type")
        index = data.get("index")
        if kind == "message_stop":
            self.stopped = True
        elif kind == "message_start" and isinstance(data.get("message"), dict):
            self.message = dict(data["message"])
        elif kind == "content_block_start" and isinstance(index, int):
            block = data.get("content_block")
            if isinstance(block, dict):
                self.blocks[index] = dict(block)
        elif kind == "content_block_delta" and isinstance(index, int) and index in self.blocks:
            self._delta(self.blocks[index], index, data.get("delta"))
        elif kind == "content_block_stop" and isinstance(index, int) and index in self.json:
            fragments = self.json.pop(index)
            try:
                self.blocks[index]["input"] = orjson.loads(fragments) if fragments else {}
            except orjson.JSONDecodeError:
                self.blocks[index]["input"] = fragments  # as it came: the archive keeps it
        elif kind == "message_delta" and self.message is not None:
            delta = data.get("delta")
            if isinstance(delta, dict):
                self.message.update(delta)
            if isinstance(data.get("usage"), dict):
                # Cumulative counts: the delta's win, but a null there means "not reported"
                # (as the anthropic SDK reads it), not zero.
                given = {k: v for k, v in data["usage"].items() if v is not None}
                self.message["usage"] = {**(self.message.get("usage") or {}), **given}

    def _delta(self, block: dict[str, Any], index: int, delta: Any) -> None:
        if not isinstance(delta, dict):
            return
        kind = delta.get("type")
        if kind == "input_json_delta":
            piece = delta.get("partial_json")
            self.json[index] = self.json.get(index, "") + (piece if isinstance(piece, str) else "")
        elif kind in _DELTAS:
            name, key = _DELTAS[kind]
            piece = delta.get(key)
            if isinstance(piece, str):
                block[name] = str(block.get(name) or "") + piece
        elif kind == "citations_delta" and isinstance(delta.get("citation"), dict):
            block.setdefault("citations", []).append(delta["citation"])

    def content(self) -> list[dict[str, Any]]:
        return [self.blocks[i] for i in sorted(self.blocks)]

    def whole(self) -> dict[str, Any] | None:
        """The message object as the non-stream answer carries it."""
        if self.message is None:
            return None
        return {**self.message, "content": self.content()}


class MessagesTap:
    """Sees the answer's bytes as they pass to the client."""

    __slots__ = ("_assembler", "_body", "_decoder")

    def __init__(self) -> None:
        self._decoder: SSEDecoder | None = None
        self._assembler: MessagesAssembler | None = None
        self._body: bytes | None = None

    def stream(self, chunk: bytes) -> None:
        if self._decoder is None:
            self._decoder = SSEDecoder()
            self._assembler = MessagesAssembler()
        assert self._assembler is not None
        for event in self._decoder.feed(chunk):
            try:
                data = orjson.loads(event.data)
            except orjson.JSONDecodeError:
                continue
            if isinstance(data, dict):
                self._assembler.feed(data)

    def whole(self, body: bytes) -> None:
        self._body = body

    def usage(self) -> Any:
        """The message's ``usage`` as the provider reported it (None when none was seen)."""
        if self._assembler is not None:
            message = self._assembler.message
            return message.get("usage") if message is not None else None
        data = self._data()
        return data.get("usage") if data is not None else None

    def _data(self) -> dict[str, Any] | None:
        if self._body is None:
            return None
        try:
            data = orjson.loads(self._body)
        except orjson.JSONDecodeError:
            return None
        return data if isinstance(data, dict) else None

    def error_event(self, message: str, code: str) -> bytes:
        """As Anthropic ends a stream with an error."""
        data = orjson.dumps({"type": "error", "error": {"type": "api_error", "message": message}})
        return b"event: error\ndata: " + data + b"\n\n"

    def complete(self) -> bool:
        if self._assembler is not None:
            return self._assembler.stopped
        return self._body is not None

    def answer(self) -> dict[str, Any] | None:
        """The assistant message (None when nothing was seen)."""
        if self._assembler is not None:
            if self._assembler.message is None and not self._assembler.blocks:
                return None
            return {"role": "assistant", "content": self._assembler.content()}
        data = self._data()
        if data is None or not isinstance(data.get("content"), list):
            return None
        return {"role": "assistant", "content": data["content"]}

"""Server-sent events: the one incremental decoder for every SSE stream the proxy reads.

``SSEDecoder.feed`` takes the bytes of a ``text/event-stream`` body exactly as they arrive, in
chunks cut anywhere, and returns the events those bytes completed. It is pure (no I/O).

Framing follows WHATWG HTML, "interpreting an event stream":

* one leading UTF-8 BOM is dropped;
* lines end in ``\\r\\n``, ``\\n`` or ``\\r``; a ``\\r`` ending one chunk and a ``\\n`` opening the
  next are one line end;
* a line starting with ``:`` is a comment (the keep-alives of most providers);
* ``field:value`` has one space after the colon removed, if there is one; a line without a colon
  is a field with an empty value;
* ``data`` appends its value to the event's data, the lines joined with ``\\n``; ``event`` sets
  the event's type; ``id`` sets the last event ID unless the value holds a NUL (it persists from
  event to event, as the spec's ``lastEventId`` does); ``retry`` sets the reconnection time if
  the value is ASCII digits; other fields are ignored;
* a blank line dispatches the event, unless no ``data`` line came (a lone ``data:`` is an event
  with empty data, which some providers send as a keep-alive);
* an event not closed by a blank line when the stream ends is never dispatched (nor would a
  browser or the OpenAI SDK show it); ``buffered`` tells how many bytes wait for that line.

Beyond the spec: an event longer than ``max_event_bytes`` (counted with line ends normalised
to ``\\n``, its closing blank line excluded) is dropped whole, however it was chunked, and counted
in ``malformed``; this bounds memory when an upstream never sends a blank line.

``Event.data`` stays bytes, undecoded: callers hand it to orjson, which parses UTF-8 bytes;
decode it with ``errors="replace"`` to get the text a browser would show. ``event`` is ``""``
when the event named no type (the spec's default, ``"message"``, is the caller's to apply) and
``id`` is ``None`` until the stream sets one.
"""

from __future__ import annotations

from typing import Final, NamedTuple

__all__ = ["DEFAULT_MAX_EVENT_BYTES", "Event", "SSEDecoder"]

# One chat-completion event is one delta (a few hundred bytes); a provider that sends a whole
# tool call in one event stays far below this.
DEFAULT_MAX_EVENT_BYTES: Final = 16 * 1024 * 1024

_BOM: Final = b"\xef\xbb\xbf"
# The generated NamedTuple constructor is a Python-level lambda; the hot path builds the tuple
# directly, at half the cost.
_tuple_new: Final = tuple.__new__


class Event(NamedTuple):
    """One dispatched event. A NamedTuple rather than a frozen dataclass: it is built once per
    streamed token on the hot path, and a frozen dataclass costs four times as much to create."""

    data: bytes
    """The ``data`` lines joined with ``\\n`` (no trailing newline)."""
    event: str = ""
    """The ``event`` field, ``""`` when absent."""
    id: str | None = None
    """The last event ID at dispatch: set by this event or an earlier one; ``None`` if never set."""
    retry: int | None = None
    """The reconnection time (ms) this event's own ``retry`` field set, else ``None``."""


class SSEDecoder:
    """Feed it the raw bytes of an event stream; get back the events each chunk completed."""

    __slots__ = (
        "malformed",
        "last_event_id",
        "retry",
        "_limit",
        "_cap",
        "_buf",
        "_scan",
        "_skip_lf",
        "_bom_checked",
        "_skipping",
        "_clean",
    )

    def __init__(self, *, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.malformed = 0  # oversized events dropped
        self.last_event_id: str | None = None
        self.retry: int | None = None  # the latest valid ``retry``, whether or not dispatched
        self._limit = max(int(max_event_bytes), 1)
        # +1: the last buffered byte may be the first \n of the blank line that ends a
        # max-sized event.
        self._cap = self._limit + 1
        # Line ends are normalised to \n as the bytes arrive, so an event ends at the first
        # b"\n\n". A bytearray, because appending is amortised O(1) and deleting the consumed
        # front is cheap, so a stream fed one byte at a time stays linear.
        self._buf = bytearray()
        self._scan = 0  # where the next search for b"\n\n" starts (the bytes before hold none)
        self._skip_lf = False  # the previous chunk ended in \r: a leading \n completes that \r\n
        self._bom_checked = False
        self._skipping = False  # dropping the rest of an oversized event up to its blank line
        # Neither a BOM nor the \n of a split \r\n can open the next chunk: a chunk without \r
        # can be appended as it is.
        self._clean = False

    @property
    def max_event_bytes(self) -> int:
        return self._limit

    @property
    def buffered(self) -> int:
        """Bytes received but not dispatched yet: an event the stream has not closed."""
        return len(self._buf)

    def feed(self, chunk: bytes | bytearray) -> list[Event]:
        """Take the next bytes of the stream; return the events they completed, in order."""
        buf = self._buf
        # Membership of an int, not of b"\r": the same memchr, but bytes.__contains__ tries the
        # int form first and pays for a failed conversion on a bytes needle (~8x slower).
        if self._clean and 0x0D not in chunk:
            buf += chunk
            if 0x0A not in chunk:
                # No line end, so no event can end here: the path of a stream fed in tiny
                # chunks, kept to an append and the size check.
                if len(buf) > self._cap:
                    self._overflow()
                return []
        elif not self._append_slow(chunk):
            return []
        if buf[0] == 0x0A and not self._skipping:
            # Blank lines before an event's first line dispatch nothing. Dropped here, whichever
            # chunk brings them, so that they never count towards the event's size.
            del buf[: len(buf) - len(buf.lstrip(b"\n"))]
            if not buf:
                return []
            self._scan = 0
        end = buf.find(b"\n\n", self._scan)
        if end < 0:
            if len(buf) > self._cap:
                self._overflow()
            else:
                # The last byte may pair with a \n at the start of the next chunk.
                self._scan = len(buf) - 1  # never -1: the buffer has at least the new \n
            return []
        # One copy of the buffer, then every event is a slice of it: bytes as callers need,
        # without a bytearray slice per event to copy again.
        text = bytes(buf)
        n = len(text)
        events: list[Event] = []
        limit = self._limit
        pos = 0
        line_end = text.find(0x0A, 0, end)  # of the event's first line
        if line_end < 0:
            line_end = end
        while True:
            if self._skipping:
                self._skipping = False  # the tail of an oversized event ends here
            elif end - pos > limit:
                self.malformed += 1  # too long, even if it came in one piece
            elif line_end == end and text.startswith(b"data: ", pos):
                # Nearly every chat-completion event is one "data: {...}" line: one slice.
                events.append(
                    _tuple_new(Event, (text[pos + 6 : end], "", self.last_event_id, None))
                )
            elif (
                text.startswith(b"event: ", pos)
                and text.startswith(b"data: ", line_end + 1)
                and text.find(0x0A, line_end + 1, end) < 0
            ):
                # The Responses and Messages APIs name every event: "event: x\ndata: {...}".
                kind = text[pos + 7 : line_end].decode("utf-8", "replace")
                events.append(
                    _tuple_new(Event, (text[line_end + 7 : end], kind, self.last_event_id, None))
                )
            else:
                event = self._event(text[pos:end])
                if event is not None:
                    events.append(event)
            pos = end + 2
            # The next event's first line end, by memchr, is most often its last: a search for
            # b"\n\n" itself runs several times slower.
            line_end = text.find(0x0A, pos)
            while line_end == pos:  # a stray blank line between events: dispatches nothing
                pos += 1
                line_end = text.find(0x0A, pos)
            if line_end < 0 or line_end + 1 == n:
                break
            if text[line_end + 1] == 0x0A:
                end = line_end
            else:
                end = text.find(b"\n\n", line_end + 1)
                if end < 0:
                    break
        # The buffer keeps only the pending event: what `buffered` and the size cap measure.
        del buf[:pos]
        if len(buf) > self._cap:
            self._overflow()
        else:
            self._scan = len(buf) - 1 if buf else 0
        return events

    def _append_slow(self, chunk: bytes | bytearray) -> bool:
        """Append ``chunk`` when it holds a ``\\r``, or may open with the ``\\n`` of a split
        ``\\r\\n`` or with the BOM; False when there is nothing new to search."""
        if not chunk:
            return False
        if self._skip_lf:
            self._skip_lf = False
            if chunk[0] == 0x0A:
                chunk = chunk[1:]
                if not chunk:
                    return False
        if 0x0D in chunk:
            # A trailing \r already ends its line (turned into \n right away, so the event is not
            # held back); remember it so that a \n opening the next chunk is not a second line end.
            self._skip_lf = chunk[-1] == 0x0D
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf = self._buf
        buf += chunk
        if not self._bom_checked:
            if len(buf) < 3 and _BOM.startswith(buf):
                return False  # could still become a BOM
            self._bom_checked = True
            if buf.startswith(_BOM):
                del buf[:3]
        self._clean = not self._skip_lf
        return len(buf) > 0  # empty when the chunk was the BOM

    def _overflow(self) -> None:
        # The pending event cannot be dispatched: drop what is buffered and skip the rest of it
        # up to its blank line. The last byte stays: it may be the separator's first \n.
        if not self._skipping:
            self.malformed += 1
            self._skipping = True
        del self._buf[:-1]
        self._scan = 0

    def _event(self, block: bytes) -> Event | None:
        """Interpret the lines of one event (``\\n`` line ends, no blank line inside)."""
        parts: list[bytes] = []
        kind = ""
        retry: int | None = None
        for line in block.split(b"\n"):
            if not line or line[0] == 0x3A:  # ": comment" (a blank line cannot occur here)
                continue
            colon = line.find(b":")
            if colon < 0:
                field, value = line, b""
            else:
                field, value = line[:colon], line[colon + 1 :]
                if value[:1] == b" ":
                    value = value[1:]
            if field == b"data":
                parts.append(value)
            elif field == b"event":
                kind = value.decode("utf-8", "replace")
            elif field == b"id":
                if 0 not in value:
                    self.last_event_id = value.decode("utf-8", "replace")
            elif field == b"retry" and value.isdigit():  # bytes.isdigit: ASCII digits only
                try:
                    retry = self.retry = int(value)
                except ValueError:
                    pass  # more digits than int() parses (sys.get_int_max_str_digits): ignored
        if not parts:
            return None
        data = parts[0] if len(parts) == 1 else b"\n".join(parts)
        return Event(data, kind, self.last_event_id, retry)

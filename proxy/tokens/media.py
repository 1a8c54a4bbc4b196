"""Token estimates for non-text content parts: images by OpenAI's tile rule, audio, files.

Sizes are read from the headers of ``data:`` URLs by decoding only the bytes needed, never by
base64 length.
"""

from __future__ import annotations

import binascii
import math
import re
import struct
from typing import Final

# --- Images (OpenAI vision pricing, tile rule) ------------------------------------------------
IMAGE_LOW_DETAIL: Final = 85
IMAGE_TILE: Final = 170
IMAGE_BASE: Final = 85
IMAGE_MAX_SIDE: Final = 2048
IMAGE_SHORT_SIDE: Final = 768
IMAGE_TILE_SIZE: Final = 512
# Size assumed when it cannot be read cheaply (remote URL, file_id, unknown format):
# 1024x1024 -> 765 tokens at high detail, a typical screenshot-sized cost.
DEFAULT_IMAGE_SIZE: Final = (1024, 1024)

# --- Audio and files (coarse, documented estimates) ------------------------------------------
# OpenAI audio input is about 1 token per 100 ms.
AUDIO_TOKENS_PER_SECOND: Final = 10
# Duration of non-WAV audio is derived from its size at an assumed 128 kbit/s (typical MP3).
AUDIO_ASSUMED_BYTES_PER_SECOND: Final = 16_000
# A PDF page is given to the model as extracted text plus an image of the page: ~765 image tokens
# at default detail plus a few hundred tokens of text.
PDF_TOKENS_PER_PAGE: Final = 1_000
# A PDF whose pages cannot be counted (compressed object streams): one token per 16 bytes.
PDF_BYTES_PER_TOKEN: Final = 16
# Any other inline file is assumed text-like: 4 bytes per token.
FILE_BYTES_PER_TOKEN: Final = 4
# A file referenced only by id (content unknown to the proxy).
FILE_REFERENCE_TOKENS: Final = 1_000

_PDF_PAGE_RE: Final = re.compile(rb"/Type\s*/Page(?![a-zA-Z])")


def image_tokens(width: int | None, height: int | None, detail: str | None = "auto") -> int:
    """OpenAI tile rule.

    ``low`` costs 85. ``high``/``auto`` (auto is counted as high, the worst case): scale down to
    fit 2048x2048, then down so the shortest side is 768, then 170 per 512px tile + 85.
    Unknown dimensions use :data:`DEFAULT_IMAGE_SIZE` (1024x1024 -> 765).
    """
    if (detail or "auto").lower() == "low":
        return IMAGE_LOW_DETAIL
    if not width or not height or width <= 0 or height <= 0:
        width, height = DEFAULT_IMAGE_SIZE
    w, h = float(width), float(height)
    if w > IMAGE_MAX_SIDE or h > IMAGE_MAX_SIDE:
        scale = IMAGE_MAX_SIDE / max(w, h)
        w, h = w * scale, h * scale
    shortest = min(w, h)
    if shortest > IMAGE_SHORT_SIDE:
        scale = IMAGE_SHORT_SIDE / shortest
        w, h = w * scale, h * scale
    # Round before the ceil so float noise (767.9999) cannot add a tile.
    tiles = math.ceil(round(w, 6) / IMAGE_TILE_SIZE) * math.ceil(round(h, 6) / IMAGE_TILE_SIZE)
    return IMAGE_TILE * tiles + IMAGE_BASE


class _Base64Window:
    """Random access to the bytes of a base64 payload, decoding only the requested span.

    Four base64 characters encode three bytes, so byte ``k`` lives in the quartet starting at
    character ``4 * (k // 3)``. Reading a JPEG's segment headers this way skips over EXIF blobs
    without decoding them.
    """

    __slots__ = ("_payload",)

    def __init__(self, payload: str) -> None:
        if any(c in payload for c in "\n\r \t"):
            # Rare (wrapped base64): position arithmetic needs the whitespace removed.
            payload = "".join(payload.split())
        if "-" in payload[:4096] or "_" in payload[:4096]:
            payload = payload.translate(str.maketrans("-_", "+/"))
        self._payload = payload

    @property
    def decoded_size(self) -> int:
        p = self._payload
        padding = len(p) - len(p.rstrip("="))
        return max(0, (len(p) * 3) // 4 - padding)

    def read(self, offset: int, size: int) -> bytes:
        if offset < 0 or size <= 0:
            return b""
        start_char = (offset // 3) * 4
        end_char = ((offset + size + 2) // 3) * 4
        chunk = self._payload[start_char:end_char]
        if not chunk:
            return b""
        chunk += "=" * (-len(chunk) % 4)
        try:
            data = binascii.a2b_base64(chunk)
        except (binascii.Error, ValueError):
            return b""
        skip = offset - (offset // 3) * 3
        return data[skip : skip + size]

    def read_all(self) -> bytes:
        try:
            return binascii.a2b_base64(self._payload + "=" * (-len(self._payload) % 4))
        except (binascii.Error, ValueError):
            return b""


def _split_data_url(url: str) -> tuple[str, _Base64Window] | None:
    """(media type, base64 window) of a base64 ``data:`` URL, else None."""
    if not url.startswith("data:"):
        return None
    comma = url.find(",", 5, 512)
    if comma < 0:
        return None
    header = url[5:comma].lower()
    if not header.endswith(";base64"):
        return None
    return header.split(";", 1)[0], _Base64Window(url[comma + 1 :])


def _png_size(head: bytes) -> tuple[int, int] | None:
    if len(head) >= 24 and head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
        width, height = struct.unpack(">II", head[16:24])
        return int(width), int(height)
    return None


def _gif_size(head: bytes) -> tuple[int, int] | None:
    if len(head) >= 10 and head[:6] in (b"GIF87a", b"GIF89a"):
        width, height = struct.unpack("<HH", head[6:10])
        return int(width), int(height)
    return None


def _webp_size(head: bytes) -> tuple[int, int] | None:
    if len(head) < 30 or head[:4] != b"RIFF" or head[8:12] != b"WEBP":
        return None
    chunk = head[12:16]
    if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", head[26:30])
        return int(width) & 0x3FFF, int(height) & 0x3FFF
    if chunk == b"VP8L" and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        width = int.from_bytes(head[24:27], "little") + 1
        height = int.from_bytes(head[27:30], "little") + 1
        return width, height
    return None


# SOFn markers carry the frame size; C4 (DHT), C8 (JPG) and CC (DAC) share the range but do not.
_JPEG_SOF: Final = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE: Final = frozenset({0x01, *range(0xD0, 0xD9)})
_JPEG_MAX_SEGMENTS: Final = 256


def _jpeg_size(window: _Base64Window) -> tuple[int, int] | None:
    if window.read(0, 2) != b"\xff\xd8":
        return None
    pos = 2
    for _ in range(_JPEG_MAX_SEGMENTS):
        header = window.read(pos, 4)
        if len(header) < 2 or header[0] != 0xFF:
            return None
        marker = header[1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _JPEG_STANDALONE:
            pos += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image / start of scan before any frame header
            return None
        if len(header) < 4:
            return None
        length = int.from_bytes(header[2:4], "big")
        if marker in _JPEG_SOF:
            frame = window.read(pos + 5, 4)
            if len(frame) < 4:
                return None
            height, width = struct.unpack(">HH", frame)
            return int(width), int(height)
        if length < 2:
            return None
        pos += 2 + length
    return None


def image_dimensions_from_data_url(url: str) -> tuple[int, int] | None:
    """(width, height) of a PNG/JPEG/GIF/WebP ``data:`` URL, decoding only its header bytes."""
    parts = _split_data_url(url)
    if parts is None:
        return None
    _media_type, window = parts
    # Sniff the bytes rather than trust the media type: clients mislabel images often.
    head = window.read(0, 32)
    if head[:2] == b"\xff\xd8":
        size = _jpeg_size(window)
    else:
        size = _png_size(head) or _gif_size(head) or _webp_size(head)
    if size is None or size[0] <= 0 or size[1] <= 0:
        return None
    return size


# Anthropic's rule (docs, "Vision": calculate image costs): an image is resized to fit a long
# edge of 1568 px and about 1.15 megapixels, then costs width * height / 750 tokens.
ANTHROPIC_IMAGE_DIVISOR: Final = 750
ANTHROPIC_MAX_SIDE: Final = 1568
ANTHROPIC_MAX_PIXELS: Final = 1_150_000
ANTHROPIC_UNKNOWN_IMAGE: Final = 1_600  # the most an image can cost: the size is unknown
# Base64 characters read for an image's header: a JPEG's size can sit after a large EXIF block.
_HEADER_CHARS: Final = 256 * 1024


def anthropic_image_tokens(source: object) -> int:
    """Tokens of an Anthropic ``image`` block's ``source``: by its size when it is inline
    base64 (only the header is decoded), the most an image costs otherwise."""
    if not isinstance(source, dict) or source.get("type") != "base64":
        return ANTHROPIC_UNKNOWN_IMAGE
    data = source.get("data")
    if not isinstance(data, str):
        return ANTHROPIC_UNKNOWN_IMAGE
    size = image_dimensions_from_data_url("data:image;base64," + data[:_HEADER_CHARS])
    if size is None:
        return ANTHROPIC_UNKNOWN_IMAGE
    w, h = float(size[0]), float(size[1])
    scale = min(1.0, ANTHROPIC_MAX_SIDE / max(w, h), math.sqrt(ANTHROPIC_MAX_PIXELS / (w * h)))
    return max(1, math.ceil(w * scale * h * scale / ANTHROPIC_IMAGE_DIVISOR))


def _audio_tokens(data: object, audio_format: object) -> int:
    """Audio estimate: duration (WAV header byte rate, else 128 kbit/s) x 10 tokens/s."""
    if not isinstance(data, str) or not data:
        return AUDIO_TOKENS_PER_SECOND
    window = _Base64Window(data)
    size = window.decoded_size
    byte_rate = AUDIO_ASSUMED_BYTES_PER_SECOND
    head = window.read(0, 32)
    if len(head) >= 32 and head[:4] == b"RIFF" and head[8:16] == b"WAVEfmt ":
        rate = int.from_bytes(head[28:32], "little")
        if rate > 0:
            byte_rate = rate
            size = max(0, size - 44)  # canonical header; not audio
    elif isinstance(audio_format, str) and audio_format.lower() in ("pcm16", "pcm"):
        byte_rate = 48_000  # 24 kHz mono 16-bit, the Realtime API's pcm16
    seconds = size / byte_rate
    return max(1, math.ceil(seconds * AUDIO_TOKENS_PER_SECOND))


def _file_data_tokens(file_data: str) -> int:
    """Inline file estimate: PDF pages x 1000 when countable, else by decoded size."""
    payload = file_data
    if payload.startswith("data:"):
        comma = payload.find(",", 5, 512)
        payload = payload[comma + 1 :] if comma >= 0 else ""
    window = _Base64Window(payload)
    if window.read(0, 5) == b"%PDF-":
        pages = len(_PDF_PAGE_RE.findall(window.read_all()))
        if pages:
            return pages * PDF_TOKENS_PER_PAGE
        return max(FILE_REFERENCE_TOKENS, window.decoded_size // PDF_BYTES_PER_TOKEN)
    return max(1, window.decoded_size // FILE_BYTES_PER_TOKEN)

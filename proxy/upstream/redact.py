"""A provider's error message made safe to log, store and show.

Error bodies may echo the caller's key ("Incorrect API key provided: sk-proj-..."), so the
message of an error the proxy's own call got is kept only after every credential it was sent
with, and anything else shaped like a key or token, is replaced by ``[redacted]``; control
characters are flattened (one log line) and the text is bounded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

import orjson

__all__ = ["MESSAGE_CHARS", "error_summary", "redact"]

MESSAGE_CHARS: Final = 300

_REDACTED: Final = "[redacted]"
# Keys by their providers' prefixes (OpenAI sk-/sk-proj-, Anthropic sk-ant-, restricted rk-,
# publishable pk-), bearer tokens, JWTs, and long opaque runs of letters and digits (base64,
# hex: OAuth tokens, session keys). A run needs a digit and a letter, and hyphens and dots end
# it, so words, error codes and model names ("claude-sonnet-4-5-20250929") survive.
_KEYLIKE: Final = re.compile(
    r"\b(?:sk|rk|pk)-(?:[\w\-*.]*[\w*])?"
    r"|\bBearer\s+\S+"
    r"|\beyJ[\w-]{4,}\.[\w-]{4,}\.[\w-]*"
    r"|(?=[A-Za-z0-9+/=_]*\d)(?=[A-Za-z0-9+/=_]*[A-Za-z])[A-Za-z0-9+/=_]{20,}",
    re.IGNORECASE,
)
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]+")


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without ``secrets`` (exact values, longest first) or anything key-like."""
    for secret in sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True):
        text = text.replace(secret, _REDACTED)
    return _KEYLIKE.sub(_REDACTED, text)


def _bounded(text: str) -> str:
    text = _CONTROL.sub(" ", text).strip()
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 1] + "…"


def error_summary(payload: bytes, secrets: Iterable[str] = ()) -> str:
    """``message (type=..., code=...)`` of an OpenAI or Anthropic error body (both put it
    under ``error``), redacted; "" when the body holds no error object."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return ""
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return ""
    parts = [f"{k}={error[k]}" for k in ("type", "code")
             if isinstance(error.get(k), str) and len(error[k]) <= 64]
    message = error.get("message")
    # Cut before redacting (bounded work); a key cut in half still matches by its prefix.
    text = redact(message[: 4 * MESSAGE_CHARS], secrets) if isinstance(message, str) else ""
    if parts:
        text = f"{text} ({', '.join(parts)})" if text else ", ".join(parts)
    return _bounded(redact(text, secrets))

"""Timestamps as the stores write them: aware UTC datetimes, and fixed-width ISO 8601 text
(always milliseconds, always ``+00:00``) so that TEXT columns sort chronologically.
"""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = [
    "format_ts",
    "parse_ts",
    "utc",
]


def utc(now: datetime | None = None) -> datetime:
    """``now`` as an aware UTC datetime; naive values are taken to be UTC already."""
    if now is None:
        return datetime.now(UTC)
    if now.tzinfo is None:
        return now.replace(tzinfo=UTC)
    return now.astimezone(UTC)


def format_ts(moment: datetime) -> str:
    # Fixed width (always milliseconds, always +00:00) so the TEXT columns sort chronologically.
    return utc(moment).isoformat(timespec="milliseconds")


def parse_ts(text: str) -> datetime:
    return utc(datetime.fromisoformat(text))

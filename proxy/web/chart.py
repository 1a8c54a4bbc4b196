"""The session page's chart: tokens per request as an inline SVG (pure: data in, SVG out).

The /files pages run no scripts (their CSP has no ``script-src``), so the chart is drawn on the
server: one line per series, a dashed vertical line at each request that compacted, a triangle
under each request whose cached share fell (coloured by the reason), axes with labels and a
legend. Each column carries a ``<title>``, which the browser shows on hover without JavaScript.

Beyond ``max_points`` requests the points are merged into buckets of consecutive requests
(each series' maximum, so a spike stays visible; a bucket is marked when any of its requests
is), keeping the SVG's size bounded whatever the session's length. Every text is escaped and
stripped of characters XML does not allow, so the result is well-formed XML for any input.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["MAX_POINTS", "Point", "tokens_chart"]

MAX_POINTS: Final = 600
# (name, colour, attribute of Point): the lines, in the legend's order.
_SERIES: Final[tuple[tuple[str, str, str], ...]] = (
    ("sent by the client", "#0969da", "sent"),
    ("forwarded", "#1a7f37", "forwarded"),
    ("cached", "#bf8700", "cached"),
    ("written to the cache", "#8250df", "written"),
)
_COMPACTION: Final = "#cf222e"
_BREAKS: Final = {"compaction": "#cf222e", "client": "#8250df", "ttl": "#6e7781",
                  "unknown": "#bc4c00"}
_OTHER_BREAK: Final = "#57606a"
# XML 1.0's Char production, negated: what may not appear in a document even as a reference.
_NOT_XML: Final = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


@dataclass(frozen=True, slots=True)
class Point:
    """One request: tokens the client sent, forwarded, read from and written to the cache."""

    sent: int
    forwarded: int
    cached: int
    written: int = 0
    compaction: bool = False  # this request made a new summary
    cache_reason: str | None = None  # why its cached share fell (None: it held)


@dataclass(frozen=True, slots=True)
class _Column:
    first: int  # 1-based request numbers the column covers
    last: int
    values: tuple[int, ...]  # per series, the maximum over the column
    compaction: bool
    reasons: tuple[str, ...]


def _text(value: object) -> str:
    """``value`` as XML character data or an attribute value (quotes escaped too)."""
    s = _NOT_XML.sub("", str(value))
    return (s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;").replace("'", "&#39;"))


def _tokens(n: float) -> str:
    """Axis labels: 950, 12k, 1.5M."""
    if n >= 1_000_000:
        return f"{n / 1_000_000:.3g}M"
    if n >= 1_000:
        return f"{n / 1_000:.3g}k"
    return f"{n:.0f}"


def _nice_step(top: int, ticks: int = 4) -> int:
    """A round step (1, 2, 2.5 or 5 times a power of ten) giving about ``ticks`` ticks."""
    raw = max(top / ticks, 1.0)
    power = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * power >= raw:
            return max(1, int(m * power))
    return int(10 * power)  # pragma: no cover - the loop always returns


def _columns(points: Sequence[Point], limit: int, fields: Sequence[str]) -> list[_Column]:
    size = max(1, math.ceil(len(points) / max(limit, 1)))
    out = []
    for start in range(0, len(points), size):
        chunk = points[start:start + size]
        values = tuple(max(max(0, int(getattr(p, f))) for p in chunk) for f in fields)
        reasons = tuple(dict.fromkeys(p.cache_reason for p in chunk if p.cache_reason))
        out.append(_Column(start + 1, start + len(chunk), values,
                           any(p.compaction for p in chunk), reasons))
    return out


def _describe(col: _Column, names: Sequence[str]) -> str:
    which = (f"request {col.first}" if col.first == col.last
             else f"requests {col.first}–{col.last} (the highest of each)")
    parts = [which] + [f"{name}: {value:,}" for name, value in zip(names, col.values, strict=True)]
    if col.compaction:
        parts.append("compaction")
    parts += [f"cache break: {r}" for r in col.reasons]
    return " · ".join(parts)


def tokens_chart(
    points: Sequence[Point], *, width: int = 960, height: int = 320,
    max_points: int = MAX_POINTS, title: str = "Tokens per request",
) -> str:
    """The SVG (one ``<svg>`` element, no XML declaration) of ``points``, oldest first."""
    series = [s for s in _SERIES if s[2] != "written" or any(p.written for p in points)]
    names = [s[0] for s in series]
    columns = _columns(points, max_points, [s[2] for s in series])
    left, right, top, bottom = 64, 16, 40, 46
    plot_w, plot_h = width - left - right, height - top - bottom
    peak = max((v for c in columns for v in c.values), default=0)
    step = _nice_step(peak)
    y_max = step * max(1, math.ceil(peak / step))
    n = len(columns)
    slot = plot_w / max(n, 1)

    def x(i: int) -> float:
        return left + slot * (i + 0.5)

    def y(v: int) -> float:
        return top + plot_h - plot_h * v / y_max

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {width} {height}" '
        f'width="100%" role="img" font-family="system-ui,sans-serif" font-size="11" '
        f'fill="#1f2328"><title>{_text(title)}</title>',
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fff" '
        'stroke="#d0d7de"/>',
    ]
    # The y axis: gridlines and labels at each step.
    out.append('<g class="y-axis">')
    for v in range(0, y_max + 1, step):
        yy = y(v)
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{yy:.1f}" y2="{yy:.1f}" '
                   'stroke="#eaeef2"/>'
                   f'<text x="{left - 6}" y="{yy + 4:.1f}" text-anchor="end">{_tokens(v)}</text>')
    out.append(f'<text transform="translate(14 {top + plot_h / 2:.1f}) rotate(-90)" '
               'text-anchor="middle">tokens</text></g>')
    # The x axis: about eight request numbers.
    out.append('<g class="x-axis">')
    every = max(1, math.ceil(n / 8))
    for i in range(0, n, every):
        out.append(f'<text x="{x(i):.1f}" y="{top + plot_h + 16}" text-anchor="middle">'
                   f"{columns[i].first}</text>")
    out.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 8}" text-anchor="middle">'
               "requests, oldest first</text></g>")
    if not columns:
        out.append(f'<text x="{left + plot_w / 2:.1f}" y="{top + plot_h / 2:.1f}" '
                   'text-anchor="middle" fill="#57606a">no requests recorded</text>')
    # Compactions: a dashed line across the plot, labelled where there is room.
    labelled = -math.inf
    out.append('<g class="compactions">')
    for i, col in enumerate(columns):
        if not col.compaction:
            continue
        xx = x(i)
        out.append(f'<g class="compaction"><title>{_text(_describe(col, names))}</title>'
                   f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{top}" y2="{top + plot_h}" '
                   f'stroke="{_COMPACTION}" stroke-dasharray="4 3"/>')
        if xx - labelled >= 70:
            out.append(f'<text x="{xx + 3:.1f}" y="{top + 11}" fill="{_COMPACTION}">'
                       "compaction</text>")
            labelled = xx
        out.append("</g>")
    out.append("</g>")
    # The series.
    for k, (name, colour, _) in enumerate(series):
        coords = " ".join(f"{x(i):.1f},{y(c.values[k]):.1f}" for i, c in enumerate(columns))
        out.append(f'<g class="series"><title>{_text(name)}</title>')
        if n > 1:
            out.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" '
                       'stroke-width="1.6" stroke-linejoin="round"/>')
        if 0 < n <= 60:
            out += [f'<circle cx="{x(i):.1f}" cy="{y(c.values[k]):.1f}" r="2.6" '
                    f'fill="{colour}"/>' for i, c in enumerate(columns)]
        out.append("</g>")
    # Cache breaks: a triangle under the column, one colour per reason.
    out.append('<g class="breaks">')
    base = top + plot_h
    for i, col in enumerate(columns):
        for j, reason in enumerate(col.reasons[:3]):
            xx, yy = x(i), base - 2 - 7 * j
            out.append(f'<path class="break" d="M{xx - 4:.1f} {yy:.1f}h8l-4 -6z" '
                       f'fill="{_BREAKS.get(reason, _OTHER_BREAK)}"><title>cache break: '
                       f"{_text(reason)} (request {col.first})</title></path>")
    out.append("</g>")
    # Hover targets: one transparent column per point with its numbers.
    out.append('<g class="hover">')
    out += [f'<rect x="{left + slot * i:.1f}" y="{top}" width="{slot:.2f}" height="{plot_h}" '
            f'fill="transparent"><title>{_text(_describe(c, names))}</title></rect>'
            for i, c in enumerate(columns)]
    out.append("</g>")
    out.append(_legend(series, points, left, top - 14))
    if n < len(points):
        out.append(f'<text x="{left + plot_w}" y="{height - 8}" text-anchor="end" '
                   f'fill="#57606a">{len(points):,} requests in {n} columns of '
                   f"{columns[0].last - columns[0].first + 1}</text>")
    out.append("</svg>")
    return "".join(out)


def _legend(series: Sequence[tuple[str, str, str]], points: Sequence[Point], x0: int,
            y0: int) -> str:
    items: list[tuple[str, str]] = []
    for name, colour, _ in series:
        items.append((name, f'<line x1="0" x2="16" y1="-4" y2="-4" stroke="{colour}" '
                            'stroke-width="2"/>'))
    if any(p.compaction for p in points):
        items.append(("compaction", f'<line x1="8" x2="8" y1="-11" y2="2" stroke="{_COMPACTION}" '
                                    'stroke-dasharray="3 2"/>'))
    reasons = dict.fromkeys(p.cache_reason for p in points if p.cache_reason)
    for reason in list(reasons)[:6]:
        colour = _BREAKS.get(reason, _OTHER_BREAK)
        items.append((f"cache break: {reason}",
                      f'<path d="M4 0h8l-4 -6z" fill="{colour}"/>'))
    out = ['<g class="legend">']
    x = x0
    for label, swatch in items:
        label = label if len(label) <= 40 else label[:39] + "…"
        out.append(f'<g class="legend-item" transform="translate({x} {y0})">{swatch}'
                   f'<text x="20" y="0">{_text(label)}</text></g>')
        x += 28 + int(len(label) * 6.2)
    out.append("</g>")
    return "".join(out)

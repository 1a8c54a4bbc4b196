"""HTML for the ``/files`` pages: jinja2 templates (``proxy/web/templates``) over the same
payloads the JSON views return.

:class:`Pages` owns the one ``jinja2.Environment`` (built by :class:`proxy.web.routes.FilesApp`,
never a module global): ``autoescape=True``, so every value a template prints is escaped unless
it is :class:`markupsafe.Markup` made here (the chart's SVG, a summary's markdown, both built by
modules that escape what they are given), and ``StrictUndefined``, so a template that names a
field the payload lacks fails the test that renders it instead of printing nothing. No page
needs JavaScript. The files hold arbitrary tool output, so escaping is what keeps a ``<script>``
in a log from running here (the Content-Security-Policy set by the routes is the second line of
defence).

The chat view of a dialog record (:func:`chat_card`) is computed here, as a plain value the
template lays out: which parts are text, tags, collapsed tool output or tool calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final
from urllib.parse import urlencode

import orjson
from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup

from proxy.web import chart
from proxy.web.markdown import Markdown

__all__ = ["Pages", "chat_card"]

LONG_RESULT_CHARS: Final = 1500  # tool results longer than this start collapsed
LONG_RESULT_LINES: Final = 25
SHOW_CHARS: Final = 50_000  # one text part shown in the chat; the raw line has the rest
SHOW_LINE_CHARS: Final = 10_000  # one line of an offloaded file


class Pages:
    """The templates, their filters, and the markdown parser: one set per :class:`FilesApp`."""

    def __init__(self) -> None:
        env = Environment(
            loader=PackageLoader("proxy.web", "templates"),
            autoescape=True,
            undefined=StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
            auto_reload=False,
        )
        self._markdown = Markdown()
        env.filters.update(num=_num, when=_when, size=_size, percent=_percent, usd=_usd,
                           base=_base, markdown=self._render_markdown, clip=_clip_line)
        env.globals.update(href=_href, chat_card=chat_card, tokens_chart=_chart,
                           show_chars=SHOW_CHARS)
        self._env = env

    def render(self, template: str, payload: Mapping[str, Any]) -> str:
        """The page ``template`` (a file under ``templates/``) for ``payload``."""
        return self._env.get_template(template).render(p=payload)

    def error(self, status: int, message: str, base: str) -> str:
        return self.render("error.html", {"status": status, "message": message, "url": base})

    def _render_markdown(self, text: str) -> Markup:
        return Markup(self._markdown.render(text))  # noqa: S704 (markdown-it escapes)


def _href(url: str, **query: object) -> str:
    kept = {k: v for k, v in query.items() if v is not None}
    return url + ("?" + urlencode(kept) if kept else "")


def _num(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _when(stamp: object) -> str:
    """``2026-12-02T10:15:30.123+00:00`` as ``2026-12-02 10:15:30 UTC``."""
    text = str(stamp or "")
    return text[:19].replace("T", " ") + " UTC" if len(text) >= 19 else text


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024 * 1024:
        return f"{n / 1024:.1f} KB"
    return f"{n / (1024 * 1024):.1f} MB"


def _percent(ratio: float) -> str:
    return f"{ratio * 100:.1f}%"


def _usd(value: float | None) -> str:
    """Dollars to the hundredth of a cent; a negative amount as ``-$0.0123``; None: no price."""
    if value is None:
        return "—"
    sign = "-" if value < 0 and round(value, 4) != 0 else ""
    return f"{sign}${abs(value):,.4f}"


def _base(url: str, levels: int) -> str:
    """``/files`` from a page URL ``levels`` segments below it."""
    return url.rsplit("/", levels)[0]


def _clip_line(line: str) -> str:
    if len(line) <= SHOW_LINE_CHARS:
        return line
    return line[:SHOW_LINE_CHARS] + f" … ({len(line) - SHOW_LINE_CHARS:,} more characters)"


def _chart(rows: Sequence[Mapping[str, Any]]) -> Markup:
    """The tokens-per-request chart of a session's ledger rows (its request entries)."""
    points = [
        chart.Point(sent=r["tokens_sent"], forwarded=r["tokens_forwarded"],
                    cached=r["billed"]["cache_read"], written=r["billed"]["cache_write"],
                    compaction=r["compaction"], cache_reason=r["cache_reason"])
        for r in rows if r["kind"] == "request"
    ]
    return Markup(chart.tokens_chart(points))  # noqa: S704 (chart.py escapes every text)


# --- the chat --------------------------------------------------------------------------------


def _pieces(content: object) -> list[tuple[str, str]]:
    """Content as ``(kind, text)``: ``("text", ...)`` or ``("tag", "[image]")`` and the like."""
    if content is None:
        return []
    if isinstance(content, str):
        return [("text", content)]
    if not isinstance(content, list):
        return [("text", orjson.dumps(content).decode())]
    out: list[tuple[str, str]] = []
    for part in content:
        if isinstance(part, str):
            out.append(("text", part))
        elif isinstance(part, dict):
            kind = part.get("type")
            if isinstance(part.get("text"), str):
                out.append(("text", part["text"]))
            elif kind in ("image_url", "input_image", "image"):
                out.append(("tag", "[image]"))
            else:
                out.append(("tag", f"[{kind or 'part'}]"))
    return out


def _clip(text: str, raw_url: str) -> dict[str, Any]:
    """A text shown up to SHOW_CHARS, and how much of it is left to the raw record."""
    return {"text": text[:SHOW_CHARS], "rest": max(0, len(text) - SHOW_CHARS), "raw": raw_url}


def _arguments(raw: object) -> str:
    """Arguments pretty-printed when they are JSON, else as the model wrote them."""
    value = raw
    if isinstance(raw, str):
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
    try:
        return orjson.dumps(value, option=orjson.OPT_INDENT_2).decode()
    except TypeError:
        return str(value)


def _calls(message: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(name, id, arguments) of the assistant's tool calls, legacy ``function_call`` too."""
    found = []
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            found.append((str(fn.get("name")), str(call.get("id") or ""),
                          _arguments(fn.get("arguments"))))
    legacy = message.get("function_call")
    if isinstance(legacy, dict):
        found.append((str(legacy.get("name")), "", _arguments(legacy.get("arguments"))))
    return found


def _as_chat(item: Mapping[str, Any]) -> Mapping[str, Any]:
    """A Responses input or output item shown as the chat message it stands for: calls with
    their name and arguments, outputs as tool results, reasoning by its summary."""
    kind = item.get("type")
    if not isinstance(kind, str) or kind == "message" or "role" in item:
        return item
    if "call_id" in item and kind.endswith("_output"):
        output = item.get("output", item.get("result"))
        return {"role": "tool", "tool_call_id": item["call_id"], "content": output}
    if "call_id" in item:
        args = item.get("arguments", item.get("input", item.get("action")))
        fn = {"name": item.get("name") or kind, "arguments": args}
        return {"role": "assistant", "tool_calls": [{"id": item["call_id"], "function": fn}]}
    if kind == "reasoning":
        summary = item.get("summary")
        parts = summary if isinstance(summary, list) else []
        if item.get("encrypted_content"):
            parts = [*parts, {"type": "encrypted reasoning"}]
        return {"role": "reasoning", "content": parts}
    return {"role": kind, "content": orjson.dumps({k: v for k, v in item.items() if k != "type"},
                                                  option=orjson.OPT_INDENT_2).decode()}


def chat_card(record: Mapping[str, Any], url: str, previous: object) -> dict[str, Any]:
    """What the dialog page shows of one archive record: its role, the facts above it (``meta``:
    ``(kind, text)`` pairs) and its body (text, tags, collapsed tool output, tool calls)."""
    line = record["line"]
    raw_url = _href(url, raw=1, start_line=line, lines=1)
    if record.get("unreadable"):
        return {"line": line, "unreadable": True}
    message = record.get("message")
    message = _as_chat(message) if isinstance(message, dict) else {"content": message}
    role = str(record.get("role") or message.get("role") or "?")
    meta: list[tuple[str, str]] = [("text", f"pos {record.get('pos')}"), ("line", str(line)),
                                   ("text", _when(record.get("ts")))]
    if message.get("name"):
        meta.insert(0, ("code", str(message["name"])))
    if role == "tool" and message.get("tool_call_id"):
        meta.insert(0, ("result", str(message["tool_call_id"])))
    if record.get("parent") and previous is not None and record["parent"] != previous:
        meta.append(("tag", "branch"))
    body: list[dict[str, Any]] = []
    for kind, text in _pieces(message.get("content")):
        if kind == "tag":
            body.append({"kind": "tag", "text": text})
        elif role in ("tool", "function") and (
            len(text) > LONG_RESULT_CHARS or text.count("\n") >= LONG_RESULT_LINES
        ):
            body.append({"kind": "collapsed", "lines": text.count("\n") + 1,
                         "size": len(text.encode("utf-8", "surrogatepass")),
                         "clip": _clip(text, raw_url)})
        else:
            body.append({"kind": "text", "clip": _clip(text, raw_url)})
    for name, call_id, args in _calls(message):
        body.append({"kind": "call", "name": name, "id": call_id, "clip": _clip(args, raw_url)})
    return {"line": line, "unreadable": False, "role": role, "meta": meta, "body": body}

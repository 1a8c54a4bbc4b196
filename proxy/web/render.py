"""HTML for the ``/files`` pages, from the same payloads the JSON views return.

Hand-written templates: every value that reaches the page goes through :func:`esc`
(``html.escape`` with quotes), URLs included, and no page needs JavaScript. The files hold
arbitrary tool output, so escaping is what keeps a ``<script>`` in a log from running here
(the Content-Security-Policy set by the routes is the second line of defence).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final
from urllib.parse import urlencode

import orjson

__all__ = [
    "Page",
    "dialog_page",
    "error_page",
    "esc",
    "index_page",
    "memory_index_page",
    "memory_scope_page",
    "session_page",
    "tool_result_page",
]

Page = Callable[[dict[str, Any]], str]

LONG_RESULT_CHARS: Final = 1500  # tool results longer than this start collapsed
LONG_RESULT_LINES: Final = 25
SHOW_CHARS: Final = 50_000  # one text part shown in the chat; the raw line has the rest
SHOW_LINE_CHARS: Final = 10_000  # one line of an offloaded file

_CSS: Final = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:0;color:#1f2328;
background:#f6f8fa}
header{background:#24292f;color:#fff;padding:.55em 1.2em}
header a{color:#fff;text-decoration:none}header .sep{color:#8c959f;margin:0 .4em}
main{padding:1em 1.2em 3em;max-width:1280px}
h1{font-size:1.35em;margin:.2em 0 .4em}h2{font-size:1.1em;margin:1.4em 0 .4em}
h3{font-size:1em;margin:0 0 .3em}
a{color:#0969da}
table{border-collapse:collapse;background:#fff}
th,td{border:1px solid #d0d7de;padding:.3em .65em;text-align:left;vertical-align:top}
th{background:#eef1f4;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
code,pre,.mono,table.lines{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;
font-size:12.5px}
h1.mono{font-size:1.15em}
pre{white-space:pre-wrap;overflow-wrap:anywhere;margin:.2em 0}
.meta{color:#57606a;font-size:12.5px}
.card{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:.6em .9em;margin:.6em 0}
.summary pre{background:#f6f8fa;padding:.5em;border-radius:4px}
table.lines{border:1px solid #d0d7de;width:100%}table.lines td{border:0;padding:0 .6em}
table.lines td.n{text-align:right;color:#8c959f;user-select:none;width:1%;white-space:nowrap}
table.lines td.n a{color:inherit;text-decoration:none}
table.lines td.t{white-space:pre-wrap;overflow-wrap:anywhere}
table.lines tr:target{background:#fff8c5}
.msg{border-left:4px solid #8c959f}.msg.user{border-left-color:#0969da}
.msg.assistant{border-left-color:#1a7f37}.msg.tool{border-left-color:#bf8700}
.msg.system,.msg.developer{border-left-color:#8250df}
.role{font-weight:600;text-transform:uppercase;font-size:12px;letter-spacing:.03em}
.call{border-top:1px dashed #d0d7de;margin-top:.4em;padding-top:.3em}
.tag{background:#eef1f4;border-radius:3px;padding:0 .35em;font-size:12px}
.pager{margin:.6em 0}.pager a,.pager span{margin-right:1em}
"""


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _href(url: str, **query: object) -> str:
    return url + ("?" + urlencode({k: v for k, v in query.items() if v is not None})
                  if query else "")


def _num(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) else esc(value)


def _when(stamp: object) -> str:
    """``2026-12-02T10:15:30.123+00:00`` as ``2026-12-02 10:15:30 UTC``."""
    text = str(stamp or "")
    return esc(text[:19].replace("T", " ") + " UTC") if len(text) >= 19 else esc(text)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024 * 1024:
        return f"{n / 1024:.1f} KB"
    return f"{n / (1024 * 1024):.1f} MB"


def _percent(ratio: float) -> str:
    return f"{ratio * 100:.1f}%"


def _layout(title: str, crumbs: Sequence[tuple[str, str | None]], body: str) -> str:
    nav = '<span class="sep">/</span>'.join(
        f'<a href="{esc(url)}">{esc(label)}</a>' if url else esc(label) for label, url in crumbs
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{esc(title)} · ctxproxy</title><style>{_CSS}</style></head>"
        f"<body><header>{nav}</header><main>{body}</main></body></html>"
    )


def _crumbs(p: Mapping[str, Any], base: str, *more: tuple[str, str | None]) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = [("ctxproxy files", base)]
    if "session" in p:
        out.append((f"{p['tenant']} / {p['session']}", f"{base}/{p['tenant']}/{p['session']}"))
    return out + list(more)


def _base(url: str, levels: int) -> str:
    """``/files`` from a page URL ``levels`` segments below it."""
    return url.rsplit("/", levels)[0]


# --- pages -----------------------------------------------------------------------------------


def error_page(status: int, message: str, base: str) -> str:
    body = (f"<h1>{status}</h1><p>{esc(message)}</p>"
            f'<p><a href="{esc(base)}">All sessions</a></p>')
    return _layout(f"error {status}", [("ctxproxy files", base)], body)


def index_page(p: dict[str, Any]) -> str:
    sessions: list[dict[str, Any]] = p["sessions"]
    base = str(p["url"])
    master = bool(p["master"])
    who = ("all tenants (master key)" if master
           else f"tenant <code>{esc(p['tenant'])}</code>")
    login = (f' · <a href="{esc(_href(base, login=1))}">log in with an API key</a>'
             if not master and p["tenant"] == "anon" else "")
    parts = [f"<h1>Sessions</h1><p class=\"meta\">{who} · {len(sessions)} sessions{login}</p>"]
    if not p.get("database", True):
        parts.append("<p>The session database is unavailable; see the proxy's log.</p>")
    if not sessions:
        parts.append("<p>No sessions yet.</p>")
        return _layout("sessions", [("ctxproxy files", None)], "".join(parts))
    head = ["Session", "Turns", "Messages", "Tokens sent", "Tokens forwarded", "Saved",
            "Compactions", "Offloads", "Last seen"]
    if master:
        head.insert(1, "Tenant")
    rows = []
    for s in sessions:
        cells = [f'<td><a href="{esc(s["url"])}">{esc(s["session"])}</a></td>']
        if master:
            cells.append(f'<td><code>{esc(s["tenant"])}</code></td>')
        cells += [f'<td class="num">{_num(s[k])}</td>'
                  for k in ("turns", "messages", "tokens_in", "tokens_out")]
        cells.append(f'<td class="num">{_percent(s["saved_ratio"])}</td>')
        cells += [f'<td class="num">{_num(s[k])}</td>' for k in ("compactions", "offloads")]
        cells.append(f"<td>{_when(s['last_seen'])}</td>")
        rows.append(f"<tr>{''.join(cells)}</tr>")
    parts.append(_table(head, rows))
    parts.append(_memory_table(p.get("memory") or [], master))
    return _layout("sessions", [("ctxproxy files", None)], "".join(parts))


def _memory_table(scopes: Sequence[Mapping[str, Any]], master: bool) -> str:
    if not scopes:
        return ""
    head = ["Memory scope", "Version", "Last fact", "Last fold"]
    if master:
        head.insert(1, "Tenant")
    rows = []
    for m in scopes:
        cells = [f'<td><a href="{esc(m["url"])}">{esc(m["scope"])}</a></td>']
        if master:
            cells.append(f'<td><code>{esc(m["tenant"])}</code></td>')
        cells += [f'<td class="num">{_num(m["version"])}</td>',
                  f"<td>{_when(m['last_entry_at'])}</td>", f"<td>{_when(m['folded_at'])}</td>"]
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return "<h2>Long-term memory</h2>" + _table(head, rows)


def memory_index_page(p: dict[str, Any]) -> str:
    base = _base(p["url"], 2)
    body = (f"<h1>Long-term memory</h1><p class=\"meta\">tenant <code>{esc(p['tenant'])}</code>"
            "</p>" + (_memory_table(p["scopes"], False) or '<p class="meta">No memory yet.</p>'))
    return _layout("memory", [("ctxproxy files", base), (f"{p['tenant']} / memory", None)], body)


def memory_scope_page(p: dict[str, Any]) -> str:
    base = _base(p["url"], 3)
    parts = [f"<h1>Memory · {esc(p['scope'])}</h1>"
             f'<p class="meta">tenant <code>{esc(p["tenant"])}</code> · version '
             f"{_num(p['version'])} · last fact {_when(p['last_entry_at'])} · last fold "
             f"{_when(p['folded_at'])}</p>"]
    versions = p["versions"]
    parts.append(f"<h2>MEMORY.md versions ({len(versions)})</h2>")
    if not versions:
        parts.append('<p class="meta">Not folded yet.</p>')
    for v in versions:
        tag = " · current" if v["current"] else ""
        parts.append(
            f'<section class="card summary"><h3>v{v["version"]} · {_when(v["created_at"])}{tag}'
            f'</h3><p class="meta"><a href="{esc(v["url"])}">{esc(v["name"])}</a></p>'
            f"<pre>{esc(v['text'])}</pre></section>"
        )
    parts.append("<h2>Daily notes</h2>")
    if p["days"]:
        parts.append("<ul>" + "".join(f'<li class="mono"><a href="{esc(d["url"])}">'
                                      f"memory/{esc(d['name'])}</a></li>" for d in p["days"])
                     + "</ul>")
    else:
        parts.append('<p class="meta">No facts recorded.</p>')
    crumbs = [("ctxproxy files", base),
              (f"{p['tenant']} / memory", f"{base}/{p['tenant']}/memory"), (p["scope"], None)]
    return _layout(f"memory {p['scope']}", crumbs, "".join(parts))


def _table(head: Sequence[str], rows: Sequence[str]) -> str:
    th = "".join(f"<th>{esc(h)}</th>" for h in head)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _files_table(files: Sequence[Mapping[str, Any]], empty: str) -> str:
    if not files:
        return f'<p class="meta">{esc(empty)}</p>'
    rows = [
        f'<tr><td class="mono"><a href="{esc(f["url"])}">{esc(f["name"])}</a></td>'
        f'<td class="num">{esc(_size(f["size"]))}</td><td>{_when(f["mtime"])}</td></tr>'
        for f in files
    ]
    return _table(["File", "Size", "Modified"], rows)


def session_page(p: dict[str, Any]) -> str:
    base = _base(p["url"], 2)
    stats = p["stats"]
    parts = [f"<h1>{esc(p['session'])}</h1>"
             f'<p class="meta">tenant <code>{esc(p["tenant"])}</code></p>']
    if stats is not None:
        pairs = [
            ("Turns", _num(stats["turns"])), ("Messages archived", _num(stats["messages"])),
            ("Tokens sent by the client", _num(stats["tokens_in"])),
            ("Tokens forwarded", _num(stats["tokens_out"])),
            ("Saved", _percent(stats["saved_ratio"])),
            ("Compactions", _num(stats["compactions"])), ("Offloads", _num(stats["offloads"])),
            ("First seen", _when(stats["first_seen"])), ("Last seen", _when(stats["last_seen"])),
        ]
        parts.append("<table>" + "".join(
            f'<tr><th>{esc(k)}</th><td class="num">{v}</td></tr>' for k, v in pairs
        ) + "</table>")
    summaries = p["summaries"]
    parts.append(f"<h2>Summaries ({len(summaries)})</h2>")
    if not summaries:
        parts.append('<p class="meta">No compaction yet.</p>')
    for i, s in enumerate(summaries, start=1):
        source = esc(s["source"]) + (f" (<code>{esc(s['model'])}</code>)" if s["model"] else "")
        replaced = (f"messages {s['head']}–{s['upto'] - 1}" if s["upto"] > s["head"]
                    else "no messages")
        # The engine may not know the size after compaction (0): say nothing rather than 0.
        after = f", {_num(s['tokens_after'])} after" if s["tokens_after"] else ""
        parts.append(
            f'<section class="card summary"><h3>#{i} · {_when(s["created_at"])} · {source}</h3>'
            f'<p class="meta">replaces {esc(replaced)} · {_num(s["tokens_before"])} tokens '
            f"before{after} · dialog: {esc(s['dialog'] or 'n/a')} · "
            f'<a href="{esc(s["url"])}">{esc(s["name"])}</a></p><pre>{esc(s["text"])}</pre>'
            "</section>"
        )
    parts.append("<h2>Dialog</h2>")
    parts.append(_files_table(p["dialog_files"], "No dialog archived."))
    parts.append(f"<h2>Offloaded tool results ({len(p['tool_results'])})</h2>")
    parts.append(_files_table(p["tool_results"], "No offloaded tool output (or all expired)."))
    return _layout(p["session"], _crumbs({}, base, (f"{p['tenant']} / {p['session']}", None)),
                   "".join(parts))


def _pager(p: Mapping[str, Any]) -> str:
    url, count = p["url"], p["page_lines"]
    links = []
    if p["prev_start_line"] is not None:
        links.append(f'<a href="{esc(_href(url, start_line=p["prev_start_line"], lines=count))}">'
                     "← previous</a>")
    shown = (f"lines {_num(p['start_line'])}–{_num(p['end_line'])} of {_num(p['total_lines'])}"
             if p["end_line"] >= p["start_line"] else f"empty ({_num(p['total_lines'])} lines)")
    links.append(f"<span>{shown}</span>")
    if p["next_start_line"] is not None:
        links.append(f'<a href="{esc(_href(url, start_line=p["next_start_line"], lines=count))}">'
                     "next →</a>")
    count_shown = p["end_line"] - p["start_line"] + 1
    raw = (_href(url, raw=1, start_line=p["start_line"], lines=count_shown) if count_shown > 0
           else _href(url, raw=1))
    links.append(f'<a href="{esc(raw)}">raw</a>')
    links.append(f'<a href="{esc(_href(url, format="json", start_line=p["start_line"]))}">'
                 "json</a>")
    return f'<div class="pager">{"".join(links)}</div>'


def _file_header(p: Mapping[str, Any]) -> str:
    return (f"<h1 class=\"mono\">{esc(p['file'])}</h1><p class=\"meta\">"
            f"{esc(_size(p['size']))} · modified {_when(p['mtime'])} · "
            f"<a href=\"{esc(_href(p['url'], raw=1))}\">whole file as text</a></p>")


def tool_result_page(p: dict[str, Any]) -> str:
    rows = []
    for n, line in enumerate(p["lines"], start=p["start_line"]):
        text = line if len(line) <= SHOW_LINE_CHARS else (
            line[:SHOW_LINE_CHARS] + f" … ({len(line) - SHOW_LINE_CHARS:,} more characters)")
        rows.append(f'<tr id="L{n}"><td class="n"><a href="#L{n}">{n}</a></td>'
                    f'<td class="t">{esc(text)}</td></tr>')
    body = (_file_header(p) + _pager(p) + f'<table class="lines">{"".join(rows)}</table>'
            + _pager(p))
    base = _base(p["url"], 4)
    return _layout(p["file"], _crumbs(p, base, (p["file"], None)), body)


def dialog_page(p: dict[str, Any]) -> str:
    cards = []
    previous: object = None
    for record in p["records"]:
        cards.append(_record_html(record, p["url"], previous))
        previous = record.get("chain")
    body = _file_header(p) + _pager(p) + "".join(cards) + _pager(p)
    base = _base(p["url"], 4)
    return _layout(p["file"], _crumbs(p, base, (p["file"], None)), body)


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


def _clip(text: str, raw_url: str) -> str:
    if len(text) <= SHOW_CHARS:
        return f"<pre>{esc(text)}</pre>"
    rest = len(text) - SHOW_CHARS
    return (f"<pre>{esc(text[:SHOW_CHARS])}</pre><p class=\"meta\">… {rest:,} more characters: "
            f'<a href="{esc(raw_url)}">the whole record</a></p>')


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


def _record_html(record: Mapping[str, Any], url: str, previous: object) -> str:
    line = record["line"]
    raw_url = _href(url, raw=1, start_line=line, lines=1)
    if record.get("unreadable"):
        return (f'<div class="card msg" id="L{line}"><span class="meta">line {line}: '
                "unreadable (torn by a crash?)</span></div>")
    message = record.get("message")
    message = _as_chat(message) if isinstance(message, dict) else {"content": message}
    role = str(record.get("role") or message.get("role") or "?")
    meta = [f"pos {esc(record.get('pos'))}", f'<a href="#L{line}">line {line}</a>',
            _when(record.get("ts"))]
    if message.get("name"):
        meta.insert(0, f"<code>{esc(message['name'])}</code>")
    if role == "tool" and message.get("tool_call_id"):
        meta.insert(0, f"result of <code>{esc(message['tool_call_id'])}</code>")
    if record.get("parent") and previous is not None and record["parent"] != previous:
        meta.append('<span class="tag">branch</span>')
    body = []
    for kind, text in _pieces(message.get("content")):
        if kind == "tag":
            body.append(f'<span class="tag">{esc(text)}</span> ')
        elif role in ("tool", "function") and (
            len(text) > LONG_RESULT_CHARS or text.count("\n") >= LONG_RESULT_LINES
        ):
            size = len(text.encode("utf-8", "surrogatepass"))
            body.append(f"<details><summary>tool output · {text.count(chr(10)) + 1:,} lines · "
                        f"{esc(_size(size))}</summary>{_clip(text, raw_url)}</details>")
        else:
            body.append(_clip(text, raw_url))
    for name, call_id, args in _calls(message):
        ident = f' <span class="meta">{esc(call_id)}</span>' if call_id else ""
        body.append(f'<div class="call">calls <code><b>{esc(name)}</b></code>{ident}'
                    f"{_clip(args, raw_url)}</div>")
    return (f'<div class="card msg {esc(role)}" id="L{line}"><div class="meta">'
            f'<span class="role">{esc(role)}</span> · {" · ".join(meta)}</div>'
            f"{''.join(body)}</div>")

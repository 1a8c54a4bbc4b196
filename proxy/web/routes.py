"""``GET /files...``: the dashboard: sessions, their cost, summaries, dialogs, offloaded files
and what ctxproxy did to each request (docs/dashboard.md#pages).

Every view builds one JSON-able payload; JSON clients get it as is and browsers get it rendered
by :mod:`proxy.web.render`'s templates, so both always show the same data.

The format a request gets is decided by :func:`proxy.web.access.ask_of`; index and session
views have no text form and answer non-HTML clients with JSON.

Paths are parsed here from the decoded URL path, one validated name per segment, and every file
is opened through :mod:`proxy.web.access`; a segment that decoded to ``..``, ``/``, ``\\``, NUL or
anything else outside the name alphabet is simply not found.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from proxy.auth import Caller, key_headers
from proxy.errors import AuthRequired, BadRequest, NotFound, OffloadedFileMissing, ProxyError
from proxy.routes import services_of
from proxy.services import Services
from proxy.store.dialog_read import parse_record
from proxy.store.fs import Hidden, iter_chunks, valid_name
from proxy.store.interfaces import FileKind, LedgerStore
from proxy.store.ledger_entry import Change, LedgerEntry
from proxy.store.memory import ScopeRow
from proxy.store.paths import MEMORY_DIR, memory_version_name
from proxy.store.sessions import SessionRow
from proxy.store.summaries import SummaryRecord
from proxy.store.times import format_ts
from proxy.web import ledger as ledger_view
from proxy.web.access import Ask, Fmt, Window, ask_of, read_head, read_window
from proxy.web.diff import cut_diff, head_bytes
from proxy.web.render import Pages

__all__ = ["MAX_LINES", "PAGE_BYTES", "PAGE_LINES", "PAGE_RECORDS", "FilesApp"]

PAGE_LINES: Final = 2000  # offloaded-file lines per page (HTML and JSON)
PAGE_RECORDS: Final = 200  # dialog records per page: each may hold a whole tool output
PAGE_BYTES: Final = 4 << 20  # file bytes per HTML/JSON page, whatever the line count
MAX_LINES: Final = 1_000_000  # largest ?lines= accepted
MAX_QUERY: Final = 200  # characters of ?q= kept
_DIALOG_NAME: Final = re.compile(r"\d{4}-\d{2}-\d{2}\.jsonl")
_NUMBER: Final = re.compile(r"[0-9]{1,9}")
_DAY_NAME: Final = re.compile(r"\d{4}-\d{2}-\d{2}\.md")
_VERSION_NAME: Final = re.compile(r"MEMORY-v(\d{4,9})\.md")
# Private data, and the files hold arbitrary tool output: never cached, never sniffed as HTML,
# no scripts, frames or outbound requests; a form (the index's search) may only GET /files.
SECURITY_HEADERS: Final = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
_TEXT: Final = "text/plain; charset=utf-8"
_HTML: Final = "text/html; charset=utf-8"


@dataclass(frozen=True, slots=True)
class _Html:
    """A view's answer for a browser: its payload, to be laid out by ``template``."""

    template: str
    payload: dict[str, Any]


View = Response | _Html


class FilesApp:
    """The ASGI endpoint behind ``/files`` and ``/files/{rest:path}``; it owns the templates."""

    def __init__(self) -> None:
        self.pages = Pages()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        ask = ask_of(request.headers, request.query_params, scope.get("root_path", ""))
        try:
            rt = services_of(scope)
            caller = rt.gate.caller(key_headers(scope["headers"]), files=True,
                                    login=ask.query.get("login") == "1")
            rest: str = scope.get("path_params", {}).get("rest", "")
            # Disk and database work happens off the event loop; chat traffic must not wait.
            response = await asyncio.to_thread(self._answer, rt, caller, ask, rest)
        except ProxyError as exc:
            response = self._error(exc, ask)
        await response(scope, receive, send)

    def _answer(self, rt: Services, caller: Caller, ask: Ask, rest: str) -> Response:
        view = _dispatch(rt, caller, ask, rest)
        if isinstance(view, _Html):
            page = self.pages.render(view.template, view.payload)
            return Response(page, 200, SECURITY_HEADERS, _HTML)
        return view

    def _error(self, exc: ProxyError, ask: Ask) -> Response:
        headers = dict(SECURITY_HEADERS)
        if isinstance(exc, AuthRequired):
            headers.update(exc.headers)
        # An HTML page only for a client that asked for HTML (a browser); everyone else, curl
        # and fetch tools included, gets the API's usual envelope.
        if ask.explicit and ask.fmt == "html":
            page = self.pages.error(exc.status, exc.message, ask.base)
            return Response(page, exc.status, headers, _HTML)
        return Response(exc.body(), exc.status, headers, "application/json")


def _gone() -> NotFound:
    # One message for "missing", "another tenant's" and "refused": existence is never revealed.
    return NotFound("no such session or file")


def _ledger(rt: Services) -> LedgerStore | None:
    """The cost ledger; None when the backend's index could not be opened: the pages are then
    shown without their ledger parts."""
    return rt.store.ledger


def _dispatch(rt: Services, caller: Caller, ask: Ask, rest: str) -> View:
    parts = rest.split("/") if rest else []
    if parts and parts[-1] == "":
        parts.pop()  # one trailing slash is harmless
    if not parts:
        return _respond(ask.fmt, _index(rt, caller, ask), "index.html")
    if len(parts) < 2 or not all(valid_name(p) for p in parts[:2]):
        raise _gone()
    tenant, session = parts[0], parts[1]
    if not caller.may_see(tenant):
        raise _gone()
    if session == MEMORY_DIR:  # a reserved session name: the tenant's long-term memory
        return _memory(rt, tenant, parts[2:], ask)
    if len(parts) == 2:
        return _respond(ask.fmt, _session(rt, tenant, session, ask), "session.html")
    if len(parts) != 4:
        raise _gone()
    kind, name = parts[2], parts[3]
    if kind == "dialog" and _DIALOG_NAME.fullmatch(name):
        return _paged(rt, tenant, session, "dialog", name, ask, PAGE_RECORDS, "dialog.html",
                      _records)
    if kind == "tool_result" and name.endswith(".txt") and valid_name(name):
        return _paged(rt, tenant, session, "tool_result", name, ask, PAGE_LINES,
                      "tool_result.html", _lines)
    if kind == "requests" and valid_name(name):
        return _respond(ask.fmt, _request(rt, tenant, session, name, ask), "request.html")
    if kind == "summaries" and name.endswith(".md") and valid_name(name):
        return _summary(rt, tenant, session, name, ask)
    raise _gone()


def _respond(fmt: Fmt, payload: dict[str, Any], template: str) -> View:
    if fmt == "html":
        return _Html(template, payload)
    return Response(orjson.dumps(payload), 200, SECURITY_HEADERS, "application/json")


def _mtime(seconds: float) -> str:
    return format_ts(datetime.fromtimestamp(seconds, UTC))


def _session_row(row: SessionRow, base: str) -> dict[str, Any]:
    return {
        "tenant": row.tenant,
        "session": row.session,
        "url": f"{base}/{row.tenant}/{row.session}",
        "turns": row.turns,
        "messages": row.messages,
        "tokens_in": row.tokens_in,
        "tokens_out": row.tokens_out,
        "saved_ratio": round(row.saved_ratio, 4),
        "compactions": row.compactions,
        "offloads": row.offloads,
        "first_seen": format_ts(row.first_seen),
        "last_seen": format_ts(row.last_seen),
    }


def _index(rt: Services, caller: Caller, ask: Ask) -> dict[str, Any]:
    """The caller's sessions (``?q=``: those whose name contains it, any case), each with its
    cost, and per tenant the ledger's totals over all its sessions."""
    q = (ask.query.get("q") or "").strip()[:MAX_QUERY]
    rows = rt.sessions.sessions(caller.scope)
    if q:
        rows = [r for r in rows if q.casefold() in r.session.casefold()]
    ledger = _ledger(rt)
    totals = ledger.totals(caller.scope) if ledger is not None else []
    costs = {(t.tenant, t.session): t for t in totals}
    sessions = []
    for r in rows:
        cost = costs.get((r.tenant, r.session))
        sessions.append({**_session_row(r, ask.base),
                         "ledger": None if cost is None else ledger_view.cost_of(cost)})
    return {
        "url": ask.base,
        "tenant": caller.scope,
        "master": caller.master,
        "database": rt.store.sessions is not None,
        "q": q or None,
        "ledger": ledger is not None,
        "tenants": ledger_view.tenant_rows(totals),
        "sessions": sessions,
        "memory": [_scope_row(r, ask.base) for r in rt.memory.store.scopes(caller.scope)],
    }


# --- long-term memory: /files/<tenant>/memory[/<scope>[/memory/<day>.md|/versions/<name>]] ---


def _scope_row(row: ScopeRow, base: str) -> dict[str, Any]:
    return {
        "tenant": row.tenant,
        "scope": row.scope,
        "url": f"{base}/{row.tenant}/{MEMORY_DIR}/{row.scope}",
        "version": row.version,
        "last_entry_at": format_ts(row.last_entry_at) if row.last_entry_at else None,
        "folded_at": format_ts(row.folded_at) if row.folded_at else None,
    }


def _memory(rt: Services, tenant: str, parts: list[str], ask: Ask) -> View:
    store = rt.memory.store
    if not parts:
        payload = {"tenant": tenant, "url": f"{ask.base}/{tenant}/{MEMORY_DIR}",
                   "scopes": [_scope_row(r, ask.base) for r in store.scopes(tenant)]}
        return _respond(ask.fmt, payload, "memory_index.html")
    scope = parts[0]
    if not valid_name(scope):
        raise _gone()
    rows = [r for r in store.scopes(tenant) if r.scope == scope]
    if not rows:
        raise _gone()
    url = f"{ask.base}/{tenant}/{MEMORY_DIR}/{scope}"
    if len(parts) == 1:
        versions = store.versions(tenant, scope)
        payload = {
            **_scope_row(rows[0], ask.base),
            "versions": [
                {"version": v.version, "name": memory_version_name(v.version),
                 "url": f"{url}/versions/{memory_version_name(v.version)}",
                 "created_at": format_ts(v.created_at), "text": v.text,
                 "current": v.version == rows[0].version}
                for v in reversed(versions)
            ],
            "days": [{"day": d, "name": f"{d}.md", "url": f"{url}/memory/{d}.md"}
                     for d in reversed(store.days(tenant, scope))],
        }
        return _respond(ask.fmt, payload, "memory_scope.html")
    if len(parts) != 3:
        raise _gone()
    kind, name = parts[1], parts[2]
    text: str | None = None
    if kind == "memory" and _DAY_NAME.fullmatch(name):
        text = store.read_day(tenant, scope, name.removesuffix(".md"))
    elif kind == "versions" and (m := _VERSION_NAME.fullmatch(name)) is not None:
        found = store.version(tenant, scope, int(m[1]))
        text = found.text if found is not None else None
    if text is None:
        raise _gone()
    if ask.fmt != "json":  # markdown is shown as text, browsers included
        return Response(text.encode("utf-8", "replace"), 200, SECURITY_HEADERS, _TEXT)
    payload = {"tenant": tenant, "scope": scope, "file": f"{kind}/{name}", "text": text}
    return Response(orjson.dumps(payload), 200, SECURITY_HEADERS, "application/json")


def _known(rt: Services, tenant: str, session: str) -> SessionRow | bool:
    """The session's counters, True for a directory without them, False when unknown."""
    row = rt.sessions.session_stats(tenant, session)
    if row is not None:
        return row
    return rt.files.exists(tenant, session)


def _session(rt: Services, tenant: str, session: str, ask: Ask) -> dict[str, Any]:
    known = _known(rt, tenant, session)
    if known is False:
        raise _gone()
    url = f"{ask.base}/{tenant}/{session}"
    history = rt.summaries.history(tenant, session)
    summaries = [
        {
            "name": rec.md_name,
            "url": f"{url}/{rec.md_relpath}",
            "created_at": format_ts(rec.created_at),
            "source": rec.source,
            "model": rec.model,
            "error": rec.error,  # why a fallback is one (None for a model's summary)
            "head": rec.head,
            "upto": rec.upto,
            "tokens_before": rec.tokens_before,
            "tokens_after": rec.tokens_after,
            "dialog": rec.pointer,
            "text": rec.text,
        }
        for rec in history
    ]
    dialogs = sorted(
        (e for e in rt.files.listing(tenant, session, "dialog")
         if _DIALOG_NAME.fullmatch(e.name)),
        key=lambda e: e.name,
    )
    results = rt.files.listing(tenant, session, "tool_result")
    ledger = _ledger(rt)
    return {
        "tenant": tenant,
        "session": session,
        "url": url,
        "stats": _session_row(known, ask.base) if isinstance(known, SessionRow) else None,
        "summaries": summaries,
        "dialog_files": [
            {"name": e.name, "url": f"{url}/dialog/{e.name}", "size": e.size,
             "mtime": _mtime(e.mtime)}
            for e in dialogs
        ],
        "tool_results": [
            {"name": e.name, "id": e.name.removesuffix(".txt"),
             "url": f"{url}/tool_result/{e.name}", "size": e.size, "mtime": _mtime(e.mtime)}
            for e in results
        ],
        "ledger": None if ledger is None else _session_ledger(ledger, tenant, session, url),
    }


def _session_ledger(ledger: LedgerStore, tenant: str, session: str,
                    url: str) -> dict[str, Any]:
    entries = ledger.entries(tenant, session, limit=ledger_view.LEDGER_ROWS)
    # The store searches by substring: "build-1" finds "build-10" too.
    totals = next((t for t in ledger.totals(tenant, search=session) if t.session == session),
                  None)
    return ledger_view.session_ledger(entries, totals, url)


def _number(ask: Ask, name: str, *, minimum: int, maximum: int) -> int | None:
    raw = ask.query.get(name)
    if raw is None or raw == "":
        return None
    if not _NUMBER.fullmatch(raw) or not minimum <= int(raw) <= maximum:
        shown = raw if len(raw) <= 20 else raw[:20] + "..."
        raise BadRequest(
            f"{name} must be a whole number from {minimum} to {maximum}, got {shown!r}",
            param=name,
        )
    return int(raw)


def _window(ask: Ask, fd: int, fmt: Fmt, page: int) -> Window:
    start = _number(ask, "start_line", minimum=1, maximum=10**9 - 1) or 1
    count = _number(ask, "lines", minimum=1, maximum=MAX_LINES)
    if fmt == "text":
        # Raw text is exactly what was asked for: no page size, no byte budget.
        window = read_window(fd, start, count, sys.maxsize)
    else:
        window = read_window(fd, start, count or page, PAGE_BYTES)
    if start > max(window.total_lines, 1):
        raise BadRequest(
            f"start_line {start} is past the end of the file ({window.total_lines} lines)",
            param="start_line",
        )
    return window


def _pager(window: Window, url: str, ask: Ask, page: int) -> dict[str, Any]:
    count = _number(ask, "lines", minimum=1, maximum=MAX_LINES) or page
    start = window.start_line
    return {
        "url": url,
        "total_lines": window.total_lines,
        "start_line": start,
        "end_line": start + len(window.lines) - 1,
        "page_lines": count,
        "next_start_line": window.next_start,
        "prev_start_line": max(1, start - count) if start > 1 else None,
    }


def _text(lines: list[bytes]) -> Response:
    return Response(b"".join(lines), 200, SECURITY_HEADERS, _TEXT)


def _stream(fd: int, size: int) -> Response:
    headers = {**SECURITY_HEADERS, "Content-Length": str(size)}
    return StreamingResponse(iter_chunks(fd, size), 200, headers, _TEXT)


def _open(
    rt: Services, tenant: str, session: str, kind: FileKind, name: str
) -> tuple[int, os.stat_result]:
    try:
        return rt.files.open(tenant, session, kind, name)
    except Hidden as exc:
        if kind == "tool_result" and exc.absent:
            raise _expired(rt, tenant, session, name) from None
        raise _gone() from None


def _expired(rt: Services, tenant: str, session: str, name: str) -> NotFound:
    """The store's own explanation for a file that is gone from a session the caller owns
    (the path was checked: nothing, not even a symlink, has that name)."""
    if _known(rt, tenant, session) is False:
        return _gone()
    try:
        rt.originals.read(tenant, session, name.removesuffix(".txt"))
    except OffloadedFileMissing as exc:
        return NotFound(str(exc))
    except (OSError, ValueError):
        pass
    return _gone()


def _paged(
    rt: Services, tenant: str, session: str, kind: FileKind, name: str, ask: Ask, page: int,
    template: str, content: Callable[[Window], dict[str, Any]],
) -> View:
    """A file as raw text (whole or a window), or one page of it as HTML/JSON."""
    fd, info = _open(rt, tenant, session, kind, name)
    fmt = ask.file_fmt()
    if fmt == "text" and "start_line" not in ask.query and "lines" not in ask.query:
        return _stream(fd, info.st_size)  # the stream closes fd
    try:
        window = _window(ask, fd, fmt, page)
    finally:
        os.close(fd)
    if fmt == "text":
        return _text(window.lines)
    url = f"{ask.base}/{tenant}/{session}/{kind}/{name}"
    payload = {
        "tenant": tenant,
        "session": session,
        "file": f"{kind}/{name}",
        "size": info.st_size,
        "mtime": _mtime(info.st_mtime),
        **_pager(window, url, ask, page),
        **content(window),
    }
    return _respond(fmt, payload, template)


def _lines(window: Window) -> dict[str, Any]:
    return {"lines": [line.decode("utf-8", "replace").removesuffix("\n") for line in window.lines]}


def _records(window: Window) -> dict[str, Any]:
    """Archive lines as records; a blank line is skipped, an unreadable one (torn by a crash)
    is reported, and a chain repeated after a crash between append and commit is shown once,
    as :meth:`DialogArchive.read_dialog_lines` does."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, raw in enumerate(window.lines, start=window.start_line):
        if not raw.strip():
            continue
        obj = parse_record(raw)
        if obj is None:
            out.append({"line": number, "unreadable": True})
            continue
        chain = obj.get("chain")
        if isinstance(chain, str):
            if chain in seen:
                continue
            seen.add(chain)
        fields = ("pos", "role", "ts", "chain", "parent", "message")
        out.append({"line": number, **{f: obj.get(f) for f in fields}})
    return {"records": out}


def _summary(rt: Services, tenant: str, session: str, name: str, ask: Ask) -> Response:
    fd, info = _open(rt, tenant, session, "summaries", name)
    if ask.fmt != "json":
        return _stream(fd, info.st_size)  # markdown is shown as text, browsers included
    try:
        window = read_window(fd, 1, None, sys.maxsize)
    finally:
        os.close(fd)
    text = b"".join(window.lines).decode("utf-8", "replace")
    payload = {"tenant": tenant, "session": session, "file": f"summaries/{name}", "text": text}
    return Response(orjson.dumps(payload), 200, SECURITY_HEADERS, "application/json")


# --- one request: /files/<tenant>/<session>/requests/<id> ---------------------------------------


def _request(rt: Services, tenant: str, session: str, entry_id: str, ask: Ask) -> dict[str, Any]:
    """A ledger entry and what ctxproxy changed in its request, each change with its reason;
    a cut with its diff against the offloaded original, an eviction with its summary."""
    ledger = _ledger(rt)
    entry = ledger.entry(tenant, session, entry_id) if ledger is not None else None
    if ledger is None or entry is None:
        raise _gone()
    session_url = f"{ask.base}/{tenant}/{session}"
    nearby = ledger.entries(tenant, session, limit=ledger_view.LEDGER_ROWS)
    # A summarizer or fold call belongs to no request (``request`` empty): nothing to list.
    calls = ledger_view.by_request(nearby, entry.request, entry.id) if entry.request else []
    history: list[SummaryRecord] | None = None
    changes = []
    for c in entry.changes:
        item: dict[str, Any] = {**ledger_view.change_json(c), "cut": None, "evicted": None}
        if c.kept_bytes is not None and c.notice is not None:
            item["cut"] = _cut(rt, tenant, session, c, session_url)
        elif c.what == "evicted" and c.at is not None and c.upto is not None:
            if history is None:
                history = rt.summaries.history(tenant, session)
            item["evicted"] = _evicted(history, c, entry, session_url)
        changes.append(item)
    own = entry.request != entry.id and valid_name(entry.request)
    return {
        "tenant": tenant,
        "session": session,
        "id": entry.id,
        "url": f"{session_url}/requests/{entry.id}",
        "session_url": session_url,
        "request_url": f"{session_url}/requests/{entry.request}" if own else None,
        "entry": ledger_view.entry_row(entry, session_url),
        "calls": [ledger_view.entry_row(e, session_url) for e in calls],
        "changes": changes,
    }


def _cut(rt: Services, tenant: str, session: str, change: Change,
         session_url: str) -> dict[str, Any]:
    """The diff of a cut: the offloaded original's head against the excerpt and notice."""
    notice = change.notice or ""
    kind, _, name = (change.file or "").partition("/")
    out: dict[str, Any] = {"url": None, "diff": None, "missing": None,
                           "notice": notice.split("\n"), "removed_url": None}
    if kind != "tool_result" or not name.endswith(".txt") or not valid_name(name):
        out["missing"] = "The original's file is not recorded."
        return out
    out["url"] = url = f"{session_url}/tool_result/{name}"
    try:
        fd, info = rt.files.open(tenant, session, "tool_result", name)
    except Hidden:
        out["missing"] = ("The original is no longer available (expired or removed); the dialog "
                          "archive keeps the message as the client sent it.")
        return out
    try:
        head, lines = read_head(fd, head_bytes(change.kept_bytes or 0))
    finally:
        os.close(fd)
    diff = cut_diff(head, change.kept_bytes or 0, notice, total_bytes=info.st_size,
                    total_lines=lines)
    out["diff"] = asdict(diff)
    if diff.removed_from is not None:
        out["removed_url"] = f"{url}?start_line={diff.removed_from}#L{diff.removed_from}"
    return out


def _evicted(history: list[SummaryRecord], change: Change, entry: LedgerEntry,
             session_url: str) -> dict[str, Any]:
    """Where evicted messages went: the summary that replaced them and their dialog lines.
    The summary is the one ending where the eviction ends, else the newest made by the time
    of the request (a compaction may finish a little after the request that started it)."""
    numbered = list(enumerate(history, start=1))
    found = next(((i, r) for i, r in numbered if r.upto == change.upto), None)
    if found is None:
        made_by = datetime.fromtimestamp(entry.ts, UTC) + timedelta(minutes=5)
        found = next(((i, r) for i, r in reversed(numbered) if r.created_at <= made_by), None)
    if found is None:
        return {"summary_url": None, "summary_name": None, "summary_file": None,
                "dialog_url": None}
    number, rec = found
    dialog_url = None
    for span in rec.span:
        kind, _, name = span.file.partition("/")
        if kind == "dialog" and _DIALOG_NAME.fullmatch(name):
            line = span.first_line
            dialog_url = f"{session_url}/dialog/{name}?start_line={line}#L{line}"
            break
    return {"summary_url": f"{session_url}#summary-{number}", "summary_name": rec.md_name,
            "summary_file": f"{session_url}/{rec.md_relpath}", "dialog_url": dialog_url}

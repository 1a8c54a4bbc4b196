"""The offload stage: two-stage truncation of tool results (SPEC section 4).

Stage 1 cuts a tool result over `recent_max_bytes + slack_bytes` and saves the original under
`tool_result/<id>.txt`; stage 2 cuts results of aged tool-call turns (see `ageing`) down to
`old_max_bytes`. Both cuts are computed from the original the client resends, so the forwarded
text depends only on the history and the config: the same history always forwards the same
bytes. Results of the client's own read tools point back to that tool and the original path.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from ..config import OffloadConfig, ReadTool, RetrievalConfig
from ..session import Identity
from ..store.tool_results import ToolResultStore, relative_path, result_id
from ..writes import Mode, Writes
from . import Message, RequestView, StageOutcome, ageing
from .notice import parse_notice
from .truncate import recut, truncate

log = logging.getLogger("proxy.pipeline")

_MARKDOWN = (".md", ".mdx", ".markdown")


@dataclass(frozen=True, slots=True)
class ReadCall:
    """A call of one of the client's read tools: where its output came from."""

    tool: str
    spec: ReadTool
    path: str
    first_line: int

    @property
    def markdown(self) -> bool:
        return self.path.lower().endswith(_MARKDOWN)


@dataclass(slots=True)
class _Entry:
    rid: str
    size: int
    cuts: dict[int, str | None]  # budget -> forwarded text (None: fits, no cut)


def _text_of(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                if not isinstance(part.get("text"), str):
                    return None
                texts.append(part["text"])
        return "\n".join(texts) if texts else None
    return None


def _with_text(message: Message, text: str) -> Message:
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": text}
    assert isinstance(content, list)
    parts: list[Any] = []
    placed = False
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            if not placed:
                parts.append({**part, "text": text})
                placed = True
            continue
        parts.append(part)  # images and other parts pass untouched
    return {**message, "content": parts}


def _first_line(value: Any) -> int:
    if isinstance(value, list) and value:
        value = value[0]
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return 1


def read_calls(
    messages: list[Message], tools: Mapping[str, ReadTool]
) -> dict[str, ReadCall]:
    """tool_call_id -> ReadCall for every call of a configured read tool."""
    found: dict[str, ReadCall] = {}
    if not tools:
        return found
    for m in messages:
        if m.get("role") != "assistant":
            continue
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                continue
            spec = tools.get(fn.get("name"))  # type: ignore[arg-type]
            if spec is None:
                continue
            try:
                args = orjson.loads(fn.get("arguments") or "{}")
            except (orjson.JSONDecodeError, TypeError):
                continue
            if not isinstance(args, dict):
                continue
            path = args.get(spec.path_arg, args.get("path", args.get("file_path")))
            if isinstance(path, str) and path and isinstance(call.get("id"), str):
                line = _first_line(args.get(spec.line_arg)) if spec.line_arg else 1
                found[call["id"]] = ReadCall(fn["name"], spec, path, line)
    return found


# A deferred write: (message index, result id, original text).
_Pending = tuple[int, str, str]


class OffloadStage:
    name = "offload"

    def __init__(
        self,
        config: OffloadConfig,
        retrieval: RetrievalConfig,
        store: ToolResultStore,
        *,
        cache_bytes: int = 256 * 1024 * 1024,
        defer_ageing: bool = False,
        files_url: str = "http://127.0.0.1:4000/files",
    ) -> None:
        self.config = config
        # With compaction on and the batched policy, stage 2 is timed to compactions by the
        # compaction stage (see `run`): the prefix then breaks once per compaction, not twice.
        self.defer_ageing = defer_ageing
        self.tool = retrieval.tool_name
        self.retrieval = retrieval
        self.files_url = files_url.rstrip("/")
        self.store = store
        self._cache: OrderedDict[tuple[str, str, str], _Entry] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._cached = 0
        # The smallest size any cut applies to: anything at or below it is never touched.
        self._floor = min(config.old_max_bytes, config.recent_max_bytes) + config.slack_bytes

    # -- budgets ---------------------------------------------------------------------------

    def _budget(self, recent: bool, markdown: bool) -> int:
        c = self.config
        budget = c.recent_max_bytes if recent else min(c.old_max_bytes, c.recent_max_bytes)
        return max(budget, c.markdown_max_bytes) if markdown else budget

    # -- per message -----------------------------------------------------------------------

    def _entry(self, tenant: str, session: str, text: str) -> _Entry:
        key = (tenant, session, text)
        entry = self._cache.get(key)
        if entry is not None:
            self._cache.move_to_end(key)
            return entry
        entry = _Entry(result_id(tenant, session, text), len(text.encode("utf-8", "surrogatepass")), {})
        self._cache[key] = entry
        self._cached += len(text)
        while self._cached > self._cache_bytes and len(self._cache) > 1:
            (_, _, old), _ = self._cache.popitem(last=False)
            self._cached -= len(old)
        return entry

    def _target(self, identity: Identity, rid: str) -> dict[str, Any]:
        """Where a notice sends the model, by retrieval mode (SPEC 7)."""
        mode = self.retrieval.mode
        if mode == "client":
            spec = self.retrieval.client_tool
            path = self.store.path(identity.tenant, identity.session, rid).resolve()
            return {"file_path": str(path), "tool": self.retrieval.client_tool_name,
                    "path_arg": spec.path_arg, "line_arg": spec.line_arg or "start_line",
                    "byte_arg": None}
        if mode == "none":
            url = f"{self.files_url}/{identity.tenant}/{identity.session}/{relative_path(rid)}"
            return {"file_path": url, "tool": "GET", "path_arg": "url",
                    "line_arg": "start_line", "byte_arg": None}
        return {"file_path": relative_path(rid), "tool": self.tool}

    def _cut(
        self, entry: _Entry, text: str, budget: int, read: ReadCall | None, identity: Identity
    ) -> str | None:
        if budget in entry.cuts:
            return entry.cuts[budget]
        if entry.size <= budget + self.config.slack_bytes:
            result = None
        elif read is not None:
            cut = truncate(
                text, budget, file_path=read.path, tool=read.tool,
                path_arg=read.spec.path_arg, line_arg=read.spec.line_arg or "start_line",
                byte_arg=None, line_offset=read.first_line - 1,
            )
            result = cut.text if cut else None
        else:
            cut = truncate(text, budget, **self._target(identity, entry.rid))
            result = cut.text if cut else None
        entry.cuts[budget] = result
        return result

    def _estimated_saving(self, text: str | None, read: ReadCall | None) -> int:
        """Bytes re-cutting this result would save: cheap, no truncation performed."""
        if text is None or 4 * len(text) <= self._floor:
            return 0
        size = len(text.encode("utf-8", "surrogatepass"))
        md = read.markdown if read else False
        now = min(size, self._budget(True, md))
        later = min(size, self._budget(False, md))
        return max(now - later, 0)

    def _offload(
        self, identity: Identity, text: str, budget: int, read: ReadCall | None,
        defer: list[_Pending] | None = None, at: int = -1,
    ) -> tuple[str | None, bool, bool]:
        """Cut `text` to `budget` and make sure its original is saved.

        Returns (the cut text or None when it fits, whether a file was written now, whether
        saving failed). A file that cannot be written means no cut: degrade, never drop.
        With `defer`, a file that must be written is appended to it as (`at`, id, text)
        instead; the caller writes it (off the event loop) before the cut is forwarded.
        """
        entry = self._entry(identity.tenant, identity.session, text)
        new = self._cut(entry, text, budget, read, identity)
        if new is None:
            return None, False, False
        try:
            if defer is None:
                return new, self.store.save(identity.tenant, identity.session, entry.rid, text), False
            if self.store.needs_write(identity.tenant, identity.session, entry.rid, text):
                defer.append((at, entry.rid, text))
                return new, True, False
            return new, False, False
        except (OSError, ValueError) as exc:
            log.warning("offload: cannot save tool result (%s); forwarding uncut", _why(exc))
            return None, False, True

    async def _stage(
        self, identity: Identity, files: list[_Pending], writes: Writes, failed: set[str]
    ) -> None:
        """A key the provider has not accepted yet: its originals are written durably where no
        tenant owns them, moved into place once the provider accepts the key and deleted when
        it rejects it (:mod:`proxy.writes`)."""
        store = self.store

        def stage() -> list[tuple[str, str, int]]:
            staged = []
            for _, rid, text in files:
                try:
                    staged.append((rid, *store.stage(rid, text)))
                except (OSError, ValueError) as exc:
                    log.warning("offload: cannot save tool result (%s); forwarding uncut",
                                _why(exc))
                    failed.add(rid)
            return staged

        staged = await asyncio.to_thread(stage)

        def promote() -> int:
            for rid, token, _ in staged:
                store.promote(identity.tenant, identity.session, rid, token)
            return sum(size for _, _, size in staged)

        def discard() -> None:
            for _, token, _ in staged:
                store.discard(token)

        if staged:
            await writes.write(promote, undo=discard)

    def _write_all(self, identity: Identity, files: list[_Pending]) -> tuple[int, set[str]]:
        """Write deferred originals; returns the bytes written and the ids that could not be."""
        failed: set[str] = set()
        written = 0
        for _, rid, text in files:
            try:
                written += self.store.write(identity.tenant, identity.session, rid, text)
            except (OSError, ValueError) as exc:
                log.warning("offload: cannot save tool result (%s); forwarding uncut", _why(exc))
                failed.add(rid)
        return written, failed

    def harder(self, messages: list[Message], identity: Identity, budget: int) -> list[Message]:
        """The last resort when even the newest turn is over budget: cut every tool result
        down to `budget`, offloading any that had not been (a message's own text is then
        its original)."""
        out = list(messages)
        changed = False
        for i, m in enumerate(messages):
            if m.get("role") not in ("tool", "function"):
                continue
            text = _text_of(m.get("content"))
            if text is None or 4 * len(text) <= budget:
                continue
            if parse_notice(text) is not None:
                new = recut(text, budget)
            else:
                new, _, _ = self._offload(identity, text, budget, None)
            if new is not None:
                out[i] = _with_text(m, new)
                changed = True
        return out if changed else messages

    # -- the stage -------------------------------------------------------------------------

    async def __call__(self, messages: list[Message], request: RequestView) -> StageOutcome:
        # New originals are written (fsynced, ms each) in a worker thread, never on the event
        # loop; a resent history only stats its files.
        files: list[_Pending] = []
        outcome = self.run(messages, request, aged_turns=0 if self.defer_ageing else None,
                           defer=files)
        if not files:
            return outcome
        failed: set[str] = set()

        def job() -> int:
            written, bad = self._write_all(request.identity, files)
            failed.update(bad)
            return written

        writes = request.writes
        # A cut is forwarded only once its original is on disk. A tenant over quota writes
        # nothing: its new results go uncut (those already saved stay cut).
        refused = writes is not None and writes.mode is Mode.OFF
        if refused:
            failed = {rid for _, rid, _ in files}
        elif writes is None:
            await asyncio.to_thread(job)
        elif writes.mode is Mode.HELD:
            await self._stage(request.identity, files, writes, failed)
        else:
            await writes.write(job)
        if not failed:
            return outcome
        out = list(outcome.messages)
        undone = {i for i, rid, _ in files if rid in failed}
        for i in undone:
            out[i] = messages[i]
        stats = dict(outcome.stats)
        stats["offloaded"] -= len(undone)
        stats["files_written"] -= len(undone)
        if not refused:
            stats["offload_errors"] += len(undone)
        changed = stats["offloaded"] > 0
        return StageOutcome(out if changed else messages, changed, stats)

    def run(
        self, messages: list[Message], request: RequestView, *, aged_turns: int | None,
        defer: list[_Pending] | None = None,
    ) -> StageOutcome:
        """Both stages; `aged_turns` re-cuts the results of the first that many tool-call
        turns (None: decide by the age policy)."""
        texts: dict[int, str] = {}
        for i, m in enumerate(messages):
            if m.get("role") in ("tool", "function"):
                text = _text_of(m.get("content"))
                if text is not None and 4 * len(text) > self._floor:
                    texts[i] = text
        if not texts:
            return StageOutcome(messages, False)

        reads = read_calls(messages, self.config.read_tools)
        turn_of, turns = ageing.tool_turns(messages)
        if aged_turns is None:
            per_turn = [0] * turns
            for i, text in texts.items():
                if turns:
                    rc = reads.get(messages[i].get("tool_call_id", ""))
                    per_turn[turn_of.get(i, 0)] += self._estimated_saving(text, rc)
            aged_upto = ageing.aged_upto(
                turns, self.config.recent_n, lambda t: per_turn[t],
                batched=self.config.age_policy == "batched",
                batch_bytes=self.config.age_batch_bytes,
            )
        else:
            aged_upto = min(aged_turns, max(turns - self.config.recent_n, 0))

        out = list(messages)
        offloaded = files_written = errors = saved = 0
        for i, text in texts.items():
            m = messages[i]
            aged = turn_of.get(i, turns) < aged_upto
            read = reads.get(m.get("tool_call_id", ""))
            budget = self._budget(not aged, read.markdown if read else False)
            if parse_notice(text) is not None:
                # Already carries a notice (a client that stored our output): never offload
                # again; stage 2 only rewrites the excerpt.
                new = recut(text, budget) if aged else None
            else:
                new, wrote, failed = self._offload(request.identity, text, budget, read, defer, i)
                files_written += wrote
                errors += failed
            if new is not None:
                out[i] = _with_text(m, new)
                offloaded += 1
                saved += len(text) - len(new)
        changed = offloaded > 0
        stats: dict[str, int] = {"offloaded": offloaded, "files_written": files_written, "offload_errors": errors,
                 "offload_chars_saved": saved, "aged_turns": aged_upto}
        return StageOutcome(out if changed else messages, changed, stats)


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{os.strerror(exc.errno)}"
    return type(exc).__name__

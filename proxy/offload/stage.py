"""The offload stage: two-stage truncation of tool results (docs/offload.md). Pure.

Stage 1 cuts a tool result over `recent_max_bytes + slack_bytes`, whose original is kept under
`tool_result/<id>.txt`; stage 2 cuts results of aged tool-call turns (see `ageing`) down to
`old_max_bytes` (not when the provider clears old tool results itself, an Anthropic
`clear_tool_uses` edit, nor results before the provider's newest compaction item, which it no
longer reads: :mod:`.native`; nor the reads a coming edit will quote: :mod:`.quotes`). Both
cuts are computed from the original the client resends, so the forwarded text depends only on
the history and the config: the same history always forwards the same bytes. Results of the client's own read tools point back to that tool and the original path.

The stage returns the originals its cuts point at as effects (:class:`FileWrite`); the runner
saves the ones not on disk yet before the request is forwarded, and forwards uncut a result
whose original could not be saved (:mod:`proxy.pipeline.runner`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.config.offload import OffloadConfig, ReadTool, ToolPolicy
from proxy.config.retrieval import RetrievalConfig
from proxy.filewise.markers import Pointer
from proxy.filewise.plan import FileForms, Form
from proxy.filewise.provenance import first_line, json_args, tool_path
from proxy.history.epoch import ageing_epoch
from proxy.history.native import head as native_head
from proxy.history.native import native, newest_compaction
from proxy.history.turns import RESULT_ROLES
from proxy.lru import LRU
from proxy.model import FileWrite, Message, RequestView, StageOutcome, result_text, tool_calls
from proxy.offload import ageing
from proxy.offload.policies import Policies
from proxy.offload.quotes import choose, working_set
from proxy.session import Identity
from proxy.store.paths import tool_result_file
from proxy.store.tool_results import relative_path, result_id
from proxy.truncation.cut import recut, truncate
from proxy.truncation.notice import parse_notice

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


def _frozen(messages: list[Message]) -> int:
    """Results through the turn of the provider's newest compaction item (the never-compacted
    head, :func:`proxy.pipeline.native.head`: the item's own turn included, whose results the
    readers group with it) keep the stage-1 cut they had on arrival, never aged or cut harder."""
    return 0 if newest_compaction(messages) is None else native_head(messages)


def read_calls(
    messages: list[Message], tools: Mapping[str, ReadTool]
) -> dict[str, ReadCall]:
    """tool_call_id -> ReadCall for every call of a configured read tool (the path as the
    call wrote it: the notice sends the model back to that tool with it)."""
    found: dict[str, ReadCall] = {}
    if not tools:
        return found
    for m in messages:
        if m.get("role") != "assistant":
            continue
        for cid, name, raw in tool_calls(m):
            spec = tools.get(name)
            if spec is None or not cid:
                continue
            args = json_args(raw)
            path = tool_path(args, spec.path_arg)
            if path:
                line = first_line(args.get(spec.line_arg)) if spec.line_arg else 1
                found[cid] = ReadCall(name, spec, path, line)
    return found


class Offloader:
    """The offload stage, pure: the cuts, and the originals they need kept (:class:`FileWrite`).

    Cuts are cached per (tenant, session, original) and budget, so a resent history costs a
    dictionary probe per result, and asking for the same history under another ageing state
    (the compaction in use changed) computes only the cuts that state adds.
    """

    name = "offload"

    def __init__(
        self,
        config: OffloadConfig,
        retrieval: RetrievalConfig,
        data_dir: Path,
        *,
        cache_bytes: int = 256 * 1024 * 1024,
        memo_bytes: int = 64 * 1024 * 1024,
        files_url: str = "http://127.0.0.1:4000/files",
    ) -> None:
        self.config = config
        self.tool = retrieval.tool_name
        self.retrieval = retrieval
        self.files_url = files_url.rstrip("/")
        self.data_dir = Path(data_dir)
        # Sized by the original each entry pins and the cuts it will hold (at most one per
        # budget: stage 1's and stage 2's, each about its budget).
        cuts = config.recent_max_bytes + config.old_max_bytes + 2 * 1024
        self._cache: LRU[tuple[str, str, str], _Entry] = LRU(
            cache_bytes, lambda key, _: len(key[2]) + min(len(key[2]), cuts) + 200
        )
        # Quote protection's working set per session epoch (it depends on history[:seen]
        # alone): parsing every call of a long history again on each request is the cost.
        self._working: LRU[tuple[str, str, int, str], Mapping[int, str]] = LRU(
            memo_bytes // 4, lambda _, found: 64 + sum(200 + len(p) for p in found.values()))
        self.policies = Policies(config.policies, cache_bytes=memo_bytes // 4)
        self.filewise = FileForms(config, cache_bytes=memo_bytes // 2)
        # The smallest size any cut applies to: anything at or below it is never touched.
        budgets = [config.old_max_bytes, config.recent_max_bytes]
        for policy in config.policies:
            budgets += [b for b in (policy.offload_max_bytes, policy.old_max_bytes) if b]
        self._floor = min(budgets) + config.slack_bytes

    # -- budgets ---------------------------------------------------------------------------

    def _budget(self, recent: bool, markdown: bool, policy: ToolPolicy | None = None) -> int:
        c = self.config
        fresh = c.recent_max_bytes
        old = c.old_max_bytes
        if policy is not None:
            fresh = policy.offload_max_bytes or fresh
            old = policy.old_max_bytes or old
        budget = fresh if recent else min(old, fresh)
        return max(budget, c.markdown_max_bytes) if markdown else budget

    # -- per message -----------------------------------------------------------------------

    def _entry(self, tenant: str, session: str, text: str) -> _Entry:
        key = (tenant, session, text)
        entry = self._cache.get(key)
        if entry is None:
            size = len(text.encode("utf-8", "surrogatepass"))
            entry = _Entry(result_id(tenant, session, text), size, {})
            self._cache.put(key, entry)
        return entry

    def _target(self, identity: Identity, rid: str) -> dict[str, Any]:
        """Where a notice sends the model, by retrieval mode (docs/retrieval.md)."""
        mode = self.retrieval.mode
        if mode == "client":
            spec = self.retrieval.client_tool
            path = os.path.abspath(
                tool_result_file(self.data_dir, identity.tenant, identity.session, rid)
            )
            return {"file_path": path, "tool": self.retrieval.client_tool_name,
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
        self, identity: Identity, text: str, budget: int, read: ReadCall | None
    ) -> tuple[str | None, str]:
        """``text`` cut to ``budget`` (None when it fits) and the id of its original."""
        entry = self._entry(identity.tenant, identity.session, text)
        return self._cut(entry, text, budget, read, identity), entry.rid

    def harder(
        self, messages: list[Message], identity: Identity, budget: int,
        spare: frozenset[str] = frozenset(),
    ) -> StageOutcome:
        """Every tool result cut down to ``budget`` (the last resort when even the kept turns
        are over the threshold) but those answering the calls in ``spare``; a result not
        offloaded before needs its original kept."""
        out = list(messages)
        files: list[FileWrite] = []
        frozen = _frozen(messages)
        for i, m in enumerate(messages):
            if m.get("role") not in RESULT_ROLES or i < frozen or m.get("tool_call_id") in spare:
                continue
            text = result_text(m.get("content"))
            if text is None or 4 * len(text) <= budget:
                continue
            if parse_notice(text) is not None:
                new = recut(text, budget)
            else:
                new, rid = self._offload(identity, text, budget, None)
                if new is not None:
                    files.append(FileWrite(i, rid, text))
            if new is not None:
                out[i] = _with_text(m, new)
        changed = any(a is not b for a, b in zip(out, messages, strict=True))
        return StageOutcome(out if changed else messages, changed, {}, tuple(files))

    def needs_work(self, messages: list[Message], request: RequestView, *,
                   seen: int | None = None, kept_from: int = 0) -> bool:
        """Whether :meth:`run` (with these ``seen``, ``kept_from``) would cut a result it has
        not cut before, or decide a file-aware form not decided yet (truncating megabytes is
        worth a worker thread; a resent history is a dictionary probe per result)."""
        tenant, session = request.identity.tenant, request.identity.session
        for m in messages:
            if m.get("role") in RESULT_ROLES:
                text = result_text(m.get("content"))
                if text is not None and 4 * len(text) > self._floor and (
                    (tenant, session, text) not in self._cache
                ):
                    return True
        # A result the file-aware rules have not decided yet (a delta, a search for repeats).
        return self.filewise.undecided(messages, request, seen=seen or 0,
                                       first=max(_frozen(messages), kept_from))

    # -- the stage -------------------------------------------------------------------------

    def __call__(self, messages: list[Message], request: RequestView) -> StageOutcome:
        """Both stages, ageing by the configured policy alone (no compaction in use)."""
        return self.run(messages, request, aged_turns=None)

    def _texts(self, messages: list[Message]) -> dict[int, str]:
        texts: dict[int, str] = {}
        for i, m in enumerate(messages):
            if m.get("role") in RESULT_ROLES:
                text = result_text(m.get("content"))
                if text is not None and 4 * len(text) > self._floor:
                    texts[i] = text
        return texts

    def protected(
        self, messages: list[Message], request: RequestView, *, aged_turns: int | None,
        seen: int | None = None, kept_from: int = 0, protect_bytes: int | None = None,
    ) -> frozenset[str]:
        """The tool_call_ids of the results :meth:`run` (same arguments) keeps at stage 1: the
        reads quote protection keeps, and the results a ``protect`` policy never cuts."""
        texts = self._texts(messages)
        if not texts:
            return frozenset()
        never = frozenset(
            cid for i, p in self.policies.of_results(messages).items()
            if p.protect and isinstance(cid := messages[i].get("tool_call_id"), str))
        reads = read_calls(messages, self.config.read_tools)
        _, spare, _ = self._ageing(messages, request, texts, reads, aged_turns, seen, kept_from,
                                protect_bytes)
        ids = (messages[i].get("tool_call_id") for i in spare)
        return never | frozenset(cid for cid in ids if isinstance(cid, str))

    def _ageing(
        self, messages: list[Message], request: RequestView, texts: dict[int, str],
        reads: dict[str, ReadCall], aged_turns: int | None, seen: int | None, kept_from: int,
        protect_bytes: int | None,
    ) -> tuple[int, frozenset[int], int | None]:
        """How many leading tool-call turns are aged, the indices of the aged reads quote
        protection keeps at their stage-1 cut, and the history index the ageing was decided
        at (the epoch's start; None: no ageing decided yet)."""
        c = self.config
        turn_of, turns = ageing.tool_turns(messages)
        if native(request).clears_tool_results:
            # The provider clears old results itself: stage 2 (and with it every rewrite at an
            # epoch, superseded reads too) stands down.
            return 0, frozenset(), None
        if aged_turns is None:
            per_turn = [0] * turns
            for i, text in texts.items():
                if turns:
                    rc = reads.get(messages[i].get("tool_call_id", ""))
                    per_turn[turn_of.get(i, 0)] += self._estimated_saving(text, rc)
            aged_upto = ageing.aged_upto(
                turns, c.recent_n, lambda t: per_turn[t],
                batched=c.age_policy == "batched", batch_bytes=c.age_batch_bytes,
            )
            if seen is None:  # the watermark's own epoch began where it last jumped
                seen = ageing_epoch(messages, aged_upto, c.recent_n)
        else:
            aged_upto = min(aged_turns, max(turns - c.recent_n, 0))
        budget = c.protect_edit_bytes if protect_bytes is None else protect_bytes
        if not aged_upto or budget <= 0:
            return aged_upto, frozenset(), seen
        frozen = max(_frozen(messages), kept_from)
        candidates: dict[int, int] = {}
        for i, text in texts.items():
            if i >= frozen and turn_of.get(i, turns) < aged_upto:
                rc = reads.get(messages[i].get("tool_call_id", ""))
                kept = text if parse_notice(text) is not None else self._offload(
                    request.identity, text, self._budget(True, rc.markdown if rc else False), rc
                )[0] or text
                candidates[i] = len(kept.encode("utf-8", "surrogatepass"))
        return aged_upto, choose(
            self._working_set(messages, request, len(messages) if seen is None else seen),
            candidates, budget), seen

    def _working_set(
        self, messages: list[Message], request: RequestView, seen: int
    ) -> Mapping[int, str]:
        c = self.config
        chains = request.chains
        if not (0 < seen <= len(chains) == len(messages)):
            return working_set(messages, seen, c.read_tools, recent_turns=c.protect_recent_turns)
        ident = request.identity
        key = (ident.tenant, ident.session, seen, chains[seen - 1])
        found = self._working.get(key)
        if found is None:
            found = working_set(messages, seen, c.read_tools,
                                recent_turns=c.protect_recent_turns)
            self._working.put(key, found)
        return found

    def run(
        self, messages: list[Message], request: RequestView, *, aged_turns: int | None,
        seen: int | None = None, kept_from: int = 0, protect_bytes: int | None = None,
    ) -> StageOutcome:
        """Both stages; ``aged_turns`` re-cuts the results of the first that many tool-call
        turns (None: decide by the age policy), but the reads quote protection keeps, decided
        on the first ``seen`` messages (the history when the ageing was decided: the
        compaction's request; None with ``aged_turns``: all of them). Results before
        ``kept_from`` (replaced by the summary) are not protected; ``protect_bytes`` overrides
        ``offload.protect_edit_bytes``."""
        texts = self._texts(messages)
        filewise = (self.filewise.enabled and len(request.chains) == len(messages)
                    and any(m.get("role") in RESULT_ROLES for m in messages))
        if not texts and not filewise:
            return StageOutcome(messages, False)  # nothing either stage or rule could touch

        reads = read_calls(messages, self.config.read_tools)
        turn_of, turns = ageing.tool_turns(messages)
        aged_upto, spare, epoch = self._ageing(messages, request, texts, reads, aged_turns, seen,
                                               kept_from, protect_bytes)

        out = list(messages)
        files: list[FileWrite] = []
        offloaded = saved = 0
        frozen = _frozen(messages)
        policies = self.policies.of_results(messages)

        def is_aged(i: int) -> bool:
            return turn_of.get(i, turns) < aged_upto and i >= frozen and i not in spare

        forms: dict[int, Form] = {}
        if filewise:
            forms = self.filewise.plan(
                messages, request, seen=epoch or 0, first=max(frozen, kept_from),
                policies=policies, aged=is_aged,
                stays_whole=lambda i, text: self._fits(messages[i], text, reads,
                                                       policies.get(i)),
                saved=lambda text: self._pointer(request.identity, text))
        kinds: dict[str, int] = {}
        for i, form in forms.items():
            text = result_text(messages[i].get("content")) or ""
            out[i] = _with_text(messages[i], form.text)
            files.append(FileWrite(i, self._entry(request.identity.tenant,
                                                  request.identity.session, text).rid, text))
            kinds[form.kind] = kinds.get(form.kind, 0) + 1
            saved += len(text) - len(form.text)
        work = request.work
        for i, text in texts.items():
            if work is not None:
                work.spend(len(text))
            m = messages[i]
            policy = policies.get(i)
            if i in forms or (policy is not None and policy.protect):
                continue  # a file-aware form; or never cut (docs/offload.md#per-tool-policies)
            aged = is_aged(i)
            read = reads.get(m.get("tool_call_id", ""))
            budget = self._budget(not aged, read.markdown if read else False, policy)
            if parse_notice(text) is not None:
                # Already carries a notice (a client that stored our output): never offload
                # again; stage 2 only rewrites the excerpt.
                new = recut(text, budget) if aged else None
            else:
                new, rid = self._offload(request.identity, text, budget, read)
                if new is not None:
                    files.append(FileWrite(i, rid, text))
            if new is not None:
                out[i] = _with_text(m, new)
                offloaded += 1
                saved += len(text) - len(new)
        changed = offloaded > 0 or bool(forms)
        stats = {"offloaded": offloaded, "offload_chars_saved": saved, "aged_turns": aged_upto,
                 "quotes_protected": len(spare),
                 **{f"files_{kind}": n for kind, n in kinds.items()}}
        return StageOutcome(out if changed else messages, changed, stats, tuple(files))

    def _fits(self, message: Message, text: str, reads: Mapping[str, ReadCall],
              policy: ToolPolicy | None) -> bool:
        """Whether stage 1 forwards ``text`` whole (it fits its budget)."""
        if 4 * len(text) <= self._floor:
            return True
        read = reads.get(message.get("tool_call_id", ""))
        budget = self._budget(True, read.markdown if read else False, policy)
        return len(text.encode("utf-8", "surrogatepass")) <= budget + self.config.slack_bytes

    def _pointer(self, identity: Identity, text: str) -> Pointer:
        """Where a file-aware form says the original is kept (the offloaded file, read as the
        retrieval mode says)."""
        rid = self._entry(identity.tenant, identity.session, text).rid
        t = self._target(identity, rid)
        return Pointer(t["file_path"], t["tool"], t.get("path_arg", "file_path"),
                       t.get("line_arg", "start_line"))

"""The pre-reasoning pipeline for one request: pure stages, effects carried out through the
services (docs/architecture.md#how-a-request-flows).

    summary in use   <- compactor.state()                     (store, cached per session)
    offload          <- Offloader.run(history, ageing of that summary, quote protection
                        decided on the history it was made at)             pure -> originals
    originals kept   <- OffloadedFiles (worker thread); a cut whose original could not be
                        saved is forwarded uncut
    plan             <- Planner.plan(...)                                   pure
      need           -> compactor.obtain()  (summarizer call, single flight, persistence), then
                        the history is offloaded for the new summary's ageing (cached cuts) and
                        planned again
      prepare        -> compactor.prepare() (background)
      still over     -> Offloader.harder() on every kept result (first sparing the reads
                        quote protection keeps)                           pure -> originals
    epoch            <- drop_thinking(): the kept turns produced before the epoch (the
                        summary's request) lose their signed thinking blocks  pure
    memory           <- memory.message() (the version pinned for the session and the summary
                        in use), inserted after the leading system messages  pure
    replay           <- the proxy's read rounds of the answers still forwarded (store, cached)
                        put back before them (pipeline.replay)               pure
    validate, count                                                         pure

Offload runs once per request in the sense that matters: each cut is computed once (cached per
original and budget) and materialized for the compaction in use. The pure steps of a large
request run in a worker thread, so tokenizing and cutting megabytes never blocks the event loop.
A step that fails is logged and skipped: the request goes on with the messages as they were.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from proxy.compaction.planner import Decision, Planner
from proxy.history.epoch import ageing_epoch, drop_thinking
from proxy.history.native import head as native_head
from proxy.history.turns import leading_system_count
from proxy.lru import LRU
from proxy.memory.inject import inject
from proxy.model import FileWrite, Message, PipelineResult, RequestView, Stage, StageOutcome
from proxy.offload.ageing import aged_at
from proxy.offload.stage import Offloader
from proxy.pipeline.validate import ValidateStage
from proxy.retrieval.replay import Source as RoundsSource
from proxy.retrieval.replay import run as replay_rounds
from proxy.store.interfaces import Originals
from proxy.store.summaries import SummaryRecord
from proxy.tokens.request import CountStage, RequestCounter
from proxy.work import Work
from proxy.writes import Mode

__all__ = ["Pipeline"]

log = logging.getLogger("proxy.pipeline")

T = TypeVar("T")


class Compaction(Protocol):
    enabled: bool

    async def state(self, request: RequestView) -> SummaryRecord | None: ...

    def prepared_plan(self, request: RequestView, summary: SummaryRecord | None) -> Any: ...

    async def obtain(self, plan: Any, request: RequestView, tokens: int) -> SummaryRecord: ...

    def prepare(self, plan: Any, request: RequestView, tokens: int) -> None: ...


class MemoryStep(Protocol):
    enabled: bool

    async def message(self, request: RequestView, epoch: str) -> Message | None: ...


class Pipeline:
    def __init__(
        self,
        *,
        offloader: Offloader,
        planner: Planner,
        compactor: Compaction,
        counter: RequestCounter,
        originals: Originals,
        timed_ageing: bool,
        old_max_bytes: int,
        stages: Sequence[Stage] | None = None,
        memory: MemoryStep | None = None,
        replay: RoundsSource | None = None,
    ) -> None:
        self.offloader = offloader
        self.memory = memory
        self.replay = replay
        self.planner = planner
        self.compactor = compactor
        self.counter = counter
        self.originals = originals
        # Batched ageing with compaction on: stage 2 is timed to compactions (ageing.aged_at).
        self.timed_ageing = timed_ageing
        self.old_max_bytes = old_max_bytes
        self.validate = ValidateStage()
        self.count = CountStage(counter)
        self.custom = list(stages) if stages is not None else None
        # Sessions this process has counted before: a session seen for the first time (a new
        # one, or one resumed after a restart) has its whole history to tokenize.
        self._seen: LRU[tuple[str, str], bool] = LRU(65536)

    # -- running ---------------------------------------------------------------------------

    async def run(self, request: RequestView) -> PipelineResult:
        """The messages to forward. Raises :class:`.work.Cancelled` once ``request.work`` is
        cancelled (its client is gone), at the next point between units of work: stages are
        pure and their effects (originals written) are carried out whole or not at all, so
        nothing durable is left half-done."""
        start = time.perf_counter()
        if self.custom is not None:
            return await self._run_custom(request, start)
        work = request.work
        stats: dict[str, int] = {}
        failed: list[str] = []
        history = _as_list(request.messages)
        await self.counter.ready(request.model)  # an encoding's first load: off the loop

        summary: SummaryRecord | None = None
        compacting = self.compactor.enabled and history and len(request.chains) == len(history)
        if compacting:
            try:
                found = await self.compactor.state(request)
                summary = self.planner.usable(found, history, request)
            except Exception:
                log.exception("looking up the summary in use failed; compacting without it")
                failed.append("compact")
                compacting = False

        messages = history
        try:
            outcome = await self._offload(history, request, summary)
            messages = outcome.messages
            _add(stats, outcome.stats)
        except Exception:
            log.exception("stage offload failed; forwarding without it")
            failed.append("offload")

        _check(work)
        if compacting:
            try:
                messages, summary = await self._compact(history, messages, request, summary,
                                                        stats)
            except Exception:
                log.exception("stage compact failed; forwarding without it")
                failed.append("compact")

        # The turns produced before the current epoch began lose their signed thinking
        # (pipeline.epoch): the epoch of the summary in use began with the request that made
        # it (every turn up to now for a summary stored before ``seen`` was recorded: always
        # valid, since no turn's thinking then goes out intact once and changed later); without
        # compaction, ageing's own rewrites start one; the last resort's harder cuts may change
        # any kept result.
        before = 0
        if compacting and summary is not None:
            before = summary.seen or len(history)
        if not self.timed_ageing and stats.get("aged_turns"):
            before = max(before, ageing_epoch(history, stats["aged_turns"],
                                              self.offloader.config.recent_n))
        last_resort = bool(stats.pop("last_resort", 0))
        if last_resort:
            before = len(history)
        epoch = ""
        if summary is not None or before:
            # Under the last resort every turn is forwarded without its thinking while it lasts
            # (``before`` moves each request) but the prefix holds: one epoch.
            epoch = f"{summary.chain if summary is not None else ''}:{'lr' if last_resort else before}"
        if before:
            # Not the head: what precedes a provider compaction item keeps its prefix (native).
            messages = drop_thinking(messages, history, before, native_head(history))

        _check(work)
        memory = self.memory
        if memory is not None and memory.enabled and history and (
            len(request.chains) == len(history)  # not a history kept upstream
        ):
            try:
                note = await memory.message(request, summary.chain if summary else "")
                if note is not None:
                    messages = inject(messages, note, leading_system_count(history))
                    stats["memory_bytes"] = len(str(note.get("content", "")).encode())
            except Exception:
                log.exception("stage memory failed; forwarding without it")
                failed.append("memory")

        replay = self.replay  # the proxy's read rounds, put back (not in a history upstream)
        if replay is not None and replay.enabled and len(request.chains) == len(history):
            try:
                outcome = await replay_rounds(replay, messages, history, request, before)
                messages = outcome.messages
                _add(stats, outcome.stats)
            except Exception:
                log.exception("stage replay failed; forwarding without it")
                failed.append("replay")

        for stage in (self.validate, self.count):
            _check(work)
            # Counting covers what the client sent too (tokens in): its new outputs, whole.
            heavy = stage is self.count and (
                self._tokenizes(messages, request) or self._tokenizes(history, request)
            )
            try:
                outcome = await self._cpu(heavy, stage, messages, request)
            except Exception:
                log.exception("stage %s failed; forwarding without it", stage.name)
                failed.append(stage.name)
                continue
            messages = outcome.messages
            _add(stats, outcome.stats)
        self._seen.put((request.identity.tenant, request.identity.session), True)
        if work is not None:
            stats["work"] = work.spent
            if work.degraded:
                stats["degraded"] = 1
        changed = len(messages) != len(history) or any(
            a is not b for a, b in zip(messages, history, strict=False)
        )
        return PipelineResult(
            messages, changed, stats, tuple(failed), (time.perf_counter() - start) * 1000,
            epoch=epoch,
            evicted=range(summary.head, summary.upto) if summary is not None else None,
        )

    async def _run_custom(self, request: RequestView, start: float) -> PipelineResult:
        """The stages given to :func:`proxy.app.create_app` instead of the default pipeline."""
        messages = _as_list(request.messages)
        changed = False
        stats: dict[str, int] = {}
        failed: list[str] = []
        for stage in self.custom or ():
            try:
                outcome: Any = stage(messages, request)
                if inspect.isawaitable(outcome):
                    outcome = await outcome
                outcome = await self._keep(outcome, messages, request)
            except Exception:
                log.exception("stage %s failed; forwarding without it", stage.name)
                failed.append(stage.name)
                continue
            messages = outcome.messages
            changed = changed or outcome.changed
            _add(stats, outcome.stats)
        return PipelineResult(
            messages, changed, stats, tuple(failed), (time.perf_counter() - start) * 1000
        )

    @staticmethod
    async def _cpu(heavy: bool, fn: Callable[..., T], *args: Any) -> T:
        """Pure work: in a worker thread when it is heavy (cutting or tokenizing texts not seen
        before), inline otherwise: a resent history is all cache hits, and a thread hop (with
        the GIL to win back) would cost more than the work."""
        if heavy:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    def _tokenizes(self, messages: Sequence[Message], request: RequestView) -> bool:
        if not request.large:
            return False
        ident = request.identity
        if self._seen.get((ident.tenant, ident.session)) is None:
            return True
        return self.counter.needs_work(messages, request.model)

    # -- offload ---------------------------------------------------------------------------

    def _aged(self, history: list[Message], summary: SummaryRecord | None) -> int | None:
        if not self.timed_ageing:
            return None  # the age policy decides from the history alone
        if summary is None or not summary.seen:
            return 0
        return aged_at(history, summary.seen, self.offloader.config.recent_n)

    def _ageing(
        self, history: list[Message], request: RequestView, summary: SummaryRecord | None
    ) -> dict[str, Any]:
        """The ageing arguments of :meth:`Offloader.run` for the summary in use: which turns
        are aged, and the history quote protection is decided on (the compaction's request,
        so it holds for the epoch). Protection never takes more than what compaction keeps
        verbatim (``keep_recent_ratio`` of the window, at 4 bytes a token): the split is
        measured with stage-1 cuts, so the kept turns cannot outgrow that share anyway."""
        timed = self.timed_ageing and summary is not None
        return {
            "aged_turns": self._aged(history, summary),
            "seen": summary.seen if timed and summary is not None else None,
            "kept_from": summary.upto if summary is not None else 0,
            "protect_bytes": min(self.offloader.config.protect_edit_bytes,
                                 4 * self.planner.budget(request).keep),
        }

    async def _offload(
        self, history: list[Message], request: RequestView, summary: SummaryRecord | None
    ) -> StageOutcome:
        ageing = self._ageing(history, request, summary)
        heavy = request.large and self.offloader.needs_work(
            history, request, seen=ageing["seen"], kept_from=ageing["kept_from"])
        outcome = await self._cpu(
            heavy, lambda: self.offloader.run(history, request, **ageing)
        )
        return await self._keep(outcome, history, request)

    async def _keep(
        self, outcome: StageOutcome, before: list[Message], request: RequestView
    ) -> StageOutcome:
        """Carry out a stage's effects: the originals its cuts point at are saved before the
        cuts can be forwarded; a cut whose original could not be saved is undone (the message
        as it was before the stage goes out)."""
        if not outcome.files:
            return outcome
        ident = request.identity
        writes = request.writes
        store = self.originals
        missing = [f for f in outcome.files
                   if store.needs_write(ident.tenant, ident.session, f.rid, f.text)]
        failed: set[str] = set()
        refused = writes is not None and writes.mode is Mode.OFF
        if missing:
            if refused:
                failed = {f.rid for f in missing}  # over quota: no new originals, no new cuts
            elif writes is not None and writes.mode is Mode.HELD:
                failed = await self._stage(missing, request)
            else:
                failed = await self._write(missing, request)
        stats = dict(outcome.stats)
        stats["files_written"] = stats.get("files_written", 0) + len(missing) - len(failed)
        if not failed:
            return StageOutcome(outcome.messages, outcome.changed, stats)
        out = list(outcome.messages)
        undone = {f.index for f in outcome.files if f.rid in failed}
        for i in undone:
            out[i] = before[i]
        stats["offloaded"] = stats.get("offloaded", 0) - len(undone)
        if not refused:
            stats["offload_errors"] = stats.get("offload_errors", 0) + len(undone)
        changed = any(a is not b for a, b in zip(out, before, strict=False)) or len(out) != len(before)
        return StageOutcome(out if changed else before, changed, stats)

    async def _write(self, files: list[FileWrite], request: RequestView) -> set[str]:
        """Write originals (fsynced: ms each) in a worker thread; the ids that failed."""
        ident = request.identity
        store = self.originals
        failed: set[str] = set()

        def job() -> int:
            written = 0
            for f in files:
                try:
                    written += store.write(ident.tenant, ident.session, f.rid, f.text)
                except (OSError, ValueError) as exc:
                    log.warning("offload: cannot save tool result (%s); forwarding uncut", _why(exc))
                    failed.add(f.rid)
            return written

        if request.writes is None:
            await asyncio.to_thread(job)
        else:
            await request.writes.write(job)
        return failed

    async def _stage(self, files: list[FileWrite], request: RequestView) -> set[str]:
        """A key the provider has not accepted yet: originals are written durably where no
        tenant owns them, moved into place once it accepts the key and deleted when it rejects
        it (:mod:`proxy.writes`). The ids that could not even be staged."""
        ident = request.identity
        store = self.originals
        failed: set[str] = set()

        def stage() -> list[tuple[str, str, int]]:
            staged = []
            for f in files:
                try:
                    staged.append((f.rid, *store.stage(f.rid, f.text)))
                except (OSError, ValueError) as exc:
                    log.warning("offload: cannot save tool result (%s); forwarding uncut", _why(exc))
                    failed.add(f.rid)
            return staged

        staged = await asyncio.to_thread(stage)

        def promote() -> int:
            for rid, token, _ in staged:
                store.promote(ident.tenant, ident.session, rid, token)
            return sum(size for _, _, size in staged)

        def discard() -> None:
            for _, token, _ in staged:
                store.discard(token)

        if staged and request.writes is not None:
            await request.writes.write(promote, undo=discard)
        return failed

    # -- compaction ------------------------------------------------------------------------

    async def _compact(
        self,
        history: list[Message],
        offloaded: list[Message],
        request: RequestView,
        summary: SummaryRecord | None,
        stats: dict[str, int],
    ) -> tuple[list[Message], SummaryRecord | None]:
        """The messages to forward and the summary in use after compaction."""
        # Splits are measured on the history with stage-1 cuts only (what the kept turns weigh
        # before the compaction ages them): pure, cached cuts, and only when a split is needed.
        def stage_one() -> list[Message]:
            if not (self.timed_ageing and self._aged(history, summary)):
                return offloaded
            return self.offloader.run(history, request, aged_turns=0).messages

        split_from = stage_one
        decision = await self._plan(offloaded, request, summary, split_from, True)
        compacted_now = 0
        for _ in range(2):  # a prepared compaction may be one step short: then go again
            if not decision.over or decision.need is None:
                break
            summary = await self.compactor.obtain(decision.need, request, decision.tokens)
            compacted_now = 1
            offloaded = (await self._offload(history, request, summary)).messages
            decision = await self._plan(offloaded, request, summary, split_from, False)
        applied = decision.applied
        if decision.over:
            spare = self.offloader.protected(history, request,
                                             **self._ageing(history, request, decision.summary))
            cut = await self._last_resort(applied, request, decision, spare)
            if cut is not applied:
                stats["last_resort"] = 1  # read (and dropped) by run()
            applied = cut
        elif not compacted_now and decision.prepare is not None:
            self.compactor.prepare(decision.prepare, request, decision.tokens)
        _add(stats, {"compacted": int(decision.summary is not None), "compactions": compacted_now,
                     "tokens_budget": decision.budget.threshold})
        return applied, decision.summary

    async def _plan(
        self, messages: list[Message], request: RequestView, summary: SummaryRecord | None,
        split_from: Callable[[], list[Message]], may_prepare: bool,
    ) -> Decision:
        prepared = self.compactor.prepared_plan(request, summary)
        return await self._cpu(
            self._tokenizes(messages, request),
            lambda: self.planner.plan(messages, request, summary, split_from=split_from,
                                      prepared=prepared, may_prepare=may_prepare),
        )

    async def _last_resort(
        self, applied: list[Message], request: RequestView, decision: Decision,
        spare: frozenset[str] = frozenset(),
    ) -> list[Message]:
        """Even the kept turns are over the threshold: every tool result is cut harder, to
        ``old_max_bytes`` (but the reads quote protection keeps, ``spare``) and then, all of
        them, to 1 KB: a request the provider refuses is worse than an edit that fails. All of
        them, not just as many as needed, so that while this lasts the forwarded prefix stays
        the same from turn to turn."""
        threshold = decision.budget.threshold
        tokens = decision.tokens
        for size, keep in ((self.old_max_bytes, spare), (1024, frozenset[str]())):
            if tokens <= threshold:
                break
            outcome = await self._cpu(
                request.large, self.offloader.harder, applied, request.identity, size, keep
            )
            applied = (await self._keep(outcome, applied, request)).messages
            tokens = await self._cpu(self._tokenizes(applied, request), self.planner.count,
                                     applied, request)
        if tokens > threshold:
            log.warning(
                "request still over the threshold after compaction (%d > %d tokens); forwarding",
                tokens, threshold,
            )
        return applied


def _check(work: Work | None) -> None:
    if work is not None:
        work.check()


def _as_list(messages: Sequence[Message]) -> list[Message]:
    # The very list when it is one: an unchanged result is then the client's own list.
    return messages if isinstance(messages, list) else list(messages)


def _add(stats: dict[str, int], more: Mapping[str, int]) -> None:
    for key, value in more.items():
        stats[key] = stats.get(key, 0) + value


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{os.strerror(exc.errno)}"
    return type(exc).__name__

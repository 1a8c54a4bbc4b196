"""The services a request is handled with, built once by the app's lifespan.

    Services
      gate, metrics            who is calling; the Prometheus registry
      upstreams                the pooled clients for the OpenAI-compatible and the Anthropic
                               upstreams and their forwarders, chosen by wire format (a
                               credential only ever goes to its own format's provider)
      router                   model_list routes through litellm (imported on first use)
      store                    the storage backend (files + SQLite, or PostgreSQL)
      originals                offloaded originals (store)
      archive                  the dialog archive service: request before forwarding, answer after
      summaries, sessions      summary records and per-session counters (for /files)
      compactor                finds, obtains, prepares and keeps summaries
      memory                   long-term memory: facts, folds, the version a request carries
      pipeline                 the pure stages and their effects, per request
      readers                  the proxy's read tool and its loop, per wire format
      thinking                 the sessions whose thinking blocks need drop_block (Messages)
      replays                  the loops' rounds, put back on later turns (proxy.retrieval.rounds)
      ledger                   every billed call: provider usage, cost, the counterfactual
      writes, usage            what a request may write; disk used per tenant
      background               work after the response, drained on shutdown (and by tests)
      gc                       expiry and disk measurement, at start-up and hourly
      telemetry                OpenTelemetry spans per request (off: a null object, no import)
      heap                     the C heap's free pages handed back after large requests

None of them is optional: a feature that is off, or a store that cannot be opened, is a null
object with the same methods. Nothing here is a module global: :func:`open_services` builds them
and :meth:`Services.close` releases them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from proxy.archive import Archive, NullArchive
from proxy.auth import Gate
from proxy.background import Background
from proxy.catalog import Capabilities, ModelFacts
from proxy.catalog.data import ensure_tiktoken_offline, read_litellm_model_map
from proxy.catalog.prices import Price, Prices
from proxy.catalog.windows import ContextWindows
from proxy.compaction.client import CallKind, SummarizerClient
from proxy.compaction.compactor import Compactor, NullCompactor
from proxy.compaction.planner import Planner
from proxy.config import Config
from proxy.config.ledger import LedgerConfig, PriceConfig
from proxy.heap import Trimmer, limit_arenas
from proxy.ledger.service import Ledger, NullLedger
from proxy.memory.service import Memory, NullMemory
from proxy.metrics import Metrics
from proxy.model import Stage
from proxy.offload.stage import Offloader
from proxy.pipeline.runner import Pipeline
from proxy.retrieval.loop import Reader, ReadLoop
from proxy.retrieval.messages_loop import MessagesReader
from proxy.retrieval.responses_loop import ResponsesReader
from proxy.retrieval.rounds import Replays
from proxy.retrieval.tool import ReadTool
from proxy.store.backend import open_backend
from proxy.store.interfaces import (
    MemoryStore,
    Originals,
    SessionFiles,
    SessionIndex,
    StoreBackend,
    Summaries,
)
from proxy.store.sessions import SessionCounters, SessionRow
from proxy.store.summaries import SummaryRecord
from proxy.store.usage import DiskUsage
from proxy.telemetry import Telemetry, open_telemetry
from proxy.tokens.counter import TokenCounter
from proxy.tokens.request import RequestCounter
from proxy.upstream.calls import CallSink
from proxy.upstream.forward import Forwarder
from proxy.upstream.http import Upstream
from proxy.upstream.litellm_route import LitellmRouter
from proxy.upstream.providers import Upstreams
from proxy.upstream.thinking import ThinkingBindings
from proxy.writes import WritePolicy

__all__ = ["Services", "cache_split", "files_url", "open_services"]

log = logging.getLogger("proxy")

GC_INTERVAL_S = 3600.0


class _NoSessions:
    """No database: no counters to show."""

    def update_session_stats(
        self, tenant: str, session: str, *, now: datetime | None = None, **increments: int
    ) -> SessionRow:
        raise RuntimeError("no database")

    def sessions(self, tenant: str | None = None) -> list[SessionRow]:
        return []

    def session_stats(self, tenant: str, session: str) -> SessionRow | None:
        return None

    def thinking_dropped(self, tenant: str, session: str) -> bool:
        return False

    def mark_thinking_dropped(self, tenant: str, session: str) -> None:
        return None


class _NoSummaries:
    """No database: no summaries (compaction is off then)."""

    def get(self, tenant: str, session: str, chain: str) -> SummaryRecord | None:
        return None

    def chains(self, tenant: str, session: str) -> set[str]:
        return set()

    def put(self, record: SummaryRecord, *, replace: bool = False) -> SummaryRecord:
        return record

    def history(self, tenant: str, session: str) -> list[SummaryRecord]:
        return []


@dataclass(frozen=True, slots=True)
class Services:
    config: Config
    gate: Gate
    metrics: Metrics
    upstreams: Upstreams  # by wire format: every call the proxy makes picks its upstream here
    router: LitellmRouter
    store: StoreBackend
    originals: Originals
    files: SessionFiles
    archive: Archive | NullArchive
    summaries: Summaries
    sessions: SessionIndex
    compactor: Compactor | NullCompactor
    memory: Memory | NullMemory
    pipeline: Pipeline
    readers: Mapping[str, ReadLoop]  # by format name; none when the read tool is off
    thinking: ThinkingBindings
    replays: Replays  # the read loops' rounds, kept and put back on later turns
    ledger: Ledger | NullLedger  # the cost ledger
    writes: WritePolicy
    usage: DiskUsage
    background: Background
    counters: SessionCounters | None
    gc: Periodic
    telemetry: Telemetry  # spans per request; NullTelemetry when off
    capabilities: Capabilities  # what each model's API accepts (proxy.catalog)
    heap: Trimmer  # hands the C heap's free pages back after large requests (proxy.heap)

    def upstream_of(self, fmt: str) -> tuple[Upstream, Forwarder]:
        """The upstream a wire format goes to: Anthropic's for Messages, else the OpenAI one."""
        return self.upstreams.of(fmt), self.upstreams.forwarder(fmt)

    @property
    def max_body(self) -> int:
        return int(self.config.server.max_body_mb * 1024 * 1024)

    @property
    def data_dir(self) -> Path:
        return self.config.storage.data_dir

    async def drain(self) -> None:
        """Wait until the work requests left behind is done (archive writes, counters)."""
        await self.background.drain()
        if self.counters is not None:
            await self.counters.drain()
        await self.telemetry.drain()

    async def collect_garbage(self) -> None:
        """Expire files and measure each tenant's disk (:mod:`proxy.store.gc`), off the loop."""
        report = await asyncio.to_thread(
            self.store.collect, self.usage, dialog_ttl_days=self.config.storage.dialog_ttl_days
        )
        if report.expired:
            # The in-memory shortcuts may point at what is gone now.
            self.archive.forget()
            self.compactor.forget()
            self.memory.forget()
            self.replays.forget()

    async def close(self) -> None:
        await self.gc.stop()
        await self.compactor.close()
        await self.background.close()
        if self.counters is not None:
            await self.counters.close()
        await self.telemetry.close()
        await self.upstreams.close()
        await asyncio.to_thread(self.store.close)


def cache_split(cache_bytes: int) -> dict[str, int]:
    """``server.cache_mb`` (in bytes) shared out among the caches keyed by content: token
    counts, cuts, message digests, the read rounds put back, and the file-aware rules'
    memos (calls parsed, decisions per epoch, policies matched, quote protection's working
    sets). Each is bounded by what its entries pin; together they take ``cache_bytes``: the
    memory bound in docs/errors.md#bounded-memory is this sum."""
    return {"tokens": cache_bytes * 7 // 20, "cuts": cache_bytes * 7 // 20,
            "digests": cache_bytes // 5, "rounds": cache_bytes // 20,
            "memos": cache_bytes // 20}


def files_url(config: Config) -> str:
    base = config.server.public_url or f"http://{config.server.host}:{config.server.port}"
    return base.rstrip("/") + "/files"


class Periodic:
    """Runs a job at once and then every ``interval`` seconds, until stopped."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self, job: Callable[[], Awaitable[None]]) -> None:
        self._task = asyncio.ensure_future(self._run(job))

    async def _run(self, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await job()
            except Exception:
                log.exception("periodic job failed")
            await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _warm(counter: RequestCounter, windows: ContextWindows, prices: Prices | None,
          capabilities: Capabilities) -> None:
    # o200k only: current OpenAI models and the estimate for every other provider. cl100k
    # (~30 MB) loads the first time an older model is seen, in a worker thread.
    counter.counter.preload(("gpt-4o",))
    document = read_litellm_model_map()  # one parse for every table made from it
    windows.load(document)
    capabilities.load(document)
    if prices is not None:
        prices.load(document)


def _price(p: PriceConfig) -> Price:
    return Price.of(input=p.input, output=p.output, cache_read=p.cache_read,
                    cache_write=p.cache_write, cache_write_1h=p.cache_write_1h)


def capabilities_of(config: Config) -> Capabilities:
    """The per-model facts of the config's catalog (over litellm's bundled map)."""
    return Capabilities({name: ModelFacts(**facts.model_dump())
                         for name, facts in config.catalog.models.items()})


def prices_of(config: LedgerConfig) -> Prices:
    """The price table of the ledger's config (over litellm's bundled map)."""
    return Prices({name: _price(p) for name, p in config.prices.items()},
                  default=_price(config.default_price) if config.default_price else None)


async def open_services(
    config: Config,
    *,
    stages: Sequence[Stage] | None = None,
    metrics: Metrics | None = None,
    gate: Gate | None = None,
    calls: CallSink | None = None,
) -> Services:
    """The app's services; ``calls`` is told of the summarizer and fold calls made on a
    session's behalf (the ledger)."""
    limit_arenas()  # before the worker threads exist (proxy.heap)
    gate = gate if gate is not None else Gate(config.auth)
    metrics = metrics or Metrics()
    # First: a telemetry the installation cannot provide stops the start before anything opens.
    telemetry = open_telemetry(config.telemetry)
    storage = config.storage
    background = Background()
    upstreams = Upstreams(
        Upstream(config.upstream, forward_client_key=not gate.closed),
        Upstream(config.anthropic, forward_client_key=not gate.closed, key_header="x-api-key"),
    )
    await upstreams.start()
    router = LitellmRouter(
        [r.model_dump() for r in config.model_list], timeout_s=config.upstream.timeout_s
    )
    ensure_tiktoken_offline()
    caches = cache_split(config.server.cache_mb * 1024 * 1024)
    try:
        store = await asyncio.to_thread(open_backend, storage,
                                        digest_cache_bytes=caches["digests"])
    except BaseException:
        await upstreams.close()
        await telemetry.close()
        raise
    originals = store.originals
    counter = RequestCounter(TokenCounter(), cache_chars=caches["tokens"])
    windows = ContextWindows(config.compaction.context_windows)
    capabilities = capabilities_of(config)
    usage = DiskUsage(storage.data_dir, store.tenant_sizes)
    writes = WritePolicy(store.files.tenant_known, usage, storage.max_tenant_mb, metrics,
                         background)

    ledger: Ledger | NullLedger = NullLedger()
    prices: Prices | None = None
    if config.ledger.enabled and store.ledger is not None:
        prices = prices_of(config.ledger)
        read_schema = (ReadTool(config, store.originals).definition()
                       if config.retrieval.mode == "proxy" and config.retrieval.max_rounds > 0
                       else None)
        ledger = Ledger(config.ledger, config.offload, store.ledger, prices, counter, metrics,
                        background, digest_cache=store.dialog.digest_cache if store.dialog
                        else None, read_tool=read_schema, shared=store.shared is not None)
    if calls is None and isinstance(ledger, Ledger):
        calls = ledger
    archive: Archive | NullArchive = NullArchive()
    summaries: Summaries = _NoSummaries()
    sessions: SessionIndex = _NoSessions()
    compactor: Compactor | NullCompactor = NullCompactor()
    counters: SessionCounters | None = None
    summarizer = _own_calls(config, upstreams, router, capabilities, metrics,
                            model=config.compaction.model, kind="summarizer")
    read_tool = config.retrieval.tool_name if config.retrieval.mode == "proxy" else None
    memory: Memory | NullMemory = NullMemory(store.memory)
    if store.dialog is not None and store.summaries is not None and store.sessions is not None:
        counters = SessionCounters(store.sessions)
        counters.start()
        archive = Archive(store.dialog, counters, background, metrics)
        summaries, sessions = store.summaries, store.sessions
        if store.memory is not None:
            folder = _own_calls(config, upstreams, router, capabilities, metrics,
                                model=config.memory.model or config.compaction.model,
                                kind="memory_fold")
            memory = _memory(config, store.memory, folder, background, read_tool, calls)
        if config.compaction.enabled:
            compactor = Compactor(config.compaction, summaries=summaries, archive=store.dialog,
                                  client=summarizer, windows=windows, shared=store.shared,
                                  facts=memory if isinstance(memory, Memory) else None,
                                  calls=calls)
    # The proxy's read rounds, put back on later turns: only while the proxy runs the tool (a
    # replayed call of a tool the request does not define would be refused).
    replays = Replays(store.rounds, cache_bytes=caches["rounds"])
    replays.enabled = config.retrieval.mode == "proxy" and config.retrieval.max_rounds > 0
    pipeline = Pipeline(
        offloader=Offloader(config.offload, config.retrieval, storage.data_dir,
                            files_url=files_url(config), cache_bytes=caches["cuts"],
                            memo_bytes=caches["memos"]),
        planner=Planner(config.compaction, counter, windows, read_tool),
        compactor=compactor,
        counter=counter,
        originals=originals,
        timed_ageing=compactor.enabled,
        old_max_bytes=config.offload.old_max_bytes,
        stages=stages,
        memory=memory,
        replay=replays,
    )
    readers: dict[str, ReadLoop] = {}
    if config.retrieval.mode == "proxy" and config.retrieval.max_rounds > 0:
        tool = ReadTool(config, originals, store.files, memory.store)
        rounds = config.retrieval.max_rounds
        readers = {"chat": Reader(upstreams.of("chat"), tool, rounds),
                   "responses": ResponsesReader(upstreams.of("responses"), tool, rounds),
                   "messages": MessagesReader(upstreams.of("messages"), tool, rounds)}
    _live_metrics(metrics, summarizer, compactor, store)
    _memory_metrics(metrics, memory)
    # The encoding (~0.4 s) and the window map load before the port accepts requests: building
    # the encoding holds the GIL for most of that time, which would stall the event loop (and
    # every request in flight) if it happened while serving.
    await asyncio.to_thread(_warm, counter, windows, prices, capabilities)

    services = Services(
        config=config, gate=gate, metrics=metrics, upstreams=upstreams, router=router,
        store=store,
        originals=originals, files=store.files, archive=archive, summaries=summaries,
        sessions=sessions, compactor=compactor, memory=memory, pipeline=pipeline,
        readers=readers, thinking=ThinkingBindings(store.sessions, metrics, background),
        replays=replays, ledger=ledger, writes=writes, usage=usage, background=background,
        counters=counters, gc=Periodic(GC_INTERVAL_S),
        telemetry=telemetry, capabilities=capabilities, heap=Trimmer(),
    )
    services.gc.start(services.collect_garbage)
    return services


def _live_metrics(
    metrics: Metrics, summarizer: SummarizerClient, compactor: Compactor | NullCompactor,
    store: StoreBackend,
) -> None:
    metrics.live("ctxproxy_store_unavailable",
                 "Store calls that failed because the shared database was down or too slow.",
                 lambda: store.failures)
    metrics.live("ctxproxy_summarizer_calls", "Summarizer calls made.", lambda: summarizer.calls)
    metrics.live("ctxproxy_summarizer_failures", "Summarizer calls that failed.",
                 lambda: summarizer.failures)
    metrics.live("ctxproxy_compactions", "Compactions stored (summaries created).",
                 lambda: compactor.compactions)
    metrics.live("ctxproxy_precompactions", "Compactions prepared in the background.",
                 lambda: compactor.precompactions)


def _own_calls(
    config: Config, upstreams: Upstreams, router: LitellmRouter, capabilities: Capabilities,
    metrics: Metrics, *, model: str | None, kind: CallKind,
) -> SummarizerClient:
    """The client of the proxy's own model calls of one kind (the summarizer, the fold)."""
    def failed(call: CallKind, status: int) -> None:
        metrics.summarizer_errors.labels(call, str(status)).inc()

    return SummarizerClient(
        upstreams, router, capabilities, model=model,
        timeout_s=config.compaction.summarizer_timeout_s,
        anthropic_model=config.anthropic.summarizer_model,
        temperature=config.compaction.temperature, kind=kind, on_failure=failed,
    )


def _memory(
    config: Config, store: MemoryStore, folder: SummarizerClient, background: Background,
    read_tool: str | None, calls: CallSink | None = None,
) -> Memory | NullMemory:
    """Long-term memory: on only with compaction (its facts come from the summarizer call);
    off, its store still serves /files what an earlier run kept."""
    if not (config.memory.enabled and config.compaction.enabled):
        if config.memory.enabled:
            log.warning("memory.enabled needs compaction.enabled (facts come from the "
                        "compaction's summarizer call): long-term memory is off")
        return NullMemory(store)
    return Memory(config.memory, store, folder, background, read_tool=read_tool, calls=calls)


def _memory_metrics(metrics: Metrics, memory: Memory | NullMemory) -> None:
    metrics.live("ctxproxy_memory_facts", "Blocks of durable facts recorded at compactions.",
                 lambda: memory.facts_recorded)
    metrics.live("ctxproxy_memory_fold_calls", "Summarizer calls made to fold memory.",
                 lambda: memory.fold_calls)
    metrics.live("ctxproxy_memory_folds", "Memory versions folded.", lambda: memory.folds)

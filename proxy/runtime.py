"""Resources owned by the app's lifespan and handed to every request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from .auth import Gate
from .compaction.client import SummarizerClient
from .compaction.engine import CompactStage
from .config import Config
from .hotcache import KnownChains, StatsBuffer
from .metrics import Metrics
from .models import ContextWindows
from .pipeline import Stage
from .pipeline.count import CountStage, RequestCounter
from .pipeline.offload import OffloadStage
from .pipeline.tokens import TokenCounter
from .pipeline.validate import ValidateStage
from .retrieval.loop import ReadLoop
from .retrieval.tool import ReadTool
from .store.db import Database
from .store.dialog import DialogArchive, DigestCache
from .store.gc import collect
from .store.summaries import SummaryStore
from .store.tool_results import ToolResultStore
from .store.usage import DiskUsage
from .tokenizer_data import ensure_tiktoken_offline
from .upstream.http import Upstream
from .upstream.litellm_route import LitellmRouter
from .writes import WritePolicy

log = logging.getLogger("proxy")

GC_INTERVAL_S = 3600.0


@dataclass(slots=True)
class Runtime:
    config: Config
    gate: Gate
    writes: WritePolicy
    usage: DiskUsage
    upstream: Upstream
    router: LitellmRouter
    stages: Sequence[Stage]
    max_body: int
    tool_results: ToolResultStore
    counter: RequestCounter
    db: Database | None = None
    archive: DialogArchive | None = None
    summaries: SummaryStore | None = None
    compact: CompactStage | None = None
    summarizer: SummarizerClient | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    gc_task: asyncio.Task[None] | None = None
    reader: ReadTool | None = None
    readloop: ReadLoop | None = None
    metrics: Metrics = field(default_factory=Metrics)
    known: KnownChains = field(default_factory=KnownChains)
    stats: StatsBuffer | None = None
    stats_task: asyncio.Task[None] | None = None

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run work after the response (persisting): tracked so shutdown can wait for it."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task failed: %r", task.exception())


async def _gc_loop(rt: Runtime, interval: float) -> None:
    """Expire files and measure each tenant's disk at start-up and then periodically, off the
    event loop (:mod:`proxy.store.gc`)."""
    while True:
        try:
            report = await asyncio.to_thread(
                collect, rt.config.storage.data_dir, rt.db, rt.tool_results, rt.usage,
                dialog_ttl_days=rt.config.storage.dialog_ttl_days,
            )
            if report.expired:
                # Forget what the in-memory shortcuts say was archived: it may be gone now.
                rt.known.clear()
                if rt.compact is not None:
                    rt.compact.forget()
        except Exception:
            log.exception("periodic gc failed")
        await asyncio.sleep(interval)


def _open_db(config: Config) -> Database | None:
    try:
        return Database.in_dir(config.storage.data_dir)
    except Exception as exc:  # a broken disk must not stop the proxy: it forwards without
        log.error("cannot open the database under %s (%s): dialog archive and compaction are "
                  "off", config.storage.data_dir, exc)
        return None


async def open_runtime(
    config: Config,
    stages: Sequence[Stage] | None = None,
    *,
    metrics: Metrics | None = None,
    gate: Gate | None = None,
) -> Runtime:
    gate = gate if gate is not None else Gate(config.auth)
    metrics = metrics or Metrics()
    upstream = Upstream(config.upstream, forward_client_key=not gate.closed)
    await upstream.start()
    router = LitellmRouter(
        [r.model_dump() for r in config.model_list], timeout_s=config.upstream.timeout_s
    )
    tool_results = ToolResultStore(config.storage.data_dir, config.storage.tool_result_ttl_days)
    ensure_tiktoken_offline()
    cache = config.server.cache_mb * 1024 * 1024
    counter = RequestCounter(TokenCounter(), cache_chars=cache * 2 // 5)
    usage = DiskUsage(config.storage.data_dir)
    rt = Runtime(
        config=config, gate=gate, usage=usage,
        writes=WritePolicy(config.storage.data_dir, usage, config.storage.max_tenant_mb, metrics),
        upstream=upstream, router=router, stages=(),
        max_body=int(config.server.max_body_mb * 1024 * 1024),
        tool_results=tool_results, counter=counter, metrics=metrics,
    )
    db = await asyncio.to_thread(_open_db, config)
    offload = OffloadStage(
        config.offload, config.retrieval, tool_results,
        defer_ageing=(
            db is not None and config.compaction.enabled and config.offload.age_policy == "batched"
        ),
        files_url=files_url(config),
        cache_bytes=cache * 2 // 5,
    )
    built: list[Stage] = [offload]
    if db is not None:
        rt.db = db
        rt.stats = StatsBuffer(db)
        rt.stats_task = asyncio.create_task(rt.stats.run())
        rt.archive = DialogArchive(config.storage.data_dir, db, digest_cache=DigestCache(max_bytes=cache // 5))
        rt.summaries = SummaryStore(db, config.storage.data_dir)
        windows = ContextWindows(config.compaction.context_windows)
        rt.summarizer = SummarizerClient(
            upstream, router, model=config.compaction.model,
            timeout_s=config.compaction.summarizer_timeout_s,
        )
        rt.compact = CompactStage(
            config.compaction, counter=counter, windows=windows, summaries=rt.summaries,
            archive=rt.archive, client=rt.summarizer, offload=offload,
            old_max_bytes=config.offload.old_max_bytes,
            read_tool=config.retrieval.tool_name if config.retrieval.mode == "proxy" else None,
        )
        built.append(rt.compact)
        # The encoding (~0.5 s) and the window map load off the start-up path.
        rt.spawn(asyncio.to_thread(_warm, counter, windows))
    built += [ValidateStage(), CountStage(counter)]
    rt.stages = list(stages) if stages is not None else built
    _live_metrics(rt)
    if config.retrieval.mode == "proxy" and config.retrieval.max_rounds > 0:
        rt.reader = ReadTool(config, tool_results)
        rt.readloop = ReadLoop(upstream, rt.reader, config.retrieval.max_rounds)
    rt.gc_task = asyncio.create_task(_gc_loop(rt, GC_INTERVAL_S))
    return rt


def _live_metrics(rt: Runtime) -> None:
    m = rt.metrics
    if rt.summarizer is not None:
        s = rt.summarizer
        m.live("ctxproxy_summarizer_calls", "Summarizer calls made.", lambda: s.calls)
        m.live("ctxproxy_summarizer_failures", "Summarizer calls that failed.", lambda: s.failures)
    if rt.compact is not None:
        c = rt.compact
        m.live("ctxproxy_compactions", "Compactions stored (summaries created).", lambda: c.compactions)
        m.live("ctxproxy_precompactions", "Compactions prepared in the background.",
               lambda: c.precompactions)


def files_url(config: Config) -> str:
    base = config.server.public_url or f"http://{config.server.host}:{config.server.port}"
    return base.rstrip("/") + "/files"


def _warm(counter: RequestCounter, windows: ContextWindows) -> None:
    # o200k only: current OpenAI models and the estimate for every other provider. cl100k
    # (~30 MB) loads the first time an older model is seen, in a worker thread.
    counter.counter.preload(("gpt-4o",))
    windows.load()


async def close_runtime(rt: Runtime) -> None:
    if rt.compact is not None:
        await rt.compact.close()
    if rt.gc_task is not None:
        rt.gc_task.cancel()
    if rt.stats_task is not None:
        rt.stats_task.cancel()  # its finally writes what is still pending
        try:
            await rt.stats_task
        except BaseException:
            pass
    pending = [t for t in rt.tasks if not t.done()]
    if pending:
        await asyncio.wait(pending, timeout=10)
    await rt.writes.close()
    await rt.upstream.close()
    if rt.db is not None:
        rt.db.close()

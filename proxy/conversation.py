"""A conversation through the pipeline, in any wire format (:mod:`proxy.formats`).

    read body -> parse (format) -> tenant, session -> what may be written -> archive the request
    -> pipeline -> write the forwarded body (only what changed) -> forward (raw, through the
    read-tool loop, or through litellm) -> archive the answer after the response

Every step is a call on a service (:mod:`proxy.services`); CPU-heavy steps of a large request
(parsing, hashing, the pure stages, writing the body) run in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from starlette.types import Receive, Scope, Send

from proxy.formats import Format, Tap
from proxy.formats.chat.request import CHAT, ChatTap
from proxy.ledger.service import RequestCalls
from proxy.metrics import Metrics
from proxy.model import PipelineResult, RequestView
from proxy.retrieval.loop import Finish, ReadLoop, Rounds
from proxy.routes import caller_of, header_map, services_of
from proxy.server.asgi import (
    JSON_CT,
    Headers,
    read_body,
    run_until_disconnect,
    run_watching,
    send_whole,
    timing_of,
)
from proxy.services import Services
from proxy.session import Identity, resolve
from proxy.store.ledger_entry import LedgerEntry
from proxy.upstream.thinking import Binding
from proxy.work import Cancelled, Work
from proxy.writes import Mode, Writes

__all__ = ["HUGE_BODY", "LARGE_BODY", "Conversation", "ctx_headers"]

log = logging.getLogger("proxy.server.access")

T = TypeVar("T")

# From this size on, the pipeline's new work (cutting, tokenizing texts not seen before) runs in
# a worker thread; resent texts are cache hits and stay on the loop.
LARGE_BODY = 256 * 1024
# From this size on, parsing and hashing the body (orjson at ~700 MB/s, then sha256) and writing
# the forwarded one run in a worker thread: a thread hop and the GIL to win back cost more for
# smaller bodies than the work does.
HUGE_BODY = 2 * 1024 * 1024


async def _cpu(large: bool, fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.to_thread(fn, *args) if large else fn(*args)


def ctx_headers(identity: Identity, result: PipelineResult, raw: bytes, out: bytes) -> Headers:
    stats = result.stats
    tokens_in = stats.get("tokens_in", len(raw) // 4)
    tokens_out = stats.get("tokens_out", len(out) // 4)
    return [
        (b"x-ctxproxy-session", identity.session.encode()),
        (b"x-ctxproxy-tokens-in", str(tokens_in).encode()),
        (b"x-ctxproxy-tokens-out", str(tokens_out).encode()),
        (b"x-ctxproxy-offloaded", str(stats.get("offloaded", 0)).encode()),
        (b"x-ctxproxy-compacted", b"1" if stats.get("compacted", 0) else b"0"),
        (b"x-ctxproxy-pipeline-ms", f"{result.elapsed_ms:.1f}".encode()),
        (b"x-ctxproxy-work", str(stats.get("work", 0)).encode()),
        (b"x-ctxproxy-degraded", b"1" if stats.get("degraded") else b"0"),
    ]


class Conversation:
    """``POST`` of a conversation in one wire format."""

    def __init__(self, fmt: Format) -> None:
        self.fmt = fmt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        svc = services_of(scope)
        caller = caller_of(scope)
        fmt = self.fmt
        raw = await read_body(scope, receive, svc.max_body,
                              idle_s=svc.config.server.body_timeout_s)
        large, huge = len(raw) >= LARGE_BODY, len(raw) >= HUGE_BODY
        parsed = await _cpu(huge, fmt.parse, raw, svc.config.server.max_messages)
        body = parsed.body
        identity = resolve(header_map(scope), body, tenant=caller.tenant, history=parsed.history)
        ticket = svc.ledger.begin(identity, fmt.name, parsed.model)
        # litellm routes translate chat completions only; other formats go to the upstream.
        params = svc.router.match(parsed.model) if fmt is CHAT else None
        upstream, forwarder = svc.upstream_of(fmt.name)
        span = svc.telemetry.request(fmt.name, parsed.model, identity, stream=parsed.stream,
                                     headers=scope["headers"], base_url=upstream.base_url,
                                     route=params)
        send = span.watch(send)
        # The provider judges the key only when it is the client's own and goes upstream.
        judges = not caller.gated and params is None and upstream.config.api_key is None
        writes = svc.writes.for_request(
            identity.tenant, provider_judges=judges, limit_mb=caller.max_disk_mb
        )
        sent = parsed.items
        chains = await _cpu(huge, svc.archive.chains, sent)
        # The archive reads the session row anyway: its thinking flag comes with it.
        dropped = await svc.archive.record_request(identity, sent, chains, writes)
        meter = Work(svc.config.server.pipeline_budget)
        view = RequestView(
            model=parsed.model, body=body, identity=identity,
            # A history kept upstream is slimmed but never compacted here.
            chains=() if parsed.continued else parsed.message_chains(chains),
            headers=scope["headers"], writes=writes, history=parsed.history,
            tools=parsed.tools, large=large, api=fmt.name, work=meter,
        )
        try:
            result = await run_watching(receive, svc.pipeline.run(view), meter.cancel)
        except Cancelled:
            # Nothing was forwarded: what the pipeline held for this request is let go (staged
            # originals deleted), as for a client that leaves during the upstream call.
            writes.finish(disconnected=True)
            span.end(disconnected=True)
            span.close()
            svc.metrics.pipeline_cancelled.inc()
            log.info("client disconnected during the pipeline; its work stopped after %d units "
                     "(session %s)", meter.spent, identity.session)
            return
        timing_of(scope).pipeline_ms = result.elapsed_ms
        if meter.degraded:
            svc.metrics.pipeline_degraded.inc()
        _count(svc.metrics, result.stats)
        span.set_pipeline(result)
        forwarded = result.messages if result.changed else parsed.history
        reader = svc.readers.get(fmt.name)
        # The read tool is offered from an agent's first request on (a client that declares
        # tools of its own), not from the first one that needs it: ``tools`` is part of every
        # later turn's prefix (prompt cache, signed thinking), so it never changes mid-session.
        reads = reader is not None and params is None and (
            bool(parsed.tools) or reader.needed(forwarded))
        if result.changed:
            out = await _cpu(huge, fmt.write, raw, parsed, result.messages)
        else:
            out = raw  # nothing changed: the upstream gets the client's bytes exactly
        extra = ctx_headers(identity, result, raw, out)
        if writes.mode is Mode.OFF:
            extra.append((b"x-ctxproxy-quota", b"exceeded"))
        if parsed.continued:
            # The history lives upstream: only this request's new items were slimmed.
            extra.append((b"x-ctxproxy-history", b"upstream"))
        tap = fmt.tap()
        # Messages: a thinking block bound to another prefix is recovered from (upstream.thinking).
        binding = (svc.thinking.binding(identity, body, persist=writes.allowed, stored=dropped)
                   if fmt.name == "messages" else None)
        rounds = Rounds()
        archived: list[bool] = []
        statuses: list[int] = []  # the upstream's first status (the ledger records 2xx only)

        async def on_status(status: int) -> None:
            if not statuses:
                statuses.append(status)
            await writes.settle(status)

        shared = svc.store.shared is not None

        async def finish(done: Rounds) -> None:
            # The read rounds are kept before the last byte: the next turn replays them.
            if done.replayable and not parsed.continued:
                await svc.replays.record(identity, fmt.name, parsed.history, tap.answer(), done,
                                         writes)
            if shared:
                # A shared store: the answer is archived before the last byte too
                # (Archive.record_answer_now).
                archived.append(await svc.archive.record_answer_now(
                    identity, sent, chains, tap.answer(), writes, done.internal,
                    incomplete=not tap.complete()))

        async def before_end() -> None:
            await writes.drain()
            await finish(rounds)

        if params is not None:
            work = _via_litellm(svc, params, {**body, "messages": forwarded}, extra, scope, send,
                                tap, statuses)
        elif reads and reader is not None:
            # The loops splice each round into ``out``'s bytes; of the parsed body they read
            # only top-level fields, which the pipeline never changes: the client's body serves,
            # not a second parse of the forwarded one (megabytes on every agent request).
            loop_body = reader.with_tool(body)
            work = _via_reads(reader, fmt, svc, scope, send, loop_body, extra, tap, identity,
                              rounds, writes, out, finish, binding, on_status)
        else:
            work = forwarder.forward(
                scope, send, "POST", fmt.subpath, out, extra=extra,
                stream_tap=tap.stream, whole_tap=tap.whole,
                on_status=on_status, before_end=before_end if shared else writes.drain,
                buffer_unknown=True,
                error_event=tap.error_event,
                binding=binding,
            )
        disconnected = False
        failure: BaseException | None = None
        try:
            disconnected = await run_until_disconnect(receive, work)
            if disconnected:
                log.info("client disconnected; upstream call cancelled (session %s)",
                         identity.session)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            span.end(error=failure, disconnected=disconnected, rounds=rounds.rounds)
            writes.finish(disconnected=disconnected)
            answer = tap.answer()  # assembled once: the replays, the archive and the ledger
            if not rounds.replayable and not parsed.continued:
                svc.replays.answered(identity, fmt.name, parsed.history, answer)
            svc.archive.record_answer_later(
                identity, sent, chains, answer, result.stats, writes, rounds.internal,
                recorded=any(archived), incomplete=not tap.complete(),
            )
            # Every upstream call is billed: the read loop's, each with its own usage; else
            # the one answer the tap saw.
            calls = RequestCalls(
                status=statuses[0] if statuses else None,
                usages=rounds.calls if rounds.calls else [tap.usage()],
                sent_at=rounds.sent_at, answer=answer, read_tool=reads)

            def recorded(entries: Sequence[LedgerEntry]) -> None:
                # The span is exported with the ledger's figures (usage, cost, cache reason),
                # which exist only once the answer is in; without them, now.
                if entries:
                    span.ledger(entries[0], rounds=entries[1:])
                else:
                    span.close()

            svc.ledger.finish(ticket, parsed=parsed, chains=chains, raw=raw, result=result,
                              calls=calls, writes=writes, large=large, done=recorded)
            if large:
                svc.heap.after_large()


async def _via_reads(
    reader: ReadLoop, fmt: Format, svc: Services, scope: Scope, send: Send,
    body: dict[str, Any], extra: Headers, tap: Tap, identity: Identity, rounds: Rounds,
    writes: Writes, raw: bytes, finish: Finish = None, binding: Binding | None = None,
    on_status: Callable[[int], Awaitable[None]] | None = None,
) -> None:
    """The model may call the proxy's read tool: run it and ask again (retrieval/loop)."""
    up, _ = svc.upstream_of(fmt.name)
    timing_of(scope).restart()
    url = up.url(fmt.subpath, scope.get("query_string", b""))
    headers = up.request_headers(scope["headers"])
    if body.get("stream") is True:
        done = await reader.stream(send, body, url, headers, extra, identity, tap.stream,
                                   on_status=on_status or writes.settle, settled=writes.drain,
                                   raw=raw, finish=finish, binding=binding)
    else:
        done = await reader.non_stream(send, body, url, headers, extra, identity, tap.whole,
                                       on_status=on_status or writes.settle,
                                       settled=writes.drain, raw=raw, finish=finish,
                                       binding=binding)
    timing_of(scope).mark()
    rounds.rounds, rounds.internal, rounds.usage = done.rounds, done.internal, done.usage
    rounds.wire, rounds.full, rounds.results = done.wire, done.full, done.results
    rounds.calls, rounds.sent_at = done.calls, done.sent_at


async def _via_litellm(
    svc: Services, params: Mapping[str, Any], body: dict[str, Any], extra: Headers,
    scope: Scope, send: Send, tap: Tap, statuses: list[int],
) -> None:
    timing = timing_of(scope)
    timing.restart()
    # The usage is billed whether or not the client's stream asked to see it.
    on_usage = tap.saw_usage if isinstance(tap, ChatTap) else None
    answer = await svc.router.complete(params, body, on_usage=on_usage)
    timing.mark()
    statuses.append(answer.status)
    if answer.chunks is not None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send(
            {"type": "http.response.start", "status": answer.status, "headers": headers + extra}
        )
        async for chunk in answer.chunks:
            tap.stream(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    payload = answer.body or b""
    tap.whole(payload)
    await send_whole(send, answer.status, [JSON_CT, *extra], payload)


def _count(metrics: Metrics, stats: Mapping[str, int]) -> None:
    metrics.tokens_in.inc(stats.get("tokens_in", 0))
    metrics.tokens_out.inc(stats.get("tokens_out", 0))
    if stats.get("offloaded"):
        metrics.offloaded.inc(stats["offloaded"])
    if stats.get("offload_errors"):
        metrics.disk_errors.inc(stats["offload_errors"])

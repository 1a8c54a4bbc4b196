"""POST /v1/chat/completions: parse, session, persist, pipeline, forward, persist the answer."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import orjson

from .persist import AnswerTap, chains_for, record_answer_later, record_request
from .pipeline import RequestView, run_pipeline
from .relay import (
    JSON_CT,
    Headers,
    Receive,
    Scope,
    Send,
    read_body,
    run_until_disconnect,
    send_whole,
    timing_of,
)
from .retrieval.loop import Rounds
from .routes import caller_of, ctx_headers, forward_raw, header_map, parse_chat, runtime_of
from .runtime import Runtime
from .session import Identity, resolve
from .writes import Mode, Writes

log = logging.getLogger("proxy.access")

_SSE = "text/event-stream"


class ChatCompletions:
    """POST /v1/chat/completions and /chat/completions."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rt = runtime_of(scope)
        caller = caller_of(scope)
        raw = await read_body(scope, receive, rt.max_body)
        body = parse_chat(raw, rt.config.server.max_messages)
        headers = header_map(scope)
        identity = resolve(headers, body, tenant=caller.tenant)
        model: str = body["model"]
        params = rt.router.match(model)
        # The provider judges the key only when it is the client's own and goes upstream.
        judges = not caller.gated and params is None and rt.config.upstream.api_key is None
        writes = rt.writes.for_request(
            identity.tenant, provider_judges=judges, limit_mb=caller.max_disk_mb
        )
        sent = body["messages"]
        chains = chains_for(rt, sent)
        await record_request(rt, identity, sent, chains, writes)
        view = RequestView(
            model=model, body=body, identity=identity, chains=chains, headers=scope["headers"],
            writes=writes,
        )
        result = await run_pipeline(rt.stages, sent, view)
        timing_of(scope).pipeline_ms = result.elapsed_ms
        _count(rt, result.stats)
        if result.changed:
            body = {**body, "messages": result.messages}
            out = orjson.dumps(body)
        else:
            out = raw  # nothing changed: the upstream gets the client's bytes exactly
        extra = ctx_headers(identity, result, raw, out)
        if writes.mode is Mode.OFF:
            extra.append((b"x-ctxproxy-quota", b"exceeded"))
        tap = AnswerTap()
        rounds = Rounds()
        forwarded = result.messages if result.changed else sent
        if params is not None:
            work = self._via_litellm(rt, params, body, extra, scope, send, tap)
        elif rt.reader is not None and rt.readloop is not None and rt.reader.needed(forwarded):
            body = rt.reader.with_tool({**body, "messages": forwarded})
            work = self._via_reads(rt, scope, send, body, extra, tap, identity, rounds, writes)
        else:
            work = forward_raw(rt, scope, send, "POST", "chat/completions", out, extra=extra,
                               stream_tap=tap.stream, whole_tap=tap.whole,
                               on_status=writes.settle, before_end=writes.drain,
                               buffer_unknown=True)
        disconnected = False
        try:
            disconnected = await run_until_disconnect(receive, work)
            if disconnected:
                log.info("client disconnected; upstream call cancelled (session %s)", identity.session)
        finally:
            writes.finish(disconnected=disconnected)
            record_answer_later(rt, identity, sent, chains, tap, result.stats, writes,
                                rounds.internal)

    async def _via_reads(
        self, rt: Runtime, scope: Scope, send: Send, body: dict[str, Any], extra: Headers,
        tap: AnswerTap, identity: Identity, rounds: Rounds, writes: Writes,
    ) -> None:
        """The model may call the proxy's read tool: run it and ask again (retrieval/loop)."""
        assert rt.readloop is not None
        up = rt.upstream
        timing_of(scope).restart()
        url = up.url("chat/completions", scope.get("query_string", b""))
        headers = up.request_headers(scope["headers"])
        loop = rt.readloop
        if body.get("stream") is True:
            done = await loop.stream(send, body, url, headers, extra, identity, tap.stream,
                                     on_status=writes.settle, settled=writes.drain)
        else:
            done = await loop.non_stream(send, body, url, headers, extra, identity, tap.whole,
                                         on_status=writes.settle, settled=writes.drain)
        timing_of(scope).mark()
        rounds.rounds, rounds.internal, rounds.usage = done.rounds, done.internal, done.usage

    async def _via_litellm(
        self,
        rt: Runtime,
        params: Mapping[str, Any],
        body: dict[str, Any],
        extra: Headers,
        scope: Scope,
        send: Send,
        tap: AnswerTap,
    ) -> None:
        timing = timing_of(scope)
        timing.restart()
        answer = await rt.router.complete(params, body)
        timing.mark()
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


def _count(rt: Runtime, stats: Mapping[str, int]) -> None:
    m = rt.metrics
    m.tokens_in.inc(stats.get("tokens_in", 0))
    m.tokens_out.inc(stats.get("tokens_out", 0))
    if stats.get("offloaded"):
        m.offloaded.inc(stats["offloaded"])
    if stats.get("offload_errors"):
        m.disk_errors.inc(stats["offload_errors"])

"""Persisting a request: the dialog received (before forwarding) and the answer (after)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from .runtime import Runtime
from .session import Identity
from .store.dialog import chain_hashes, chain_step
from .upstream.assemble import StreamAssembler, message_from_completion
from .writes import Mode, Writes

log = logging.getLogger("proxy.store")


class AnswerTap:
    """Sees the answer's bytes as they pass to the client, to archive it assembled."""

    __slots__ = ("assembler", "body")

    def __init__(self) -> None:
        self.assembler: StreamAssembler | None = None
        self.body: bytes | None = None

    def stream(self, chunk: bytes) -> None:
        if self.assembler is None:
            self.assembler = StreamAssembler()
        self.assembler.feed(chunk)

    def whole(self, body: bytes) -> None:
        self.body = body

    def message(self) -> dict[str, Any] | None:
        if self.assembler is not None:
            return self.assembler.message()
        if self.body is not None:
            return message_from_completion(self.body)
        return None


def chains_for(rt: Runtime, messages: Sequence[Any]) -> list[str]:
    if rt.archive is None:
        return []
    try:
        return chain_hashes(messages, rt.archive.digest_cache)
    except Exception:  # unhashable content is the client's problem, not a reason to fail
        log.exception("cannot hash the history; archive and compaction skip this request")
        return []


async def record_request(
    rt: Runtime, identity: Identity, messages: Sequence[Any], chains: Sequence[str],
    writes: Writes,
) -> None:
    """Archive what the client sent before anything can go wrong upstream (or, for a key the
    provider has not accepted yet, once it has: :mod:`proxy.writes`); never raises."""
    archive = rt.archive
    if archive is None or len(chains) != len(messages) or not writes.allowed:
        return
    if rt.known.all_known(identity.tenant, identity.session, chains):
        return  # a resent history: nothing new to write, no thread hop, no query

    def job() -> int:
        assert archive is not None
        return archive.record(identity.tenant, identity.session, messages, chains=chains).bytes_written

    try:
        await writes.write(job, lambda: rt.known.add(identity.tenant, identity.session, chains))
    except Exception as exc:
        rt.metrics.disk_errors.inc()
        log.warning("dialog archive write failed (%s); forwarding anyway", exc)


def record_answer_later(
    rt: Runtime,
    identity: Identity,
    messages: Sequence[Any],
    chains: Sequence[str],
    tap: AnswerTap,
    stats: Mapping[str, int],
    writes: Writes,
    internal: Sequence[Any] = (),
) -> None:
    """After the response: archive the answer and count the turn, off the request's path.
    Only for a request whose writes are on (a key the provider rejected, or a tenant over its
    quota, leaves no trace)."""
    if rt.archive is None or rt.stats is None or writes.mode is not Mode.NOW:
        return
    rt.stats.add(
        identity.tenant,
        identity.session,
        turns=1,
        tokens_in=int(stats.get("tokens_in", 0)),
        tokens_out=int(stats.get("tokens_out", 0)),
        compactions=int(stats.get("compactions", 0)),
        offloads=int(stats.get("offloaded", 0)),
    )
    answer = tap.message()
    if answer is None and not internal:
        return
    archive = rt.archive
    if not internal and len(chains) == len(messages):
        answer_chain = chain_step(chains[-1] if chains else None, answer, archive.digest_cache)
        if rt.known.all_known(identity.tenant, identity.session, (answer_chain,)):
            return

    def record() -> int:
        if internal:
            # The proxy's own read rounds: archived (lossless) as the continuation the model saw.
            result = archive.record(
                identity.tenant, identity.session, [*messages, *internal], answer=answer
            )
        else:
            result = archive.record(
                identity.tenant, identity.session, messages, chains=chains, answer=answer
            )
        if result.answer_chain is not None:
            rt.known.add(identity.tenant, identity.session, (result.answer_chain,))
        return result.bytes_written

    def work() -> None:
        writes.write_sync(record)

    async def run() -> None:
        try:
            await writes.drain()  # the request's own held lines first, in order
            await asyncio.to_thread(work)
        except Exception as exc:
            rt.metrics.disk_errors.inc()
            log.warning("recording the answer failed: %s", exc)

    rt.spawn(run())

"""The dialog archive service (docs/archive.md): what the client sent, before it is forwarded,
and the answer, after it was relayed; plus the per-session counters.

Agents resend their whole history every turn, so almost every message a request carries was
archived before: an in-memory set of archived chains answers that without a thread hop or a
query (the store stays the truth). Writes go through the request's :class:`proxy.writes.Writes`
(a key the provider has not accepted yet, a tenant over quota).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from proxy.background import Background
from proxy.lru import LRU
from proxy.metrics import Metrics
from proxy.session import Identity
from proxy.store.chains import chain_hashes, chain_step
from proxy.store.dialog import FileSpan
from proxy.store.interfaces import DialogStore
from proxy.store.sessions import SessionCounters
from proxy.writes import Mode, Writes

__all__ = ["Archive", "NullArchive"]

log = logging.getLogger("proxy.store")


class _KnownChains:
    """Chains already archived, per session: a bounded set."""

    def __init__(self, limit: int = 200_000) -> None:
        self._seen: LRU[tuple[str, str, str], bool] = LRU(limit)

    def all_known(self, tenant: str, session: str, chains: Iterable[str]) -> bool:
        return all(self._seen.get((tenant, session, c)) for c in chains)

    def add(self, tenant: str, session: str, chains: Iterable[str]) -> None:
        for c in chains:
            self._seen.put((tenant, session, c), True)

    def clear(self) -> None:
        self._seen.clear()


class Archive:
    enabled = True

    def __init__(
        self,
        store: DialogStore,
        counters: SessionCounters,
        background: Background,
        metrics: Metrics,
    ) -> None:
        self.store = store
        self.counters = counters
        self.background = background
        self.metrics = metrics
        self.known = _KnownChains()

    def chains(self, messages: Sequence[Any]) -> list[str]:
        """Chain hashes of a history (CPU: a large one belongs in a worker thread); empty when
        it cannot be hashed, which turns archive and compaction off for the request."""
        try:
            return chain_hashes(messages, self.store.digest_cache)
        except Exception:  # unhashable content is the client's problem, not a reason to fail
            log.exception("cannot hash the history; archive and compaction skip this request")
            return []

    def span(self, tenant: str, session: str, chains: Sequence[str]) -> list[FileSpan]:
        return self.store.span(tenant, session, chains)

    async def record_request(
        self, identity: Identity, messages: Sequence[Any], chains: Sequence[str], writes: Writes
    ) -> bool | None:
        """Archive what the client sent before anything can go wrong upstream (or, for a key
        the provider has not accepted yet, once it has); never raises. Returns the session's
        thinking flag when the write read the session row (None: it did not; see
        :class:`proxy.store.dialog.RecordResult`)."""
        if len(chains) != len(messages) or not writes.allowed:
            return None
        tenant, session = identity.tenant, identity.session
        if self.known.all_known(tenant, session, chains):
            return None  # a resent history: nothing new to write, no thread hop, no query
        store = self.store
        flag: list[bool | None] = []

        def job() -> int:
            result = store.record(tenant, session, messages, chains=chains)
            flag.append(result.thinking_dropped)
            return result.bytes_written

        try:
            await writes.write(job, lambda: self.known.add(tenant, session, chains))
        except Exception as exc:
            self.metrics.disk_errors.inc()
            log.warning("dialog archive write failed (%s); forwarding anyway", exc)
        return flag[0] if flag else None

    async def record_answer_now(
        self,
        identity: Identity,
        messages: Sequence[Any],
        chains: Sequence[str],
        answer: dict[str, Any] | Sequence[dict[str, Any]] | None,
        writes: Writes,
        internal: Sequence[Any] = (),
        *,
        incomplete: bool = False,
    ) -> bool:
        """Archive the answer (and the proxy's read rounds) before the response's last byte,
        for a store other replicas share: the client's next turn may land on another replica,
        and the lines a summary's pointer names must not depend on which write lands first.
        True when it is recorded (then :meth:`record_answer_later` only counts the turn)."""
        if writes.mode is not Mode.NOW or (not answer and not internal):
            return False
        await writes.drain()  # the request's own held lines first, in order
        record = self._answer_job(identity, messages, chains, answer, internal, incomplete)
        if record is None:
            return True
        try:
            await asyncio.to_thread(writes.write_sync, record)
        except Exception as exc:
            self.metrics.disk_errors.inc()
            log.warning("recording the answer failed: %s", exc)
            return False
        return True

    def _answer_job(
        self,
        identity: Identity,
        messages: Sequence[Any],
        chains: Sequence[str],
        answer: dict[str, Any] | Sequence[dict[str, Any]] | None,
        internal: Sequence[Any],
        incomplete: bool = False,
    ) -> Callable[[], int] | None:
        """The write that archives an answer (``incomplete``: its stream broke); None when it
        is archived already."""
        tenant, session = identity.tenant, identity.session
        store = self.store
        if not internal and len(chains) == len(messages):
            answer_chain = chains[-1] if chains else None
            for one in [answer] if isinstance(answer, dict) else list(answer or ()):
                answer_chain = chain_step(answer_chain, one, store.digest_cache)
            if answer_chain and self.known.all_known(tenant, session, (answer_chain,)):
                return None

        def record() -> int:
            if internal:
                # The proxy's own read rounds: archived (lossless) as the continuation the
                # model saw.
                result = store.record(tenant, session, [*messages, *internal], answer=answer,
                                      incomplete=incomplete)
            else:
                result = store.record(tenant, session, messages, chains=chains, answer=answer,
                                      incomplete=incomplete)
            if result.answer_chain is not None:
                self.known.add(tenant, session, (result.answer_chain,))
            return result.bytes_written

        return record

    def record_answer_later(
        self,
        identity: Identity,
        messages: Sequence[Any],
        chains: Sequence[str],
        answer: dict[str, Any] | Sequence[dict[str, Any]] | None,
        stats: Mapping[str, int],
        writes: Writes,
        internal: Sequence[Any] = (),
        *,
        recorded: bool = False,
        incomplete: bool = False,
    ) -> None:
        """After the response: archive the answer (a message, or the list of items a Responses
        answer has) and count the turn, off the request's path.
        Only for a request whose writes are on (a key the provider rejected, or a tenant over
        its quota, leaves no trace)."""
        if writes.mode is not Mode.NOW:
            return
        tenant, session = identity.tenant, identity.session
        self.counters.add(
            tenant, session, turns=1,
            tokens_in=int(stats.get("tokens_in", 0)),
            tokens_out=int(stats.get("tokens_out", 0)),
            compactions=int(stats.get("compactions", 0)),
            offloads=int(stats.get("offloaded", 0)),
        )
        if recorded or (not answer and not internal):
            return
        record = self._answer_job(identity, messages, chains, answer, internal, incomplete)
        if record is None:
            return

        async def run() -> None:
            try:
                await writes.drain()  # the request's own held lines first, in order
                await asyncio.to_thread(writes.write_sync, record)
            except Exception as exc:
                self.metrics.disk_errors.inc()
                log.warning("recording the answer failed: %s", exc)

        self.background.spawn(run())

    def forget(self) -> None:
        """Drop the in-memory shortcut (archived lines may have expired)."""
        self.known.clear()


class NullArchive:
    """No store to archive into (the database could not be opened): nothing is recorded, and
    without chains nothing is compacted either."""

    enabled = False

    def chains(self, messages: Sequence[Any]) -> list[str]:
        return []

    def span(self, tenant: str, session: str, chains: Sequence[str]) -> list[FileSpan]:
        return []

    async def record_request(
        self, identity: Identity, messages: Sequence[Any], chains: Sequence[str], writes: Writes
    ) -> bool | None:
        return None

    async def record_answer_now(
        self, identity: Identity, messages: Sequence[Any], chains: Sequence[str],
        answer: dict[str, Any] | Sequence[dict[str, Any]] | None, writes: Writes,
        internal: Sequence[Any] = (), *, incomplete: bool = False,
    ) -> bool:
        return False

    def record_answer_later(
        self, identity: Identity, messages: Sequence[Any], chains: Sequence[str],
        answer: dict[str, Any] | Sequence[dict[str, Any]] | None, stats: Mapping[str, int],
        writes: Writes, internal: Sequence[Any] = (), *, recorded: bool = False,
        incomplete: bool = False,
    ) -> None:
        return None

    def forget(self) -> None:
        return None

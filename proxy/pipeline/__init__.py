"""The pre-reasoning pipeline: pure stages over the request's message list.

A stage gets the current messages and a read-only view of the request and returns new messages
plus what it did. It never performs network I/O and reaches disk only through a store object it
was constructed with. A stage that fails is skipped (logged and counted): the request is still
forwarded with the messages as they were before that stage.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..session import Identity
from ..writes import Writes

log = logging.getLogger("proxy.pipeline")

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class RequestView:
    """What a stage may read about the request besides its messages."""

    model: str
    body: Mapping[str, Any]  # as the client sent it: body["messages"] are the originals
    identity: Identity
    chains: Sequence[str] = ()  # chain hash per original message (see store.dialog)
    headers: Sequence[tuple[bytes, bytes]] = ()  # the client's, for calls made on its behalf
    writes: Writes | None = None  # what the request may write (None: everything, now)


@dataclass(frozen=True, slots=True)
class StageOutcome:
    messages: list[Message]
    changed: bool
    stats: Mapping[str, int] = field(default_factory=dict)


class Stage(Protocol):
    name: str

    def __call__(
        self, messages: list[Message], request: RequestView
    ) -> StageOutcome | Awaitable[StageOutcome]: ...


@dataclass(frozen=True, slots=True)
class PipelineResult:
    messages: list[Message]
    changed: bool
    stats: Mapping[str, int]
    failed: tuple[str, ...]
    elapsed_ms: float


async def run_pipeline(
    stages: Sequence[Stage], messages: list[Message], request: RequestView
) -> PipelineResult:
    start = time.perf_counter()
    changed = False
    stats: dict[str, int] = {}
    failed: list[str] = []
    for stage in stages:
        try:
            outcome = stage(messages, request)
            if inspect.isawaitable(outcome):
                outcome = await outcome
        except Exception:
            # Degrade, never drop: the request goes on with the messages as they were.
            log.exception("stage %s failed; forwarding without it", stage.name)
            failed.append(stage.name)
            continue
        messages = outcome.messages
        changed = changed or outcome.changed
        for key, value in outcome.stats.items():
            stats[key] = stats.get(key, 0) + value
    return PipelineResult(
        messages, changed, stats, tuple(failed), (time.perf_counter() - start) * 1000
    )

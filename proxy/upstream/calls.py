"""Calls the proxy makes on a session's behalf that the provider bills, reported to the ledger
by the services that make them (the compactor's summarizer, long-term memory's fold).

The services do not know the ledger: they are handed a :class:`CallSink` (the ledger service,
or nothing) and tell it of each call once its answer is in, with the answer's ``usage`` object
as the provider sent it (:func:`proxy.ledger.usage.parse_usage` reads it later).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from proxy.session import Identity

__all__ = ["Call", "CallSink"]


@dataclass(frozen=True, slots=True)
class Call:
    kind: Literal["summarizer", "memory_fold"]
    api: str  # the wire format of the call itself: "chat" or "messages"
    model: str  # the model the call asked for
    usage: Any  # the answer's usage object as it came (None: it had none)
    ts: float  # unix seconds when the call was sent
    status: int = 200  # the provider's status (a failed call may still be billed)


class CallSink(Protocol):
    def record_call(self, identity: Identity, call: Call) -> None:
        """Told of one call made for ``identity``'s session; never raises, never blocks."""
        ...

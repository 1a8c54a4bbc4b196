"""A request's pipeline work: counted against a budget, and stopped when its client is gone.

Every stage spends :class:`Work` as it goes (:meth:`Work.spend`, in *units*: about one unit
per byte of text a stage looks at, and a few per message or call it visits), between its
units of work. Two things can happen then:

* the client disconnected (:meth:`Work.cancel`, from the event loop): the next
  :meth:`Work.spend` raises :class:`Cancelled` in whatever thread the stage runs in, so the
  work of a request nobody waits for stops within one unit of work. Nothing durable is
  half-done by it: stages are pure, and the runner carries out their effects (originals
  written, staged ones promoted) only after a stage returned;
* the budget ran out (``server.pipeline_budget``): :attr:`Work.exhausted` turns true, and the
  stages that can degrade do (see :mod:`proxy.pipeline.runner`): the file-aware rules give the
  results they have not decided yet their stage-1 form (:mod:`proxy.filewise.plan`: decided
  by a work count over the epoch, so a request that degrades and the next one that does not
  forward the same prefix), the optional stages after offload forward what they have.

A count, not a clock: a wall-clock budget would fire on a busy machine and not on a quiet
one, so the same history could be forwarded two ways; a count of the work a history takes is
a function of that history (and of the config), the same on every replica and every retry.
A unit is about 0.13 us of pipeline on this project's machines (``bench/file_rereads.py``:
44.6M units in 5.9 s for a 12 MB body of re-reads), so the default budget is some 8 s of one
core.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["DEFAULT_BUDGET", "Cancelled", "Work"]

log = logging.getLogger("proxy.pipeline")

#: Work units a request may spend before the pipeline degrades (``server.pipeline_budget``):
#: about 64 MB of text looked at. The file-aware rules count some 2 units per character of the
#: results they decide (the result and what it is compared with), so an epoch decides ~30 MB
#: of results before they degrade; a 12 MB body of re-reads spends 45M in all.
DEFAULT_BUDGET = 64_000_000


class Cancelled(BaseException):  # noqa: N818 - the word the callers read
    """The request's client is gone: its pipeline work stops. A BaseException, as
    ``asyncio.CancelledError`` is: a stage's ``except Exception`` (which forwards without the
    stage) must not swallow it."""


class Work:
    """The work a request's pipeline has done, its budget, and whether it should stop. Shared
    by the event loop (which cancels) and the worker threads (which spend): an int and an
    event, each written by one side."""

    __slots__ = ("_cancelled", "_logged", "budget", "degraded", "hook", "spent")

    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        self.budget = budget
        self.spent = 0
        self.degraded: list[str] = []  # the stages that degraded, in order
        self._cancelled = threading.Event()
        self._logged = False
        # Called on every spend (tests: to cancel at a chosen point; a counter of calls).
        self.hook: Callable[[Work], None] | None = None

    def spend(self, units: int) -> None:
        """Count ``units`` of work done; raise :class:`Cancelled` once the client is gone."""
        self.spent += units
        if self._cancelled.is_set():
            raise Cancelled
        if self.hook is not None:
            self.hook(self)

    def check(self) -> None:
        """Raise :class:`Cancelled` once the client is gone (a point between units of work)."""
        if self._cancelled.is_set():
            raise Cancelled

    @property
    def exhausted(self) -> bool:
        return self.spent > self.budget

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()

    def degrade(self, stage: str) -> None:
        """Record that ``stage`` degraded (once per stage); the first one logs, once per
        request."""
        if stage in self.degraded:
            return
        self.degraded.append(stage)
        if not self._logged:
            self._logged = True
            log.warning("pipeline budget of %d work units spent (%d); degrading from stage %s "
                        "on (server.pipeline_budget)", self.budget, self.spent, stage)

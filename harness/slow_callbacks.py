"""Count an event loop's slow callbacks, as asyncio's debug mode reports them.

In debug mode asyncio (and uvloop) time each callback the loop runs from its ready queue and
timers, one step of a task included, and log those that took ``loop.slow_callback_duration``
or longer as ``Executing <handle> took 0.012 seconds`` (WARNING, ``asyncio`` logger). While
such a callback runs, nothing else on that loop does.

:class:`SlowCallbacks` switches one loop to debug mode and counts those records with a filter
on the ``asyncio`` logger, taking only the records of the loop's own thread (other loops in
the process are left alone). To also learn the worst callback *under* the threshold, the
loop's ``slow_callback_duration`` is set to a lower ``floor_s``; the records between the floor
and the threshold are counted and dropped, so the log shows what a loop with
``slow_callback_duration = threshold_s`` would have logged.

What the durations are: wall time, so they include waiting for the GIL while other threads of
the process run Python code (worker threads, or in-process test servers and clients) and for a
CPU, and debug mode's own cost (it records a stack for every handle and future it creates).
Not timed: uvloop runs its I/O callbacks (``Protocol.data_received``: parsing requests and
upstream responses) outside the ready queue, so only asyncio's own loop times those.

::

    watch = SlowCallbacks(threshold_s=0.010)
    with serve_in_thread(app, loop_setup=watch.install):  # called in the server's thread
        ...
    print(watch.summary())  # event loop: 0 callbacks over 10 ms (worst 6.1 ms: <Task ...>)
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field

__all__ = ["SlowCallback", "SlowCallbacks", "SlowSite"]

_EXECUTING = re.compile(r"^Executing (.*) took ([0-9.]+) seconds$", re.DOTALL)
_TASK_NAME = re.compile(r"^<Task .*?name='([^']*)'")
_SITE_PACKAGES = re.compile(r"/[^\s<>'\"]*/site-packages/")
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


@dataclass(frozen=True)
class SlowCallback:
    """One callback that took ``seconds``, ending ``at_s`` seconds after counting began.

    ``handle`` is asyncio's description of it, source paths shortened (for one step of a
    task, the task's repr, which names the task's outermost coroutine only). ``awaiting`` is,
    for a task still pending, its chain of coroutine frames where the step ended, outermost
    first (``file:line function``): the code that ran for ``seconds`` is what led from the
    task's previous await to that one.
    """

    seconds: float
    handle: str
    awaiting: tuple[str, ...] = ()
    at_s: float = 0.0


@dataclass
class SlowSite:
    """The callbacks over the threshold that ended at one place (see :attr:`SlowCallbacks.sites`)."""

    count: int = 0
    worst_s: float = 0.0
    first_at_s: float = 0.0


@dataclass
class _Figures:
    count: int = 0
    over_floor: int = 0
    worst: list[SlowCallback] = field(default_factory=list)
    sites: dict[str, SlowSite] = field(default_factory=dict)


class SlowCallbacks(logging.Filter):
    """Debug mode for one event loop, and the count of its callbacks over ``threshold_s``.

    :meth:`install` must run in the loop's thread (``ServerThread(loop_setup=...)`` does);
    the figures are read at the end (written by the loop's thread only). ``log_slow=False``
    drops even the records over the threshold once counted (the summary reports them); by
    default those stay in the log. ``origins=True`` keeps the other half of debug mode, the
    record of where each coroutine was created (off by default: it costs on every coroutine
    call, inflating the durations, and only serves "never awaited" warnings).
    """

    def __init__(
        self,
        threshold_s: float = 0.010,
        floor_s: float = 0.001,
        *,
        keep: int = 5,
        log_slow: bool = True,
        origins: bool = False,
    ) -> None:
        super().__init__("asyncio-slow-callbacks")
        if not 0 < floor_s <= threshold_s:
            raise ValueError("need 0 < floor_s <= threshold_s")
        self.threshold_s = threshold_s
        self.floor_s = floor_s
        self.keep = keep
        self.log_slow = log_slow
        self.origins = origins
        self._figures = _Figures()
        self._thread_id: int | None = None
        self._installed_at = 0.0

    @property
    def count(self) -> int:
        """Callbacks that took ``threshold_s`` or longer (the figure tracked; target 0)."""
        return self._figures.count

    @property
    def over_floor(self) -> int:
        """Callbacks that took ``floor_s`` or longer (asyncio logged each of these)."""
        return self._figures.over_floor

    @property
    def worst(self) -> list[SlowCallback]:
        """The ``keep`` slowest callbacks (of at least ``floor_s``), slowest first."""
        return list(self._figures.worst)

    @property
    def sites(self) -> dict[str, SlowSite]:
        """The callbacks over the threshold by where they ended, most frequent first.

        For a task, the innermost frame outside the standard library where the step ended
        (``proxy/tokens/request.py:94 request_async``); else asyncio's description of the
        handle, without task names, times and "created at".
        """
        items = sorted(self._figures.sites.items(), key=lambda kv: (-kv[1].count, -kv[1].worst_s))
        return dict(items)

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Debug mode on ``loop``, the floor as its slow-callback duration; start counting."""
        self._thread_id = threading.get_ident()
        self._installed_at = time.time()
        loop.set_debug(True)
        loop.slow_callback_duration = self.floor_s
        if not self.origins:
            # Debug mode also records where every coroutine was created (for "never awaited"
            # warnings), a cost on each call that the durations would include. The loop turns
            # it on when it starts running; this runs right after.
            loop.call_soon(sys.set_coroutine_origin_tracking_depth, 0)
        logging.getLogger("asyncio").addFilter(self)

    def uninstall(self) -> None:
        """Stop counting (the loop stays in debug mode)."""
        logging.getLogger("asyncio").removeFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self._thread_id or not isinstance(record.msg, str):
            return True  # not a record of our loop: leave it alone
        args = record.args
        if isinstance(args, tuple) and len(args) == 2 and isinstance(args[1], float):
            if not record.msg.startswith("Executing "):
                return True
            raw_handle: object = args[0]
            seconds = args[1]
        else:
            # A filter added before this one may have merged the arguments into the message
            # already (litellm adds a secret-scrubbing filter to the asyncio logger on import).
            found = _EXECUTING.match(record.getMessage())
            if found is None:
                return True
            raw_handle, seconds = found[1], float(found[2])
        fig = self._figures
        fig.over_floor += 1
        over = seconds >= self.threshold_s
        if not over and len(fig.worst) >= self.keep and seconds <= fig.worst[-1].seconds:
            return False  # the common case: nothing to describe
        # Only now is the handle described (we are in the loop's thread, right after it ran).
        handle = raw_handle if isinstance(raw_handle, str) else repr(raw_handle)
        frames = _awaiting(handle)
        at_s = record.created - self._installed_at
        if over:
            fig.count += 1
            site = fig.sites.setdefault(_site(handle, frames), SlowSite(first_at_s=at_s))
            site.count += 1
            site.worst_s = max(site.worst_s, seconds)
        if len(fig.worst) < self.keep or seconds > fig.worst[-1].seconds:
            awaiting = tuple(f"{_short(path)}:{line} {func}" for path, line, func in frames)
            fig.worst.append(SlowCallback(seconds, _short(handle), awaiting, at_s))
            fig.worst.sort(key=lambda cb: cb.seconds, reverse=True)
            del fig.worst[self.keep :]
        return over and self.log_slow

    def summary(self, detail: int = 3) -> str:
        """``event loop: N callbacks over 10 ms (worst ...)``; when N > 0, where they ended
        (up to 5 places) and the ``detail`` slowest, each with the await its step ended at."""
        fig = self._figures
        head = f"event loop: {fig.count} callbacks over {self.threshold_s * 1000:g} ms"
        if not fig.worst:
            return f"{head} (worst under {self.floor_s * 1000:g} ms)"
        top = fig.worst[0]
        lines = [f"{head} (worst {top.seconds * 1000:.1f} ms at {top.at_s:.1f} s: {top.handle})"]
        shown = fig.worst[:detail] if fig.count else []
        if fig.count:
            lines.append("  where they ended (for a task, the await that ended the step):")
            for name, site in list(self.sites.items())[:5]:
                lines.append(f"    {site.count:>5}x  worst {site.worst_s * 1000:6.1f} ms  "
                             f"first at {site.first_at_s:5.1f} s  {name}")
            lines.append("  the slowest:")
        for cb in shown:
            lines.append(f"    {cb.seconds * 1000:6.1f} ms at {cb.at_s:.1f} s: {cb.handle}")
            if cb.awaiting:
                lines.append("      awaiting " + " <- ".join(reversed(cb.awaiting)))
        if not shown and top.awaiting:
            lines.append("  awaiting " + " <- ".join(reversed(top.awaiting)))
        return "\n".join(lines)


def _awaiting(handle: str) -> list[tuple[str, int, str]]:
    """For a pending task: where its coroutines stand, outermost first; [] otherwise."""
    m = _TASK_NAME.match(handle)
    if m is None:
        return []
    try:
        task = next(t for t in asyncio.all_tasks() if t.get_name() == m.group(1))
    except (RuntimeError, StopIteration):  # no running loop here; the task has finished
        return []
    frames: list[tuple[str, int, str]] = []
    aw: object = task.get_coro()
    while aw is not None and len(frames) < 64:
        frame = getattr(aw, "cr_frame", None) or getattr(aw, "gi_frame", None)
        if frame is None:
            break
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        aw = getattr(aw, "cr_await", None) or getattr(aw, "gi_yieldfrom", None)
    return frames


def _site(handle: str, frames: list[tuple[str, int, str]]) -> str:
    for path, line, func in reversed(frames):
        if not path.startswith(_STDLIB):
            return f"{_short(path)}:{line} {func}"
    text = re.sub(r" name='[^']*'| when=\S+| created at [^\s>]+", "", handle)
    return _short(text)


def _short(text: str) -> str:
    """Source paths in ``text`` from their package on (``uvicorn/...``, ``asyncio/...``)."""
    text = _SITE_PACKAGES.sub("", text)
    for prefix in (_STDLIB, os.getcwd() + os.sep):
        text = text.replace(prefix, "")
    return text

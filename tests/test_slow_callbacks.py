"""harness.slow_callbacks: one event loop's callbacks over 10 ms, as debug mode reports
them, counted for that loop only; and ServerThread's ``loop_setup`` hook the benches use."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from harness.slow_callbacks import SlowCallbacks
from proxy.demo.servers import serve_in_thread


async def _pause() -> None:
    await asyncio.sleep(0)


async def _blocks() -> None:
    await asyncio.sleep(0)
    time.sleep(0.004)  # over the floor, under the threshold
    await _pause()
    time.sleep(0.03)  # over the threshold: this step ends awaiting in _pause
    await _pause()


def _other_loop_blocking() -> None:
    """Another thread's loop in debug mode, blocking 30 ms: its record is not ours."""

    async def main() -> None:
        asyncio.get_running_loop().slow_callback_duration = 0.001
        await asyncio.sleep(0)
        time.sleep(0.03)

    asyncio.run(main(), debug=True)


def _loop_factories() -> list[Callable[[], asyncio.AbstractEventLoop]]:
    factories: list[Callable[[], asyncio.AbstractEventLoop]] = [asyncio.SelectorEventLoop]
    try:
        import uvloop
    except ImportError:
        return factories
    return [*factories, uvloop.new_event_loop]


@pytest.mark.parametrize("factory", _loop_factories())
def test_counts_the_slow_steps_of_its_own_loop(
    factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    watch = SlowCallbacks(threshold_s=0.010, floor_s=0.002, log_slow=False)
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            watch.install(runner.get_loop())
            other = threading.Thread(target=_other_loop_blocking)
            other.start()
            other.join()
            runner.run(_blocks())
    finally:
        watch.uninstall()
    assert watch.count >= 1
    # Under load other steps may be slow too: the blocking one is among the worst.
    top = next(cb for cb in watch.worst if cb.seconds >= 0.03 and any(
        "test_slow_callbacks.py:" in f and f.endswith(" _pause") for f in cb.awaiting))
    assert top.handle.startswith("<Task")
    assert any("test_slow_callbacks.py:" in site and site.endswith("_pause") for site in watch.sites)
    assert watch.over_floor >= 2  # the 4 ms step was seen too, below the threshold
    assert any(cb.seconds < 0.010 for cb in watch.worst) or watch.count >= 2
    assert watch.summary().startswith(f"event loop: {watch.count} callbacks over 10 ms (worst ")


def test_nothing_slow() -> None:
    watch = SlowCallbacks(threshold_s=0.010, floor_s=0.005)
    try:
        with asyncio.Runner() as runner:
            watch.install(runner.get_loop())
            runner.run(_pause())
    finally:
        watch.uninstall()
    assert watch.count == 0
    assert watch.summary() == "event loop: 0 callbacks over 10 ms (worst under 5 ms)"


def test_server_thread_loop_setup() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        time.sleep(0.02)  # blocking the server's loop
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    watch = SlowCallbacks(threshold_s=0.010, log_slow=False)
    loops: list[asyncio.AbstractEventLoop] = []

    def setup(loop: asyncio.AbstractEventLoop) -> None:
        loops.append(loop)
        watch.install(loop)

    try:
        with serve_in_thread(app, lifespan="off", loop_setup=setup) as srv:
            assert httpx.get(srv.url).text == "ok"
            assert loops == [srv.loop]
    finally:
        watch.uninstall()
    assert loops[0].get_debug()
    assert watch.count >= 1 and watch.worst[0].seconds >= 0.02

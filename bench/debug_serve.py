"""``python -m proxy serve`` with the event loop in asyncio debug mode, for bench/load.py.

    python -m bench.debug_serve --loop-report FILE --config FILE [--host H] [--port P]
                                [--log-level info]

The same app (``create_app(load_config(...))``), uvicorn settings, event loop (uvloop when
installed) and logging as ``proxy.cli.serve``, whose uvicorn arguments this mirrors: keep them in
step. The difference: the loop runs in debug mode and
:class:`proxy.testing.slow_callbacks.SlowCallbacks` counts its callbacks of 10 ms or more
(asyncio's "Executing <...> took 0.012 seconds" warnings, which stay in the log). On SIGTERM or
SIGINT, after uvicorn's graceful shutdown, the summary goes to ``--loop-report`` and to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from harness.slow_callbacks import SlowCallbacks
from proxy.app import create_app
from proxy.cli import _setup_logging, _with_overrides
from proxy.config import exposure_problem, load_config


class _Terminated(BaseException):
    """uvicorn re-raises the SIGTERM it shut down for; end quietly and write the report."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def main() -> int:
    ap = argparse.ArgumentParser(description="python -m proxy serve, event loop in debug mode")
    ap.add_argument("--loop-report", type=Path, required=True, help="where the summary goes")
    ap.add_argument("--config")
    ap.add_argument("--host")
    ap.add_argument("--port", type=int)
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = ap.parse_args()
    config = _with_overrides(load_config(args.config), args.host, args.port)
    problem = exposure_problem(config)
    if problem is not None:
        sys.exit(f"ctxproxy: config error: {problem}")
    _setup_logging(args.log_level)
    logging.getLogger("proxy").info(
        "ctxproxy listening on http://%s:%d -> %s (bench/debug_serve.py: event loop in debug mode)",
        config.server.host, config.server.port, config.upstream.base_url,
    )
    drain: Any = config.server.shutdown_timeout_s
    server = uvicorn.Server(uvicorn.Config(
        create_app(config),
        host=config.server.host,
        port=config.server.port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,
        server_header=False,
        date_header=False,
        lifespan="on",
        timeout_graceful_shutdown=drain,
    ))
    watch = SlowCallbacks(threshold_s=0.010)
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        # What uvicorn.run does (Server.run), with the loop set up before it runs.
        with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
            watch.install(runner.get_loop())
            runner.run(server.serve())
    except (_Terminated, KeyboardInterrupt):
        pass
    finally:
        watch.uninstall()
        report = watch.summary()
        args.loop_report.write_text(report + "\n")
        print(report, file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

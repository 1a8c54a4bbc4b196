"""Command line: `ctxproxy serve`, the entry point of the console script and `python -m proxy`."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from proxy.config import Config, exposure_problem, load_config
from proxy.errors import ConfigError
from proxy.logs import BoundedFormatter
from proxy.server.protocol import header_deadline_protocol
from proxy.telemetry import installation_problem

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ctxproxy", description="OpenAI-compatible context-management proxy."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", help="YAML configuration file (every field optional)")
    serve.add_argument("--host", help="interface to listen on (overrides server.host)")
    serve.add_argument("--port", type=int, help="port to listen on (overrides server.port)")
    serve.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    demo = sub.add_parser("demo", help="play a long scripted agent session through the proxy")
    demo.add_argument("--data-dir", help="where to keep the demo's files (default: a temp dir)")
    demo.add_argument("--keep-serving", action="store_true", help="keep the proxy up at the end")
    gc = sub.add_parser("gc", help="delete expired offloaded files now")
    gc.add_argument("--config", help="YAML configuration file (every field optional)")
    db = sub.add_parser("db", help="the shared database (storage.url)")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_sub.add_parser("upgrade", help="create or migrate the schema, then exit")
    upgrade.add_argument("--config", help="YAML configuration file with storage.url")
    copy = sub.add_parser("migrate-storage",
                          help="copy a data_dir (files + SQLite) into the database at storage.url")
    copy.add_argument("--config", help="YAML configuration file with storage.url")
    copy.add_argument("--from", dest="source", help="data_dir to copy (default: storage.data_dir)")
    return parser


def _with_overrides(config: Config, host: str | None, port: int | None) -> Config:
    server = config.server.model_copy(
        update={k: v for k, v in (("host", host), ("port", port)) if v is not None}
    )
    return config.model_copy(update={"server": server})


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(BoundedFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger("proxy")
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False


class _Terminated(BaseException):
    """SIGTERM after uvicorn's graceful shutdown (see :func:`serve`)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def serve(config: Config, log_level: str) -> int:
    """Run until SIGTERM/SIGINT, then shut down gracefully (exit 0).

    Shutdown, by uvicorn: the listening socket closes at once (new connections are refused),
    idle keep-alive connections close, requests and streams in flight run to completion for up
    to ``server.shutdown_timeout_s`` and are cancelled after that; only then does the lifespan
    close the runtime (it waits for the archive writes those requests left behind, then closes
    the upstream client and the database). A second SIGINT skips the wait.

    uvicorn re-raises the captured signal once it is done, so that the process would die of
    SIGTERM (exit status 143) after an orderly shutdown; the handler installed here turns that
    into a plain return, exit code 0 as for every orderly stop.
    """
    import uvicorn

    from proxy.app import create_app

    _setup_logging(log_level)
    logging.getLogger("proxy").info(
        "ctxproxy listening on http://%s:%d -> %s",
        config.server.host,
        config.server.port,
        config.upstream.base_url,
    )
    # uvicorn's Config annotates the timeout as int; it only reaches asyncio.wait_for.
    drain: Any = config.server.shutdown_timeout_s
    keepalive: Any = config.server.keepalive_s  # annotated int too; a float works the same
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        uvicorn.run(
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
            http=header_deadline_protocol(config.server.header_timeout_s),
            timeout_keep_alive=keepalive,
        )
    except _Terminated:
        pass
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    return EXIT_OK


def gc(config: Config) -> int:
    """Expire what is due now and report every tenant's disk use against its quota."""
    from proxy.store.db import Database
    from proxy.store.gc import collect
    from proxy.store.paths import db_path
    from proxy.store.tool_results import ToolResultStore
    from proxy.store.usage import DiskUsage

    storage = config.storage
    if storage.url is not None:
        from proxy.store.postgres import PostgresBackend

        backend = PostgresBackend(storage, digest_cache_bytes=0)
        try:
            report = backend.collect(DiskUsage(storage.data_dir, backend.tenant_sizes),
                                     dialog_ttl_days=storage.dialog_ttl_days)
        finally:
            backend.close()
    else:
        store = ToolResultStore(storage.data_dir, storage.tool_result_ttl_days)
        db = Database.in_dir(storage.data_dir) if db_path(storage.data_dir).exists() else None
        try:
            report = collect(storage.data_dir, db, store, DiskUsage(storage.data_dir),
                             dialog_ttl_days=storage.dialog_ttl_days)
        finally:
            if db is not None:
                db.close()
    where = "the database" if storage.url is not None else str(storage.data_dir)
    print(f"deleted {report.tool_results} offloaded file(s) older than "
          f"{storage.tool_result_ttl_days:g} days from {where}")
    if storage.dialog_ttl_days is not None:
        print(f"deleted {report.dialog_files} dialog file(s), {report.summaries} summary(ies), "
              f"{report.sessions} session(s) and {report.memory_files} memory file(s) older "
              f"than {storage.dialog_ttl_days:g} days")
        print(f"deleted {report.ledger_entries} cost ledger entry(ies) older than "
              f"{storage.dialog_ttl_days:g} days")
    limits = {k.tenant: k.max_disk_mb for k in config.auth.keys if k.max_disk_mb is not None}
    for tenant, used in sorted(report.usage.items()):
        limit = limits.get(tenant, storage.max_tenant_mb)
        over = limit is not None and used >= limit * 1024 * 1024
        shown = "no quota" if limit is None else f"quota {limit:g} MiB"
        print(f"tenant {tenant}: {used / (1024 * 1024):.1f} MiB ({shown})"
              + (": OVER QUOTA, nothing new is written" if over else ""))
    return EXIT_OK


def _pool(config: Config) -> Any:
    from proxy.store.postgres import PgPool

    if config.storage.url is None:
        raise ConfigError("storage.url: set it to the postgresql:// URL of the shared database")
    pool = PgPool(config.storage.url, max_size=2, timeout_s=config.storage.statement_timeout_s)
    pool.open()
    return pool


def db_upgrade(config: Config) -> int:
    """Bring the shared database's schema to this version (what ``serve`` does at start)."""
    from proxy.store.postgres import SCHEMA_VERSION, upgrade

    pool = _pool(config)
    try:
        with pool.connection() as conn:
            applied = upgrade(conn)
    finally:
        pool.close()
    print(f"schema version {SCHEMA_VERSION}"
          + (f" (applied {', '.join(map(str, applied))})" if applied else " (already current)"))
    return EXIT_OK


def migrate_storage(config: Config, source: str | None) -> int:
    """Copy a files + SQLite data_dir into the database at storage.url (idempotent)."""
    from pathlib import Path

    from proxy.store.postgres import upgrade
    from proxy.store.postgres.copy import copy_data_dir

    data_dir = Path(source) if source else config.storage.data_dir
    if not data_dir.is_dir():
        raise ConfigError(f"{data_dir}: not a directory")
    pool = _pool(config)
    try:
        with pool.connection() as conn:
            upgrade(conn)
        report = copy_data_dir(data_dir, pool)
    finally:
        pool.close()
    print(f"copied from {data_dir}: {report.originals} offloaded file(s), "
          f"{report.dialog_lines} dialog line(s), {report.messages} index row(s), "
          f"{report.summaries} summary(ies), {report.sessions} session(s), "
          f"{report.memory_days} memory note day(s), {report.memory_versions} memory "
          f"version(s), {report.rounds} read round record(s), {report.ledger} ledger "
          "entry(ies)")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            from proxy.demo.run import run_demo

            return run_demo(data_dir=args.data_dir, keep_serving=args.keep_serving)
        config = load_config(args.config)
        if args.command == "serve":
            if args.port is not None and not 0 <= args.port <= 65535:
                raise ConfigError("server.port: must be between 0 and 65535")
            config = _with_overrides(config, args.host, args.port)
            problem = exposure_problem(config) or installation_problem(config.telemetry)
            if problem is not None:
                raise ConfigError(problem)
            return serve(config, args.log_level)
        if args.command == "gc":
            return gc(config)
        if args.command == "db":
            return db_upgrade(config)
        if args.command == "migrate-storage":
            return migrate_storage(config, args.source)
    except ConfigError as exc:
        print(f"ctxproxy: config error: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception as exc:  # the CLI's last line of defence: one line, exit 1
        print(f"ctxproxy: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

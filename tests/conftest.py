"""Fixtures of the three layers the suite tests at.

* In process (``inproc``, ``make_inproc``): the app's lifespan in the test's own loop and an
  ``httpx.AsyncClient`` calling it directly (:mod:`harness.inprocess`). The default for
  handler logic: no port, no server thread.
* A real server on loopback (``proxy``, ``make_proxy``, ``module_proxy``): uvicorn in a thread
  (:mod:`proxy.demo.servers`), for real client libraries, faults and disconnects on the wire,
  raw request targets.
* The real command line in a child process (:mod:`harness.process`): signals, ``kill -9``.

All of them forward to one fake upstream per worker, on a real loopback socket (the proxy's
outbound aiohttp client needs one): ``fake`` is that fake, reset around every test.
"""

from __future__ import annotations

import contextlib
import http.client
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from harness.inprocess import InProcess
from harness.process import free_port
from proxy.app import create_app
from proxy.config import Config, config_from_mapping
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import ServerThread, serve_in_thread
from proxy.store.db import Database

#: Modules whose tests import litellm, langchain or openai-agents: seconds of CPU per process
#: that imports them (and a litellm route's first use imports litellm in the proxy too).
SLOW_IMPORT_MODULES = frozenset({
    "tests/test_clients.py", "tests/test_litellm_e2e.py", "tests/test_litellm_route.py",
    "tests/test_secrets.py",
})
#: Modules whose tests share costly module or session fixtures (a PostgreSQL server, three
#: replicas behind a balancer): each group runs whole on one worker, so they start once (the
#: PostgreSQL store and memory tests share that worker's server).
ONE_WORKER_MODULES = {
    "tests/test_postgres_store.py": "postgres",
    "tests/test_postgres_memory.py": "postgres",
    "tests/test_thinking_recovery.py": "postgres",
    "tests/test_replay_postgres.py": "postgres",
    "tests/test_ledger_store.py": "postgres",
    "tests/test_scale_out.py": "scale-out",
    "tests/test_preserved_thinking.py": "postgres",
    "tests/test_claude_code.py": "claude-code",  # the nine-file session: one run, two tests
    "tests/test_file_sessions.py": "file-sessions",  # one session per client, read by each test
}


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With the default ``--dist load``: every test is its own unit of work, but the tests of
    SLOW_IMPORT_MODULES are one unit, which one worker runs (and so imports those libraries
    once, not once per worker). xdist's own ``xdist_group`` marks would say the same, but
    pytest 9.2 ignores the node ids ``--dist loadgroup`` relies on (pytest-xdist#1386)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SlowImportsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module in SLOW_IMPORT_MODULES:
                return "slow-imports"
            if module in ONE_WORKER_MODULES:
                return ONE_WORKER_MODULES[module]
            return nodeid

    return SlowImportsTogether(config, log)


@pytest.fixture(scope="session")
def _fake_server() -> Iterator[tuple[FakeUpstream, ServerThread]]:
    fake = FakeUpstream()
    with serve_in_thread(fake) as srv:
        yield fake, srv


@pytest.fixture
def fake(_fake_server: tuple[FakeUpstream, ServerThread]) -> Iterator[FakeUpstream]:
    fake, _ = _fake_server
    fake.reset()
    yield fake
    fake.reset()


@pytest.fixture
def fake_url(_fake_server: tuple[FakeUpstream, ServerThread]) -> str:
    return _fake_server[1].url + "/v1"


def proxy_config(
    upstream_url: str, data_dir: Path, overrides: dict[str, Any] | None = None
) -> Config:
    """The proxy in front of ``upstream_url`` with its data under ``data_dir``; ``overrides``
    as a mapping (a section given as a dict is merged into the defaults' section)."""
    data: dict[str, Any] = {
        "upstream": {"base_url": upstream_url},
        # The same fake speaks Anthropic's API: no test ever reaches api.anthropic.com.
        "anthropic": {"base_url": upstream_url.removesuffix("/v1")},
        "storage": {"data_dir": str(data_dir)},
    }
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return config_from_mapping(data)


ENVELOPE_KEYS = {"message", "type", "param", "code"}


def assert_envelope(
    r: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``r`` is a proxy-made error: ``status``, OpenAI's error envelope (and its param, code)."""
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"].startswith("application/json")
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == ENVELOPE_KEYS
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def closed_port() -> int:
    """A loopback port with nothing listening on it."""
    return free_port()


def raw_get(
    url: str, target: str, headers: dict[str, str] | None = None, method: str = "GET"
) -> tuple[int, bytes]:
    """A request whose target is sent byte for byte (httpx would normalise ``..``)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=10)
    try:
        conn.putrequest(method, target, skip_accept_encoding=True)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


# --- in process -------------------------------------------------------------------------------

InProcessFactory = Callable[..., Awaitable[InProcess]]


@pytest.fixture
async def make_inproc(
    fake: FakeUpstream, fake_url: str, tmp_path: Path
) -> AsyncIterator[InProcessFactory]:
    """Start the proxy in this test's loop in front of the fake (data under ``tmp_path/data``);
    ``await make_inproc(overrides, stages=...)``. Stopped (lifespan shutdown) after the test."""
    async with contextlib.AsyncExitStack() as stack:

        async def factory(overrides: dict[str, Any] | None = None, **kwargs: Any) -> InProcess:
            app = create_app(proxy_config(fake_url, tmp_path / "data", overrides), **kwargs)
            return await stack.enter_async_context(InProcess(app))

        yield factory


@pytest.fixture
async def inproc(make_inproc: InProcessFactory) -> InProcess:
    """The proxy with the default configuration, in process."""
    return await make_inproc()


# --- real servers on loopback ---------------------------------------------------------------

ProxyFactory = Callable[..., ServerThread]


@pytest.fixture
def make_proxy(
    fake: FakeUpstream, fake_url: str, tmp_path: Path
) -> Iterator[ProxyFactory]:
    """Start a real proxy on loopback in front of the fake; config overrides as a mapping."""
    started: list[ServerThread] = []

    def factory(overrides: dict[str, Any] | None = None, **kwargs: Any) -> ServerThread:
        config = proxy_config(fake_url, tmp_path / "data", overrides)
        srv = serve_in_thread(create_app(config, **kwargs), lifespan="on")
        srv.start()
        started.append(srv)
        return srv

    yield factory
    for srv in started:
        srv.stop()


@pytest.fixture
def proxy(make_proxy: ProxyFactory) -> ServerThread:
    return make_proxy()


@pytest.fixture(scope="module")
def module_proxy(
    _fake_server: tuple[FakeUpstream, ServerThread], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    """One real proxy (default configuration) for a module whose tests do not depend on the
    proxy's state: what one test leaves in its data dir, the next one does not look at."""
    config = proxy_config(_fake_server[1].url + "/v1", tmp_path_factory.mktemp("proxy") / "data")
    with serve_in_thread(create_app(config), lifespan="on") as srv:
        yield srv


# --- the data directory -----------------------------------------------------------------------


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def db(data_dir: Path) -> Iterator[Database]:
    """The one SQLite database, as the app opens it under data_dir."""
    database = Database.in_dir(data_dir)
    yield database
    database.close()


def examples(thorough: int) -> int:
    """Hypothesis examples for a property: a third by default, so the default suite stays fast
    (CI runs it on every push, with new random examples each time); all of them with
    ``CTXPROXY_THOROUGH=1``."""
    return thorough if os.environ.get("CTXPROXY_THOROUGH") else max(20, thorough // 3)

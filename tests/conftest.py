from __future__ import annotations

import http.client
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from proxy.app import create_app
from proxy.config import Config, config_from_mapping
from proxy.store.db import Database
from proxy.testing.fake_upstream import FakeUpstream
from proxy.testing.process import free_port
from proxy.testing.servers import ServerThread, serve_in_thread


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


ProxyFactory = Callable[..., ServerThread]


@pytest.fixture
def make_proxy(
    fake: FakeUpstream, fake_url: str, tmp_path: Path
) -> Iterator[ProxyFactory]:
    """Start a real proxy on loopback in front of the fake; config overrides as a mapping."""
    started: list[ServerThread] = []

    def factory(overrides: dict[str, Any] | None = None, **kwargs: Any) -> ServerThread:
        data: dict[str, Any] = {
            "upstream": {"base_url": fake_url},
            "storage": {"data_dir": str(tmp_path / "data")},
        }
        for key, value in (overrides or {}).items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        config: Config = config_from_mapping(data)
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


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def db(data_dir: Path) -> Iterator[Database]:
    """The one SQLite database, as the app opens it under data_dir."""
    database = Database.in_dir(data_dir)
    yield database
    database.close()

"""Fixtures for the PostgreSQL tests: one real server per test worker (started from Debian's
``postgresql`` package, which ``.ci/run`` installs), a fresh database per test."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from harness.postgres import PostgresServer, find_binaries

NO_SERVER = "no PostgreSQL server binaries (install Debian's postgresql package; .ci/run does)"


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    if find_binaries() is None:
        pytest.skip(NO_SERVER)
    server = PostgresServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def pg_url(postgres: PostgresServer, request: pytest.FixtureRequest) -> str:
    """A new empty database named after the test."""
    name = re.sub(r"[^a-z0-9_]", "_", request.node.name.lower())[:50]
    return postgres.create_database(name)

"""The passthrough never leaves upstream.base_url's path: hostile request targets, sent byte for
byte over a raw socket (an HTTP client library would normalise them away first), get a 400
envelope and the upstream sees nothing; plain paths reach it exactly as the client wrote them."""

from __future__ import annotations

import orjson
import pytest

from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import ServerThread

from .conftest import raw_get

HOSTILE = [
    "/v1/../admin/secret",
    "/v1/../../admin/secret",
    "/v1/models/../../admin",
    "/v1/%2e%2e/admin",
    "/v1/%2E%2E/admin",
    "/v1/.%2e/admin",
    "/v1/%2e./admin",
    "/v1/%252e%252e/admin",
    "/v1/%25252e%25252e/admin",
    "/v1/./models",
    "/v1/%2e/models",
    "/v1/models/.",
    "/v1/models/..",
    "/v1/models/./gpt",
    "/v1/models%2f..%2f..%2fadmin",
    "/v1/models%2F..%2F..%2Fadmin",
    "/v1/..%2fadmin",
    "/v1/..%252fadmin",
    "/v1/files/%2e%2e%2f%2e%2e%2fadmin",
    "/v1/..%5cadmin",
    "/v1/..%255cadmin",
    "/v1/%5c..%5cadmin",
    "/v1//admin",
    "/v1/models//x",
    "/v1/models/",
    "/v1/",
    "/v1/%2fadmin",
    "/v1/a%00b",
    "/v1/%00/x",
    "/v1/%0d%0aHost:%20evil",
    "/v1/..;/admin",
    "/v1/%2e%2e;x/admin",
    "/v1/%c0%ae%c0%ae/admin",
    "/v1/%u002e%u002e/admin",
    "/v1/models/%2e%2e%2f",
    "/v1/embeddings/..%2f..%2f..%2fadmin?x=1",
]


def test_at_least_thirty_hostile_paths() -> None:
    assert len(HOSTILE) >= 30 and len(set(HOSTILE)) == len(HOSTILE)


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_hostile_paths_are_refused_and_never_reach_the_upstream(
    proxy: ServerThread, fake: FakeUpstream, method: str
) -> None:
    headers = {"authorization": "Bearer sk-client", "content-length": "0"}
    refused = 0
    for target in HOSTILE:
        status, body = raw_get(proxy.url, target, headers, method=method)
        assert status == 400, (target, status, body)
        error = orjson.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_path"
        refused += 1
    assert refused == len(HOSTILE)
    assert fake.request_count == 0, [r.raw_path for r in fake.received]


@pytest.mark.parametrize(
    "target",
    [
        "/v1/models/fake-model",
        "/v1/files/file-abc123/content",
        "/v1/files/name%20with%20space",
        "/v1/batches?limit=2&after=batch_1",
        "/v1/responses/resp_123/input_items",
        "/v1/vector_stores/vs_1/files/file-2",
    ],
)
def test_plain_paths_pass_exactly_as_written(
    proxy: ServerThread, fake: FakeUpstream, target: str
) -> None:
    status, body = raw_get(proxy.url, target, {"authorization": "Bearer sk-client"})
    assert status == 200, body
    [got] = fake.received
    path, _, query = target.partition("?")
    assert got.raw_path == path and got.query == query

"""Prometheus metrics: one registry per app (no process-global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def route_of(path: str) -> str:
    """A bounded label for a path (raw paths would explode the series count)."""
    if path in ("/v1/chat/completions", "/chat/completions"):
        return "chat"
    if path == "/v1/models":
        return "models"
    if path.startswith("/v1/"):
        return "passthrough"
    if path == "/files" or path.startswith("/files/"):
        return "files"
    if path in ("/healthz", "/readyz", "/metrics"):
        return path[1:]
    return "other"


class _Live(Collector):
    """Counters kept by other objects (summarizer, compaction engine), read at scrape time."""

    def __init__(self) -> None:
        self.sources: dict[str, tuple[str, Callable[[], float]]] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, (doc, read) in self.sources.items():
            family = CounterMetricFamily(name, doc)
            family.add_metric([], read())
            yield family


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("ctxproxy_requests", "HTTP requests by route and status.",
                                ["route", "status"], registry=r)
        self.upstream_seconds = Histogram("ctxproxy_upstream_seconds",
                                          "Time until the upstream's answer started.", ["route"],
                                          buckets=_LATENCY, registry=r)
        self.pipeline_seconds = Histogram("ctxproxy_pipeline_seconds",
                                          "Time spent in the context pipeline per chat request.",
                                          buckets=_LATENCY, registry=r)
        self.pipeline_degraded = Counter(
            "ctxproxy_pipeline_degraded",
            "Requests whose pipeline spent its work budget and degraded "
            "(server.pipeline_budget).", registry=r)
        self.pipeline_cancelled = Counter(
            "ctxproxy_pipeline_cancelled",
            "Requests whose pipeline work stopped because the client disconnected.", registry=r)
        self.tokens_in = Counter("ctxproxy_tokens_in", "Tokens the clients sent.", registry=r)
        self.tokens_out = Counter("ctxproxy_tokens_out", "Tokens forwarded upstream.", registry=r)
        self.offloaded = Counter("ctxproxy_offloaded_results",
                                 "Tool results forwarded cut (offload notices).", registry=r)
        self.disk_errors = Counter("ctxproxy_disk_errors",
                                   "Writes that failed (offloaded files, dialog archive).", registry=r)
        self.quota_exceeded = Counter("ctxproxy_quota_exceeded",
                                      "Requests forwarded without writing: tenant over its disk "
                                      "quota.", registry=r)
        self.auth_failures = Counter("ctxproxy_auth_failures",
                                     "Requests refused with 401 (missing or unknown key).",
                                     registry=r)
        self.thinking_dropped = Counter("ctxproxy_thinking_dropped",
                                        "Messages requests sent again with drop_block after "
                                        "Anthropic's prefix check refused a thinking block.",
                                        registry=r)
        # The cost ledger (proxy.ledger): no tenant or session labels (the route carries no names).
        self.cache_breaks = Counter("ctxproxy_cache_breaks",
                                    "Calls whose cached share fell, by reason: compaction "
                                    "(ctxproxy started an epoch), client (the client changed "
                                    "its history), ttl (the cache expired), unknown.",
                                    ["reason"], registry=r)
        for reason in ("compaction", "client", "ttl", "unknown"):
            self.cache_breaks.labels(reason)
        self.billed_tokens = Counter("ctxproxy_billed_tokens",
                                     "Tokens billed by the providers (their usage, else the "
                                     "proxy's estimate), by part and kind of call.",
                                     ["part", "call"], registry=r)
        self.cost_usd = Counter("ctxproxy_cost_usd",
                                "USD billed through ctxproxy, calls of priced models, by kind "
                                "of call (request, read_round, summarizer, memory_fold).",
                                ["call"], registry=r)
        self.direct_cost_usd = Counter("ctxproxy_direct_cost_usd",
                                       "USD the same client requests would have cost sent "
                                       "directly (the counterfactual), priced models.",
                                       registry=r)
        self.summarizer_errors = Counter("ctxproxy_summarizer_errors",
                                         "The proxy's own model calls that failed, by kind "
                                         "(summarizer, memory_fold) and the provider's status "
                                         "(0: no answer: a timeout, a broken connection; 200: "
                                         "an answer with no text). Each one's summary is the "
                                         "fallback, or its fold wrote nothing.",
                                         ["call", "status"], registry=r)
        self._live = _Live()
        r.register(self._live)

    def live(self, name: str, doc: str, read: Callable[[], float]) -> None:
        self._live.sources[name] = (doc, read)

    def observe_request(self, path: str, status: int, upstream_ms: float | None) -> None:
        route = route_of(path)
        self.requests.labels(route, str(status)).inc()
        if upstream_ms is not None:
            self.upstream_seconds.labels(route).observe(upstream_ms / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)

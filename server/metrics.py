"""Prometheus metrics: one CollectorRegistry per app, so tests and replicas never share state.

Request counters and latency histograms are labelled by the route *template*
(``/api/v1/caches/{cache}/...``), never the raw path, so label cardinality
stays bounded and no key or token lands in a label. Sizes per cache and
environment are read from the index at scrape time: every replica reports
the same truth. Telemetry and maintenance counters count what this replica
handled; Prometheus sums them across replicas.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cachectl.index import Index

log = logging.getLogger("cachectl.server")
access_log = logging.getLogger("cachectl.server.access")

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class IndexCollector(Collector):
    """Bytes and entries per cache and environment, straight from the index."""

    def __init__(self, index: Index) -> None:
        self.index = index

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("cachectl_index_up", "1 when the index answered this scrape")
        cache_bytes = GaugeMetricFamily(
            "cachectl_cache_bytes", "Bytes of entries per cache", labels=["cache"]
        )
        cache_entries = GaugeMetricFamily(
            "cachectl_cache_entries", "Entries per cache", labels=["cache"]
        )
        cache_limit = GaugeMetricFamily(
            "cachectl_cache_max_bytes", "Size limit per cache (policy)", labels=["cache"]
        )
        env_labels = ["cache", "environment", "jax_version", "backend", "device"]
        env_bytes = GaugeMetricFamily(
            "cachectl_environment_bytes", "Bytes of entries per environment", labels=env_labels
        )
        env_entries = GaugeMetricFamily(
            "cachectl_environment_entries", "Entries per environment", labels=env_labels
        )
        try:
            for cache in self.index.list_caches():
                envs = self.index.environment_stats(cache.name)
                cache_bytes.add_metric([cache.name], sum(e.bytes for e in envs))
                cache_entries.add_metric([cache.name], sum(e.entries for e in envs))
                if cache.max_size:
                    cache_limit.add_metric([cache.name], cache.max_size)
                for e in envs:
                    labels = [
                        cache.name,
                        e.digest[:16],
                        e.environment.jax_version,
                        e.environment.backend,
                        f"{e.environment.device_kind} x{e.environment.device_count}",
                    ]
                    env_bytes.add_metric(labels, e.bytes)
                    env_entries.add_metric(labels, e.entries)
            up.add_metric([], 1)
        except Exception as exc:  # noqa: BLE001 - a scrape must answer even when the index is down
            log.warning("metrics: index unavailable: %s", exc)
            up.add_metric([], 0)
        yield from (up, cache_bytes, cache_entries, cache_limit, env_bytes, env_entries)


class Metrics:
    def __init__(self, index: Index | None = None) -> None:
        disable_created_metrics()  # *_created series double the output and say nothing here
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "cachectl_http_requests",
            "HTTP requests by route template and status",
            ["method", "route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "cachectl_http_request_duration_seconds",
            "Request latency by route template",
            ["method", "route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.telemetry_requests = Counter(
            "cachectl_telemetry_compile_requests",
            "Compile requests reported by services",
            ["cache"],
            registry=r,
        )
        self.telemetry_hits = Counter(
            "cachectl_telemetry_hits", "Cache hits reported by services", ["cache"], registry=r
        )
        self.telemetry_misses = Counter(
            "cachectl_telemetry_misses", "Cache misses reported by services", ["cache"], registry=r
        )
        self.uploads = Counter(
            "cachectl_entry_uploads", "Entry uploads by outcome", ["cache", "outcome"], registry=r
        )
        self.upload_bytes = Counter(
            "cachectl_entry_upload_bytes",
            "Bytes of entries stored by uploads",
            ["cache"],
            registry=r,
        )
        self.download_bytes = Counter(
            "cachectl_entry_download_bytes", "Bytes of entries served", ["cache"], registry=r
        )
        self.maintenance_runs = Counter(
            "cachectl_maintenance_runs",
            "Prune/gc/verify runs by kind and outcome",
            ["cache", "kind", "status", "trigger"],
            registry=r,
        )
        self.bytes_freed = Counter(
            "cachectl_maintenance_bytes_freed",
            "Bytes freed by prune and gc",
            ["cache", "kind"],
            registry=r,
        )
        if index is not None:
            r.register(IndexCollector(index))
        self.series: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI: counts and times every request by route template, and logs it (path only)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_wrapper(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "<unmatched>"
            observe(
                self.metrics,
                scope.get("method", "?"),
                template,
                status,
                time.perf_counter() - started,
            )


def observe(metrics: Metrics, method: str, template: str, status: int, elapsed: float) -> None:
    """Count, time and log one request (MetricsMiddleware's, and server/fast_lane.py's); each
    route's series are looked up once (``labels`` takes a lock and builds a key every call)."""
    series = metrics.series.get((method, template, status))
    if series is None:
        series = (
            metrics.requests.labels(method, template, str(status)),
            metrics.latency.labels(method, template),
        )
        if len(metrics.series) < 10_000:  # templates and statuses: a few hundred at most
            metrics.series[(method, template, status)] = series
    series[0].inc()
    series[1].observe(elapsed)
    # The template, never the query string: nothing a client put in the URL
    # (a token by mistake) reaches the log.
    if access_log.isEnabledFor(logging.INFO):
        access_log.info("%s %s %d %.1fms", method, template, status, elapsed * 1000)

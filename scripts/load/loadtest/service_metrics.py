"""The service's own figures during a load test, from two readings of its ``/metrics``.

Pure: ``Reading.parse`` turns the Prometheus text into counters, a difference of two
readings is what happened between them, and ``rows`` turns such a difference into the
figures the dashboard shows. The counters are those of ``service/telemetry/metrics.py``; a metric
the service does not export reads as zero, so an older or newer service still works.
Each figure is summed over the series that make it up: a service of several models has
one per model (the ``model`` label), and an older one a single series.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# Routes that are not load: scrapes, probes, and 404s.
NOT_LOAD_ROUTES = frozenset({"/metrics", "/info", "/healthz", "/readyz", "unmatched"})

# The batchers' figures are the workers', not a route's: every batched route (and model) shares them.
BATCHER_ROW = "batcher (all batched routes)"

NOT_APPLICABLE = "-"

_ROUTE_COUNTERS = {
    "serve_http_request_duration_seconds_sum": "latency_sum",
    "serve_http_request_duration_seconds_count": "latency_count",
}
_SCALARS = {
    "serve_inferred_items_total": "items",
    "serve_batches_total": "batches",
    "serve_batch_queue_wait_seconds_sum": "queue_wait_sum",
    "serve_batch_queue_wait_seconds_count": "queue_wait_count",
    "serve_batch_model_duration_seconds_sum": "model_sum",
    "serve_batch_model_duration_seconds_count": "model_count",
}


@dataclass(frozen=True)
class RouteCounts:
    """Requests one route answered, by status code, and the sum of their latencies."""

    by_code: Mapping[str, float] = field(default_factory=dict)
    latency_sum: float = 0.0
    latency_count: float = 0.0

    def __sub__(self, other: RouteCounts) -> RouteCounts:
        return _combine(self, other, -1)

    def __add__(self, other: RouteCounts) -> RouteCounts:
        return _combine(self, other, 1)

    @property
    def requests(self) -> float:
        return sum(self.by_code.values())


def _combine(a: RouteCounts, b: RouteCounts, sign: int) -> RouteCounts:
    codes = {
        code: a.by_code.get(code, 0.0) + sign * b.by_code.get(code, 0.0) for code in {*a.by_code, *b.by_code}
    }
    return RouteCounts(
        by_code=codes,
        latency_sum=a.latency_sum + sign * b.latency_sum,
        latency_count=a.latency_count + sign * b.latency_count,
    )


@dataclass(frozen=True)
class Reading:
    """The service's counters at one moment, or (after ``-``) their growth between two."""

    routes: Mapping[str, RouteCounts] = field(default_factory=dict)
    items: float = 0.0
    batches: float = 0.0
    queue_wait_sum: float = 0.0
    queue_wait_count: float = 0.0
    model_sum: float = 0.0
    model_count: float = 0.0
    rejected: Mapping[str, float] = field(default_factory=dict)  # 503s by reason, all routes
    queue_depth: float = 0.0  # a gauge: the later reading's value survives a difference

    @classmethod
    def parse(cls, text: str) -> Reading:
        """The counters in a ``/metrics`` answer (Prometheus text format)."""
        codes: dict[str, dict[str, float]] = {}
        route_values: dict[str, dict[str, float]] = {}
        scalars: dict[str, float] = {}
        rejected: dict[str, float] = {}
        queue_depth = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, labels, value = sample.name, sample.labels, float(sample.value)
                route = labels.get("route")
                if name == "serve_http_requests_total" and route not in (None, *NOT_LOAD_ROUTES):
                    by_code = codes.setdefault(route, {})
                    code = labels.get("code", "")
                    by_code[code] = by_code.get(code, 0.0) + value
                elif name in _ROUTE_COUNTERS and route not in (None, *NOT_LOAD_ROUTES):
                    figures = route_values.setdefault(route, {})
                    figures[_ROUTE_COUNTERS[name]] = figures.get(_ROUTE_COUNTERS[name], 0.0) + value
                elif name in _SCALARS:
                    scalars[_SCALARS[name]] = scalars.get(_SCALARS[name], 0.0) + value
                elif name == "serve_rejected_requests_total":
                    reason = labels.get("reason", "")
                    rejected[reason] = rejected.get(reason, 0.0) + value
                elif name == "serve_batch_queue_depth":
                    queue_depth += value
        routes = {
            route: RouteCounts(by_code=codes.get(route, {}), **route_values.get(route, {}))
            for route in {*codes, *route_values}
        }
        return cls(routes=routes, rejected=rejected, queue_depth=queue_depth, **scalars)

    def __sub__(self, earlier: Reading) -> Reading:
        return self._combine(earlier, -1)

    def __add__(self, other: Reading) -> Reading:
        return self._combine(other, 1)

    def _combine(self, other: Reading, sign: int) -> Reading:
        empty = RouteCounts()
        routes = {}
        for route in {*self.routes, *other.routes}:
            mine, theirs = self.routes.get(route, empty), other.routes.get(route, empty)
            routes[route] = mine - theirs if sign < 0 else mine + theirs
        rejected = {
            reason: self.rejected.get(reason, 0.0) + sign * other.rejected.get(reason, 0.0)
            for reason in {*self.rejected, *other.rejected}
        }
        sums = {
            f.name: getattr(self, f.name) + sign * getattr(other, f.name)
            for f in fields(self)
            if f.name not in ("routes", "rejected", "queue_depth")
        }
        return Reading(routes=routes, rejected=rejected, queue_depth=self.queue_depth, **sums)


COLUMNS = (
    ("users", "Users"),
    ("route", "Route"),
    ("requests", "Requests"),
    ("rps", "Req/s"),
    ("mean_latency_ms", "Service mean latency (ms)"),
    ("shed", "Shed (503)"),
    ("timed_out", "Timed out (504)"),
    ("batches", "Batches"),
    ("items_per_s", "Items/s"),
    ("mean_batch_size", "Mean batch size"),
    ("mean_queue_wait_ms", "Mean queue wait (ms)"),
    ("mean_model_ms", "Model time per batch (ms)"),
    ("queue_full", "Queue full (503)"),
)
"""(key, title) of each figure, in the order the dashboard, CSV and report show them."""


def rows(users: str, growth: Reading, seconds: float) -> list[dict[str, Any]]:
    """One row per route that answered load in ``growth``, then the batcher's row.

    ``growth`` is a difference of two readings ``seconds`` apart; ``users`` labels
    the rows (a user count, or the whole run).
    """
    out: list[dict[str, Any]] = []
    for route in sorted(growth.routes):
        counts = growth.routes[route]
        if counts.requests <= 0:
            continue
        out.append(
            _row(
                users,
                route,
                requests=round(counts.requests),
                rps=_ratio(counts.requests, seconds, 1),
                mean_latency_ms=_ratio(1000 * counts.latency_sum, counts.latency_count, 1),
                shed=round(counts.by_code.get("503", 0.0)),
                timed_out=round(counts.by_code.get("504", 0.0)),
            )
        )
    if growth.batches > 0:
        out.append(
            _row(
                users,
                BATCHER_ROW,
                batches=round(growth.batches),
                # Texts (items) answered a second: what a client that sends many to a
                # request gets, where its requests a second say little.
                items_per_s=_ratio(growth.items, seconds, 1),
                mean_batch_size=_ratio(growth.items, growth.batches, 2),
                mean_queue_wait_ms=_ratio(1000 * growth.queue_wait_sum, growth.queue_wait_count, 1),
                mean_model_ms=_ratio(1000 * growth.model_sum, growth.model_count, 1),
                queue_full=round(growth.rejected.get("queue_full", 0.0)),
            )
        )
    return out


def _row(users: str, route: str, **figures: Any) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys((key for key, _ in COLUMNS), NOT_APPLICABLE)
    row.update(users=users, route=route, **figures)
    return row


def _ratio(numerator: float, denominator: float, digits: int) -> float | str:
    return round(numerator / denominator, digits) if denominator > 0 else NOT_APPLICABLE


def total(readings: Iterable[Reading]) -> Reading:
    """The sum of several growths."""
    result = Reading()
    for reading in readings:
        result = result + reading
    return result

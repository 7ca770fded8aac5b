"""End to end: Debian's real Prometheus scrapes real gunicorn and evaluates deploy/prometheus's rules."""

from __future__ import annotations

import json

import pytest

from scripts.common.launcher import ROOT
from tests.support.prometheus import PROMETHEUS, SKIP_PROMETHEUS, prometheus
from tests.support.promql import all_values, from_grafana, groupings, metric_names
from tests.support.server import gunicorn

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(PROMETHEUS is None, reason=SKIP_PROMETHEUS)]

WIDTH = 4
SMALL = {"SERVE_MODEL": "mlp", "SERVE_MLP_WIDTH": str(WIDTH), "SERVE_MLP_DEPTH": "1", "SERVE_WORKERS": "1"}
BATCHED, NAIVE = 7, 3
ITEMS_PER_REQUEST = 2
# The series a model's batcher writes (service.telemetry.model_metrics).
BATCHING = ("serve_batch", "serve_inferred")


def counts(result: list[dict[str, object]]) -> dict[tuple[str, str], float]:
    return {(r["metric"]["route"], r["metric"]["code"]): float(r["value"][1]) for r in result}


def test_prometheus_scrapes_the_service_and_evaluates_the_rules() -> None:
    with gunicorn(SMALL) as server, prometheus([server.url.removeprefix("http://")]) as prom:
        prom.wait_for('up{job="torch-serve-batched"}', lambda r: bool(r) and r[0]["value"][1] == "1")
        body = {"inputs": [[0.25] * WIDTH] * ITEMS_PER_REQUEST}

        def send(batched: int, naive: int) -> None:
            # One at a time, so that every batch holds one request's items.
            for _ in range(batched):
                assert server.post("/predict/batched", json=body).status_code == 200
            for _ in range(naive):
                assert server.post("/predict/naive", json=body).status_code == 200

        def scraped(batched: int, naive: int) -> None:
            def check(result: list[dict[str, object]]) -> bool:
                found = counts(result)
                return (
                    found.get(("/predict/batched", "200")) == batched
                    and found.get(("/predict/naive", "200")) == naive
                )

            prom.wait_for("serve_http_requests_total", check)

        # A route's series appears with its first request; one scrape of it
        # before the rest is what lets rate() see them arrive.
        send(1, 1)
        scraped(1, 1)
        send(BATCHED - 1, NAIVE - 1)
        scraped(BATCHED, NAIVE)
        # Recording rules over what was scraped: every batch held one request's items,
        # and the figure is the one model's, named as its info names it.
        (info,) = prom.query("serve_model_info")
        model = info["metric"]["model"]
        prom.wait_for(
            "job_model:serve_batch_size_items:mean5m",
            lambda r: (
                len(r) == 1
                and r[0]["metric"].get("model") == model
                and abs(float(r[0]["value"][1]) - ITEMS_PER_REQUEST) < 1e-9
            ),
        )
        prom.wait_for(
            'job_model_route_code:serve_http_requests:rate5m{route="/predict/batched", code="200"}',
            lambda r: bool(r) and float(r[0]["value"][1]) > 0,
        )
        # Every rule, alerts included, evaluates against the live series without an error.
        groups = prom.rule_groups()
        assert {g["name"] for g in groups} == {"torch-serve-batched.recording", "torch-serve-batched.alerts"}
        for group in groups:
            for rule in group["rules"]:
                assert rule["health"] == "ok", rule
        # The service is healthy: no alert fires.
        firing = [r["name"] for g in groups for r in g["rules"] if r.get("state") == "firing"]
        assert firing == []
        # Every dashboard query runs on the real server, with "All" models chosen; a
        # batching panel draws one line per model, named.
        dashboard = json.loads((ROOT / "deploy" / "grafana" / "torch-serve-batched.json").read_text())
        chosen = all_values(dashboard)
        per_model = 0
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                result = prom.query(from_grafana(expr, variables=chosen))
                batching = all(name.startswith(BATCHING) for name in metric_names(expr))
                if batching and all("model" in labels for labels in groupings(expr)):
                    assert all(r["metric"].get("model") == model for r in result), (expr, result)
                    per_model += len(result)
        assert per_model > 0

"""The Grafana dashboard reads only metrics the service exports, compared against a live /metrics."""

from __future__ import annotations

import json

import pytest
import yaml

from scripts.common.launcher import ROOT
from service.config.settings import Settings
from service.telemetry.metrics import Metrics
from tests.support.metrics import Scrape
from tests.support.prometheus import RULE_FILES
from tests.support.promql import from_grafana, metric_names, selectors
from tests.support.server import gunicorn

pytestmark = pytest.mark.e2e

DASHBOARD = ROOT / "deploy" / "grafana" / "torch-serve-batched.json"
# Series Prometheus makes itself rather than reads from a target.
PROMETHEUS_SERIES = {"up"}


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def recorded_series() -> set[str]:
    names = set()
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            names |= {rule["record"] for rule in group["rules"] if "record" in rule}
    return names


def gpu_worker_series() -> set[str]:
    """What a GPU worker exports: the service's own Metrics, told that its model loaded on a GPU."""
    metrics = Metrics(Settings(worker_slot=0, worker_device="cuda:0"), gpu_memory=lambda device: (1, 2))
    metrics.on_model_loaded("cuda", 1.0)
    return Scrape.parse(metrics.render()).names()


def test_every_query_reads_only_metrics_the_service_exports() -> None:
    with gunicorn(
        {"SERVE_MODEL": "mlp", "SERVE_MLP_WIDTH": "4", "SERVE_MLP_DEPTH": "1", "SERVE_WORKERS": "1"}
    ) as server:
        # One request on each prediction route, so that every histogram has a sample.
        for route in ("/predict/batched", "/predict/naive"):
            assert server.post(route, json={"inputs": [[0.5] * 4]}).status_code == 200
        scrape = Scrape.parse(server.get("/metrics").content)
    exported = scrape.names() | gpu_worker_series() | recorded_series() | PROMETHEUS_SERIES
    for query in queries():
        unknown = metric_names(from_grafana(query)) - exported
        assert not unknown, f"{query!r} reads {sorted(unknown)}, which the service does not export"
    # What a panel filters by $model carries the label in every series the service exports.
    (info,) = scrape.series("serve_model_info")
    filtered = {name for query in queries() for name, matchers in selectors(query) if "model=~" in matchers}
    assert "serve_batch_queue_depth" in filtered
    for name in filtered:
        series = scrape.series(name)
        assert series, f"{name} is filtered by model but has no series"
        assert all("model" in labels for labels in series), f"{name}: {series}"
        if name.startswith(("serve_batch", "serve_inferred", "serve_model_load")):
            # The model's own series: labelled with the name serve_model_info gives it.
            assert {labels["model"] for labels in series} == {info["model"]}, f"{name}: {series}"

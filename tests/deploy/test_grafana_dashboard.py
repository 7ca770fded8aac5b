"""The Grafana dashboard: its panels, each query parsed by promtool, each metric one the service exports."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import yaml

from scripts.launcher import ROOT
from service.metrics import Metrics
from service.settings import Settings
from tests.support.metrics import Scrape
from tests.support.prometheus import PROMTOOL, RULE_FILES, SKIP_PROMTOOL, promtool
from tests.support.promql import from_grafana, metric_names
from tests.support.server import gunicorn

DASHBOARD = ROOT / "deploy" / "grafana" / "torch-serve-batched.json"
# Series Prometheus makes itself rather than reads from a target.
PROMETHEUS_SERIES = {"up"}
# The panels the dashboard must have, by a word each title holds.
PANELS = (
    "Requests",
    "Errors",
    "Latency",
    "Batch size",
    "Queue depth",
    "Queue wait",
    "Shed",
    "Model time",
    "Workers up",
    "GPU memory",
)


def dashboard() -> dict[str, object]:
    return json.loads(DASHBOARD.read_text())


def queries() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel["targets"]]


def test_dashboard_has_the_panels_and_unique_ids() -> None:
    panels = dashboard()["panels"]
    titles = [panel["title"] for panel in panels]
    for word in PANELS:
        assert any(word in title for title in titles), f"no panel about {word!r} in {titles}"
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


@pytest.mark.skipif(PROMTOOL is None, reason=SKIP_PROMTOOL)
def test_every_query_parses() -> None:
    """promtool parses each query, as Grafana sends it, as a recording rule's expression."""
    rules = [{"record": f"dashboard:query_{i}", "expr": from_grafana(q)} for i, q in enumerate(queries())]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dashboard-queries.yaml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
        result = promtool("check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


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


@pytest.mark.e2e
def test_every_query_reads_only_metrics_the_service_exports() -> None:
    with gunicorn(
        {"SERVE_MODEL": "mlp", "SERVE_MLP_WIDTH": "4", "SERVE_MLP_DEPTH": "1", "SERVE_WORKERS": "1"}
    ) as server:
        # One request on each prediction route, so that every histogram has a sample.
        for route in ("/predict/batched", "/predict/naive"):
            assert server.post(route, json={"inputs": [[0.5] * 4]}).status_code == 200
        live = Scrape.parse(server.get("/metrics").content).names()
    exported = live | gpu_worker_series() | recorded_series() | PROMETHEUS_SERIES
    for query in queries():
        unknown = metric_names(from_grafana(query)) - exported
        assert not unknown, f"{query!r} reads {sorted(unknown)}, which the service does not export"

"""The Grafana dashboard: its panels, and each query parsed by promtool (tests/e2e/test_grafana_metrics.py
checks the metrics they read against a live /metrics)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import yaml

from scripts.common.launcher import ROOT
from tests.support.prometheus import PROMTOOL, SKIP_PROMTOOL, promtool
from tests.support.promql import from_grafana

DASHBOARD = ROOT / "deploy" / "grafana" / "torch-serve-batched.json"
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
    "Worker memory",
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

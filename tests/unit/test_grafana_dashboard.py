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
from tests.support.promql import all_values, from_grafana, groupings, metric_names, selectors

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
    "Items per second",
)
# What each served model writes (service.telemetry.model_metrics), and the request series,
# labelled with the model a request was routed to: the panels filter them by $model.
MODEL_SERIES = frozenset(
    {
        "serve_http_requests_total",
        "serve_http_request_duration_seconds",
        "serve_batch_queue_wait_seconds",
        "serve_batch_model_duration_seconds",
        "serve_batch_size_items",
        "serve_inferred_items_total",
        "serve_batches_total",
        "serve_batch_tokens_total",
        "serve_batch_sub_batches",
        "serve_batch_queue_depth",
        "serve_rejected_requests_total",
        "serve_timed_out_requests_total",
        "serve_model_load_seconds",
        "serve_model_info",
        "serve_model_exactness",
    }
)
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def dashboard() -> dict[str, object]:
    return json.loads(DASHBOARD.read_text())


def queries() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel["targets"]]


def family(name: str) -> str:
    """The metric a sample name belongs to: a histogram's, for its buckets, sum and count."""
    for suffix in _HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in MODEL_SERIES:
            return name.removesuffix(suffix)
    return name


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


def test_the_model_variable_lists_the_served_models_and_all_keeps_requests_of_none() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}  # type: ignore[index]
    model = variables["model"]
    assert model["query"]["query"] == model["definition"]
    assert model["definition"].startswith("label_values(serve_model_info{")
    assert model["definition"].endswith(", model)")
    assert model["multi"] and model["includeAll"]
    # All matches the empty value too: the requests that reached no model carry no model label.
    assert model["allValue"] == ".*"
    assert all_values(dashboard())["model"] == ".*"


def test_per_model_panels_filter_and_split_by_model_and_worker_panels_do_not() -> None:
    split = 0
    for query in queries():
        for name, matchers in selectors(query):
            if family(name) in MODEL_SERIES:
                assert 'model=~"$model"' in matchers, f"{query!r}: {name} is not filtered by $model"
            else:
                assert "model" not in matchers, f"{query!r}: {name} is a worker's, with no model label"
        names = metric_names(query)
        if names and all(family(name) in MODEL_SERIES for name in names):
            # One line per model: every aggregation keeps the label.
            for labels in groupings(query):
                assert "model" in labels, f"{query!r} sums over models"
                split += 1
    assert split >= 10


@pytest.mark.skipif(PROMTOOL is None, reason=SKIP_PROMTOOL)
def test_every_query_parses() -> None:
    """promtool parses each query, as Grafana sends it, as a recording rule's expression."""
    chosen = all_values(dashboard())
    rules = [
        {"record": f"dashboard:query_{i}", "expr": from_grafana(q, variables=chosen)}
        for i, q in enumerate(queries())
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dashboard-queries.yaml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
        result = promtool("check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout

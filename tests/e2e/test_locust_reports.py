"""Headless Locust runs the dashboard's scenarios and writes the service's figures beside its reports."""

from __future__ import annotations

import csv
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import images
from tests.support.server import ROOT, Server, gunicorn

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SMALL_MLP = {"SERVE_MODEL": "mlp", "SERVE_MLP_WIDTH": "16", "SERVE_MLP_DEPTH": "2", "SERVE_WORKERS": "1"}
ROUTES = ("/predict/batched", "/predict/naive")


def headless(host: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``locust -f locustfile.py --headless`` against ``host``, which must end with 0."""
    result = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "locustfile.py", "--host", host, "--headless", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def read_stats(prefix: Path) -> dict[str, dict[str, str]]:
    """Locust's ``PREFIX_stats.csv``, by request name."""
    with open(f"{prefix}_stats.csv") as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with gunicorn(SMALL_MLP) as s:
        yield s


def test_headless_step_load_writes_locust_s_reports_and_the_batching_figures(
    server: Server, tmp_path: Path
) -> None:
    prefix, report = tmp_path / "step", tmp_path / "step.html"
    headless(
        server.url,
        *("--shape", "StepLoad", "--step-seconds", "3", "--metrics-interval", "0.5"),
        *("--csv", str(prefix), "--html", str(report), "--only-summary", "NaiveUser", "BatchedUser"),
        timeout=180,
    )
    stats = read_stats(prefix)
    assert set(stats) == {*ROUTES, "Aggregated"}, "GET /info and /metrics stay out of the statistics"
    assert int(stats["Aggregated"]["Failure Count"]) == 0

    with open(f"{prefix}_batching.csv") as f:
        batching = {(row["Users"], row["Route"]): row for row in csv.DictReader(f)}
    for route in ROUTES:
        assert int(batching[("whole run", route)]["Requests"]) > 0
        assert int(batching[("whole run", route)]["Shed (503)"]) == 0
    users_seen = {users for users, _ in batching}
    for users in (1, 8, 32, 64):  # each route had a turn at each count
        assert {f"{users} BatchedUser", f"{users} NaiveUser"} <= users_seen
    assert float(batching[("64 BatchedUser", "batcher (all batched routes)")]["Mean batch size"]) >= 1

    html = report.read_text()
    assert html.count('id="service-batching"') == 1
    assert "64 BatchedUser" in html


def test_a_plain_headless_run_keeps_its_user_count_and_think_time(server: Server, tmp_path: Path) -> None:
    prefix = tmp_path / "plain"
    result = headless(
        server.url,
        *("-u", "3", "-r", "3", "-t", "3s", "--wait-min", "0", "--wait-max", "0.05"),
        *("--csv", str(prefix), "--only-summary", "BatchedUser"),
    )
    assert "Shape test" not in result.stderr, "no shape runs unless one is asked for"
    assert "All users spawned" in result.stderr and "(3 total users)" in result.stderr
    with open(f"{prefix}_batching.csv") as f:
        batching = {(row["Users"], row["Route"]): row for row in csv.DictReader(f)}
    assert int(batching[("3 BatchedUser", "/predict/batched")]["Requests"]) > 0


def test_indexing_jobs_send_the_embeddings_api_many_texts_a_request(tmp_path: Path) -> None:
    # The module's mlp serves no embeddings: a text model that answers vectors, quick to load.
    prefix = tmp_path / "indexing"
    with gunicorn({"SERVE_MODEL": "tests.support.models:vectors", "SERVE_WORKERS": "1"}) as text_server:
        headless(
            text_server.url,
            *("-u", "2", "-r", "2", "-t", "3s", "--texts-per-request", "8"),
            *("--csv", str(prefix), "--only-summary", "IndexingUser"),
        )
    stats = read_stats(prefix)
    assert set(stats) == {"/v1/embeddings (8 texts)", "Aggregated"}, "the name says what a request carries"
    assert int(stats["Aggregated"]["Failure Count"]) == 0, stats
    with open(f"{prefix}_batching.csv") as f:
        batching = {(row["Users"], row["Route"]): row for row in csv.DictReader(f)}
    route = batching[("2 IndexingUser", "/v1/embeddings")]
    assert int(route["Requests"]) > 0, route
    batcher = batching[("2 IndexingUser", "batcher (all batched routes)")]
    assert float(batcher["Mean batch size"]) >= 8, batcher
    # Texts a second: 8 to each request (both rounded; a request counts when answered,
    # its texts when their batch ran).
    assert float(batcher["Items/s"]) == pytest.approx(8 * float(route["Req/s"]), rel=0.05), batcher


def test_retrieval_users_embed_a_query_then_rerank_its_candidates_on_one_service(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # Tiny models (tests/support/hf_dirs.py), named in an order that puts the reranker
    # second: the users learn which is which from /v1/models, not from the names.
    spec = f"embed={model_dirs['embeddings']},rerank={model_dirs['rerank']}"
    prefix = tmp_path / "retrieval"
    with gunicorn({"SERVE_MODEL": spec, "SERVE_WORKERS": "1"}) as pair:
        headless(
            pair.url,
            *("-u", "2", "-r", "2", "-t", "4s", "--wait-min", "0", "--wait-max", "0"),
            *("--documents-per-query", "4", "--csv", str(prefix), "--only-summary", "RetrievalUser"),
        )
    stats = read_stats(prefix)
    steps = ("/v1/embeddings (query)", "/v2/rerank (4 documents)")
    assert set(stats) == {*steps, "Aggregated"}, "GET /v1/models stays out; each step has its name"
    assert int(stats["Aggregated"]["Failure Count"]) == 0, stats
    for step in steps:
        assert int(stats[step]["Request Count"]) > 0, stats[step]
    # Every answered query went on to its rerank: at most the users' last queries had not.
    embedded, reranked = (int(stats[step]["Request Count"]) for step in steps)
    assert 0 <= embedded - reranked <= 2, stats
    with open(f"{prefix}_batching.csv") as f:
        batching = {(row["Users"], row["Route"]): row for row in csv.DictReader(f)}
    for route in ("/v1/embeddings", "/v2/rerank"):
        assert int(batching[("whole run", route)]["Requests"]) > 0, batching


def test_a_retrieval_user_on_a_service_without_a_reranker_stops_saying_so(server: Server) -> None:
    # The module's service serves one mlp: neither an embedder nor a reranker.
    command = [sys.executable, "-m", "locust", "-f", "locustfile.py", "--host", server.url, "--headless"]
    command += ["-u", "1", "-r", "1", "-t", "2s", "--only-summary", "RetrievalUser"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, result.stderr[-3000:]
    assert f"the service at {server.url} serves no embeddings and no rerank model" in result.stderr


@pytest.mark.filterwarnings(images.JIT_DEPRECATED)
@pytest.mark.parametrize("items", [1, 3])
def test_locust_sends_an_image_model_jpeg_uploads(tmp_path: Path, items: int) -> None:
    # One image as the raw body, several as multipart (scripts/load/loadtest/workload.py).
    model_dir = images.image_model_dir(tmp_path / "model", "locust-cnn")
    prefix = tmp_path / "images"
    with gunicorn({"SERVE_MODEL": str(model_dir), "SERVE_WORKERS": "1"}) as image_server:
        headless(
            image_server.url,
            *("-u", "2", "-r", "2", "-t", "3s", "--wait-min", "0", "--wait-max", "0.05"),
            *("--items-per-request", str(items), "--csv", str(prefix), "--only-summary"),
            *("NaiveUser", "BatchedUser"),
        )
        stats = read_stats(prefix)
        assert int(stats["Aggregated"]["Failure Count"]) == 0, stats
        for route in ROUTES:
            assert int(stats[route]["Request Count"]) > 0, stats[route]

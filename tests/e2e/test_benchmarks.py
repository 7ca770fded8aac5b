"""The load-testing tools run against a real service and produce what they promise."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.bench.offline import splits_for
from tests.support.server import ROOT, Server, gunicorn

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SMALL_MLP = {"SERVE_MODEL": "mlp", "SERVE_MLP_WIDTH": "16", "SERVE_MLP_DEPTH": "2", "SERVE_WORKERS": "1"}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with gunicorn(SMALL_MLP) as s:
        yield s


def test_locust_runs_headless_against_both_routes(server: Server, tmp_path: Path) -> None:
    prefix = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            "locustfile.py",
            "--host",
            server.url,
            "--headless",
            "-u",
            "4",
            "-r",
            "4",
            "-t",
            "4s",
            "--wait-min",
            "0",
            "--wait-max",
            "0.05",
            "--csv",
            str(prefix),
            "--only-summary",
            "NaiveUser",
            "BatchedUser",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(f"{prefix}_stats.csv") as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    for route in ("/predict/naive", "/predict/batched"):
        assert int(stats[route]["Request Count"]) > 0
        assert int(stats[route]["Failure Count"]) == 0
    assert int(stats["Aggregated"]["Failure Count"]) == 0


def test_bench_script_starts_the_service_and_writes_its_table_data_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")} | SMALL_MLP
    result = subprocess.run(
        [
            sys.executable,
            "scripts/bench/bench.py",
            "--concurrency",
            "1,4",
            "--seconds",
            "1",
            "--warmup",
            "0",
            "--offline-seconds",
            "0.5",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = (out / "results.md").read_text()
    assert "| naive | 4 |" in table and "| batched | 1 |" in table
    data = json.loads((out / "results.json").read_text())
    assert {(r["route"], r["clients"]) for r in data["rows"]} == {
        ("naive", 1),
        ("batched", 1),
        ("naive", 4),
        ("batched", 4),
    }
    assert all(r["errors"] == 0 and r["rps"] > 0 for r in data["rows"])
    assert data["offline"]["items_per_s"] > 0
    cores = len(os.sched_getaffinity(0))
    assert {s["split"] for s in data["offline"]["splits"]} == {str(s) for s in splits_for(cores)}
    with (out / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4
    for plot in ("throughput.png", "latency.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_script_with_the_asyncio_generator_measures_without_errors(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")} | SMALL_MLP
    command = [sys.executable, "scripts/bench/bench.py", "--generator", "asyncio", "--no-offline"]
    command += ["--concurrency", "4", "--seconds", "1", "--warmup", "0", "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["generator"] == "asyncio"
    assert {(r["route"], r["clients"]) for r in data["rows"]} == {("naive", 4), ("batched", 4)}
    assert all(r["errors"] == 0 and r["rps"] > 0 for r in data["rows"])


def test_bench_script_refuses_non_loopback_targets(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "scripts/bench/bench.py", "--url", "http://10.0.0.1:8000", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "only loopback" in result.stderr


def test_bench_script_reranks_corpus_lines_on_both_rerank_routes_against_the_offline_limit(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus.txt"
    lines = (ROOT / "scripts/fixtures/corpus/mixed.txt").read_text().splitlines()[:48]
    corpus.write_text("\n".join(lines) + "\n")
    out = tmp_path / "bench"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")} | {"SERVE_WORKERS": "1"}
    command = [sys.executable, "scripts/bench/bench.py", "--model", str(model_dirs["rerank"])]
    command += ["--rerank", "4"]
    command += ["--corpus", str(corpus), "--concurrency", "1,4", "--seconds", "1", "--warmup", "0"]
    command += ["--offline-seconds", "0.3", "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["rerank_documents"] == 4 and data["items_per_request"] == 4
    assert {(r["route"], r["clients"]) for r in data["rows"]} == {
        ("naive", 1),
        ("batched", 1),
        ("naive", 4),
        ("batched", 4),
    }
    for row in data["rows"]:
        assert row["errors"] == 0 and row["rps"] > 0
        assert row["items_per_s"] == pytest.approx(4 * row["rps"])
    assert next(r for r in data["rows"] if r["route"] == "naive")["mean_batch"] == 4
    assert data["offline"]["items_per_s"] > 0
    assert "sorted, cut by cost" in {s["strategy"].split(" ", 1)[1] for s in data["offline"]["splits"]}
    # The batcher without HTTP, on the service's own split (one worker), fed by the most clients.
    batcher = data["offline"]["batcher"]
    assert batcher["items_per_s"] > 0 and batcher["split"].startswith("1x") and batcher["clients"] == 4
    table = (out / "results.md").read_text()
    assert "a query and 4 documents" in table and "| req/s | pairs/s |" in table
    assert "Batcher without HTTP: **" in table and "the batched route at 4 clients reaches" in table


def test_bench_script_refuses_rerank_of_a_model_that_is_no_cross_encoder(tmp_path: Path) -> None:
    command = [sys.executable, "scripts/bench/bench.py", "--model", "mlp", "--rerank", "4"]
    command += ["--corpus", "scripts/fixtures/corpus/mixed.txt", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "--rerank needs a cross-encoder" in result.stderr


def test_retrieval_bench_runs_searches_on_one_service_and_on_two_side_by_side(
    model_dirs: dict[str, Path],
) -> None:
    command = [sys.executable, "scripts/bench/retrieval.py", "--users", "2", "--seconds", "1"]
    command += ["--documents", "4", "--embedder", str(model_dirs["embeddings"])]
    command += ["--cross-encoder", str(model_dirs["rerank"])]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Command: `.venv/bin/python scripts/bench/retrieval.py --users 2 --seconds 1" in result.stdout
    lines = [line.strip("|").split("|") for line in result.stdout.splitlines() if line.startswith("| 2 |")]
    rows = {cells[1].strip(): [cell.strip() for cell in cells] for cells in lines}
    assert set(rows) == {"one service", "two services"}, result.stdout
    for setup, cells in rows.items():
        assert float(cells[3]) > 0, (setup, cells)  # searches a second
        assert cells[-1] == "0", (setup, cells)  # every answer a 200
    assert rows["one service"][4].endswith("x") and rows["two services"][4] == "-"
    assert " + " in rows["two services"][2], "each service's own plan"

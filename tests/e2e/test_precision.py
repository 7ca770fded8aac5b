"""SERVE_PRECISION on real gunicorn: int8 served and reported, the fallback, and the refusals.

The models are the tiny random BERTs of tests.support.hf_dirs, so the floors are
set loose where the test is about int8 being served rather than about its
exactness (tests/unit/test_precision.py checks all-MiniLM-L6-v2's at the default
floor). Speed is measured by scripts/bench/precision.py, not here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.metrics import Scrape
from tests.support.server import gunicorn, gunicorn_exit

pytestmark = pytest.mark.e2e

LOOSE = {"SERVE_PRECISION_MIN_TOP1": "0", "SERVE_PRECISION_MAX_SCORE_DIFF": "1000"}
QUERY = "how long do cats sleep"
DOCUMENTS = ["The stock market fell.", "Cats sleep up to sixteen hours a day.", "cats", "A cat naps."]


@pytest.mark.parametrize(("worker_class", "share"), [("gthread", "on"), ("gevent", "on"), ("gthread", "off")])
def test_int8_is_served_on_both_routes_and_every_worker_reports_it(
    model_dirs: dict[str, Path], worker_class: str, share: str
) -> None:
    env = {
        "SERVE_MODEL": str(model_dirs["rerank"]),
        "SERVE_PRECISION": "int8",
        "SERVE_WORKERS": "2",
        "SERVE_WORKER_CLASS": worker_class,
        "SERVE_SHARE_WEIGHTS": share,
        **LOOSE,
    }
    with gunicorn(env) as server:
        info = server.get("/info").json()
        assert info["precision"]["requested"] == "int8" and info["precision"]["in_use"] == "int8"
        assert info["precision"]["quantized_layers"] > 0
        assert set(info["precision"]["exactness"]) == {
            "max_score_diff",
            "top1_agreement",
            "top1_kept_with_margin",
        }
        for route in ("/rerank/naive", "/rerank/batched"):
            response = server.post(route, json={"query": QUERY, "documents": DOCUMENTS})
            assert response.status_code == 200, response.text
            assert len(response.json()["results"]) == len(DOCUMENTS)
        scrape = Scrape.parse(server.get("/metrics").text)
        infos = scrape.series("serve_model_info")
        assert len(infos) == 2 and {series["precision"] for series in infos} == {"int8"}
        assert {s["figure"] for s in scrape.series("serve_model_exactness")} == {
            "max_score_diff",
            "top1_agreement",
            "top1_kept_with_margin",
        }
        if share == "off":
            # One worker checked; the other applied its choice.
            assert server.log().count("as the service's check chose it") == 1
        else:
            # A child of the master checked (the master never runs the model); the
            # master applied its choice to the one copy both workers share.
            assert server.log().count("checking precision int8 in a child process") == 1
            assert "as the service's check chose it" not in server.log()
            assert info["shared_weights"] is True


def test_under_the_floor_the_service_falls_back_to_float32_and_says_why(model_dirs: dict[str, Path]) -> None:
    env = {
        "SERVE_MODEL": str(model_dirs["classification"]),
        "SERVE_PRECISION": "int8",
        "SERVE_WORKERS": "1",
        "SERVE_PRECISION_MIN_TOP1": "1",
        "SERVE_PRECISION_MAX_SCORE_DIFF": "0",
    }
    with gunicorn(env) as server:
        precision = server.get("/info").json()["precision"]
        assert precision["in_use"] == "float32" and precision["requested"] == "int8"
        assert "falls back to float32" in precision["fallback"]
        assert "falls back to float32" in server.log()
        assert server.post("/predict/batched", json={"inputs": ["fine"]}).status_code == 200


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"SERVE_PRECISION": "float16"}, "not served on a CPU"),
        ({"SERVE_PRECISION": "bfloat16"}, "avx512_bf16 or amx_bf16"),
        ({"SERVE_PRECISION": "int8", "SERVE_MODEL": "mlp"}, "runs in float32 only"),
    ],
)
def test_a_precision_that_does_not_belong_stops_the_service_with_the_reason(
    env: dict[str, str], reason: str
) -> None:
    from service.models.precision import cpu_flags

    if env["SERVE_PRECISION"] == "bfloat16" and cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        pytest.skip("this processor has native bfloat16, which the service serves")
    code, log = gunicorn_exit({"SERVE_WORKERS": "1", **env})
    assert code != 0
    assert reason in log

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
            "clear_share",
            "top1_where_clear",
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
            "clear_share",
            "top1_where_clear",
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


def expected_auto() -> tuple[str, str]:
    """What ``auto`` picks for a text model on this machine's processor: (precision, reason code)."""
    from service.models.precision import cpu_flags

    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "bfloat16", "amx_bf16"
    if "avx512_bf16" in flags:  # kept only where it measured faster: either may come out
        return "measured", "avx512_bf16_faster"
    return "float32", "no_bfloat16"


CORPUS = Path(__file__).resolve().parents[2] / "scripts" / "fixtures" / "corpus" / "mixed.txt"
# The smallest cosine between an embedding answered alone (/predict/naive) and the same text's in
# a batch (/predict/batched) in bfloat16, where the batch's padding changes the rounding
# (docs/protocols.md); in float32 they agree to float rounding.
NAIVE_BATCHED_MIN_COSINE = 0.999


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_auto_serves_the_processors_best_arithmetic_and_says_why(worker_class: str) -> None:
    import numpy as np

    precision, code = expected_auto()
    with gunicorn({"SERVE_WORKERS": "2", "SERVE_WORKER_CLASS": worker_class}) as server:
        info = server.get("/info").json()["precision"]
        assert info["requested"] == "auto" and info["reason"].startswith("auto: ")
        if precision == "bfloat16":
            assert (
                info["in_use"] == "bfloat16"
                and info["reason"] == "auto: bfloat16, the processor has amx_bf16"
            )
            # auto's floor: 0.999, with the tail's reserve on the samples.
            assert info["exactness"]["min_cosine"] >= 0.9996
        elif precision == "float32":
            assert info["in_use"] == "float32" and "no native bfloat16" in info["reason"]
        else:
            assert "speedup_vs_float32" in info
            code = "avx512_bf16_faster" if info["in_use"] == "bfloat16" else "slower"
        (series,) = {
            s["precision_reason"]
            for s in Scrape.parse(server.get("/metrics").text).series("serve_model_info")
        }
        assert series == code
        assert f"precision {info['in_use']} (asked: auto); auto: " in server.log()
        # Both routes answer the same texts alike, within bfloat16's stated tolerance.
        texts = [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()][:24]
        answers = []
        for route in ("/predict/naive", "/predict/batched"):
            response = server.post(route, json={"inputs": texts})
            assert response.status_code == 200, response.text
            answers.append(np.asarray(response.json()["outputs"], dtype=np.float64))
        cosines = (answers[0] * answers[1]).sum(axis=1)  # unit vectors
        alone = [
            server.post("/predict/naive", json={"inputs": [text]}).json()["outputs"][0] for text in texts[:8]
        ]
        cosines = np.concatenate([cosines, (np.asarray(alone) * answers[1][:8]).sum(axis=1)])
        assert cosines.min() >= (NAIVE_BATCHED_MIN_COSINE if info["in_use"] != "float32" else 1 - 1e-6)


def test_auto_checks_a_cross_encoder_directory_and_serves_it_on_every_rerank_route(
    model_dirs: dict[str, Path],
) -> None:
    precision, _ = expected_auto()
    with gunicorn({"SERVE_MODEL": str(model_dirs["rerank"]), "SERVE_WORKERS": "1"}) as server:
        info = server.get("/info").json()["precision"]
        assert info["requested"] == "auto"
        if precision == "float32":
            assert info["in_use"] == "float32" and "exactness" not in info
        elif info["in_use"] == "bfloat16":
            figures = info["exactness"]
            assert figures["top1_where_clear"] == 1 and figures["clear_share"] >= 0.5
        else:  # a tiny random network may miss auto's floor: float32, saying which figure missed
            assert "bfloat16 falls back to float32" in info["fallback"]
        for route, body in (
            ("/rerank/naive", {"query": QUERY, "documents": DOCUMENTS}),
            ("/rerank/batched", {"query": QUERY, "documents": DOCUMENTS}),
            ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "model": "tiny-rerank"}),
        ):
            response = server.post(route, json=body)
            assert response.status_code == 200, response.text
            assert len(response.json()["results"]) == len(DOCUMENTS)

"""In-process tests of the routes, through Flask's test client."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
from flask.testing import FlaskClient

from service.config.settings import Settings
from service.runtime import EXTENSION, LOAD_FAILED
from tests.support.models import POISON, SECRET_PATH, EchoModel

VECTOR = [0.1 * i for i in range(16)]


def test_both_routes_return_the_same_outputs(client: FlaskClient) -> None:
    body = {"inputs": [VECTOR, VECTOR[::-1]]}
    naive = client.post("/predict/naive", json=body)
    batched = client.post("/predict/batched", json=body)
    alias = client.post("/predict", json=body)
    assert naive.status_code == batched.status_code == alias.status_code == 200
    assert naive.json["model"] == batched.json["model"] == "mlp"  # type: ignore[index]
    assert len(naive.json["outputs"]) == 2  # type: ignore[index]
    np.testing.assert_allclose(naive.json["outputs"], batched.json["outputs"], rtol=1e-5, atol=1e-6)  # type: ignore[index]
    np.testing.assert_allclose(alias.json["outputs"], batched.json["outputs"], rtol=1e-5, atol=1e-6)  # type: ignore[index]
    assert naive.json["outputs"][0] != naive.json["outputs"][1]  # type: ignore[index]


def test_probes_and_info(client: FlaskClient) -> None:
    assert client.get("/healthz").json == {"status": "ok"}
    assert client.get("/readyz").json == {"status": "ready"}
    info = client.get("/info").json
    assert info["model"] == {  # type: ignore[index]
        "name": "mlp",
        "task": "generic",
        "item_kind": "vector",
        "item_shape": [16],
        "device": "cpu",
    }
    assert info["batching"]["max_batch_size"] == 64  # type: ignore[index]
    assert isinstance(info["pid"], int)  # type: ignore[index]


@pytest.mark.parametrize("route", ["/predict/naive", "/predict/batched"])
@pytest.mark.parametrize(
    ("kwargs", "status", "fragment"),
    [
        ({"data": b"{nope", "content_type": "application/json"}, 400, "not valid JSON"),
        ({"data": b'{"inputs": [[1]]}', "content_type": "text/plain"}, 415, "Content-Type"),
        ({"json": {}}, 422, '"inputs"'),
        ({"json": {"inputs": []}}, 422, "empty"),
        ({"json": {"inputs": [VECTOR, [1, 2]]}}, 422, "inputs[1]"),
        ({"json": {"inputs": [VECTOR] * 9}}, 413, "limit is 8"),
        (
            {"data": b"[" + b" " * (9 << 20) + b"]", "content_type": "application/json"},
            413,
            "SERVE_MAX_BODY_BYTES",
        ),
    ],
)
def test_bad_input_gets_a_json_error(
    client: FlaskClient, route: str, kwargs: dict[str, object], status: int, fragment: str
) -> None:
    response = client.post(route, **kwargs)  # type: ignore[arg-type]
    assert response.status_code == status
    assert response.is_json
    assert fragment in response.json["error"]  # type: ignore[index]
    assert "Traceback" not in response.get_data(as_text=True)


def test_unknown_routes_and_methods_get_json_errors(client: FlaskClient) -> None:
    missing = client.get("/nope")
    assert missing.status_code == 404 and missing.is_json
    wrong = client.get("/predict/batched")
    assert wrong.status_code == 405 and wrong.is_json
    assert "POST" in wrong.headers["Allow"]


def test_requests_report_the_batch_they_ran_in(client: FlaskClient) -> None:
    response = client.post("/predict/batched", json={"inputs": [VECTOR, VECTOR]})
    assert response.headers["X-Batch-Size"] == "2"


def test_a_bad_item_in_a_concurrent_batch_fails_only_its_request(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(Settings(model="tests.support.models:echo"))
    model: EchoModel = client.application.extensions[EXTENSION].model._inner
    model.gate.clear()
    results: dict[str, tuple[int, object]] = {}

    def call(name: str, items: list[str]) -> None:
        response = client.application.test_client().post("/predict/batched", json={"inputs": items})
        results[name] = (response.status_code, response.json)

    first = threading.Thread(target=call, args=("first", ["warm"]))
    first.start()
    assert model.entered.wait(10)
    runtime = client.application.extensions[EXTENSION]
    threads = [
        threading.Thread(target=call, args=(name, items))
        for name, items in (("good", ["abc"]), ("bad", ["x", POISON]), ("other", ["hello"]))
    ]
    for thread in threads:
        thread.start()
    while runtime.batcher.depth < 3:  # all three queued behind the busy model
        threading.Event().wait(0.005)
    model.gate.set()
    for thread in [first, *threads]:
        thread.join(10)
    assert results["good"] == (200, {"model": "echo", "outputs": [[3.0]]})
    assert results["other"] == (200, {"model": "echo", "outputs": [[5.0]]})
    assert results["bad"][0] == 500
    assert "ValueError" in results["bad"][1]["error"]  # type: ignore[index]
    # They did run as one batch first, in whatever order the three threads queued.
    assert sorted(model.batches[1]) == sorted(["abc", "x", POISON, "hello"])


def test_bearer_token_guards_the_predict_routes(make_client: Callable[[Settings], FlaskClient]) -> None:
    client = make_client(Settings(model="mlp", mlp_width=16, mlp_depth=1, api_token="s3cret"))
    body = {"inputs": [VECTOR]}
    refused = client.post("/predict", json=body)
    assert refused.status_code == 401
    assert refused.headers["WWW-Authenticate"].startswith("Bearer")
    assert client.post("/predict", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.post("/predict", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/healthz").status_code == 200


def test_a_model_that_fails_to_load_answers_503_without_the_error_text(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    # Outside gunicorn nothing stops the process: it stays up, not ready. The
    # load error names a path on the host, so it goes to the log only.
    client = make_client(Settings(model="tests.support.models:unloadable"))
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json == {"status": "not ready", "error": LOAD_FAILED}
    info = client.get("/info").json
    assert info["ready"] is False  # type: ignore[index]
    assert info["not_ready_reason"] == LOAD_FAILED  # type: ignore[index]
    for route in ("/predict/naive", "/predict/batched"):
        predict = client.post(route, json={"inputs": ["x"]})
        assert predict.status_code == 503
        assert predict.json == {"error": LOAD_FAILED}
        assert predict.headers["Retry-After"]
    runtime = client.application.extensions[EXTENSION]
    assert SECRET_PATH in runtime.load_error  # kept for the log
    assert LOAD_FAILED == "the model failed to load; see the service log"


def test_a_model_that_cannot_be_imported_also_keeps_the_error_to_the_log(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(Settings(model="no_such_module:factory"))
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json["error"] == LOAD_FAILED  # type: ignore[index]


QUIRKY = Settings(model="tests.support.models:quirky")


@pytest.mark.parametrize("route", ["/predict/naive", "/predict/batched"])
@pytest.mark.parametrize("item", ["nested-nan", "scalar-inf", "labelled-nan"])
def test_non_finite_outputs_of_any_kind_fail_with_500_on_both_routes(
    make_client: Callable[[Settings], FlaskClient], route: str, item: str
) -> None:
    client = make_client(QUIRKY)
    answer = client.post(route, json={"inputs": ["fine", item]})
    assert answer.status_code == 500
    assert answer.json == {"error": "model returned a non-finite value (NaN or infinity) for input 1"}


@pytest.mark.parametrize("route", ["/predict/naive", "/predict/batched"])
def test_a_string_that_spells_nan_is_not_a_non_finite_number(
    make_client: Callable[[Settings], FlaskClient], route: str
) -> None:
    answer = make_client(QUIRKY).post(route, json={"inputs": ["nan-text"]})
    assert answer.status_code == 200
    assert answer.json["outputs"] == ["nan"]  # type: ignore[index]


@pytest.mark.parametrize("route", ["/predict/naive", "/predict/batched"])
def test_a_gpu_out_of_memory_is_503_with_retry_after_on_both_routes(
    make_client: Callable[[Settings], FlaskClient], route: str
) -> None:
    # The model raises a mock named OutOfMemoryError, as torch.cuda does on a GPU
    # (none here); the service recognises it by that name.
    client = make_client(QUIRKY)
    answer = client.post(route, json={"inputs": ["oom"]})
    assert answer.status_code == 503
    assert answer.headers["Retry-After"] == "1"
    assert "GPU ran out of memory" in answer.json["error"]  # type: ignore[index]
    assert client.post(route, json={"inputs": ["after"]}).status_code == 200

"""Several models in one app: each picked by name on every protocol, one default, clear errors.

In-process (Flask's test client); tests/e2e/test_several_models.py serves them
from real gunicorn with the SDKs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from service.config.settings import Settings
from service.runtime import EXTENSION

VECTORS = "tests.support.models:vectors"
ECHO = "tests.support.models:echo"


@pytest.fixture
def several(make_client: Callable[[Settings], FlaskClient], model_dirs: dict[str, Path]) -> FlaskClient:
    spec = f"vec|text-embedding-3-small={VECTORS},echo={ECHO},rerank|rerank-v3.5={model_dirs['rerank']}"
    return make_client(Settings(model=spec, torch_threads=1))


def body(response: Any) -> dict[str, Any]:
    document: dict[str, Any] = response.json
    return document


def test_the_request_picks_its_model_and_the_first_is_the_default(several: FlaskClient) -> None:
    default = body(several.post("/predict", json={"inputs": ["a b"]}))
    assert default == {"model": "vec", "outputs": [[3.0, 1.0, 1.0]]}
    echo = body(several.post("/predict", json={"model": "echo", "inputs": ["a b"]}))
    assert echo == {"model": "echo", "outputs": [[3.0]]}
    # The naive route picks alike, and ?model= names the model of a body that cannot.
    assert body(several.post("/predict/naive", json={"model": "echo", "inputs": ["abcd"]}))["outputs"] == [
        [4.0]
    ]
    assert body(several.post("/predict?model=echo", json={"inputs": ["abcd"]}))["model"] == "echo"
    # An alias answers under the served name.
    assert (
        body(several.post("/predict", json={"model": "text-embedding-3-small", "inputs": ["x"]}))["model"]
        == "vec"
    )


def test_an_unknown_name_is_404_naming_the_models_served(several: FlaskClient) -> None:
    for response in (
        several.post("/predict", json={"model": "gpt-4", "inputs": ["x"]}),
        several.post("/v2/rerank", json={"model": "gpt-4", "query": "q", "documents": ["d"]}),
        several.post("/v2/models/gpt-4/infer", json={"inputs": []}),
    ):
        assert response.status_code == 404, response.get_data()
        said = str(response.json)
        assert "gpt-4" in said and "'vec'" in said and "'rerank'" in said and "'echo'" in said
    error = several.post("/v1/embeddings", json={"model": "gpt-4", "input": "x"}).json["error"]  # type: ignore[index]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error["message"].startswith("The model 'gpt-4' does not exist; this service serves")


def test_a_route_that_does_not_fit_the_named_model_says_its_task(several: FlaskClient) -> None:
    wrong = several.post("/v1/embeddings", json={"model": "rerank", "input": "x"})
    assert wrong.status_code == 404
    assert "serves rerank, not embeddings" in wrong.json["error"]["message"]  # type: ignore[index]
    wrong = several.post("/v2/rerank", json={"model": "vec", "query": "q", "documents": ["d"]})
    assert wrong.status_code == 404 and "not rerank" in wrong.json["message"]  # type: ignore[index]


def test_openai_cohere_and_oip_each_reach_their_model(several: FlaskClient) -> None:
    embedded = body(
        several.post("/v1/embeddings", json={"model": "text-embedding-3-small", "input": ["a b"]})
    )
    assert embedded["model"] == "vec" and embedded["data"][0]["embedding"] == [3.0, 1.0, 1.0]
    # Unnamed, rerank goes to the first cross-encoder, not to the default model.
    ranked = body(several.post("/v2/rerank", json={"query": "q", "documents": ["a", "b", "c"]}))
    named = body(
        several.post("/v1/rerank", json={"model": "rerank-v3.5", "query": "q", "documents": ["a", "b", "c"]})
    )
    assert [r["index"] for r in ranked["results"]] == [r["index"] for r in named["results"]]
    assert sorted(r["index"] for r in ranked["results"]) == [0, 1, 2]
    infer = several.post(
        "/v2/models/vec/infer",
        json={"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": ["a b"]}]},
    )
    assert infer.status_code == 200 and infer.json["model_name"] == "vec"  # type: ignore[index]
    assert several.get("/v2/models/rerank/ready").json == {"name": "rerank", "ready": True}
    assert several.get("/v2/models/echo").json["name"] == "echo"  # type: ignore[index]


def test_discovery_lists_every_model_with_its_task(several: FlaskClient) -> None:
    listed = body(several.get("/v1/models"))["data"]
    assert [(m["id"], m["task"], m["aliases"]) for m in listed] == [
        ("vec", "generic", ["text-embedding-3-small"]),
        ("echo", "generic", []),
        ("rerank", "rerank", ["rerank-v3.5"]),
    ]
    assert body(several.get("/v1/models/rerank-v3.5"))["id"] == "rerank"
    assert several.get("/v1/models/gpt-4").status_code == 404
    info = body(several.get("/info"))
    assert [(m["name"], m["model"]["task"], m["ready"]) for m in info["models"]] == [
        ("vec", "generic", True),
        ("echo", "generic", True),
        ("rerank", "rerank", True),
    ]
    assert info["model"]["name"] == "vec"  # the default, where a one-model service has its model
    assert info["batching"]["models_take_turns"] is True


def test_each_model_has_its_own_batcher_on_one_shared_model_time(several: FlaskClient) -> None:
    models = several.application.extensions[EXTENSION]
    batchers = [rt.batcher for rt in models.runtimes]
    assert len({id(b) for b in batchers}) == 3
    assert models.model_time is not None and all(rt.model_time is models.model_time for rt in models.runtimes)


def test_one_model_takes_no_turns_and_keeps_its_own_name(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(Settings(model=VECTORS))
    models = client.application.extensions[EXTENSION]
    assert models.single and models.model_time is None and models.default.model_time is None
    assert body(client.post("/predict", json={"inputs": ["x"]}))["model"] == "vectors"
    assert body(client.post("/predict", json={"model": "vectors", "inputs": ["x"]}))["model"] == "vectors"
    # The protocols that always named their model still refuse another name.
    assert client.post("/v1/embeddings", json={"model": "other", "input": "x"}).status_code == 404


def test_a_named_lone_model_answers_to_its_name(make_client: Callable[[Settings], FlaskClient]) -> None:
    client = make_client(Settings(model=f"mine|theirs={VECTORS}"))
    assert body(client.post("/predict", json={"inputs": ["x"]}))["model"] == "mine"
    assert body(client.post("/v1/embeddings", json={"model": "theirs", "input": "x"}))["model"] == "mine"


def test_two_unnamed_models_of_one_name_cannot_be_told_apart(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(Settings(model=f"{ECHO},{ECHO}"))
    models = client.application.extensions[EXTENSION]
    assert "two models answer to the name 'echo'" in (models.load_error or "")
    assert client.get("/readyz").status_code == 503
    # Named, the same model may be served twice.
    twice = make_client(Settings(model=f"a={ECHO},b={ECHO}"))
    assert body(twice.post("/predict", json={"model": "b", "inputs": ["xy"]}))["model"] == "b"


def test_a_model_that_fails_to_load_is_named(make_client: Callable[[Settings], FlaskClient]) -> None:
    client = make_client(Settings(model=f"vec={VECTORS},broken=tests.support.models:broken_load"))
    models = client.application.extensions[EXTENSION]
    assert models.load_error is not None and models.load_error.startswith("model 'broken' failed to load")
    assert client.get("/readyz").status_code == 503
    assert client.post("/predict", json={"inputs": ["x"]}).status_code == 503


def test_one_lone_models_predict_ignores_a_model_field_as_it_always_did(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(Settings(model=VECTORS))
    # Clients that send a "model" of their own to /predict keep working with one model.
    assert body(client.post("/predict", json={"model": "other", "inputs": ["x"]}))["model"] == "vectors"
    assert body(client.post("/predict?model=other", json={"inputs": ["x"]}))["model"] == "vectors"
    several = make_client(Settings(model=f"a={VECTORS},b={ECHO}"))
    wrong = several.post("/predict", json={"model": 7, "inputs": ["x"]})
    assert wrong.status_code == 400 and '"model" must be a string' in wrong.json["error"]  # type: ignore[index]


def test_a_stalled_model_fails_the_other_models_requests_and_replaces_the_worker(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    # The stalled model holds the worker's model time: the other model's requests,
    # waiting for their turn, get 503 at once rather than wait for ever.
    settings = Settings(
        model=f"script=tests.support.models:scripted,echo={ECHO}",
        request_timeout_ms=8000,
        stall_timeout_ms=1000,
    )
    client = make_client(settings)
    models = client.application.extensions[EXTENSION]
    faults: list[str] = []
    reported = threading.Event()
    models.on_fault = lambda reason: (faults.append(reason), reported.set())
    answers: dict[str, int] = {}

    def send(name: str, text: str) -> None:
        answers[name] = client.post("/predict", json={"model": name, "inputs": [text]}).status_code

    wedged = threading.Thread(target=send, args=("script", "wedge"))
    wedged.start()
    time.sleep(0.3)  # the wedge holds the time now
    waiting = threading.Thread(target=send, args=("echo", "waits for its turn"))
    waiting.start()
    assert reported.wait(10)
    waiting.join(10)
    assert answers["echo"] == 503 and faults and "stuck" in faults[0]
    started = time.monotonic()
    assert models.stop(timeout=30) is False and time.monotonic() - started < 5  # no wait on a faulty worker
    models.runtimes[0].model._inner.unwedge()  # type: ignore[union-attr]
    wedged.join(10)


def test_the_models_load_one_after_another_and_a_failure_skips_the_rest(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(Settings(model=f"broken=tests.support.models:broken_load,echo={ECHO}"))
    models = client.application.extensions[EXTENSION]
    assert models.load_error is not None and models.load_error.startswith("model 'broken' failed to load")
    assert models.runtimes[1].model is None
    assert models.runtimes[1].load_error == "not loaded: model 'broken' failed to load first"

"""In-process tests of the OpenAI embeddings routes: the API's shapes and error bodies."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flask.testing import FlaskClient

from service.config.settings import Settings
from tests.support.metrics import Scrape

VECTORS = Settings(model="tests.support.models:vectors", max_items_per_request=8)


@pytest.fixture
def vectors(make_client: Callable[[Settings], FlaskClient]) -> FlaskClient:
    return make_client(VECTORS)


def embed(client: FlaskClient, **body: Any) -> Any:
    return client.post("/v1/embeddings", json={"model": "vectors", **body})


def test_a_string_and_a_list_of_strings(vectors: FlaskClient) -> None:
    one = embed(vectors, input="a b c")
    assert one.status_code == 200, one.json
    assert one.json == {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [5.0, 2.0, 1.0]}],
        "model": "vectors",
        # This model has no tokenizer to count with.
        "usage": {"prompt_tokens": 0, "total_tokens": 0},
    }
    assert one.headers["X-Batch-Size"] == "1"
    many = embed(vectors, input=["ab", "a b c d"], encoding_format="float")
    assert [d["index"] for d in many.json["data"]] == [0, 1]  # type: ignore[index]
    assert [d["embedding"] for d in many.json["data"]] == [[2.0, 0.0, 1.0], [7.0, 3.0, 1.0]]  # type: ignore[index]


def test_base64_is_little_endian_float32(vectors: FlaskClient) -> None:
    response = embed(vectors, input=["ab", "a b c d"], encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist() for d in response.json["data"]]  # type: ignore[index]
    assert decoded == [[2.0, 0.0, 1.0], [7.0, 3.0, 1.0]]


def test_dimensions_cut_and_renormalise(vectors: FlaskClient) -> None:
    # text-embedding-3's "dimensions": the first components, scaled back to unit length.
    cut = embed(vectors, input=["a b c", "ab"], dimensions=2, encoding_format="float").json
    expected = [np.array([5.0, 2.0]) / np.hypot(5.0, 2.0), np.array([2.0, 0.0]) / 2.0]
    np.testing.assert_allclose([d["embedding"] for d in cut["data"]], expected, rtol=1e-6)  # type: ignore[index]
    whole = embed(vectors, input="a b c", dimensions=3, encoding_format="base64").json["data"][0]  # type: ignore[index]
    vector = np.frombuffer(base64.b64decode(whole["embedding"]), "<f4")
    np.testing.assert_allclose(vector, np.array([5.0, 2.0, 1.0]) / np.sqrt(30.0), rtol=1e-6)
    # Left out, or null: the model's own vectors, untouched.
    assert embed(vectors, input="a b c", dimensions=None).json["data"][0]["embedding"] == [5.0, 2.0, 1.0]  # type: ignore[index]


def test_models_lists_the_served_model(vectors: FlaskClient) -> None:
    listed = vectors.get("/v1/models").json
    [model] = listed["data"]  # type: ignore[index]
    assert listed["object"] == "list"  # type: ignore[index]
    assert (model["id"], model["object"], model["owned_by"]) == ("vectors", "model", "torch-serve-batched")
    assert isinstance(model["created"], int)
    assert vectors.get("/v1/models/vectors").json == model
    assert vectors.get("/v1/models/other").status_code == 404


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.get_data()
    error: dict[str, Any] = response.json["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    return error


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"input": []}, "input", "empty"),
        ({"input": ""}, "input", "empty string"),
        ({"input": ["ok", ""]}, "input", "input[1]"),
        ({"input": [1, 2, 3]}, "input", "token arrays"),
        ({"input": [[1, 2]]}, "input", "token arrays"),
        ({"input": {"text": "x"}}, "input", "a string or a list"),
        ({}, "input", "a string or a list"),
        ({"input": [[1, 2]]}, "input", "check_embedding_ctx_length=False"),
        ({"input": "x", "dimensions": 4}, "dimensions", "from 1 to 3"),
        ({"input": "x", "dimensions": 0}, "dimensions", "from 1 to 3"),
        ({"input": "x", "dimensions": "2"}, "dimensions", "got string"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "int8"),
        ({"input": ["x"] * 9}, None, "limit is 8"),
    ],
)
def test_bad_requests_are_400s_in_openais_shape(
    vectors: FlaskClient, body: dict[str, Any], param: str | None, fragment: str
) -> None:
    error = error_of(embed(vectors, **body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert fragment in error["message"]


@pytest.mark.parametrize("entry", [True, ["a"], [], {"text": "x"}, 1.5])
def test_only_token_ids_get_langchains_hint(vectors: FlaskClient, entry: Any) -> None:
    message = error_of(embed(vectors, input=["ok", entry]), 400)["message"]
    assert message.startswith("input[1]: expected a string") and "check_embedding_ctx_length" not in message


def test_a_non_json_body_is_a_400(vectors: FlaskClient) -> None:
    assert (
        "not valid JSON"
        in error_of(vectors.post("/v1/embeddings", data=b"{", content_type="application/json"), 400)[
            "message"
        ]
    )
    assert (
        "Content-Type"
        in error_of(vectors.post("/v1/embeddings", data=b"{}", content_type="text/plain"), 400)["message"]
    )
    assert "JSON object" in error_of(vectors.post("/v1/embeddings", json=["x"]), 400)["message"]


def test_an_unknown_model_is_a_404_model_not_found(vectors: FlaskClient) -> None:
    error = error_of(
        vectors.post("/v1/embeddings", json={"model": "text-embedding-3-small", "input": "x"}), 404
    )
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert "'vectors'" in error["message"]
    assert error_of(vectors.post("/v1/embeddings", json={"input": "x"}), 400)["param"] == "model"


@pytest.mark.parametrize("model", ["mlp", "tests.support.models:sleepy"])
def test_models_that_do_not_embed_text_are_not_served(
    make_client: Callable[[Settings], FlaskClient], model: str
) -> None:
    client = make_client(Settings(model=model, mlp_width=16, mlp_depth=1))
    name = client.get("/info").json["model"]["name"]  # type: ignore[index]
    error = error_of(client.post("/v1/embeddings", json={"model": name, "input": "x"}), 404)
    assert "another model that takes text and returns vectors" in error["message"]
    # Listed all the same, with its task: /v1/models lists every model the service serves.
    listed = client.get("/v1/models").json["data"]  # type: ignore[index]
    assert [(m["id"], m["task"]) for m in listed] == [(name, "generic")]


def test_a_model_returning_no_vectors_fails_cleanly(make_client: Callable[[Settings], FlaskClient]) -> None:
    # labels declares no output shape, so it is only found out when it answers.
    client = make_client(Settings(model="tests.support.models:labels"))
    error = error_of(client.post("/v1/embeddings", json={"model": "labels", "input": "x"}), 500)
    assert error["type"] == "server_error"


def test_unknown_routes_and_methods_answer_in_openais_shape(vectors: FlaskClient) -> None:
    assert error_of(vectors.post("/v1/chat/completions", json={}), 404)["type"] == "invalid_request_error"
    error_of(vectors.get("/v1/embeddings"), 405)


def test_the_token_guards_embeddings(make_client: Callable[[Settings], FlaskClient]) -> None:
    client = make_client(Settings(model="tests.support.models:vectors", api_token="s3cret"))
    error = error_of(client.post("/v1/embeddings", json={"model": "vectors", "input": "x"}), 401)
    assert error["code"] == "invalid_api_key"
    ok = client.post(
        "/v1/embeddings", json={"model": "vectors", "input": "x"}, headers={"Authorization": "Bearer s3cret"}
    )
    assert ok.status_code == 200


def test_metrics_label_the_route(vectors: FlaskClient) -> None:
    assert embed(vectors, input=["a", "b"]).status_code == 200
    scrape = Scrape.parse(vectors.get("/metrics").get_data())
    assert scrape.total("serve_http_requests_total", route="/v1/embeddings", code="200") == 1
    assert scrape.total("serve_inferred_items_total") == 2

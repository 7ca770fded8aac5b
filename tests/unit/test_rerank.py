"""In-process tests of the rerank routes and of every task on the standard protocols."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flask.testing import FlaskClient

from service.config.settings import Settings
from tests.support.hf_dirs import RERANK_DOCUMENTS as DOCUMENTS
from tests.support.hf_dirs import RERANK_QUERY as QUERY

ROUTES = ["/v1/rerank", "/v2/rerank", "/rerank/naive", "/rerank/batched"]


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, Path]) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(model_dirs["rerank"]), local_files_only=True)
    scores: np.ndarray = model.predict([[QUERY, doc] for doc in DOCUMENTS])
    return scores


@pytest.fixture
def reranker(make_client: Callable[[Settings], FlaskClient], model_dirs: dict[str, Path]) -> FlaskClient:
    return make_client(Settings(model=str(model_dirs["rerank"]), torch_threads=1, max_items_per_request=8))


def serve(
    make_client: Callable[[Settings], FlaskClient], model_dirs: dict[str, Path], task: str
) -> FlaskClient:
    return make_client(Settings(model=str(model_dirs[task]), torch_threads=1, max_items_per_request=8))


@pytest.mark.parametrize("route", ROUTES)
def test_results_are_every_document_best_first_with_cross_encoder_scores(
    reranker: FlaskClient, reference: np.ndarray, route: str
) -> None:
    response = reranker.post(route, json={"query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.json
    body: dict[str, Any] = response.json  # type: ignore[assignment]
    results = body["results"]
    assert [r["index"] for r in results] == list(np.argsort(-reference, kind="stable"))
    for result in results:
        assert set(result) == {"index", "relevance_score"}
        assert result["relevance_score"] == pytest.approx(float(reference[result["index"]]), abs=1e-4)
    assert isinstance(body["id"], str) and body["id"]
    assert body["meta"]["api_version"]["version"] == ("1" if route == "/v1/rerank" else "2")
    assert body["meta"]["tokens"]["input_tokens"] > 4 * len(QUERY.split())
    assert response.headers["X-Batch-Size"] == str(len(DOCUMENTS))


@pytest.mark.parametrize("route", ROUTES)
def test_top_n_and_return_documents(reranker: FlaskClient, reference: np.ndarray, route: str) -> None:
    documents = [{"text": doc} for doc in DOCUMENTS]
    body = {"query": QUERY, "documents": documents, "top_n": 2, "return_documents": True}
    results = reranker.post(route, json=body).json["results"]  # type: ignore[index]
    best = list(np.argsort(-reference, kind="stable")[:2])
    assert [r["index"] for r in results] == best
    assert [r["document"] for r in results] == [{"text": DOCUMENTS[i]} for i in best]
    # More than there are documents: all of them, as Cohere answers.
    many = reranker.post(route, json={"query": QUERY, "documents": DOCUMENTS, "top_n": 50})
    assert len(many.json["results"]) == len(DOCUMENTS)  # type: ignore[index]


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"query": QUERY, "documents": []}, 400, '"documents" is empty'),
        ({"query": QUERY, "documents": ["ok", 3]}, 400, "documents[1] must be a string"),
        (
            {"query": QUERY, "documents": ["ok", {"title": "x"}]},
            400,
            'documents[1] must be a string or {"text"',
        ),
        ({"query": QUERY, "documents": DOCUMENTS, "top_n": 0}, 400, '"top_n" must be a whole number'),
        ({"query": QUERY, "documents": DOCUMENTS, "top_n": "3"}, 400, '"top_n"'),
        (
            {"query": "q" * 20_001, "documents": DOCUMENTS},
            400,
            '"query" is 20001 characters; the limit is 20000',
        ),
        ({"query": "", "documents": DOCUMENTS}, 400, '"query" is empty'),
        ({"documents": DOCUMENTS}, 400, '"query" must be a string'),
        (
            {"query": QUERY, "documents": ["x" * 20_001]},
            400,
            "documents[0]: the document is 20001 characters",
        ),
        ({"query": QUERY, "documents": DOCUMENTS, "return_documents": "yes"}, 400, '"return_documents"'),
        ({"query": QUERY, "documents": DOCUMENTS, "max_tokens_per_doc": 64}, 400, '"max_tokens_per_doc"'),
        (
            {"query": QUERY, "documents": DOCUMENTS, "model": "rerank-v3.5"},
            404,
            "this service serves 'tiny-rerank'",
        ),
        ({"query": QUERY, "documents": ["d"] * 9}, 413, "the limit is 8"),
    ],
)
@pytest.mark.parametrize("route", ["/v2/rerank", "/rerank/naive"])
def test_bad_requests_name_the_field(
    reranker: FlaskClient, route: str, body: dict[str, Any], status: int, fragment: str
) -> None:
    response = reranker.post(route, json=body)
    # Cohere's routes speak Cohere's error shape and status; the service's own routes
    # its own, with /predict's 422 for a bad field.
    assert response.status_code == (422 if status == 400 and route == "/rerank/naive" else status)
    key = "message" if route == "/v2/rerank" else "error"
    assert fragment in response.json[key], response.json  # type: ignore[index]


@pytest.mark.parametrize("route", ROUTES)
def test_rerank_on_an_embedding_model_is_refused_naming_its_task(
    make_client: Callable[[Settings], FlaskClient], model_dirs: dict[str, Path], route: str
) -> None:
    client = serve(make_client, model_dirs, "embeddings")
    response = client.post(route, json={"query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 404
    message = response.json["message" if route.startswith(("/v1", "/v2")) else "error"]  # type: ignore[index]
    assert "serves embeddings, not rerank" in message


def test_embeddings_on_a_reranker_are_refused_naming_its_task(reranker: FlaskClient) -> None:
    response = reranker.post("/v1/embeddings", json={"input": "text", "model": "tiny-rerank"})
    assert response.status_code == 404
    assert "serves rerank, not embeddings" in response.json["error"]["message"]  # type: ignore[index]


def test_a_reranker_shows_its_task_in_info_and_oip_metadata(reranker: FlaskClient) -> None:
    assert reranker.get("/info").json["model"]["task"] == "rerank"  # type: ignore[index]
    metadata = reranker.get("/v2/models/tiny-rerank").json
    assert metadata["inputs"] == [{"name": "input", "datatype": "BYTES", "shape": [-1, 2]}]  # type: ignore[index]
    assert metadata["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1]}]  # type: ignore[index]


def test_oip_infer_scores_query_document_rows(reranker: FlaskClient, reference: np.ndarray) -> None:
    rows = [[QUERY, doc] for doc in DOCUMENTS]
    tensor = {"name": "input", "datatype": "BYTES", "shape": [len(rows), 2], "data": rows}
    response = reranker.post("/v2/models/tiny-rerank/infer", json={"inputs": [tensor]})
    assert response.status_code == 200, response.json
    output = response.json["outputs"][0]  # type: ignore[index]
    assert output["datatype"] == "FP32" and output["shape"] == [len(DOCUMENTS)]
    np.testing.assert_allclose(output["data"], reference, atol=1e-4)


@pytest.mark.parametrize(
    ("task", "texts"),
    [("classification", ["I loved it.", "Awful."]), ("fill-mask", ["Paris is the [MASK]."])],
)
def test_oip_carries_structured_outputs_as_their_json(
    make_client: Callable[[Settings], FlaskClient], model_dirs: dict[str, Path], task: str, texts: list[str]
) -> None:
    client = serve(make_client, model_dirs, task)
    name = model_dirs[task].name
    metadata = client.get(f"/v2/models/{name}").json
    assert metadata["outputs"] == [{"name": "output", "datatype": "BYTES", "shape": [-1]}]  # type: ignore[index]
    tensor = {"name": "input", "datatype": "BYTES", "shape": [len(texts)], "data": texts}
    response = client.post(f"/v2/models/{name}/infer", json={"inputs": [tensor]})
    assert response.status_code == 200, response.json
    output = response.json["outputs"][0]  # type: ignore[index]
    assert output["datatype"] == "BYTES" and output["shape"] == [len(texts)]
    predicted = client.post("/predict", json={"inputs": texts}).json["outputs"]  # type: ignore[index]
    carried = [json.loads(element) for element in output["data"]]
    # The same labels or tokens; scores to float32's last bits, since the two calls may
    # batch (and pad) the texts differently.
    assert _without_scores(carried) == _without_scores(predicted)
    np.testing.assert_allclose(_scores(carried), _scores(predicted), atol=1e-5)


def _without_scores(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_scores(item) for key, item in value.items() if key != "score"}
    if isinstance(value, list):
        return [_without_scores(item) for item in value]
    return value


def _scores(value: Any) -> list[float]:
    if isinstance(value, dict):
        return [float(value["score"])] if "score" in value else []
    if isinstance(value, list):
        return [score for item in value for score in _scores(item)]
    return []

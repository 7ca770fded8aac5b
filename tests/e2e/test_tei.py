"""End to end: Text Embeddings Inference's clients, as they are, against real gunicorn.

huggingface_hub's InferenceClient, LlamaIndex's TextEmbeddingsInference and
Haystack's TEI embedders and ranker get what sentence-transformers gives run
directly (SERVE_PRECISION=float32, so that the comparison is of float32 with
float32). One service serves the four models they need: the default model
(what a client that names none gets), a cross-encoder (what /rerank picks
unnamed), a classifier and an embedder with prompts and a default prompt
(reached by ``?model=``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from tests.support.hf_dirs import RERANK_DOCUMENTS as DOCUMENTS
from tests.support.hf_dirs import RERANK_QUERY as QUERY
from tests.support.hf_dirs import minilm_path, prompt_dir
from tests.support.server import Server, gunicorn

# Before Haystack is imported: its telemetry would reach for the network.
os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")

pytestmark = pytest.mark.e2e

MODEL = "all-MiniLM-L6-v2"
TEXTS = [
    "A man is eating food.",
    "The service was slow, the food was cold and the bill was wrong twice over, so we left.",
    "ok",
]
PROMPTS = {"query": "query: ", "passage": "passage: "}


@pytest.fixture(scope="module")
def prompted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A default prompt, as E5-style directories set one: what a request that names none gets.
    return prompt_dir(tmp_path_factory.mktemp("tei") / "prompted", PROMPTS, "passage")


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path], prompted: Path) -> Iterator[Server]:
    spec = (
        f"{MODEL}=minilm,rerank={model_dirs['rerank']},classify={model_dirs['classification']},"
        f"prompted={prompted}"
    )
    env = {"SERVE_MODEL": spec, "SERVE_WORKERS": "1", "SERVE_PRECISION": "float32"}
    with gunicorn(env, ready_timeout=180) as running:
        yield running


def sentence_transformer(path: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu", local_files_only=True)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    """What sentence-transformers gives for TEXTS, run directly on the default model's directory."""
    return np.asarray(sentence_transformer(minilm_path()).encode(TEXTS), dtype=np.float64)


def assert_same_embeddings(got: Any, expected: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == expected.shape
    cosines = (got * expected).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
    assert cosines.min() >= 0.9999, cosines


def test_inference_client_feature_extraction(server: Server, reference: np.ndarray) -> None:
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=server.url)
    assert_same_embeddings(client.feature_extraction(TEXTS), reference)
    assert_same_embeddings(client.feature_extraction(TEXTS[0]), reference[:1])
    assert_same_embeddings(client.feature_extraction(TEXTS, normalize=True, truncate=True), reference)


def test_llamaindex_text_embeddings_inference(server: Server, reference: np.ndarray) -> None:
    from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

    embedder = TextEmbeddingsInference(base_url=server.url, model_name=MODEL)
    assert_same_embeddings(embedder.get_text_embedding_batch(TEXTS), reference)
    assert_same_embeddings([embedder.get_query_embedding(TEXTS[0])], reference[:1])


def test_post_embed(server: Server, reference: np.ndarray) -> None:
    response = server.post("/embed", json={"inputs": TEXTS})
    assert response.status_code == 200, response.text
    assert_same_embeddings(response.json(), reference)
    assert int(response.headers["X-Batch-Size"]) >= 3


def test_haystack_embedders(server: Server, reference: np.ndarray) -> None:
    from haystack import Document
    from haystack_integrations.components.embedders.huggingface_api import (
        HuggingFaceAPIDocumentEmbedder,
        HuggingFaceAPITextEmbedder,
    )

    api = {"api_type": "text_embeddings_inference", "api_params": {"url": server.url}}
    text = HuggingFaceAPITextEmbedder(**api).run(text=TEXTS[0])  # type: ignore[arg-type]
    assert_same_embeddings([text["embedding"]], reference[:1])
    documents = HuggingFaceAPIDocumentEmbedder(**api).run(  # type: ignore[arg-type]
        documents=[Document(content=t) for t in TEXTS]
    )["documents"]
    assert_same_embeddings([d.embedding for d in documents], reference)


def test_dimensions_cut_and_renormalise(server: Server, reference: np.ndarray) -> None:
    from huggingface_hub import InferenceClient

    cut = np.asarray(InferenceClient(base_url=server.url).feature_extraction(TEXTS, dimensions=128))
    expected = reference[:, :128] / np.linalg.norm(reference[:, :128], axis=1, keepdims=True)
    assert cut.shape == (3, 128)
    np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(cut, expected, atol=1e-4)
    assert_same_embeddings(cut, expected)


def test_truncation_on_the_left(server: Server) -> None:
    long = " ".join(f"word{i} and" for i in range(400))  # far past the model's 256 tokens
    reference = sentence_transformer(minilm_path())
    reference.tokenizer.truncation_side = "left"
    expected = np.asarray(reference.encode([long]), dtype=np.float64)
    left = server.post("/embed", json={"inputs": [long], "truncation_direction": "Left"}).json()
    assert_same_embeddings(left, expected)
    right = server.post("/embed", json={"inputs": [long]}).json()
    assert np.dot(left[0], right[0]) < 0.99  # a different end of the text


def test_a_prompt_chosen_by_name(server: Server, prompted: Path) -> None:
    from huggingface_hub import InferenceClient

    reference = sentence_transformer(prompted)
    client = InferenceClient(base_url=server.url + "/?model=prompted")
    query = client.feature_extraction(TEXTS, prompt_name="query")
    assert_same_embeddings(query, reference.encode(TEXTS, prompt_name="query"))
    # No name: the directory's default, "passage", as encode gives it; not the texts alone.
    unnamed = np.asarray(client.feature_extraction(TEXTS), dtype=np.float64)
    assert_same_embeddings(unnamed, reference.encode(TEXTS, prompt_name="passage"))
    alone = reference.encode(TEXTS, prompt="")
    assert ((unnamed * alone).sum(axis=1) < 0.9999).all()
    [tokens] = server.post("/tokenize?model=prompted", json={"inputs": "ok", "prompt_name": "query"}).json()
    assert [t["text"] for t in tokens] == ["[CLS]", "query", ":", "ok", "[SEP]"]
    [tokens] = server.post("/tokenize?model=prompted", json={"inputs": "ok"}).json()
    assert [t["text"] for t in tokens] == ["[CLS]", "passage", ":", "ok", "[SEP]"]


def test_rerank_gives_cross_encoder_s_order(server: Server, model_dirs: dict[str, Path]) -> None:
    from sentence_transformers import CrossEncoder

    scores = CrossEncoder(str(model_dirs["rerank"]), local_files_only=True).predict(
        [[QUERY, d] for d in DOCUMENTS]
    )
    order = np.argsort(-scores, kind="stable").tolist()
    # Unnamed, /rerank answers the first cross-encoder served, not the default embedder.
    ranks = server.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS}).json()
    assert [r["index"] for r in ranks] == order
    np.testing.assert_allclose([r["score"] for r in ranks], scores[order], atol=1e-5)
    body = {"query": QUERY, "texts": DOCUMENTS, "return_text": True}
    root = server.post("/?model=rerank", json=body).json()
    assert [(r["index"], r["text"]) for r in root] == [(i, DOCUMENTS[i]) for i in order]


def test_haystack_ranker(server: Server, model_dirs: dict[str, Path]) -> None:
    from haystack import Document
    from haystack_integrations.components.rankers.huggingface_api import HuggingFaceTEIRanker

    ranks = server.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS}).json()
    ranker = HuggingFaceTEIRanker(url=server.url, top_k=3)
    ranked = ranker.run(query=QUERY, documents=[Document(content=d) for d in DOCUMENTS])["documents"]
    assert [d.content for d in ranked] == [DOCUMENTS[r["index"]] for r in ranks[:3]]


def test_inference_client_text_classification(server: Server) -> None:
    from huggingface_hub import InferenceClient

    text = "What a lovely day"
    expected = server.post("/predict", json={"model": "classify", "inputs": [text]}).json()
    labels = InferenceClient(base_url=server.url + "/?model=classify").text_classification(text)
    assert [(e.label, e.score) for e in labels] == [(e["label"], e["score"]) for e in expected["outputs"][0]]


def test_bad_requests_get_tei_errors(server: Server) -> None:
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError) as too_wide:
        InferenceClient(base_url=server.url).feature_extraction("x", dimensions=385)
    assert too_wide.value.response is not None and too_wide.value.response.status_code == 422
    assert too_wide.value.response.json()["error_type"] == "Validation"
    assert "from 1 to 384" in too_wide.value.response.json()["error"]
    cases: list[tuple[str, Any, int, str]] = [
        ("/embed", {"inputs": []}, 400, "Empty"),
        ("/embed", {"inputs": [[101, 2023]]}, 422, "Validation"),
        ("/embed", {"inputs": "x", "truncation_direction": "middle"}, 422, "Validation"),
        ("/embed", {"inputs": ["x"] * 2049}, 413, "Validation"),
        ("/embed?model=prompted", {"inputs": "x", "prompt_name": "document"}, 422, "Validation"),
        ("/rerank", {"query": 3, "texts": ["a"]}, 422, "Validation"),
        ("/embed?model=rerank", {"inputs": "x"}, 404, "Backend"),
    ]
    for path, body, status, error_type in cases:
        response = requests.post(server.url + path, json=body, timeout=30)
        assert (response.status_code, response.json()["error_type"]) == (status, error_type), response.text
    prompts = requests.post(server.url + "/embed?model=prompted", json=cases[4][1], timeout=30).json()
    assert "'query', 'passage'" in prompts["error"]


def test_info_has_tei_s_keys(server: Server) -> None:
    info = server.get("/info").json()
    assert info["model_id"] == MODEL
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert (info["max_input_length"], info["max_client_batch_size"]) == (256, 2048)
    assert info["model"]["name"] == MODEL and info["ready"] is True  # the service's own keys stay

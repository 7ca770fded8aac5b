"""End to end: real gunicorn started on model directories, under gthread and gevent, against the libraries.

Concurrent requests on /predict/batched share batches (length-aware sub-batches:
each kind reports token counts), and must still equal what sentence-transformers
and transformers give when run directly, as /predict/naive must.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.hf_dirs import RERANK_DOCUMENTS as DOCUMENTS
from tests.support.hf_dirs import RERANK_QUERY as QUERY
from tests.support.metrics import Scrape
from tests.support.server import Server, gunicorn, gunicorn_exit

pytestmark = pytest.mark.e2e

TEXTS = [
    "I loved this film.",
    "The service was slow, the food was cold and the bill was wrong twice over, so we left.",
    "ok",
    "A man is riding a horse along the beach at sunset while gulls circle overhead.",
]
MASKED = ["Paris is the [MASK] of France.", "A [MASK] sat on the [MASK].", "[MASK]"]
PAIRS = [[QUERY, doc] for doc in DOCUMENTS]


@pytest.fixture(scope="module", params=["gthread", "gevent"])
def worker_class(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def start(path: Path, worker_class: str) -> Any:
    env = {"SERVE_MODEL": str(path), "SERVE_WORKERS": "1", "SERVE_WORKER_CLASS": worker_class}
    return gunicorn(env)


def both_routes(server: Server, inputs: list[Any]) -> list[list[Any]]:
    """Each input alone on /predict/naive, then all at once as concurrent requests on /predict/batched."""
    naive = [server.post("/predict/naive", json={"inputs": [item]}) for item in inputs]
    with ThreadPoolExecutor(len(inputs)) as pool:
        batched = list(
            pool.map(lambda item: server.post("/predict/batched", json={"inputs": [item]}), inputs)
        )
    for response in naive + batched:
        assert response.status_code == 200, response.text
    return [[r.json()["outputs"][0] for r in naive], [r.json()["outputs"][0] for r in batched]]


def tokens_counted(server: Server) -> float:
    return Scrape.parse(server.get("/metrics").content).total("serve_batch_tokens_total", kind="real")


def test_embeddings(model_dirs: dict[str, Path], worker_class: str) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(model_dirs["embeddings"]), local_files_only=True).encode(TEXTS)
    with start(model_dirs["embeddings"], worker_class) as server:
        for outputs in both_routes(server, TEXTS):
            got = np.array(outputs)
            cosine = (got * reference).sum(1) / (
                np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1)
            )
            assert cosine.min() >= 0.999
        assert tokens_counted(server) > 0
        assert server.get("/info").json()["model"]["task"] == "embeddings"


def test_rerank(model_dirs: dict[str, Path], worker_class: str) -> None:
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(model_dirs["rerank"]), local_files_only=True).predict(PAIRS)
    with start(model_dirs["rerank"], worker_class) as server:
        for outputs in both_routes(server, PAIRS):
            np.testing.assert_allclose(outputs, reference, atol=1e-4)
        for route in ("/v1/rerank", "/v2/rerank", "/rerank/naive", "/rerank/batched"):
            response = server.post(route, json={"query": QUERY, "documents": DOCUMENTS})
            assert response.status_code == 200, response.text
            results = response.json()["results"]
            assert [r["index"] for r in results] == list(np.argsort(-reference, kind="stable"))
            got = [r["relevance_score"] for r in results]
            np.testing.assert_allclose(got, np.sort(reference)[::-1], atol=1e-4)
        assert tokens_counted(server) > 0


def test_classification(model_dirs: dict[str, Path], worker_class: str) -> None:
    from transformers import pipeline

    reference = pipeline("text-classification", model=str(model_dirs["classification"]), top_k=None)(TEXTS)
    with start(model_dirs["classification"], worker_class) as server:
        for outputs in both_routes(server, TEXTS):
            for got, want in zip(outputs, reference, strict=True):
                assert [e["label"] for e in got] == [e["label"] for e in want]
                np.testing.assert_allclose([e["score"] for e in got], [e["score"] for e in want], atol=1e-4)
        assert tokens_counted(server) > 0


def test_fill_mask(model_dirs: dict[str, Path], worker_class: str) -> None:
    from transformers import pipeline

    reference = pipeline("fill-mask", model=str(model_dirs["fill-mask"]))(MASKED)
    with start(model_dirs["fill-mask"], worker_class) as server:
        for outputs in both_routes(server, MASKED):
            for got, want in zip(outputs, reference, strict=True):
                got_masks = [got] if isinstance(got[0], dict) else got
                want_masks = [want] if isinstance(want[0], dict) else want
                assert len(got_masks) == len(want_masks)
                for g, w in zip(got_masks, want_masks, strict=True):
                    assert [(f["token_str"], f["sequence"]) for f in g] == [
                        (f["token_str"], f["sequence"]) for f in w
                    ]
                    np.testing.assert_allclose([f["score"] for f in g], [f["score"] for f in w], atol=1e-4)
        refused = server.post("/predict/batched", json={"inputs": ["no mask here"]})
        assert refused.status_code == 422 and "has no [MASK]" in refused.json()["error"]


def test_an_unsupported_directory_stops_the_master_before_any_worker(model_dirs: dict[str, Path]) -> None:
    code, log = gunicorn_exit({"SERVE_MODEL": str(model_dirs["plain"])}, timeout=30)
    assert code == 1
    assert "config.json names BertModel" in log and "*ForMaskedLM model for fill-mask" in log, log
    assert "Booting worker" not in log


@pytest.fixture(scope="module")
def reranker(model_dirs: dict[str, Path]) -> Iterator[Server]:
    with start(model_dirs["rerank"], "gthread") as server:
        yield server


def test_the_cohere_sdk_reranks_with_client_and_client_v2(
    reranker: Server, model_dirs: dict[str, Path]
) -> None:
    import cohere
    import httpx
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(model_dirs["rerank"]), local_files_only=True).predict(PAIRS)
    best = list(np.argsort(-reference, kind="stable"))

    # The SDK's own httpx client would be left open; one the test closes is passed in.
    with httpx.Client(timeout=60) as http:
        v1 = cohere.Client(api_key="unused", base_url=reranker.url, httpx_client=http)
        response = v1.rerank(query=QUERY, documents=DOCUMENTS, top_n=3, return_documents=True)
        assert [r.index for r in response.results] == best[:3]
        assert [r.document.text for r in response.results if r.document] == [DOCUMENTS[i] for i in best[:3]]
        assert response.results[0].relevance_score == pytest.approx(float(reference[best[0]]), abs=1e-4)
        assert response.meta is not None and response.meta.api_version is not None

        v2 = cohere.ClientV2(api_key="unused", base_url=reranker.url, httpx_client=http)
        response2 = v2.rerank(model="tiny-rerank", query=QUERY, documents=DOCUMENTS)
        assert [r.index for r in response2.results] == best
        np.testing.assert_allclose([r.relevance_score for r in response2.results], reference[best], atol=1e-4)

        # The SDK raises by status: a wrong model name is its NotFoundError.
        with pytest.raises(cohere.NotFoundError):
            v2.rerank(model="rerank-v3.5", query=QUERY, documents=DOCUMENTS)
        with pytest.raises(cohere.BadRequestError):
            v2.rerank(model="tiny-rerank", query=QUERY, documents=[])


def test_the_openai_sdk_embeds_from_a_sentence_transformers_directory(model_dirs: dict[str, Path]) -> None:
    import openai
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(model_dirs["embeddings"]), local_files_only=True).encode(TEXTS)
    with start(model_dirs["embeddings"], "gthread") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        response = client.embeddings.create(model="minilm-embeddings", input=TEXTS)
        client.close()
    got = np.array([item.embedding for item in response.data])
    cosine = (got * reference).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1))
    assert cosine.min() >= 0.999
    assert response.usage.prompt_tokens > len(TEXTS)

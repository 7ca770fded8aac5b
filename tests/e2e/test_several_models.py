"""End to end: an embedder and a cross-encoder in one service, on one port, with the SDKs.

Real gunicorn, both worker classes. Each model answers through the service of
two as it does served alone; discovery lists both; a flood of one model's
requests leaves the other's answered; a model that fails to load stops the
service with its name.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests

from tests.support.server import Server, gunicorn, gunicorn_exit

pytestmark = pytest.mark.e2e

SENTENCES = ["A man is eating food.", "A man is riding a horse.", "The sky is blue."]
QUERY = "What does a man eat?"
DOCUMENTS = ["A man is eating food.", "The sky is blue.", "A man is riding a horse.", "Bread is food."]


# The pair's answers are compared with each model's alone at 1e-5. In bfloat16 (auto's choice
# on a CPU with AMX) a worker's thread count moves the rounding, and the pair runs two workers
# of one thread where each model alone runs one of two (docs/protocols.md).
FLOAT32 = {"SERVE_PRECISION": "float32"}


def pair_spec(model_dirs: dict[str, Path]) -> str:
    return (
        f"embed|text-embedding-3-small={model_dirs['embeddings']},rerank|rerank-v3.5={model_dirs['rerank']}"
    )


@pytest.fixture(scope="module", params=["gthread", "gevent"])
def pair(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Iterator[Server]:
    env = {
        "SERVE_MODEL": pair_spec(model_dirs),
        "SERVE_WORKERS": "2",
        "SERVE_WORKER_CLASS": str(request.param),
        **FLOAT32,
    }
    with gunicorn(env) as server:
        yield server


@pytest.fixture(scope="module")
def alone(model_dirs: dict[str, Path]) -> Iterator[dict[str, Server]]:
    """Each model served by itself, under the same names: what the pair must answer alike."""
    env = {"SERVE_WORKERS": "1", **FLOAT32}
    with (
        gunicorn({**env, "SERVE_MODEL": f"embed={model_dirs['embeddings']}"}) as embed,
        gunicorn({**env, "SERVE_MODEL": f"rerank={model_dirs['rerank']}"}) as rerank,
    ):
        yield {"embed": embed, "rerank": rerank}


def test_the_sdks_get_from_the_pair_what_each_model_gives_alone(
    pair: Server, alone: dict[str, Server]
) -> None:
    import cohere
    import httpx
    import openai

    def embeddings(server: Server, model: str) -> np.ndarray:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
            response = client.embeddings.create(model=model, input=SENTENCES)
            assert response.model == "embed"
            return np.array([d.embedding for d in response.data])

    def ranking(server: Server, model: str) -> tuple[list[int], list[float]]:
        with httpx.Client(timeout=60) as http:
            client = cohere.ClientV2(api_key="unused", base_url=server.url, httpx_client=http)
            results = client.rerank(model=model, query=QUERY, documents=DOCUMENTS).results
            return [r.index for r in results], [r.relevance_score for r in results]

    np.testing.assert_allclose(
        embeddings(pair, "text-embedding-3-small"), embeddings(alone["embed"], "embed"), atol=1e-5
    )
    order, scores = ranking(pair, "rerank-v3.5")
    alone_order, alone_scores = ranking(alone["rerank"], "rerank")
    assert order == alone_order
    np.testing.assert_allclose(scores, alone_scores, atol=1e-5)


def test_discovery_lists_both_and_unknown_names_are_refused(pair: Server) -> None:
    import openai

    with openai.OpenAI(base_url=pair.url + "/v1", api_key="unused") as client:
        assert [m.id for m in client.models.list()] == ["embed", "rerank"]
        with pytest.raises(openai.NotFoundError, match="this service serves"):
            client.embeddings.create(model="text-embedding-ada-002", input="x")
    info = pair.get("/info").json()
    assert [(m["name"], m["model"]["task"]) for m in info["models"]] == [
        ("embed", "embeddings"),
        ("rerank", "rerank"),
    ]
    assert pair.get("/v2/models/rerank/ready").json() == {"name": "rerank", "ready": True}
    assert pair.get("/v2/models/nope/ready").status_code == 404
    metrics = pair.get("/metrics").text
    assert 'serve_inferred_items_total{model="embed"}' in metrics
    assert 'serve_inferred_items_total{model="rerank"}' in metrics


def test_a_flood_of_embeddings_leaves_the_reranks_answered(pair: Server) -> None:
    # 32 clients embed as fast as they can for a few seconds while 4 clients rerank:
    # every rerank is answered (the models take turns on the worker's threads).
    stop = threading.Event()
    texts = [f"{s} ({i})" for i, s in enumerate(SENTENCES * 3)]

    def embed() -> list[int]:
        codes = []
        with requests.Session() as session:
            while not stop.is_set():
                response = session.post(
                    pair.url + "/v1/embeddings", json={"model": "embed", "input": texts}, timeout=60
                )
                codes.append(response.status_code)
        return codes

    def rerank() -> list[int]:
        codes = []
        with requests.Session() as session:
            while not stop.is_set():
                body = {"model": "rerank", "query": QUERY, "documents": DOCUMENTS * 4}
                codes.append(session.post(pair.url + "/v2/rerank", json=body, timeout=60).status_code)
        return codes

    with ThreadPoolExecutor(36) as pool:
        embedders = [pool.submit(embed) for _ in range(32)]
        rerankers = [pool.submit(rerank) for _ in range(4)]
        time.sleep(6)
        stop.set()
        reranks = [code for f in rerankers for code in f.result(120)]
        embeds = [code for f in embedders for code in f.result(120)]
    assert reranks and set(reranks) == {200}, reranks
    assert embeds and set(embeds) == {200}


def test_a_model_that_fails_to_load_stops_the_service_with_its_name(model_dirs: dict[str, Path]) -> None:
    spec = f"embed={model_dirs['embeddings']},broken=tests.support.models:broken_load"
    code, log = gunicorn_exit({"SERVE_MODEL": spec, "SERVE_WORKERS": "1"})
    assert code == 3, log
    assert "model 'broken' failed to load" in log and "injected load failure" in log
    # And one that cannot be named at all is refused before any worker starts.
    code, log = gunicorn_exit({"SERVE_MODEL": "embed=minilm,embed=mlp"}, timeout=30)
    assert code != 0 and "the name 'embed' is given to both" in log


def test_three_models_of_three_kinds_on_one_port(model_dirs: dict[str, Path]) -> None:
    dirs = model_dirs
    spec = f"embed={dirs['embeddings']},rerank={dirs['rerank']},sentiment={dirs['classification']}"
    with gunicorn({"SERVE_MODEL": spec, "SERVE_WORKERS": "1"}) as server:
        listed = server.get("/v1/models").json()["data"]
        assert [(m["id"], m["task"]) for m in listed] == [
            ("embed", "embeddings"),
            ("rerank", "rerank"),
            ("sentiment", "classification"),
        ]
        embedded = server.post("/predict", json={"inputs": ["A man is eating food."]}).json()
        assert embedded["model"] == "embed" and len(embedded["outputs"][0]) == 384
        labelled = server.post("/predict", json={"model": "sentiment", "inputs": ["Great film."]}).json()
        assert labelled["model"] == "sentiment" and {o["label"] for o in labelled["outputs"][0]} == {
            "negative",
            "neutral",
            "positive",
        }
        ranked = server.post("/v2/rerank", json={"query": QUERY, "documents": DOCUMENTS}).json()
        assert sorted(r["index"] for r in ranked["results"]) == [0, 1, 2, 3]
        # Each route keeps to its task: the classifier is not a reranker.
        assert (
            server.post(
                "/v2/rerank", json={"model": "sentiment", "query": "q", "documents": ["d"]}
            ).status_code
            == 404
        )

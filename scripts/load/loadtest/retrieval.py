"""What a retrieval user (``RetrievalUser``) sends: one query to embed, then its candidates to rerank.

A search, or a RAG stack's retrieval, runs two models a question: the query is embedded
(OpenAI's ``POST /v1/embeddings``, one text) to find candidates in a vector index, and a
cross-encoder then reranks them against it (Cohere's ``POST /v2/rerank``). The candidates
here are the ``--documents-per-query`` corpus lines after the query's line: a passage of
real prose beside it, as an index returns neighbours, and never the query itself (unless
a query asks for the whole corpus).

The two models are learnt once per host from ``GET /v1/models``, outside Locust's client
(the probe never shows in the request statistics): the first that serves embeddings and
the first that serves rerank, so a service of several models needs no option to say which.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import requests

from scripts.load.loadtest.workload import WorkloadError
from service.models.base import EMBEDDINGS, RERANK

# A reranker's usual share of a first-stage retrieval: enough candidates to reorder,
# few enough that the query's wait stays interactive.
DEFAULT_DOCUMENTS_PER_QUERY = 16

_MODELS_TIMEOUT_S = 10


@dataclass(frozen=True)
class RetrievalModels:
    """The served names of the service's embedder and reranker."""

    embed: str
    rerank: str


def check_documents_per_query(count: int) -> int:
    """``count``, if a query can have that many candidates."""
    if count < 1:
        raise ValueError(
            f"--documents-per-query (LOCUST_DOCUMENTS_PER_QUERY) must be at least 1 document, got {count}"
        )
    return count


def pick_models(listing: Any, host: str) -> RetrievalModels:
    """The first embedder and the first reranker in ``GET /v1/models``'s answer from ``host``."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        raise WorkloadError(f'GET {host}/v1/models answered without a list of models in its "data"')
    by_task: dict[str, str] = {}
    for entry in data:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            by_task.setdefault(str(entry.get("task")), entry["id"])
    missing = [task for task in (EMBEDDINGS, RERANK) if task not in by_task]
    if missing:
        served = ", ".join(f"{name} ({task})" for task, name in by_task.items()) or "none"
        raise WorkloadError(
            f"the service at {host} serves no {' and no '.join(missing)} model (it serves {served}); "
            "RetrievalUser needs an embedder and a cross-encoder in one service, e.g. "
            "SERVE_MODEL='embed=minilm,rerank=/path/to/cross-encoder'"
        )
    return RetrievalModels(embed=by_task[EMBEDDINGS], rerank=by_task[RERANK])


def query_and_candidates(texts: Sequence[str], count: int, rng: random.Random) -> tuple[str, list[str]]:
    """A random line of ``texts``, and the ``count`` lines after it, wrapping round at the end."""
    start = rng.randrange(len(texts))
    return texts[start], [texts[(start + 1 + i) % len(texts)] for i in range(count)]


def embed_request(model: str, query: str) -> dict[str, Any]:
    """Keyword arguments for ``requests`` (Locust's client) that embed the query."""
    return {"json": {"model": model, "input": [query]}}


def rerank_request(model: str, query: str, documents: Sequence[str]) -> dict[str, Any]:
    """Keyword arguments for ``requests`` that rerank ``documents`` against the query, all ranked."""
    return {"json": {"model": model, "query": query, "documents": list(documents)}}


def rerank_failure(status: int, answer: Any, sent: int) -> str | None:
    """Why a rerank answer to ``sent`` documents failed, where Locust's verdict by status says too little.

    As ``workload.embeddings_failure``: a 200 must rank every document; a 4xx says what was
    wrong in Cohere's error document (``{"message": ...}``); None leaves the verdict to
    Locust (a success, or a 5xx it counts as a failure by its status).
    """
    if status == 200:
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list):
            return '200 without a list of "results"'
        return f"{len(results)} results for {sent} documents" if len(results) != sent else None
    if 400 <= status < 500 and isinstance(answer, dict) and isinstance(answer.get("message"), str):
        return f"{status}: {answer['message']}"
    return None


_cache: dict[str, RetrievalModels] = {}
_lock = threading.Lock()


def models_for(host: str) -> RetrievalModels:
    """The embedder and reranker the service at ``host`` serves, asking its ``/v1/models`` on first use."""
    with _lock:  # the first users start together; one of them asks
        if host not in _cache:
            _cache[host] = pick_models(_listing(host.rstrip("/")), host.rstrip("/"))
        return _cache[host]


def _listing(host: str) -> Any:
    url = host + "/v1/models"
    try:
        response = requests.get(url, timeout=_MODELS_TIMEOUT_S)
        response.raise_for_status()
        return response.json()
    except (requests.RequestException, ValueError) as exc:
        raise WorkloadError(
            f"GET {url} failed ({exc}); is the service running there? Start it with `bash scripts/serve`"
        ) from exc

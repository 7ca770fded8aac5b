"""What the load-test users send: texts from the mixed-length corpus, images as uploads, or sample items.

An image model gets what its clients send most: one JPEG as the raw request body
(``Content-Type: image/jpeg``), or several as ``multipart/form-data``; the image
is decoded and preprocessed in the service's request thread as a real upload is.

An indexing job (``IndexingUser``) sends OpenAI's ``POST /v1/embeddings`` a document at a
time: ``--texts-per-request`` consecutive lines of the corpus, its sentences in order.

The served model is learnt once per host from ``GET /info``, outside Locust's client,
so that the probe never shows in the request statistics.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from service.models.base import sample_item, sample_jpeg

# Real prose, one sentence per line, from a few words to a long paragraph: the
# benchmarks' corpus, so that the dashboard sees the lengths a service sees.
CORPUS = Path(__file__).resolve().parents[2] / "fixtures" / "corpus" / "mixed.txt"

_INFO_TIMEOUT_S = 10
# An indexing job's batch: sentence-transformers' encode() sends the model 32 texts at a time.
DEFAULT_TEXTS_PER_REQUEST = 32


class WorkloadError(RuntimeError):
    """The service could not be asked what it serves, or serves items we cannot make up."""


def read_corpus(path: Path = CORPUS) -> list[str]:
    texts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise WorkloadError(
            f"the corpus {path} holds no text; rebuild it with scripts/fixtures/make_corpus.py"
        )
    return texts


@dataclass(frozen=True)
class Workload:
    """Request bodies for the model described by ``/info``'s ``model`` object."""

    model: dict[str, Any]
    texts: tuple[str, ...]

    def body(self, items: int, rng: random.Random) -> dict[str, Any]:
        """A JSON request body of ``items`` items."""
        if self.model.get("item_kind") == "text":
            return {"inputs": [rng.choice(self.texts) for _ in range(items)]}
        return {"inputs": [sample_item(self.model, rng) for _ in range(items)]}

    def request(self, items: int, rng: random.Random) -> dict[str, Any]:
        """Keyword arguments for ``requests`` (Locust's client) that send ``items`` items."""
        if self.model.get("item_kind") != "image":
            return {"json": self.body(items, rng)}
        if items == 1:
            return {"data": sample_jpeg(rng), "headers": {"Content-Type": "image/jpeg"}}
        return {"files": [("image", (f"{i}.jpg", sample_jpeg(rng), "image/jpeg")) for i in range(items)]}

    def passage(self, count: int, rng: random.Random) -> list[str]:
        """``count`` consecutive lines of the corpus from a random one, wrapping round at its end."""
        start = rng.randrange(len(self.texts))
        return [self.texts[(start + i) % len(self.texts)] for i in range(count)]

    def embeddings_request(self, count: int, rng: random.Random) -> dict[str, Any]:
        """Keyword arguments for ``requests`` that send OpenAI's embeddings API ``count`` texts."""
        return {"json": {"model": self.model.get("name", ""), "input": self.passage(count, rng)}}


def check_texts_per_request(count: int) -> int:
    """``count``, if a request can carry that many texts."""
    if count < 1:
        raise ValueError(
            f"--texts-per-request (LOCUST_TEXTS_PER_REQUEST) must be at least 1 text, got {count}"
        )
    return count


def embeddings_failure(status: int, answer: Any, sent: int) -> str | None:
    """Why an embeddings answer to ``sent`` texts failed, where Locust's verdict by status says too little.

    A 200 must hold an embedding per text. A 4xx says what was wrong in OpenAI's error
    document (a model that serves no embeddings, more texts than the service takes), which
    Locust's "400 Client Error" would hide. None leaves the verdict to Locust: a success,
    or a 5xx (a 503 shed, a 504 timed out), which it counts as a failure by its status.
    """
    if status == 200:
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list):
            return '200 without a list of embeddings in its "data"'
        return f"{len(data)} embeddings for {sent} texts" if len(data) != sent else None
    if 400 <= status < 500 and isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        return f"{status}: {answer['error'].get('message')}"
    return None


_cache: dict[str, Workload] = {}
_lock = threading.Lock()


def workload_for(host: str) -> Workload:
    """The workload for the service at ``host``, asking its ``/info`` on first use."""
    with _lock:  # the first users start together; one of them asks
        if host not in _cache:
            _cache[host] = Workload(model=_served_model(host), texts=tuple(read_corpus()))
        return _cache[host]


def _served_model(host: str) -> dict[str, Any]:
    url = host.rstrip("/") + "/info"
    try:
        response = requests.get(url, timeout=_INFO_TIMEOUT_S)
        response.raise_for_status()
        model: dict[str, Any] = response.json()["model"]
    except (requests.RequestException, ValueError, KeyError) as exc:
        raise WorkloadError(
            f"GET {url} failed ({exc}); is the service running there? Start it with `bash scripts/serve`"
        ) from exc
    if model.get("item_kind") != "text":
        try:
            sample_item(model)
        except ValueError as exc:
            raise WorkloadError(str(exc)) from exc
    return model

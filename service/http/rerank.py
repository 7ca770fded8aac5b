"""Rerank, as Cohere's API speaks it: ``POST /v1/rerank`` and ``POST /v2/rerank``; and its naive twin.

One request of N documents is N (query, document) items to the batcher, so a
rerank request shares batches with every other request the worker serves.
``/v1/rerank`` and ``/v2/rerank`` take the batched path, with Cohere's body,
response and error shape (``{"message"}``), so that the ``cohere`` SDK's
``Client`` and ``ClientV2`` work against the service as they are.
``/rerank/naive`` and ``/rerank/batched`` take the same body and answer the
same document as ``/v2/rerank``, on the naive and the batched path: the
comparison /predict offers, for rerank. Served only when the model's task is
rerank; any other model answers 404 naming its task.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flask import Blueprint, Response, request

from service.errors import ModelError, ServeError, json_type
from service.http.access import REQUEST_ID_ENVIRON_KEY
from service.http.inference import (
    Answer,
    Batched,
    Choose,
    Handler,
    json_answer,
    runtime,
    serve_batched,
    serve_naive,
)
from service.http.payload import check_count, load_json, prepare_items, require_json
from service.model_set import ModelSet
from service.models import Model
from service.models.base import MAX_TEXT_CHARS, RERANK, item_sizer, task_of

bp = Blueprint("rerank", __name__)

COHERE_PATHS = ("/v1/rerank", "/v2/rerank")
NAIVE_PATHS = ("/rerank/naive", "/rerank/batched")
EXAMPLE = '{"query": "text", "documents": ["text", ...], "top_n": 3}'
# Cohere's fields this service has no use for: a value other than these is refused, not ignored.
_UNSUPPORTED = {"max_chunks_per_doc": None, "max_tokens_per_doc": None, "relevant_spans": None}


class NotFound(ServeError):
    status = 404


class BadField(ServeError):
    """A field of the rerank request is wrong; the message names it. 422, as /predict's bad items."""

    status = 422


def error_document(status: int, message: str) -> tuple[int, dict[str, Any]]:
    """Cohere's error status and body; its SDK raises by status. 422 is Cohere's 400 for a bad field."""
    return 400 if status == 422 else status, {"message": message}


@dataclass
class RerankRequest:
    texts: list[str]
    top_n: int
    return_documents: bool
    items: list[Any]


def answer_rerank(
    rt: ModelSet,
    environ: dict[str, Any],
    args: Mapping[str, Any],
    *,
    version: int = 2,
    naive: bool = False,
) -> Answer:
    asked: list[RerankRequest] = []

    def parse(body: bytes, choose: Choose) -> list[Any]:
        if rt.single:  # the task first, as ever: a lone embedder says so before anything else
            check_rerank_model(choose(None))
        require_json(environ.get("CONTENT_TYPE"))
        document = load_json(body, EXAMPLE)
        if not isinstance(document, dict):
            raise BadField(f"the body must be a JSON object such as {EXAMPLE}, got {json_type(document)}")
        # Unnamed, the first cross-encoder served, which need not be the default model.
        name = document.get("model")
        model = choose(rt.first_of(RERANK) if name is None else name)
        check_rerank_model(model)
        asked.append(parse_request(document, model, rt.settings.documents_limit))
        return asked[0].items

    done = serve_naive(rt, environ, parse) if naive else serve_batched(rt, environ, parse)
    rid = environ.get(REQUEST_ID_ENVIRON_KEY) or uuid.uuid4().hex
    return json_answer(render(done, asked[0], version, rid), done.batch_size)


def answer_rerank_v1(rt: ModelSet, environ: dict[str, Any], args: Mapping[str, Any]) -> Answer:
    return answer_rerank(rt, environ, args, version=1)


def answer_rerank_naive(rt: ModelSet, environ: dict[str, Any], args: Mapping[str, Any]) -> Answer:
    return answer_rerank(rt, environ, args, naive=True)


# Answered by service.http.direct in a served app; see service.http.routes.DIRECT.
DIRECT: dict[str, Handler] = {
    "rerank.rerank_v1": answer_rerank_v1,
    "rerank.rerank_v2": answer_rerank,
    "rerank.rerank_naive": answer_rerank_naive,
}


@bp.post("/v1/rerank")
def rerank_v1() -> Response:
    return answer_rerank_v1(runtime(), request.environ, {}).response()


@bp.post("/v2/rerank")
@bp.post("/rerank/batched")
def rerank_v2() -> Response:
    return answer_rerank(runtime(), request.environ, {}).response()


@bp.post("/rerank/naive")
def rerank_naive() -> Response:
    return answer_rerank_naive(runtime(), request.environ, {}).response()


def check_rerank_model(model: Model) -> None:
    task = task_of(model)
    if task != RERANK:
        raise NotFound(
            f"model {model.name!r} serves {task}, not rerank; the rerank routes serve a cross-encoder "
            "(a *ForSequenceClassification directory with one label). POST /predict serves this one"
        )


def parse_request(document: dict[str, Any], model: Model, max_items: int) -> RerankRequest:
    """The checked request, its documents prepared as (query, document) items; BadField names the field."""
    for field, allowed in _UNSUPPORTED.items():
        if document.get(field) is not allowed:
            raise BadField(f'"{field}" is not supported; leave it out')
    rank_fields = document.get("rank_fields")
    if rank_fields is not None and rank_fields != ["text"]:
        raise BadField(f'"rank_fields" may only be ["text"], got {rank_fields!r:.80}')
    query = _query(document.get("query"))
    texts = _documents(document.get("documents"), max_items)
    check_count(len(texts), max_items, "documents", "SERVE_MAX_DOCUMENTS_PER_REQUEST")
    top_n = _top_n(document.get("top_n"), len(texts))
    return_documents = document.get("return_documents", False)
    if not isinstance(return_documents, bool):
        raise BadField(f'"return_documents" must be true or false, got {json_type(return_documents)}')
    items = prepare_items([[query, text] for text in texts], model, max_items, "documents")
    return RerankRequest(texts, top_n, return_documents, items)


def _query(query: Any) -> str:
    if not isinstance(query, str):
        raise BadField(f'"query" must be a string, got {json_type(query)}')
    if not query.strip():
        raise BadField('"query" is empty; send the text to rank the documents against')
    if len(query) > MAX_TEXT_CHARS:
        raise BadField(f'"query" is {len(query)} characters; the limit is {MAX_TEXT_CHARS}')
    return query


def _documents(documents: Any, max_items: int) -> list[str]:
    if not isinstance(documents, list):
        raise BadField(
            f'"documents" must be a list of strings or {{"text": string}} objects, got {json_type(documents)}'
        )
    if not documents:
        raise BadField('"documents" is empty; send at least one document')
    texts = []
    for index, entry in enumerate(documents):
        text = entry.get("text") if isinstance(entry, dict) else entry
        if not isinstance(text, str):
            shown = 'an object without a "text" string' if isinstance(entry, dict) else json_type(entry)
            raise BadField(f'documents[{index}] must be a string or {{"text": string}}, got {shown}')
        texts.append(text)
    return texts


def _top_n(top_n: Any, documents: int) -> int:
    """How many results to return: all by default; more than there are documents returns them all."""
    if top_n is None:
        return documents
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise BadField(f'"top_n" must be a whole number of at least 1, got {top_n!r:.40}')
    return min(top_n, documents)


def render(done: Batched, asked: RerankRequest, version: int, request_id: str) -> dict[str, Any]:
    try:
        scores = np.asarray(done.outputs, dtype=np.float64).reshape(len(asked.texts))
    except (TypeError, ValueError) as exc:
        raise ModelError(
            f"model {done.model.name!r} returned outputs that are not one score per document"
        ) from exc
    # Stable: documents of equal score keep their order.
    order = np.argsort(-scores, kind="stable")[: asked.top_n]
    results = []
    for index in order.tolist():
        result: dict[str, Any] = {"index": index, "relevance_score": float(scores[index])}
        if asked.return_documents:
            result["document"] = {"text": asked.texts[index]}
        results.append(result)
    size = item_sizer(done.model)
    tokens = sum(size(item) for item in asked.items) if size is not None else 0
    return {
        "id": request_id,
        "results": results,
        "meta": {"api_version": {"version": str(version)}, "tokens": {"input_tokens": tokens}},
    }

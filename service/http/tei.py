"""Text Embeddings Inference's API: ``POST /embed``, ``/rerank``, ``/tokenize``, and ``POST /`` by task.

So that TEI's clients work against the service as they are: huggingface_hub's
``InferenceClient(base_url=<the service>)`` (``feature_extraction`` and
``text_classification`` POST to the root), LlamaIndex's
``TextEmbeddingsInference`` and Chroma's ``HuggingFaceEmbeddingServer``
(``/embed``), Haystack's TEI embedders (through InferenceClient) and ranker
(``/rerank``). ``/embed``, ``/rerank`` and ``/`` take the batched path
(service.http.inference): their requests share batches, limits, deadlines and
admission with every other protocol's. ``/tokenize`` runs the model's
tokenizer in the request thread, as every route's ``prepare`` does, its body
bounded and its deadline kept as the batched routes' are. Bodies are
read and answers written by service.http.tei_codec; ``/info`` carries TEI's
keys beside the service's own (``info``).

Which model: the one ``?model=`` names; else the default model (the first
SERVE_MODEL lists), but for ``/rerank`` the first cross-encoder served, as
Cohere's ``/v1/rerank`` picks it (Haystack's ranker cannot add a query to its
URL). ``POST /`` answers as TEI does for that model's task: ``/embed`` for an
embedder, ``/rerank`` for a cross-encoder, TEI's classify for a classifier.

Errors take TEI's shape, ``{"error": message, "error_type": kind}``
(service.http.tei_codec.error_document, by the error's class). The statuses
are TEI's for a bad field (422) and an empty batch (400), and the service's
where they differ: 503 with ``Retry-After`` for an overloaded or
loading worker (TEI: 429 and 503), 413 for too many inputs or too large a body
(TEI: 422 and 413), 404 for a model the route does not serve (TEI: 424), 415
for a body that is not JSON, 504 past the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from flask import Blueprint, Response, request

from service import __version__
from service.errors import DeadlineExceeded, InvalidInput
from service.http.inference import (
    Answer,
    Choose,
    Handler,
    json_answer,
    json_response,
    query_model,
    runtime,
    serve_batched,
    serve_in_thread,
)
from service.http.payload import check_count, prepare_items
from service.http.tei_codec import (
    Classify,
    Embed,
    NotServed,
    Rerank,
    document_of,
    parse_classify,
    parse_embed,
    parse_rerank,
    parse_tokenize,
    render_classify,
    render_rerank,
    tei_pooling,
)
from service.http.vectors import as_vectors, check_dimensions, embedding_size, embeds_text, shorten
from service.model_set import ModelSet
from service.models import Model
from service.models.base import (
    CLASSIFICATION,
    EMBEDDINGS,
    GENERIC,
    RERANK,
    cuts_on,
    task_of,
    token_pieces,
    truncating,
)
from service.models.prompts import prompt_text, with_prompt

bp = Blueprint("tei", __name__)

_INPUTS = '{"inputs": ["text", ...]}'
_QUERY_AND_TEXTS = '{"query": "text", "texts": ["text", ...]}'
# The route that serves a model of each task, for the 404 of a route that does not.
_SERVED_AT = {EMBEDDINGS: "POST /embed", RERANK: "POST /rerank", CLASSIFICATION: "POST /"}


# -- the batched routes ----------------------------------------------------------


def answer_embed(rt: ModelSet, environ: dict[str, Any], args: Mapping[str, Any]) -> Answer:
    return _embed(rt, environ, query_model(environ))


def answer_rerank(rt: ModelSet, environ: dict[str, Any], args: Mapping[str, Any]) -> Answer:
    named = query_model(environ)
    return _rerank(rt, environ, named if named is not None else rt.first_of(RERANK))


def answer_root(rt: ModelSet, environ: dict[str, Any], args: Mapping[str, Any]) -> Answer:
    """TEI's route for the task of the model ``?model=`` names (else the default's)."""
    name = query_model(environ)
    rt.require_ready()
    task = task_of(rt.pick(name).require_ready()[0])
    if task == RERANK:
        return _rerank(rt, environ, name)
    if task == CLASSIFICATION:
        return _classify(rt, environ, name)
    return _embed(rt, environ, name)


# Answered by service.http.direct in a served app; see service.http.routes.DIRECT.
DIRECT: dict[str, Handler] = {"tei.embed": answer_embed, "tei.rerank": answer_rerank, "tei.root": answer_root}


@bp.post("/embed")
def embed() -> Response:
    return answer_embed(runtime(), request.environ, {}).response()


@bp.post("/rerank")
def rerank() -> Response:
    return answer_rerank(runtime(), request.environ, {}).response()


@bp.post("/")
def root() -> Response:
    return answer_root(runtime(), request.environ, {}).response()


def _embed(rt: ModelSet, environ: dict[str, Any], name: str | None) -> Answer:
    asked: list[tuple[Embed, int | None]] = []

    def parse(body: bytes, choose: Choose) -> list[Any]:
        if rt.single:  # the task first, as every route does: a lone reranker says so before anything else
            _check_embedder(choose(None))
        document = document_of(body, environ.get("CONTENT_TYPE"), _INPUTS)
        model = choose(name)
        _check_embedder(model)
        embed = parse_embed(document)
        _check_side(model, embed.side)
        try:
            dimensions = check_dimensions(embed.dimensions, embedding_size(model), model.name)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        asked.append((embed, dimensions))
        texts = with_prompt(model, embed.texts, embed.prompt_name)
        with truncating(embed.side):
            return prepare_items(texts, model, rt.settings.max_items_per_request)

    done = serve_batched(rt, environ, parse)
    embed, dimensions = asked[0]
    try:
        vectors = shorten(as_vectors(done.model, done.outputs), dimensions, normalize=embed.normalize)
    except ValueError as exc:  # a model that declares no size, found out by its vectors
        raise InvalidInput(str(exc)) from None
    return json_answer(vectors, done.batch_size)


def _rerank(rt: ModelSet, environ: dict[str, Any], name: str | None) -> Answer:
    asked: list[Rerank] = []

    def parse(body: bytes, choose: Choose) -> list[Any]:
        if rt.single:
            _check_task(choose(None), RERANK)
        document = document_of(body, environ.get("CONTENT_TYPE"), _QUERY_AND_TEXTS)
        model = choose(name)
        _check_task(model, RERANK)
        rerank = parse_rerank(document)
        _check_side(model, rerank.side)
        asked.append(rerank)
        limit = rt.settings.documents_limit
        check_count(len(rerank.texts), limit, "texts", "SERVE_MAX_DOCUMENTS_PER_REQUEST")
        with truncating(rerank.side):
            return prepare_items([[rerank.query, text] for text in rerank.texts], model, limit, "texts")

    done = serve_batched(rt, environ, parse)
    return json_answer(render_rerank(done.outputs, asked[0], done.model.name), done.batch_size)


def _classify(rt: ModelSet, environ: dict[str, Any], name: str | None) -> Answer:
    asked: list[Classify] = []

    def parse(body: bytes, choose: Choose) -> list[Any]:
        document = document_of(body, environ.get("CONTENT_TYPE"), '{"inputs": "text"}')
        model = choose(name)
        _check_task(model, CLASSIFICATION)
        classify = parse_classify(document)
        _check_side(model, classify.side)
        asked.append(classify)
        with truncating(classify.side):
            return prepare_items(classify.texts, model, rt.settings.max_items_per_request)

    done = serve_batched(rt, environ, parse)
    return json_answer(render_classify(done.outputs, asked[0], done.model.name), done.batch_size)


def _check_embedder(model: Model) -> None:
    if not embeds_text(model):
        task = task_of(model)
        served = _SERVED_AT.get(task, "POST /predict")
        kind = task if task != GENERIC else f"{model.item_kind} items"
        raise NotServed(
            f"model {model.name!r} serves {kind}, not text embeddings; POST /embed serves a "
            "sentence-transformers directory or another model that takes text and returns vectors. "
            f"{served} serves this one"
        )


def _check_task(model: Model, task: str) -> None:
    served = task_of(model)
    if served != task:
        what = "a cross-encoder" if task == RERANK else "a sequence classifier"
        raise NotServed(
            f"model {model.name!r} serves {served}, not {task}; this route serves {what}. "
            f"{_SERVED_AT.get(served, 'POST /predict')} serves this one"
        )


def _check_side(model: Model, side: str | None) -> None:
    """Refuse a ``truncation_direction`` the model would not honour, rather than cut the other side."""
    if side is not None and not cuts_on(model, side):
        raise InvalidInput(
            f'"truncation_direction" "{side.capitalize()}": model {model.name!r} cannot cut texts on the '
            f"{side}; only a model that tokenizes with a fast tokenizer through the service (a Hugging "
            'Face directory) can. Leave "truncation_direction" out'
        )


# -- /tokenize ----------------------------------------------------------------


@bp.post("/tokenize")
def tokenize() -> Response:
    """Each text's tokens, as the model's tokenizer makes them: its prompt included, as TEI does, and cut
    at the model's limit on its tokenizer's side."""
    models = runtime()
    models.require_ready()
    model = models.pick(query_model(request.environ)).require_ready()[0]
    pieces = token_pieces(model)
    if pieces is None:
        raise NotServed(
            f"model {model.name!r} has no tokenizer; POST /tokenize serves the models that tokenize text"
        )
    limit = models.settings.max_items_per_request

    def answer(body: bytes, until: float) -> list[Any]:
        asked = parse_tokenize(document_of(body, request.environ.get("CONTENT_TYPE"), _INPUTS))
        check_count(len(asked.texts), limit)
        prompt = prompt_text(model, asked.prompt_name)
        tokens = []
        for index, text in enumerate(asked.texts):
            if time.monotonic() > until:
                done = f"{index} of its {len(asked.texts)} texts"
                raise DeadlineExceeded(f"the request's deadline passed after {done} were tokenized")
            try:
                tokens.append(pieces(text, asked.add_special_tokens, prompt))
            except ValueError as exc:
                raise InvalidInput(f"inputs[{index}]: {exc}") from None
        return tokens

    return json_response(serve_in_thread(models, request.environ, answer))


# -- /info ----------------------------------------------------------------------


def info(models: ModelSet, name: str | None) -> dict[str, Any]:
    """TEI's ``/info`` keys, for the model ``name`` picks (None: the default), beside the service's own."""
    rt = models.pick(name)
    model, settings = rt.model, models.settings
    task = task_of(model) if model is not None else None
    return {
        "model_id": rt.label,
        "model_sha": None,
        "model_dtype": rt.precision.precision if rt.precision is not None else None,
        "model_type": _model_type(model) if model is not None else None,
        # Not TEI's count of requests: the items one worker holds queued at most (SERVE_MAX_QUEUE),
        # past which it answers 503. The service's nearest bound on what it takes in at once.
        "max_concurrent_requests": settings.queue_limit,
        "max_input_length": getattr(model, "max_input_length", None),
        "max_batch_tokens": settings.max_batch_tokens,
        "max_batch_requests": settings.max_batch_size,
        "max_client_batch_size": settings.documents_limit
        if task == RERANK
        else settings.max_items_per_request,
        # Texts past the model's limit are always cut (service.http.tei_codec).
        "auto_truncate": True,
        "tokenization_workers": None,
        "version": __version__,
        "sha": None,
        "docker_label": None,
    }


def _model_type(model: Model) -> dict[str, Any] | None:
    """TEI's ``model_type``: which of its routes ``POST /`` is for the model, with what TEI tells of it."""
    task = task_of(model)
    if task in (RERANK, CLASSIFICATION):
        labels = list(getattr(model, "labels", None) or [])
        described = {
            "id2label": {str(index): label for index, label in enumerate(labels)},
            "label2id": {label: index for index, label in enumerate(labels)},
        }
        return {"reranker" if task == RERANK else "classifier": described}
    if embeds_text(model):
        return {"embedding": {"pooling": tei_pooling(getattr(model, "pooling", None))}}
    return None

"""OpenAI's embeddings API: ``POST /v1/embeddings`` and ``GET /v1/models``.

Served for models whose items are text and whose outputs are vectors, so that
the openai SDK, and the RAG stacks built on it, can embed through the batched
path (service.http.inference). Any other model answers 404 saying why.

Errors take OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
with the statuses the SDK maps to its exceptions: 400 BadRequestError (the
/predict route's 413, 415 and 422 are 400 here), 401 AuthenticationError, 404
NotFoundError, and 5xx InternalServerError, which the SDK retries.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
from flask import Blueprint, Flask, Response, current_app, request

from service.errors import InvalidInput, ServeError, json_type
from service.http.inference import Answer, Choose, Handler, json_answer, json_response, runtime, serve_batched
from service.http.payload import is_token_ids, load_json, prepare_items, require_json
from service.http.vectors import as_vectors, check_dimensions, embedding_size, embeds_text, shorten
from service.model_set import ModelSet, UnknownModel
from service.models import Model
from service.models.base import GENERIC, RERANK, item_sizer, task_of
from service.models.prompts import prompts_of, with_prompt
from service.runtime import ModelRuntime

bp = Blueprint("openai", __name__, url_prefix="/v1")

OWNER = "torch-serve-batched"
ENCODINGS = ("float", "base64")
_CREATED = "openai_created"
_TOKENS_HINT = (
    "; token arrays are not supported, send the text (LangChain's OpenAIEmbeddings sends token ids "
    "unless made with check_embedding_ctx_length=False)"
)
# Statuses the SDK has no exception class for, and what OpenAI answers instead.
_STATUS = {413: 400, 415: 400, 422: 400}


class OpenAIError(ServeError):
    """An error about one field of the request, which OpenAI's shape names in ``param``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


def init_app(app: Flask) -> None:
    app.register_blueprint(bp)
    # "created" in /v1/models: when this worker started serving.
    app.extensions[_CREATED] = int(time.time())


def error_document(status: int, message: str, exc: BaseException | None = None) -> tuple[int, dict[str, Any]]:
    status = _STATUS.get(status, status)
    kind = "invalid_request_error" if status < 500 else "server_error"
    param, code = (exc.param, exc.code) if isinstance(exc, OpenAIError) else (None, None)
    if status == 401:
        code = "invalid_api_key"
    error = {"message": message, "type": kind, "param": param, "code": code}
    return status, {"error": error}


@bp.get("/models")
def list_models() -> Response:
    """Every model served, the default first, each by its served name; ``task`` says which API serves it."""
    models = runtime()
    models.require_ready()
    return json_response({"object": "list", "data": [_describe(rt) for rt in models.runtimes]})


@bp.get("/models/<name>")
def get_model(name: str) -> Response:
    models = runtime()
    models.require_ready()
    return json_response(_describe(_chosen(models.pick, name)))


def answer_embeddings(rt: ModelSet, environ: dict[str, Any], args: Mapping[str, Any]) -> Answer:
    asked: dict[str, Any] = {}

    def parse(body: bytes, choose: Choose) -> list[object]:
        if rt.single:  # the task first, as ever: a lone reranker says so before anything else
            _check_embedding_model(choose(None))
        require_json(environ.get("CONTENT_TYPE"))
        document = load_json(body, '{"input": "text", "model": "' + rt.default.label + '"}')
        if not isinstance(document, dict):
            raise OpenAIError(400, f"the body must be a JSON object, got {json_type(document)}")
        name = document.get("model")
        if not isinstance(name, str):
            raise OpenAIError(400, f'"model" must name the model; {rt.served()}', param="model")
        model = _chosen(choose, name)
        _check_embedding_model(model)
        asked.update(_check_request(document, model))
        texts = _with_prompt(model, asked["texts"], document.get("prompt_name"))
        asked["items"] = prepare_items(texts, model, rt.settings.max_items_per_request, "input")
        return asked["items"]  # type: ignore[no-any-return]

    done = serve_batched(rt, environ, parse)
    vectors = _shortened(as_vectors(done.model, done.outputs), asked["dimensions"])
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(vector, asked["encoding_format"])}
        for i, vector in enumerate(vectors)
    ]
    tokens = _count_tokens(done.model, asked["items"])
    document = {
        "object": "list",
        "data": data,
        "model": done.model.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return json_answer(document, done.batch_size)


# Answered by service.http.direct in a served app; see service.http.routes.DIRECT.
DIRECT: dict[str, Handler] = {"openai.embeddings": answer_embeddings}


@bp.post("/embeddings")
def embeddings() -> Response:
    return answer_embeddings(runtime(), request.environ, {}).response()


def _with_prompt(model: Model, texts: list[str], prompt_name: Any) -> list[Any]:
    """The texts with the prompt ``prompt_name`` names (the openai SDK sends it in ``extra_body``)."""
    try:
        return with_prompt(model, texts, prompt_name)
    except InvalidInput as exc:
        raise OpenAIError(400, exc.message, param="prompt_name") from None


def _check_request(document: dict[str, Any], model: Model) -> dict[str, Any]:
    try:
        dimensions = check_dimensions(document.get("dimensions"), embedding_size(model), model.name)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="dimensions") from None
    encoding = document.get("encoding_format", "float")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise OpenAIError(
            400,
            f'"encoding_format" must be "float" or "base64", got {encoding!r:.40}',
            param="encoding_format",
        )
    return {"texts": _texts(document.get("input")), "encoding_format": encoding, "dimensions": dimensions}


def _shortened(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The vectors cut to ``dimensions`` and scaled back to unit length, as text-embedding-3's are."""
    if dimensions is None:
        return vectors
    try:
        return shorten(vectors, dimensions, normalize=True)
    except ValueError as exc:  # a model that declares no size, found out by its vectors
        raise OpenAIError(400, str(exc), param="dimensions") from None


def _texts(given: Any) -> list[str]:
    texts = [given] if isinstance(given, str) else given
    if not isinstance(texts, list):
        raise OpenAIError(
            400, f'"input" must be a string or a list of strings, got {json_type(given)}', param="input"
        )
    if not texts:
        raise OpenAIError(400, '"input" is empty; send at least one text', param="input")
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            # LangChain's OpenAIEmbeddings sends tiktoken's token ids for OpenAI's models unless told not to.
            hint = _TOKENS_HINT if is_token_ids(text) else ""
            raise OpenAIError(
                400, f"input[{index}]: expected a string, got {json_type(text)}{hint}", param="input"
            )
        if not text:
            raise OpenAIError(400, f"input[{index}] is an empty string; send some text", param="input")
    return texts


T = TypeVar("T")


def _chosen(choose: Callable[[str], T], name: str) -> T:
    """``choose(name)``, an unknown name answered in OpenAI's own words (the SDK's NotFoundError)."""
    try:
        return choose(name)
    except UnknownModel as exc:
        message = f"The model {exc.name!r} does not exist; {exc.served}"
        raise OpenAIError(404, message, param="model", code="model_not_found") from None


def _check_embedding_model(model: Model) -> None:
    if not embeds_text(model):
        task = task_of(model)
        kind = task if task != GENERIC else f"{model.item_kind} items"
        raise OpenAIError(
            404,
            f"model {model.name!r} serves {kind}, not embeddings; the embeddings API serves a "
            "sentence-transformers directory or another model that takes text and returns vectors. "
            f"{'POST /v1/rerank' if task == RERANK else 'POST /predict'} serves this one",
            code="model_not_found",
        )


def _describe(rt: ModelRuntime) -> dict[str, Any]:
    model = rt.model
    described = {
        "id": rt.label,
        "object": "model",
        "created": current_app.extensions[_CREATED],
        "owned_by": OWNER,
        # Beyond OpenAI's fields: which API serves it, and the other names it answers to.
        "task": task_of(model) if model is not None else None,
        "aliases": list(rt.names[1:]),
    }
    prompts = prompts_of(model) if model is not None else None
    if prompts is not None:  # a sentence-transformers directory's, which "prompt_name" chooses
        described.update(prompts.describe())
    return described


def _encode(vector: np.ndarray, encoding: str) -> Any:
    if encoding == "base64":
        # What the SDK decodes: little-endian float32, base64.
        return base64.b64encode(vector.tobytes()).decode("ascii")
    return vector


def _count_tokens(model: Model, items: list[Any]) -> int:
    """Tokens the model read: a text model's item size is its token count after truncation
    (service.models.base.SizedModel); 0 for a model that does not report sizes."""
    size = item_sizer(model)
    return sum(size(item) for item in items) if size is not None else 0

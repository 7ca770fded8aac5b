"""Text Embeddings Inference's request bodies, answers and errors. Pure: no Flask, no model.

The fields are TEI's (its router's ``EmbedRequest``, ``RerankRequest``,
``PredictRequest`` and ``TokenizeRequest``), with TEI's defaults; a field TEI
does not know is ignored, as TEI's router ignores it. A field of the wrong type
or value is an InvalidInput naming it (422 ``Validation``, TEI's status), an
empty batch an ``Empty`` (400): the service's own error classes, which keep
their status when service.http.payload.prepare_items names an item in them,
and which ``error_document`` maps to TEI's ``error_type``. The choices that
differ from TEI are the service's:

- Texts past the model's token limit are always cut at it, as TEI's default
  (``--auto-truncate``) cuts them and as every other route of the service
  does; ``truncate: false`` does not make them an error.
  ``truncation_direction`` chooses the side.
- Token ids in place of texts are refused (422): the models here tokenize texts.
- ``raw_scores: true`` is refused (422): the service returns each model's
  scores after its activation (CrossEncoder's; a classifier's softmax).
- A classifier answers a list of labels per text even for one text (TEI
  answers a bare list there): the nesting huggingface_hub's
  ``text_classification`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from service.errors import BadRequest, InvalidInput, ModelError, NotReady, Overloaded, ServeError, json_type
from service.http.payload import is_token_ids, load_json, require_json

# TEI's routes: their errors take TEI's shape (service.http.shapes), and SERVE_API_TOKEN guards them.
PATHS = ("/", "/embed", "/rerank", "/tokenize")
# TEI's error types (its router's ErrorType): what its clients read beside the status.
VALIDATION, EMPTY, OVERLOADED, UNHEALTHY, BACKEND = (
    "Validation",
    "Empty",
    "Overloaded",
    "Unhealthy",
    "Backend",
)
SIDES = ("left", "right")
# sentence-transformers' pooling modes under TEI's names, where TEI names them otherwise.
_TEI_POOLING = {"lasttoken": "last_token"}
_IDS_REFUSED = "; token ids are not supported, send the text"


class Empty(BadRequest):
    """A request of no texts: 400, TEI's ``Empty``."""


class NotServed(ServeError):
    """The route does not serve the model's task (or the model has no tokenizer): 404, TEI's ``Backend``."""

    status = 404


def error_document(status: int, message: str, exc: BaseException | None = None) -> tuple[int, dict[str, Any]]:
    """TEI's error body, ``{"error", "error_type"}``, at the service's status; the type by ``exc``'s class."""
    if isinstance(exc, Empty):
        kind = EMPTY
    elif isinstance(exc, NotReady):
        kind = UNHEALTHY
    elif isinstance(exc, Overloaded) or status == 503:
        kind = OVERLOADED
    elif isinstance(exc, NotServed) or status >= 500:
        kind = BACKEND
    else:  # a bad field or body (400, 413, 415, 422), an unknown model (404), no token (401)
        kind = VALIDATION
    return status, {"error": message, "error_type": kind}


def tei_pooling(mode: str | None) -> str | None:
    """A pooling mode as TEI's ``/info`` names it ("last_token" for sentence-transformers' "lasttoken")."""
    return _TEI_POOLING.get(mode, mode) if mode is not None else None


@dataclass(frozen=True)
class Embed:
    texts: list[str]
    normalize: bool
    # As sent: the model's size checks them (service.http.vectors, service.models.prompts).
    dimensions: Any
    prompt_name: Any
    # "left" or "right"; None for the tokenizer's own side.
    side: str | None


@dataclass(frozen=True)
class Rerank:
    query: str
    texts: list[str]
    return_text: bool
    side: str | None


@dataclass(frozen=True)
class Classify:
    texts: list[str]
    # Labels kept per text, best first (huggingface_hub's "top_k" parameter); None: all.
    top_k: int | None
    side: str | None


@dataclass(frozen=True)
class Tokenize:
    texts: list[str]
    add_special_tokens: bool
    prompt_name: Any


def document_of(body: bytes, content_type: str | None, example: str) -> dict[str, Any]:
    """The request's JSON object; 415 unless it is JSON, 400 unless it parses, 422 unless an object."""
    require_json(content_type)
    document = load_json(body, example)
    if not isinstance(document, dict):
        raise InvalidInput(f"the body must be a JSON object such as {example}, got {json_type(document)}")
    return document


def parse_embed(document: dict[str, Any]) -> Embed:
    return Embed(
        texts=_texts(document.get("inputs")),
        normalize=_flag(document, "normalize", True),
        dimensions=document.get("dimensions"),
        prompt_name=document.get("prompt_name"),
        side=_truncation(document),
    )


def parse_rerank(document: dict[str, Any]) -> Rerank:
    query = document.get("query")
    if not isinstance(query, str):
        raise InvalidInput(f'"query" must be a string, got {json_type(query)}')
    _refuse_raw_scores(document)
    return Rerank(
        query=query,
        texts=_texts(document.get("texts"), "texts"),
        return_text=_flag(document, "return_text", False),
        side=_truncation(document),
    )


def parse_classify(document: dict[str, Any]) -> Classify:
    """A classify body: ``inputs`` a text or a batch ``[["text"], ...]``; huggingface_hub's ``parameters``."""
    _refuse_raw_scores(document)
    parameters = document.get("parameters")
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict):
        raise InvalidInput(f'"parameters" must be an object, got {json_type(parameters)}')
    if parameters.get("function_to_apply") is not None:
        raise InvalidInput(
            '"function_to_apply" is not supported: the scores are the model\'s own (a softmax over its '
            "labels, a sigmoid for each where it is multi-label); leave it out"
        )
    top_k = parameters.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise InvalidInput(f'"top_k" must be a whole number of at least 1, got {top_k!r:.40}')
    return Classify(texts=_classify_texts(document.get("inputs")), top_k=top_k, side=_truncation(document))


def parse_tokenize(document: dict[str, Any]) -> Tokenize:
    return Tokenize(
        texts=_texts(document.get("inputs")),
        add_special_tokens=_flag(document, "add_special_tokens", True),
        prompt_name=document.get("prompt_name"),
    )


def render_rerank(outputs: Any, asked: Rerank, model_name: str) -> list[dict[str, Any]]:
    """``[{"index", "text"?, "score"}]``, best first; texts of equal score keep their order."""
    try:
        scores = np.asarray(outputs, dtype=np.float64).reshape(len(asked.texts))
    except (TypeError, ValueError) as exc:
        raise ModelError(f"model {model_name!r} returned outputs that are not one score per text") from exc
    ranks = []
    for index in np.argsort(-scores, kind="stable").tolist():
        rank: dict[str, Any] = {"index": index}
        if asked.return_text:
            rank["text"] = asked.texts[index]
        rank["score"] = float(scores[index])
        ranks.append(rank)
    return ranks


def render_classify(outputs: Any, asked: Classify, model_name: str) -> list[Any]:
    """Each text's ``[{"label", "score"}, ...]``, best first, cut to ``top_k``."""
    if not all(isinstance(labels, list) for labels in outputs):
        raise ModelError(f"model {model_name!r} returned outputs that are not lists of labels")
    return [labels[: asked.top_k] for labels in outputs]


def _texts(value: Any, field: str = "inputs") -> list[str]:
    if isinstance(value, str):
        return [value]
    if value is None:
        raise InvalidInput(
            f'"{field}" is missing; send {{"{field}": "text"}} or {{"{field}": ["text", ...]}}'
        )
    if not isinstance(value, list):
        raise InvalidInput(f'"{field}" must be a string or a list of strings, got {json_type(value)}')
    if not value:
        raise Empty(f'"{field}" is empty; send at least one text')
    for index, text in enumerate(value):
        if not isinstance(text, str):
            hint = _IDS_REFUSED if is_token_ids(text) else ""
            raise InvalidInput(f"{field}[{index}] must be a string, got {json_type(text)}{hint}")
    return value


def _classify_texts(value: Any) -> list[str]:
    """TEI's classify inputs: a text, a pair ``[a, b]`` or a batch ``[[a], [a, b], ...]``; pairs refused."""
    if isinstance(value, list) and value and all(isinstance(entry, list) for entry in value):
        texts = []
        for index, entry in enumerate(value):
            if len(entry) != 1 or not isinstance(entry[0], str):
                raise InvalidInput(
                    f'inputs[{index}] must be ["text"]: a batch is [["text"], ["text"], ...], and pairs of '
                    "texts are for a cross-encoder (POST /rerank)"
                )
            texts.append(entry[0])
        return texts
    if isinstance(value, list) and len(value) > 1 and all(isinstance(entry, str) for entry in value):
        raise InvalidInput(
            '"inputs": a list of strings is one pair of texts in TEI\'s API, which a classifier here does '
            'not take; send "text", or [["text"], ["text"], ...] for several'
        )
    return _texts(value)


def _flag(document: dict[str, Any], field: str, default: bool) -> bool:
    value = document.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidInput(f'"{field}" must be true or false, got {json_type(value)}')
    return value


def _truncation(document: dict[str, Any]) -> str | None:
    """The side ``truncation_direction`` asks to cut ("Right" or "Left"; huggingface_hub's are lower case).

    ``truncate`` is checked, but texts past the model's limit are cut whatever it says (see above).
    """
    _flag(document, "truncate", True)
    value = document.get("truncation_direction")
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in SIDES:
        return value.lower()
    shown = repr(value)[:40] if isinstance(value, str) else json_type(value)
    raise InvalidInput(f'"truncation_direction" must be "Right" or "Left", got {shown}')


def _refuse_raw_scores(document: dict[str, Any]) -> None:
    if _flag(document, "raw_scores", False):
        raise InvalidInput(
            '"raw_scores": true is not supported: the scores are the model\'s after its activation, '
            "as sentence-transformers' CrossEncoder.predict gives them; leave it false"
        )

"""Request bodies to model items, and results to response bodies. Pure: no Flask.

Sizes are bounded before parsing (``service.http.inference.read_body`` refuses
an oversized body as it streams in), and every item passes ``model.prepare`` before
the request may reach a batch. A model whose items are images (``item_kind``
"image") also takes a raw body of one image (``image/jpeg``, ``image/png``,
``image/webp``) and ``multipart/form-data``, one image a part
(service.http.multipart); its ``prepare`` decodes the files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from service.errors import (
    BadRequest,
    InvalidInput,
    PayloadTooLarge,
    ServeError,
    UnsupportedMediaType,
    json_type,
)
from service.http.multipart import MULTIPART, parse_parts
from service.models.base import Model, Outputs

JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY
IMAGE_ITEM_KIND = "image"
# The media types of a raw body holding one image; the model decides which formats it decodes.
IMAGE_TYPES = ("image/jpeg", "image/png", "image/webp")


def parse_inputs(
    body: bytes,
    content_type: str | None,
    choose: Callable[[Any], Model],
    max_items: int,
    query_model: str | None = None,
) -> list[Any]:
    """The prepared items of a ``{"inputs": [...], "model": name}`` body; a ServeError names any problem.

    ``choose`` gives the model a name picks (None: the default). The name is the
    body's ``model`` field, else ``query_model`` (the URL's ``?model=``, which is
    how a raw image body names its model).
    """
    mimetype = media_type(content_type)
    if mimetype in IMAGE_TYPES or mimetype == MULTIPART:
        model = choose(query_model)
        if model.item_kind == IMAGE_ITEM_KIND:
            if mimetype == MULTIPART:
                return prepare_items(parse_parts(body, content_type or "", max_items), model, max_items)
            if not body:
                raise InvalidInput(f"the request body is empty; send the {mimetype} file's bytes")
            return prepare_items([body], model, max_items)
    elif mimetype != "application/json" and choose(query_model).item_kind == IMAGE_ITEM_KIND:
        raise UnsupportedMediaType(
            f"Content-Type must be {', '.join(IMAGE_TYPES)} (one image), {MULTIPART} (images) "
            f"or application/json (base64 images), got {mimetype or 'none'}"
        )
    require_json(content_type)
    document = load_json(body, '{"inputs": [item, ...]}')
    if not isinstance(document, dict):
        raise InvalidInput(f'the body must be a JSON object with an "inputs" list, got {json_type(document)}')
    model = choose(document.get("model", query_model))
    if "inputs" not in document:
        raise InvalidInput('the body has no "inputs" field; send {"inputs": [item, ...]}')
    inputs = document["inputs"]
    if not isinstance(inputs, list):
        raise InvalidInput(f'"inputs" must be a list, got {json_type(inputs)}')
    return prepare_items(inputs, model, max_items)


def media_type(content_type: str | None) -> str:
    """The media type of a Content-Type header, without its parameters, in lower case."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def require_json(content_type: str | None) -> None:
    mimetype = media_type(content_type)
    if mimetype != "application/json":
        raise UnsupportedMediaType(f"Content-Type must be application/json, got {mimetype or 'none'}")


def load_json(body: bytes | memoryview, example: str) -> Any:
    """The parsed JSON ``body``; ``example`` shows the client what to send instead of nothing."""
    if not body:
        raise BadRequest(f"the request body is empty; send {example}")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


def check_count(
    count: int, max_items: int, field: str = "inputs", setting: str = "SERVE_MAX_ITEMS_PER_REQUEST"
) -> None:
    """Refuse a request of no items, or of more than ``max_items`` (``setting``), before any is read."""
    if count == 0:
        raise InvalidInput(f'"{field}" is empty; send at least one item')
    if count > max_items:
        raise PayloadTooLarge(f'"{field}" holds {count} items; the limit is {max_items} ({setting})')


def prepare_items(values: list[Any], model: Model, max_items: int, field: str = "inputs") -> list[Any]:
    """Every protocol's items, checked and converted by ``model.prepare``; errors name the index."""
    check_count(len(values), max_items, field)
    prepared = []
    for index, item in enumerate(values):
        try:
            prepared.append(model.prepare(item))
        except ServeError as exc:
            # A refusal with its own status (413 for an image of too many pixels,
            # 415 for a format the model does not take) keeps it.
            raise type(exc)(f"{field}[{index}]: {exc.message}") from None
        except ValueError as exc:
            raise InvalidInput(f"{field}[{index}]: {exc}") from None
    return prepared


def is_token_ids(value: Any) -> bool:
    """Whether ``value``, sent in place of a text, is a token id or a list of them.

    OpenAI's and TEI's APIs take token ids; the service's models tokenize
    texts, and a refusal of ids says how to send text instead.
    """

    def token_id(entry: Any) -> bool:
        return isinstance(entry, int) and not isinstance(entry, bool)  # JSON's true is no number

    return token_id(value) or (isinstance(value, list) and bool(value) and all(map(token_id, value)))


def render_outputs(model_name: str, outputs: Outputs) -> bytes:
    return orjson.dumps({"model": model_name, "outputs": outputs}, option=JSON_OPTIONS)

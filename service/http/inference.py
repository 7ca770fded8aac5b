"""The one inference path every protocol shares: body, deadline, admission, batcher, outputs.

A protocol module only translates: it turns its request body into raw items
and the outputs into its own response. Everything between runs here, once for
all of them: the body limit, readiness, the deadline (SERVE_REQUEST_TIMEOUT_MS,
lowered by X-Request-Timeout-Ms), validation of every item by the model
(``service.http.payload.prepare_items``, called by each protocol's parser),
the batcher's queue bound, and waiting for the batch. The access line and the
request metrics come from the middleware around the app, and the bearer token
from a request hook; both see every route (``service.http.access``,
``service.http.routes.require_token``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from flask import Response, current_app, request
from werkzeug.exceptions import HTTPException

from service.batching.waiting import wait_result
from service.errors import BadRequest, PayloadTooLarge
from service.http.access import note_batch_size
from service.http.arrival import ARRIVAL_ENVIRON_KEY, LET_IN, RETURNING_ENVIRON_KEY
from service.models import Model
from service.models.base import Outputs
from service.runtime import EXTENSION, ModelRuntime

TIMEOUT_HEADER = "X-Request-Timeout-Ms"
BATCH_SIZE_HEADER = "X-Batch-Size"

# Turns a request body into the model's prepared items, or raises a ServeError.
Parser = Callable[[bytes, Model], list[Any]]


def runtime() -> ModelRuntime:
    rt: ModelRuntime = current_app.extensions[EXTENSION]
    return rt


def json_response(document: object, status: int = 200) -> Response:
    return Response(
        orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY), status=status, mimetype="application/json"
    )


def is_inference_path(path: str) -> bool:
    """Whether ``path`` runs the model: the routes that SERVE_API_TOKEN guards."""
    return (
        path.startswith(("/predict", "/rerank/"))
        or path in ("/v1/embeddings", "/v1/rerank", "/v2/rerank")
        or (path.startswith("/v2/models/") and path.endswith("/infer"))
    )


def deadline(started: float, limit_ms: int) -> float:
    """The request's monotonic deadline: ``limit_ms`` (SERVE_REQUEST_TIMEOUT_MS), or less if asked."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is not None:
        try:
            asked = int(raw)
        except ValueError:
            asked = 0
        if asked < 1:
            raise BadRequest(f"{TIMEOUT_HEADER} must be a positive integer of milliseconds, got {raw!r}")
        limit_ms = min(limit_ms, asked)
    return started + limit_ms / 1000


def read_body(limit: int) -> bytes:
    """The request body, refused when it is over ``limit`` (SERVE_MAX_BODY_BYTES) or its framing is broken."""
    try:
        body = request.get_data(cache=False)
    except HTTPException:
        raise  # werkzeug's own: 413 for a body over the limit, 400 for a client gone mid-body
    except Exception as exc:
        # The server could not decode the body's framing (gunicorn raises its
        # InvalidChunkSize on a malformed chunked body): the client's fault, not ours.
        raise BadRequest(f"the request body could not be read ({type(exc).__name__})") from None
    if len(body) > limit:
        # A chunked body has no Content-Length to refuse up front; werkzeug stops
        # reading it one byte past the limit (MAX_CONTENT_LENGTH is limit + 1).
        raise PayloadTooLarge(f"the request body is over {limit} bytes (SERVE_MAX_BODY_BYTES)")
    return body


@dataclass(frozen=True)
class Batched:
    model: Model
    outputs: Outputs
    # Items in the batch this request ran in.
    batch_size: int


def run_batched(parse: Parser) -> Batched:
    """Parse this request's body with ``parse`` and run its items through the worker's batcher."""
    # From the request's arrival (service.http.door), not from now: its wait for
    # a thread counts toward its deadline and its latency budget.
    arrived = request.environ.get(ARRIVAL_ENVIRON_KEY)
    if not isinstance(arrived, float):
        arrived = time.monotonic()
    rt = runtime()
    until = deadline(arrived, rt.settings.request_timeout_ms)
    model, batcher = rt.require_ready()
    with batcher.in_flight():
        items = parse(read_body(rt.settings.max_body_bytes), model)
        returning = request.environ.get(RETURNING_ENVIRON_KEY) == LET_IN
        pending = batcher.submit(items, until, arrived, returning)
        outputs = wait_result(pending.future, until - time.monotonic())
    note_batch_size(pending.batch_size)
    return Batched(model, outputs, pending.batch_size)


def run_naive(parse: Parser) -> Batched:
    """Parse this request's body and run its items in this thread (the comparison route)."""
    rt = runtime()
    model, _ = rt.require_ready()
    items = parse(read_body(rt.settings.max_body_bytes), model)
    outputs = rt.predict_naive(items)
    note_batch_size(len(items))
    return Batched(model, outputs, len(items))


def with_batch_size(response: Response, batch_size: int) -> Response:
    # Lets a client (and the tests) see batching at work without scraping metrics.
    response.headers[BATCH_SIZE_HEADER] = str(batch_size)
    return response

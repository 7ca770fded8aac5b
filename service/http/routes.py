"""HTTP routes: JSON in, JSON out. Parsing lives in service.http.payload, work in service.runtime."""

from __future__ import annotations

import hmac
import time

import orjson
from flask import Blueprint, Response, current_app, g, request
from werkzeug.exceptions import HTTPException

from service.batching.waiting import wait_result
from service.errors import BadRequest, PayloadTooLarge, Unauthorized
from service.http.arrival import ARRIVAL_ENVIRON_KEY
from service.http.payload import parse_inputs, render_outputs
from service.models import Model, describe
from service.models.base import Outputs
from service.runtime import EXTENSION, ModelRuntime

bp = Blueprint("serve", __name__)

TIMEOUT_HEADER = "X-Request-Timeout-Ms"
BATCH_SIZE_HEADER = "X-Batch-Size"


def runtime() -> ModelRuntime:
    rt: ModelRuntime = current_app.extensions[EXTENSION]
    return rt


def json_response(document: object, status: int = 200) -> Response:
    return Response(orjson.dumps(document), status=status, mimetype="application/json")


@bp.before_app_request
def _authorize() -> None:
    token = runtime().settings.api_token
    if token is None or not request.path.startswith("/predict"):
        return
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    # compare_digest takes as long for a near miss as for a wild guess.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Unauthorized("a valid bearer token is required: send Authorization: Bearer <SERVE_API_TOKEN>")


def _deadline(started: float) -> float:
    """The request's monotonic deadline: SERVE_REQUEST_TIMEOUT_MS, or less if the client asks."""
    limit_ms = runtime().settings.request_timeout_ms
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


def _read_body() -> bytes:
    try:
        return request.get_data(cache=False)
    except HTTPException:
        raise  # werkzeug's own: 413 for a body over the limit, 400 for a client gone mid-body
    except Exception as exc:
        # The server could not decode the body's framing (gunicorn raises its
        # InvalidChunkSize on a malformed chunked body): the client's fault, not ours.
        raise BadRequest(f"the request body could not be read ({type(exc).__name__})") from None


def _parse(rt: ModelRuntime, model: Model) -> list[object]:
    body = _read_body()
    limit = rt.settings.max_body_bytes
    if len(body) > limit:
        # A chunked body has no Content-Length to refuse up front; werkzeug stops
        # reading it one byte past the limit (MAX_CONTENT_LENGTH is limit + 1).
        raise PayloadTooLarge(f"the request body is over {limit} bytes (SERVE_MAX_BODY_BYTES)")
    return parse_inputs(body, request.content_type, model, rt.settings.max_items_per_request)


def _predictions(model: Model, outputs: Outputs, batch_size: int) -> Response:
    g.batch_size = batch_size
    response = Response(render_outputs(model.name, outputs), mimetype="application/json")
    # Lets a client (and the tests) see batching at work without scraping metrics.
    response.headers[BATCH_SIZE_HEADER] = str(batch_size)
    return response


@bp.post("/predict/naive")
def predict_naive() -> Response:
    rt = runtime()
    model, _ = rt.require_ready()
    items = _parse(rt, model)
    outputs = rt.predict_naive(items)
    return _predictions(model, outputs, len(items))


@bp.post("/predict")
@bp.post("/predict/batched")
def predict_batched() -> Response:
    # From the request's arrival (service.http.door), not from now: its wait for
    # a thread counts toward its deadline and its latency budget.
    arrived = request.environ.get(ARRIVAL_ENVIRON_KEY)
    if not isinstance(arrived, float):
        arrived = time.monotonic()
    deadline = _deadline(arrived)
    rt = runtime()
    model, batcher = rt.require_ready()
    with batcher.in_flight():
        items = _parse(rt, model)
        pending = batcher.submit(items, deadline, arrived)
        outputs = wait_result(pending.future, deadline - time.monotonic())
    return _predictions(model, outputs, pending.batch_size)


@bp.get("/healthz")
def healthz() -> Response:
    return json_response({"status": "ok"})


@bp.get("/readyz")
def readyz() -> Response:
    reason = runtime().readiness()
    if reason is not None:
        return json_response({"status": "not ready", "error": reason}, 503)
    return json_response({"status": "ready"})


@bp.get("/info")
def info() -> Response:
    rt = runtime()
    s = rt.settings
    return json_response(
        {
            "model": describe(rt.model) if rt.model is not None else None,
            "ready": rt.readiness() is None,
            "not_ready_reason": rt.readiness(),
            "pid": rt.pid,
            # The worker's place in the topology plan; null outside gunicorn_conf.py.
            "slot": s.worker_slot,
            "device": s.worker_device or rt.device,
            "gpu_memory_fraction": s.worker_gpu_memory_fraction,
            "torch_threads": s.torch_threads,
            "batching": {
                "max_batch_size": s.max_batch_size,
                "max_batch_delay_ms": s.max_batch_delay_ms,
                "gather": s.batch_gather,
                "max_queue": s.queue_limit,
                "queue_depth": rt.batcher.depth if rt.batcher is not None else 0,
            },
            "limits": {
                "max_items_per_request": s.max_items_per_request,
                "max_body_bytes": s.max_body_bytes,
                "request_timeout_ms": s.request_timeout_ms,
                # null when SERVE_LATENCY_BUDGET_MS=0 turned the budget off
                "latency_budget_ms": round(s.latency_budget_s * 1000) if s.latency_budget_ms != 0 else None,
            },
        }
    )

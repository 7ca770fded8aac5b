"""The service's own JSON routes: /predict, probes and /info.

Parsing lives in service.http.payload; the path every protocol shares, in
service.http.inference.
"""

from __future__ import annotations

import hmac

from flask import Blueprint, Flask, Response, request

from service.errors import Unauthorized
from service.http.inference import (
    BATCH_SIZE_HEADER,
    TIMEOUT_HEADER,
    Batched,
    is_inference_path,
    json_response,
    run_batched,
    run_naive,
    runtime,
    with_batch_size,
)
from service.http.payload import parse_inputs, render_outputs
from service.models import Model, describe

__all__ = ["BATCH_SIZE_HEADER", "TIMEOUT_HEADER", "bp", "json_response", "require_token"]

bp = Blueprint("serve", __name__)


def require_token(app: Flask, token: str | None) -> None:
    """Refuse (401) an inference request without ``Authorization: Bearer <token>``; no check without a token.

    Registered only when SERVE_API_TOKEN is set: a request hook costs every
    request Flask's dispatch, even one that returns at once.
    """
    if token is None:
        return
    expected = token.encode()

    @app.before_request
    def _authorize() -> None:
        if not is_inference_path(request.path):
            return
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        # compare_digest takes as long for a near miss as for a wild guess.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            raise Unauthorized(
                "a valid bearer token is required: send Authorization: Bearer <SERVE_API_TOKEN>"
            )


def _parse(body: bytes, model: Model) -> list[object]:
    return parse_inputs(body, request.content_type, model, runtime().settings.max_items_per_request)


def _predictions(done: Batched) -> Response:
    response = Response(render_outputs(done.model.name, done.outputs), mimetype="application/json")
    return with_batch_size(response, done.batch_size)


@bp.post("/predict/naive")
def predict_naive() -> Response:
    return _predictions(run_naive(_parse))


@bp.post("/predict")
@bp.post("/predict/batched")
def predict_batched() -> Response:
    return _predictions(run_batched(_parse))


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

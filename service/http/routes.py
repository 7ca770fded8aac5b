"""The service's own JSON routes: /predict, probes and /info.

Parsing lives in service.http.payload; the path every protocol shares, in
service.http.inference.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

from flask import Blueprint, Flask, Response, request

from service.errors import Unauthorized
from service.host import allocator
from service.http import tei
from service.http.inference import (
    BATCH_SIZE_HEADER,
    TIMEOUT_HEADER,
    Answer,
    Choose,
    Handler,
    batch_size_header,
    is_inference_path,
    json_response,
    query_model,
    runtime,
    serve_batched,
    serve_naive,
)
from service.http.payload import parse_inputs, render_outputs
from service.model_set import ModelSet
from service.models import describe
from service.runtime import ModelRuntime

__all__ = [
    "BATCH_SIZE_HEADER",
    "DIRECT",
    "TIMEOUT_HEADER",
    "bp",
    "check_token",
    "json_response",
    "require_token",
]

bp = Blueprint("serve", __name__)


def require_token(app: Flask, token: str | None) -> None:
    """Refuse (401) an inference request without ``Authorization: Bearer <token>``; no check without a token.

    Registered only when SERVE_API_TOKEN is set: a request hook costs every
    request Flask's dispatch, even one that returns at once. The direct routes
    (service.http.direct) check the same token themselves.
    """
    if token is None:
        return
    expected = token.encode()

    @app.before_request
    def _authorize() -> None:
        if is_inference_path(request.path):
            check_token(request.headers.get("Authorization", ""), expected)


def check_token(authorization: str, expected: bytes) -> None:
    """Raise Unauthorized unless the ``Authorization`` header holds the bearer token ``expected``."""
    scheme, _, given = authorization.partition(" ")
    # compare_digest takes as long for a near miss as for a wild guess.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
        raise Unauthorized("a valid bearer token is required: send Authorization: Bearer <SERVE_API_TOKEN>")


def answer_predict(
    rt: ModelSet, environ: dict[str, Any], args: Mapping[str, Any], *, naive: bool = False
) -> Answer:
    """A /predict request's items through its model's batcher, or in this thread for /predict/naive."""
    # ?model= names the model of a body that cannot (a raw image); the body's "model" field goes first.
    named = query_model(environ)

    def parse(body: bytes, choose: Choose) -> list[object]:
        content_type = environ.get("CONTENT_TYPE")
        if rt.single:
            # A lone model's /predict always ignored a "model" field: clients that send one keep working.
            return parse_inputs(body, content_type, lambda _: choose(None), rt.settings.max_items_per_request)
        return parse_inputs(body, content_type, choose, rt.settings.max_items_per_request, named)

    done = serve_naive(rt, environ, parse) if naive else serve_batched(rt, environ, parse)
    body = render_outputs(done.model.name, done.outputs)
    return Answer(body, "application/json", (batch_size_header(done.batch_size),))


def answer_naive(rt: ModelSet, environ: dict[str, Any], args: Mapping[str, Any]) -> Answer:
    return answer_predict(rt, environ, args, naive=True)


# The routes service.http.direct answers, by endpoint. In a served app their
# POSTs never reach these views; the views stay the reference the direct
# answers are tested against (tests/unit/test_direct.py).
DIRECT: dict[str, Handler] = {"serve.predict_batched": answer_predict, "serve.predict_naive": answer_naive}


@bp.post("/predict/naive")
def predict_naive() -> Response:
    return answer_naive(runtime(), request.environ, {}).response()


@bp.post("/predict")
@bp.post("/predict/batched")
def predict_batched() -> Response:
    return answer_predict(runtime(), request.environ, {}).response()


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
    models = runtime()
    s = models.settings
    first = models.default
    return json_response(
        {
            # The default model (the first SERVE_MODEL lists), as a service of one model describes it.
            "model": describe(first.model) if first.model is not None else None,
            # The precision in use, what was asked for, and its exactness against float32.
            "precision": first.precision.describe() if first.precision is not None else None,
            # Built once in the gunicorn master and shared by every worker (SERVE_SHARE_WEIGHTS).
            "shared_weights": first.shared_weights,
            # "jemalloc" or "system": the worker's malloc (SERVE_ALLOCATOR, service.host.allocator).
            "allocator": allocator.in_use(),
            # Every model served, the default first, with the names clients may pick it by.
            "models": [_describe_model(rt) for rt in models.runtimes],
            "ready": models.readiness() is None,
            "not_ready_reason": models.readiness(),
            "pid": models.pid,
            # The worker's place in the topology plan; null outside gunicorn_conf.py.
            "slot": s.worker_slot,
            "device": s.worker_device or models.device,
            "gpu_memory_fraction": s.worker_gpu_memory_fraction,
            "torch_threads": s.torch_threads,
            "batching": {
                "max_batch_size": s.max_batch_size,
                "max_batch_delay_ms": s.max_batch_delay_ms,
                "gather": s.batch_gather,
                "max_queue": s.queue_limit,
                "queue_depth": sum(rt.batcher.depth for rt in models.runtimes if rt.batcher is not None),
                # Models share the worker's threads, one call at a time (service.batching.model_time).
                "models_take_turns": models.model_time is not None,
            },
            "limits": {
                "max_items_per_request": s.max_items_per_request,
                "max_documents_per_request": s.documents_limit,
                "max_body_bytes": s.max_body_bytes,
                "request_timeout_ms": s.request_timeout_ms,
                # null when SERVE_LATENCY_BUDGET_MS=0 turned the budget off
                "latency_budget_ms": round(s.latency_budget_s * 1000) if s.latency_budget_ms != 0 else None,
            },
            # Text Embeddings Inference's keys, for its clients: the default model's, or ?model='s.
            **tei.info(models, query_model(request.environ)),
        }
    )


def _describe_model(rt: ModelRuntime) -> dict[str, Any]:
    return {
        "name": rt.label,
        "names": list(rt.names),
        "model": describe(rt.model) if rt.model is not None else None,
        "precision": rt.precision.describe() if rt.precision is not None else None,
        "shared_weights": rt.shared_weights,
        "ready": rt.readiness() is None,
        "queue_depth": rt.batcher.depth if rt.batcher is not None else 0,
    }

"""How the service answers an error: one translation, worded by each protocol for its path.

Flask's error handlers (service.http.app) and the direct predict routes
(service.http.direct) both answer through ``answer_error``, so an error reads
the same whichever answered it. Each protocol only decides the body and status
its clients understand: OpenAI's SDK reads ``{"error": {"message", ...}}``; the
Open Inference Protocol's clients read ``{"error": message}`` and expect 400 for
any bad tensor, where /predict says 422 for a bad item. Cohere's rerank routes
answer ``{"message"}``; TEI's routes ``{"error", "error_type"}``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from service.errors import Overloaded, ServeError, Unauthorized
from service.http import openai_api, rerank, tei_codec
from service.http.access import REQUEST_ID_ENVIRON_KEY
from service.http.arrival import MODEL_ENVIRON_KEY, ask_to_hold

if TYPE_CHECKING:
    from service.config.settings import Settings
    from service.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

# All a client is told of a fault in the service itself.
INTERNAL_ERROR = "internal server error; see the service log"


@dataclass(frozen=True)
class ErrorAnswer:
    status: int
    document: object
    # Beside Content-Type and Content-Length, in order.
    headers: list[tuple[str, str]]


def error_document(
    path: str, status: int, message: str, exc: BaseException | None = None
) -> tuple[int, object]:
    """The status and body the protocol of ``path`` gives an error."""
    if path in rerank.COHERE_PATHS:
        return rerank.error_document(status, message)
    if path in tei_codec.PATHS:
        return tei_codec.error_document(status, message, exc)
    if path.startswith("/v1/"):
        return openai_api.error_document(status, message, exc)
    if (path == "/v2" or path.startswith("/v2/")) and status == 422:
        status = 400
    return status, {"error": message}


def answer_error(
    exc: BaseException, path: str, environ: dict[str, Any], settings: Settings, metrics: Metrics
) -> ErrorAnswer:
    """What the client is told of ``exc``, raised while answering the request of ``environ``.

    A ServeError says its own status and message, and a shed one is counted; a
    werkzeug HTTPException (a 405, a client gone mid-body) keeps its status and
    headers; anything else is a 500 that tells the client nothing of the cause,
    logged with the request's id.
    """
    headers: list[tuple[str, str]] = []
    cause: BaseException | None = exc
    if isinstance(exc, ServeError):
        metrics.count_error(exc, environ.get(MODEL_ENVIRON_KEY, ""))
        status, message = exc.status, exc.message
        if isinstance(exc, Overloaded):
            headers.append(("Retry-After", str(exc.retry_after_s)))
            # Refused by the batcher (queue full, over the budget once queued), on any
            # protocol's route: held as the door's refusals are.
            if settings.hold_refused:
                ask_to_hold(environ, exc.retry_after_s, settings.latency_budget_s)
        if isinstance(exc, Unauthorized):
            headers.append(("WWW-Authenticate", 'Bearer realm="predict"'))
    elif isinstance(exc, RequestEntityTooLarge):
        # Content-Length over the limit: refused before the body is read.
        status, cause = 413, None
        message = f"the request body is over {settings.max_body_bytes} bytes (SERVE_MAX_BODY_BYTES)"
    elif isinstance(exc, HTTPException):
        status, message = exc.code or 500, exc.description or exc.name
        # e.g. Allow on a 405; the body is JSON, whatever werkzeug's page would be.
        headers = [(name, value) for name, value in exc.get_headers() if name.lower() != "content-type"]
    else:
        log.error("unhandled error in request %s", environ.get(REQUEST_ID_ENVIRON_KEY), exc_info=exc)
        status, message, cause = 500, INTERNAL_ERROR, None
    status, document = error_document(path, status, message, cause)
    return ErrorAnswer(status, document, headers)

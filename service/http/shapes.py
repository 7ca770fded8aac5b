"""How each protocol words an error, chosen by the request's path.

One set of error handlers (service.http.app) serves every route; each
protocol only decides the body and status its clients understand. OpenAI's
SDK reads ``{"error": {"message", ...}}``; the Open Inference Protocol's
clients read ``{"error": message}`` and expect 400 for any bad tensor, where
/predict says 422 for a bad item. Cohere's rerank routes answer ``{"message"}``.
"""

from __future__ import annotations

from flask import Response, has_request_context, request

from service.http import openai_api, rerank
from service.http.inference import json_response


def error_response(status: int, message: str, exc: BaseException | None = None) -> Response:
    path = request.path if has_request_context() else ""
    if path in rerank.COHERE_PATHS:
        return rerank.error_response(status, message)
    if path.startswith("/v1/"):
        return openai_api.error_response(status, message, exc)
    if (path == "/v2" or path.startswith("/v2/")) and status == 422:
        status = 400
    return json_response({"error": message}, status)

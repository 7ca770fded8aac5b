"""The application factory. Builds everything per worker process; nothing at import."""

from __future__ import annotations

import logging

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from service.errors import Overloaded, ServeError, Unauthorized
from service.http import access, openai_api, rerank, v2
from service.http.arrival import ask_to_hold
from service.http.door import Door
from service.http.routes import bp, require_token
from service.http.shapes import error_response
from service.metrics import Metrics
from service.runtime import ModelRuntime
from service.settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> Flask:
    """A Flask app serving ``settings.model`` (read from ``SERVE_*`` when None).

    Starts loading the model in the background: call it in the process that
    serves (a gunicorn worker), never before a fork.
    """
    settings = settings if settings is not None else Settings.from_env()
    app = Flask("service")
    # One byte over the limit, so that a chunked body (no Content-Length) that
    # is too long shows it: werkzeug silently stops reading at this many bytes.
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes + 1
    metrics = Metrics(settings)
    metrics.init_app(app)
    # The route a request matched reaches the access middleware through its environ.
    app.request_class = access.RoutedRequest
    app.register_blueprint(bp)
    require_token(app, settings.api_token)
    # The standard protocols, each a thin translation to the same batched path.
    app.register_blueprint(v2.bp)
    app.register_blueprint(rerank.bp)
    openai_api.init_app(app)
    _register_error_handlers(app, settings, metrics)
    runtime = ModelRuntime(settings, observer=metrics)
    runtime.init_app(app)
    # Outside Flask: every answer the app gives gets its id, metrics and line
    # (service.http.access), and a request refused for the latency budget costs
    # no more than it must (the door answers it before any of that).
    app.wsgi_app = Door(access.Access(app.wsgi_app, metrics), runtime, metrics)  # type: ignore[method-assign]
    runtime.start()
    return app


def _register_error_handlers(app: Flask, settings: Settings, metrics: Metrics) -> None:
    @app.errorhandler(ServeError)
    def serve_error(exc: ServeError) -> Response:
        metrics.count_error(exc)
        response = error_response(exc.status, exc.message, exc)
        if isinstance(exc, Overloaded):
            response.headers["Retry-After"] = str(exc.retry_after_s)
            # Refused by the batcher (queue full, over the budget once queued), on any
            # protocol's route: held as the door's refusals are.
            if settings.hold_refused:
                ask_to_hold(request.environ, exc.retry_after_s, settings.latency_budget_s)
        if isinstance(exc, Unauthorized):
            response.headers["WWW-Authenticate"] = 'Bearer realm="predict"'
        return response

    @app.errorhandler(RequestEntityTooLarge)
    def too_large(exc: RequestEntityTooLarge) -> Response:
        # Content-Length over MAX_CONTENT_LENGTH: refused before the body is read.
        return error_response(
            413, f"the request body is over {settings.max_body_bytes} bytes (SERVE_MAX_BODY_BYTES)"
        )

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        response = error_response(exc.code or 500, exc.description or exc.name, exc)
        for name, value in exc.get_headers():
            if name.lower() != "content-type":
                response.headers[name] = value  # e.g. Allow on a 405
        return response

    @app.errorhandler(Exception)
    def unexpected(exc: Exception) -> Response:
        log.exception("unhandled error in request %s", access.current_request_id())
        return error_response(500, "internal server error; see the service log")

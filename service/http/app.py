"""The application factory. Builds everything per worker process; nothing at import."""

from __future__ import annotations

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from service.config.settings import Settings
from service.errors import ServeError
from service.http import access, openai_api, rerank, routes, tei, v2
from service.http import door as doors
from service.http.direct import Direct
from service.http.inference import json_response
from service.http.linger import Linger
from service.http.routes import bp, require_token
from service.http.shapes import answer_error
from service.model_set import ModelSet
from service.telemetry.metrics import Metrics

# The routes service.http.direct answers: the protocols' busiest inference routes.
DIRECT = {**routes.DIRECT, **openai_api.DIRECT, **v2.DIRECT, **rerank.DIRECT, **tei.DIRECT}


def create_app(settings: Settings | None = None) -> Flask:
    """A Flask app serving the models ``settings.model`` lists (read from ``SERVE_*`` when None).

    Starts loading the model in the background: call it in the process that
    serves (a gunicorn worker), never before a fork.
    """
    settings = settings if settings is not None else Settings.from_env()
    app = Flask("service")
    # The inference routes read their bodies with this limit themselves
    # (service.http.inference.read_body); Flask applies it to anything else.
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
    app.register_blueprint(tei.bp)
    openai_api.init_app(app)
    _register_error_handlers(app, settings, metrics)
    # Every model SERVE_MODEL lists, each with its batcher and its metrics' model label.
    runtime = ModelSet(settings, observer_for=metrics.for_model)
    runtime.init_app(app)
    # Outside Flask: every answer the app gives gets its id, metrics and line
    # (service.http.access), and a request refused for the latency budget costs
    # no more than it must (the door answers it before any of that).
    # The busiest inference routes' POSTs (DIRECT) are answered without Flask's
    # request context (service.http.direct): the same answers, for less.
    # Around them all, a refused body still arriving is read before the connection
    # closes, so that its client reads the refusal (service.http.linger).
    door = doors.Door(access.Access(Direct(app, runtime, metrics, DIRECT), metrics), runtime, metrics)
    app.extensions[doors.EXTENSION] = door
    app.wsgi_app = Linger(door, settings.linger_bytes, settings.linger_ms / 1000)  # type: ignore[method-assign]
    runtime.start()
    return app


def _register_error_handlers(app: Flask, settings: Settings, metrics: Metrics) -> None:
    def answer(exc: Exception) -> Response:
        said = answer_error(exc, request.path, request.environ, settings, metrics)
        response = json_response(said.document, said.status)
        for name, value in said.headers:
            response.headers[name] = value
        return response

    # Flask picks the handler of the nearest class; all three say the same.
    for kind in (ServeError, HTTPException, Exception):
        app.register_error_handler(kind, answer)

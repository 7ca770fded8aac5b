# design:
# - Flask's share of a bare handler's cost is most of it: in process, a Flask
#   view that parses JSON and returns bytes costs about 54 us a request, the
#   same work as a plain WSGI callable 8 us. The request context, its pushes and
#   pops, the Request and Response objects and the context-local lookups are all
#   per request, and under 72 request threads every microsecond holding the GIL
#   is paid again in waits for it.
# - So the inference routes that carry the load are answered here from the
#   environ, through the same functions their Flask views call (each protocol's
#   DIRECT handlers, service.http.shapes.answer_error): one body reader, one
#   parser, one error translation. What Flask added on top, this adds too: the
#   matched rule for the metrics, the token check, the status line werkzeug
#   would write. The URL is matched by werkzeug, against Flask's own map.
# - POST only, and only the routes in the table: any other method, a path that
#   Flask would redirect, every other route goes to Flask as before.

"""The busiest inference routes' POSTs, answered without Flask's request context; the rest go to Flask.

Inside the access middleware (service.http.access), which gives every answer
its request id, metrics and access line, this one's included.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from flask import Flask, Response
from werkzeug.exceptions import HTTPException
from werkzeug.routing import Rule
from werkzeug.wsgi import get_path_info

from service.http.access import REQUEST_ID_ENVIRON_KEY, RULE_ENVIRON_KEY
from service.http.inference import Handler, json_bytes
from service.http.routes import check_token
from service.http.shapes import INTERNAL_ERROR, answer_error, error_document

if TYPE_CHECKING:
    from service.model_set import ModelSet
    from service.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

_JSON = "application/json"
# Paths whose match is remembered at most; past it the memory starts over.
MAX_REMEMBERED_PATHS = 1024
Headers = tuple[tuple[str, str], ...]


class Direct:
    def __init__(
        self, app: Flask, runtime: ModelSet, metrics: Metrics, handlers: Mapping[str, Handler]
    ) -> None:
        """Answer the POSTs of the endpoints in ``handlers`` (by Flask endpoint); pass the rest to ``app``."""
        self._app = app.wsgi_app
        self._runtime = runtime
        self._metrics = metrics
        self._handlers = dict(handlers)
        token = runtime.settings.api_token
        self._token = token.encode() if token is not None else None
        # Bound once: matching needs only the path and the method, never the host.
        self._urls = app.url_map.bind("localhost")
        self._status_lines: dict[int, str] = {}
        # What each path matched: (rule, args), or None for Flask's to answer. The map
        # does not change once the app is made, and werkzeug's matcher costs about
        # 15 us a request on a route with a variable part (/v2/models/<name>/infer).
        self._matches: dict[str, tuple[Rule, Mapping[str, Any]] | None] = {}

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") != "POST":
            return self._app(environ, start_response)
        # Decoded from the WSGI string as Flask decodes it, so a model's non-ASCII
        # name matches; the error's wording goes by the path as request.path gives it.
        path_info = get_path_info(environ)
        path = "/" + path_info.lstrip("/")
        try:
            matched = self._matches[path_info]
        except KeyError:
            matched = self._match(path_info)
        if matched is None:
            return self._app(environ, start_response)
        rule, args = matched
        handler = self._handlers.get(rule.endpoint)
        if handler is None:
            return self._app(environ, start_response)
        # The route's label in the metrics and the access line, as Flask leaves it.
        environ[RULE_ENVIRON_KEY] = rule
        try:
            if self._token is not None:
                check_token(environ.get("HTTP_AUTHORIZATION", ""), self._token)
            answer = handler(self._runtime, environ, args)
            status, body, content_type, extra = 200, answer.body, answer.content_type, answer.headers
        except Exception as exc:
            status, body, content_type, extra = self._error(exc, path, environ)
        start_response(
            self._status_line(status),
            [("Content-Type", content_type), ("Content-Length", str(len(body))), *extra],
        )
        return [body]

    def _match(self, path_info: str) -> tuple[Rule, Mapping[str, Any]] | None:
        """The rule a POST to ``path_info`` matches, and its arguments (None: for Flask), remembered."""
        matched: tuple[Rule, Mapping[str, Any]] | None
        try:
            rule, args = self._urls.match(path_info, method="POST", return_rule=True)
        except HTTPException:
            matched = None  # a 404, a 405 or a redirect: Flask's to answer
        else:
            matched = (rule, MappingProxyType(args))  # shared by every request to the path
        if len(self._matches) >= MAX_REMEMBERED_PATHS:
            # Paths are the client's to choose: a flood of distinct ones must not grow this.
            self._matches.clear()
        self._matches[path_info] = matched
        return matched

    def _error(self, exc: Exception, path: str, environ: dict[str, Any]) -> tuple[int, bytes, str, Headers]:
        try:
            said = answer_error(exc, path, environ, self._runtime.settings, self._metrics)
            return said.status, json_bytes(said.document), _JSON, tuple(said.headers)
        except Exception:
            # As Flask does when its error handler fails: a plain 500, still JSON,
            # still through the access middleware for its line and metrics.
            log.exception("answering the error of request %s failed", environ.get(REQUEST_ID_ENVIRON_KEY))
            status, document = error_document(path, 500, INTERNAL_ERROR)
            return status, json_bytes(document), _JSON, ()

    def _status_line(self, status: int) -> str:
        line = self._status_lines.get(status)
        if line is None:
            # Worded as werkzeug words it ("422 UNPROCESSABLE ENTITY"), so clients see one service.
            line = self._status_lines[status] = Response(status=status).status
        return line

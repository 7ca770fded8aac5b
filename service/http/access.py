"""Request ids, request metrics and the access log line, around the Flask app.

Every response carries ``X-Request-ID``: the one the client (or a proxy in
front) sent when it is sane, else a new one, so a client's report, the proxy's
log and this service's log name the same request. Each request writes one
access line to the ``service.access`` logger: request id, method, path, route,
model, status, latency and the size of the batch it ran in.

This is WSGI middleware rather than Flask request hooks: a hook costs Flask's
dispatch and each of its reads a context-local lookup, which on a free model
added up to a seventh of a request's Python time, and every extra microsecond
a request holds the GIL, 72 request threads pay again queueing for it. What
only Flask knows reaches it through the environ: the matched rule
(``RoutedRequest``) and the batch size (``note_batch_size``).
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

from flask import Request
from werkzeug.routing import Rule
from werkzeug.wsgi import get_path_info

from service.http.arrival import ARRIVAL_ENVIRON_KEY, MODEL_ENVIRON_KEY
from service.telemetry.logs import ACCESS_LOGGER, info_record
from service.telemetry.metrics import UNMATCHED_ROUTE, Metrics

REQUEST_ID_HEADER = "X-Request-ID"
# Where the middleware leaves what the app and the line share.
REQUEST_ID_ENVIRON_KEY = "serve.request_id"
RULE_ENVIRON_KEY = "serve.rule"
BATCH_SIZE_ENVIRON_KEY = "serve.batch_size"

# Bounded and plain, so a client cannot forge log lines or bloat every line
# it is written to; this covers UUIDs, nginx's $request_id and trace ids.
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}", re.ASCII)
_MAX_LOGGED_PATH = 200

access_log = logging.getLogger(ACCESS_LOGGER)
log = logging.getLogger(__name__)

ACCESS_LINE = (
    '%(remote)s "%(method)s %(path)s" %(status)d %(duration_ms).2f ms '
    "route=%(route)s model=%(model)s batch_size=%(batch_size)s request_id=%(request_id)s"
)

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def request_id(given: str | None) -> str:
    """``given`` if it is a sane request id, else a new random one: 32 hex digits, as a UUID's.

    From ``random`` rather than ``uuid.uuid4``, whose os.urandom call measured
    20 us a request: an id must not repeat, not resist guessing. The random
    module reseeds itself in each forked worker, so workers do not repeat
    each other either.
    """
    if given is not None and _SANE_REQUEST_ID.fullmatch(given):
        return given
    return f"{random.getrandbits(128):032x}"


def note_batch_size(environ: dict[str, Any], size: int) -> None:
    """The items in the batch the request ran in, for its access line."""
    environ[BATCH_SIZE_ENVIRON_KEY] = size


class RoutedRequest(Request):
    """Flask's request, which also leaves the rule it matched in the environ.

    Flask pops the request before the middleware sees the answer; the environ
    outlives it. The rule is the route's label (``/predict/batched``), never the
    raw path: bounded cardinality.
    """

    @property
    def url_rule(self) -> Rule | None:
        rule: Rule | None = self.environ.get(RULE_ENVIRON_KEY)
        return rule

    @url_rule.setter
    def url_rule(self, rule: Rule | None) -> None:
        self.environ[RULE_ENVIRON_KEY] = rule


class Access:
    """Around the Flask app: request id, in-flight count, request metrics and the access line.

    Inside the door (service.http.door), which answers its own refusals. Every
    answer the app gives passes here, a 401 from the token check or a 404
    included.
    """

    def __init__(self, app: WsgiApp, metrics: Metrics) -> None:
        self._app = app
        self._metrics = metrics

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        rid = environ[REQUEST_ID_ENVIRON_KEY] = request_id(environ.get("HTTP_X_REQUEST_ID"))
        # From the request's arrival where the door settled it (service.http.door):
        # the wait for a thread is part of what the client waits.
        arrived = environ.get(ARRIVAL_ENVIRON_KEY)
        started = arrived if isinstance(arrived, float) else time.monotonic()
        status = ""

        def start(given: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            nonlocal status
            status = given
            headers.append((REQUEST_ID_HEADER, rid))
            return start_response(given, headers, exc_info)

        metrics = self._metrics
        metrics.request_started()
        try:
            answer = self._app(environ, start)
            try:
                seconds = time.monotonic() - started
                rule = environ.get(RULE_ENVIRON_KEY)
                route = rule.rule if rule is not None else UNMATCHED_ROUTE
                code = int(status[:3]) if status[:3].isdigit() else 500
                metrics.observe_request(route, code, seconds, environ.get(MODEL_ENVIRON_KEY, ""))
                if access_log.isEnabledFor(logging.INFO):
                    _write_access_line(environ, rid, route, code, seconds)
            except Exception:
                # The answer is made: a fault in its metrics (a full disk under the
                # metrics files) must not turn it into an error the client sees.
                log.exception("recording request %s failed", rid)
        finally:
            try:
                metrics.request_finished()
            except Exception:
                log.exception("recording the end of request %s failed", rid)
        return answer


def _write_access_line(environ: dict[str, Any], rid: str, route: str, status: int, seconds: float) -> None:
    batch_size = environ.get(BATCH_SIZE_ENVIRON_KEY)
    fields: dict[str, Any] = {
        "request_id": rid,
        "remote": environ.get("REMOTE_ADDR"),
        "method": environ.get("REQUEST_METHOD", "GET").upper(),
        "path": _printable("/" + get_path_info(environ).lstrip("/")),  # as request.path
        "route": route,
        # The served name of the model it was routed to (None: none was, as for a probe).
        "model": environ.get(MODEL_ENVIRON_KEY) or None,
        "status": status,
        "duration_ms": round(seconds * 1000, 3),
        "batch_size": batch_size,
    }
    text = {
        **fields,
        "batch_size": "-" if batch_size is None else batch_size,
        "model": fields["model"] or "-",
    }
    # Made here rather than by access_log.info, which walks the stack for the
    # caller's file and line on every request: the line never shows them.
    access_log.handle(info_record(ACCESS_LOGGER, ACCESS_LINE, text, fields=fields))


def _printable(path: str) -> str:
    """The path as one bounded log token: a decoded path may hold newlines or quotes."""
    if len(path) <= _MAX_LOGGED_PATH and path.isprintable() and '"' not in path and " " not in path:
        return path  # the usual path, checked in C rather than a character at a time
    cleaned = "".join(c if c.isprintable() and c not in '" ' else "?" for c in path[:_MAX_LOGGED_PATH])
    return cleaned + ("..." if len(path) > _MAX_LOGGED_PATH else "")

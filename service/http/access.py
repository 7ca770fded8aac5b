"""Request ids, request metrics and the access log line, as Flask request hooks.

Every response carries ``X-Request-ID``: the one the client (or a proxy in
front) sent when it is sane, else a new one, so a client's report, the proxy's
log and this service's log name the same request. Each request writes one
access line to the ``service.access`` logger: request id, method, path, route,
status, latency and the size of the batch it ran in.
"""

from __future__ import annotations

import logging
import random
import re
import time
from typing import Any

from flask import Flask, Response, g, request

from service.http.arrival import ARRIVAL_ENVIRON_KEY
from service.logs import ACCESS_LOGGER
from service.metrics import UNMATCHED_ROUTE, Metrics

REQUEST_ID_HEADER = "X-Request-ID"

# Bounded and plain, so a client cannot forge log lines or bloat every line
# it is written to; this covers UUIDs, nginx's $request_id and trace ids.
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}", re.ASCII)
_MAX_LOGGED_PATH = 200

access_log = logging.getLogger(ACCESS_LOGGER)

ACCESS_LINE = (
    '%(remote)s "%(method)s %(path)s" %(status)d %(duration_ms).2f ms '
    "route=%(route)s batch_size=%(batch_size)s request_id=%(request_id)s"
)


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


def route_label() -> str:
    """The matched URL rule (``/predict/batched``), never the raw path: bounded cardinality."""
    rule = request.url_rule
    return rule.rule if rule is not None else UNMATCHED_ROUTE


def init_app(app: Flask, metrics: Metrics) -> None:
    """Register the hooks. Call before any blueprint that has its own before-request hooks.

    Hooks run in the order they were registered, and one that raises (a 401
    from the token check) skips those after it: registered first, these see
    every request.
    """

    @app.before_request
    def begin() -> None:
        g.request_id = request_id(request.headers.get(REQUEST_ID_HEADER))
        # From the request's arrival where the door settled it (service.http.door):
        # the wait for a thread is part of what the client waits.
        arrived = request.environ.get(ARRIVAL_ENVIRON_KEY)
        g.started = arrived if isinstance(arrived, float) else time.monotonic()
        metrics.request_started()
        g.counted_in_flight = True

    @app.after_request
    def finish(response: Response) -> Response:
        started = g.get("started")
        seconds = time.monotonic() - started if started is not None else 0.0
        rid = g.get("request_id") or request_id(None)
        response.headers[REQUEST_ID_HEADER] = rid
        route = route_label()
        metrics.observe_request(route, response.status_code, seconds)
        if access_log.isEnabledFor(logging.INFO):
            _write_access_line(rid, route, response.status_code, seconds)
        return response

    @app.teardown_request
    def end(exc: BaseException | None) -> None:
        # Teardown runs even when a response could not be made.
        if g.pop("counted_in_flight", False):
            metrics.request_finished()


def _write_access_line(rid: str, route: str, status: int, seconds: float) -> None:
    fields: dict[str, Any] = {
        "request_id": rid,
        "remote": request.remote_addr,
        "method": request.method,
        "path": _printable(request.path),
        "route": route,
        "status": status,
        "duration_ms": round(seconds * 1000, 3),
        "batch_size": g.get("batch_size"),
    }
    text = {**fields, "batch_size": "-" if fields["batch_size"] is None else fields["batch_size"]}
    # Made here rather than by access_log.info, which walks the stack for the
    # caller's file and line on every request: the line never shows them.
    record = access_log.makeRecord(
        ACCESS_LOGGER, logging.INFO, __file__, 0, ACCESS_LINE, (text,), None, extra={"fields": fields}
    )
    access_log.handle(record)


def _printable(path: str) -> str:
    """The path as one bounded log token: a decoded path may hold newlines or quotes."""
    if len(path) <= _MAX_LOGGED_PATH and path.isprintable() and '"' not in path and " " not in path:
        return path  # the usual path, checked in C rather than a character at a time
    cleaned = "".join(c if c.isprintable() and c not in '" ' else "?" for c in path[:_MAX_LOGGED_PATH])
    return cleaned + ("..." if len(path) > _MAX_LOGGED_PATH else "")

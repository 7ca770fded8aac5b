# design:
# - Door runs in every request thread (gthread) or greenlet (gevent) before
#   Flask does. It reads the batcher's predicted wait (under the batcher's own
#   lock) and updates one StandingQueue under a native lock held for a few
#   operations, never across I/O, so greenlets and threads can share it.
# - A refused request is answered here and never reaches Flask: no request
#   context, no access line (at thousands a second the line would cost more than
#   the refusal); the metrics count it as any other answer.
# - Door.check is also called from gthread's event loop (service.host.worker),
#   which answers its refusals without a request thread while the door is
#   refusing. That caller counts only refusals: StandingQueue.stands reads the
#   standing queue without adding a sample, so a request let in is counted once,
#   by the door in its thread.

"""Admission at the door: refuse, before any parsing, a request that cannot be answered in time.

It wraps the Flask app (``app.wsgi_app``) and runs first, in the request's own
thread or greenlet, before Flask builds a request context, before the token
check and before the body is read, so a refusal costs a few dictionary lookups
and a short write (the body is read only after the answer is out, by
service.http.linger, so that the connection can carry the client's next
request). For the predict routes it

- settles when the request arrived (service.http.arrival): the worker's stamp
  or nginx's ``X-Request-Start``, whichever says it waited longer; the route
  counts the request's deadline from then;
- records that wait before the handler (``serve_http_wait_before_handler_seconds``);
- refuses it with 503, ``Retry-After`` and a JSON error, counted under
  ``over_budget``, when it already waited past SERVE_LATENCY_BUDGET_MS, when
  the work queued ahead of it (the batcher's predicted wait) would take it past
  that budget, or when the wait before the handler has become a standing queue
  and it waited past a tenth of the budget there (service.batching.admission);
- asks the worker, for a refusal to a client that came straight to it, to hold
  the connection for the Retry-After it was told before reading the next
  request on it (service.http.arrival.hold; service.host.hold).

Other paths pass straight through. The batcher checks the budget again when
the request is queued: many requests can pass the door together.

Under gthread, for a second after each refusal, the worker's event loop asks
the door about each kept-alive request whose bytes are all in before it hands
the connection to a thread, and answers a refusal itself: that costs a third
of a refusal in a thread (docs/overload.md). The answer is the same.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from service.batching import native
from service.errors import Overloaded
from service.http.access import REQUEST_ID_HEADER, WsgiApp, request_id
from service.http.arrival import (
    ARRIVAL_ENVIRON_KEY,
    FOLLOW_UP_ENVIRON_KEY,
    LET_IN,
    MODEL_ENVIRON_KEY,
    RETURNING_ENVIRON_KEY,
    TIMEOUT_ENVIRON_KEY,
    WAITING_ENVIRON_KEY,
    hold,
    hold_seconds,
    proxy_wait,
    settle_wait,
)
from service.http.inference import query_model
from service.http.request_head import header_number
from service.http.shapes import error_document
from service.telemetry.model_metrics import NO_MODEL

if TYPE_CHECKING:
    from service.batching.admission import Refusal as AdmissionRefusal
    from service.batching.batcher import Batcher
    from service.model_set import ModelSet
    from service.runtime import ModelRuntime
    from service.telemetry.metrics import Metrics

# The Flask extension under which the app keeps its door, for the worker's event loop.
EXTENSION = "serve.door"

# The prediction routes, each with whether its requests queue in a batcher (and
# so wait for the work ahead) and whether the URL's ?model= names their model
# (TEI's); the others name it in the body, which the door does not read. v2's
# name it in the path (admitted_route).
ADMITTED_ROUTES: dict[str, tuple[bool, bool]] = {
    "/predict": (True, False),
    "/predict/batched": (True, False),
    "/predict/naive": (False, False),
    "/v1/embeddings": (True, False),
    "/v1/rerank": (True, False),
    "/v2/rerank": (True, False),
    "/rerank/batched": (True, False),
    "/rerank/naive": (False, False),
    "/embed": (True, True),
    "/rerank": (True, True),
    "/": (True, True),
}


def admitted_route(environ: dict[str, Any]) -> tuple[bool, str | None, str] | None:
    """Whether the request is for a prediction route: (queued, the model its URL names, the route's rule).

    None: not a prediction route (probes, metrics, /tokenize), which the door
    lets through. The model is None where the URL names none (the default, or
    the one the unread body names). The rule is Flask's, as the request metrics
    name the route: never a path with a model's name in it.
    """
    path = environ.get("PATH_INFO", "")
    route = ADMITTED_ROUTES.get(path)
    if route is not None:
        queued, in_query = route
        return queued, query_model(environ) if in_query else None, path
    # The Open Inference Protocol's /v2/models/<name>[/versions/<v>]/infer.
    parts = path.split("/")
    if parts[1:3] != ["v2", "models"] or parts[-1] != "infer":
        return None
    if len(parts) == 5:
        return True, parts[3], "/v2/models/<name>/infer"
    if len(parts) == 7 and parts[4] == "versions":
        return True, parts[3], "/v2/models/<name>/versions/<version>/infer"
    return None


@dataclass(frozen=True, slots=True)
class Refusal:
    """The door's answer to a request it refuses: a 503 in the route's error shape."""

    status: str
    headers: list[tuple[str, str]]
    body: bytes
    # How long its connection is to be held before its next request is read
    # (service.host.hold); 0.0 where SERVE_HOLD_REFUSED is off.
    hold_s: float


class Door:
    # How long after a refusal the worker's event loop keeps checking requests
    # itself (service.host.worker): refusals come in runs, under overload.
    REFUSING_S = 1.0

    def __init__(self, app: WsgiApp, models: ModelSet, metrics: Metrics) -> None:
        self._app = app
        self._models = models
        # The admission rule and the wait before the handler are the worker's,
        # whatever the model; the predicted wait is the model's own. With
        # several models, a body that names one is unread here, so the door
        # checks only the wait so far, and that model's batcher the rest.
        self._runtime = runtime = models.default
        self._metrics = metrics
        self._standing = runtime.admission.standing_queue()
        self._lock = native.allocate_lock()  # guards _standing: every request thread updates it
        self._last_refusal = -math.inf

    def refusing(self, now: float) -> bool:
        """Whether the door refused a request within the last REFUSING_S."""
        return now - self._last_refusal < self.REFUSING_S

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        refusal = self.check(environ)
        if refusal is None:
            return self._app(environ, start_response)
        start_response(refusal.status, refusal.headers)
        if refusal.hold_s:
            hold(environ, refusal.hold_s)
        # The body, unread, is read after the answer is out (service.http.linger), so
        # that the connection can carry the client's next request.
        return [refusal.body]

    def check(self, environ: dict[str, Any], *, ahead_of_thread: bool = False) -> Refusal | None:
        """The refusal, counted, for a request that cannot be answered in time; None to let it in.

        Once it returns None, ``environ[ARRIVAL_ENVIRON_KEY]`` is the arrival the
        route counts the deadline from. The environ needs only what a request's
        line and headers give, and the worker's stamps.

        ``ahead_of_thread``: the gthread worker's event loop asks, before the
        request waits for a thread (service.host.worker). It counts only a
        refusal: a request it lets in is checked again, and counted, by the door
        in its thread, as every request is, after its wait for the thread.
        """
        route = admitted_route(environ)
        if route is None or environ.get("REQUEST_METHOD") != "POST":
            return None
        queued, name, rule = route
        now = time.monotonic()
        waited = settle_wait(
            environ.get(ARRIVAL_ENVIRON_KEY),
            now,
            proxy_wait(environ.get("HTTP_X_REQUEST_START"), time.time()),
        )
        environ[ARRIVAL_ENVIRON_KEY] = now - waited
        if not ahead_of_thread:
            self._metrics.observe_wait(waited)
        # The model whose queue the request joins: a lone model, or the one the URL
        # names; one the body names is not known here.
        runtime: ModelRuntime | None = None
        if self._models.single:
            runtime = self._runtime
        elif name is not None:
            runtime = self._models.named(name)
            if runtime is None:
                return None  # no such model: the route's 404
        settings = (runtime or self._runtime).settings
        length = _content_length(environ)
        if length is not None and length > settings.max_body_bytes:
            return None  # the route refuses it unread: 413, not 503
        batcher = runtime.batcher if queued and runtime is not None else None
        # Weighed by its items before they are read: the body's length at the
        # bytes per item of recent requests, no more than a request may hold
        # (the batcher checks the exact count).
        items = 1
        if batcher is not None:
            items = min(batcher.gate.estimate_items(length), settings.max_items_per_request)
        deadline_s = _deadline_s(environ, settings.request_timeout_ms)
        if batcher is not None and batcher.gate.too_large(items, deadline_s) is not None:
            # Too large even alone, by its length: the batcher refuses it once
            # its items are known (413, not 503).
            return None
        predicted, behind = batcher.gate.door_outlook(items) if batcher is not None else (0.0, False)
        returning = environ.get(RETURNING_ENVIRON_KEY)
        # Asked before its wait for a thread while arrivals outrun the answers, a
        # request is judged on the wait the door in its thread will see: one that
        # will wait past the standing queue's target is refused now, where its
        # refusal costs a third of a thread's. While the service keeps up, a queue
        # for threads is a closed loop's, answered by its deadline: the estimate
        # (each request ahead holds a thread for a whole service time) would refuse
        # clients the threads' door lets in once those ahead of them are refused.
        to_wait = _thread_wait(environ, batcher) if ahead_of_thread and behind else 0.0
        # A returning request waited out a hold the worker chose, not a queue: it
        # neither shows nor is refused by a standing queue (else a service whose
        # clients had all been refused once would refuse them for good).
        standing = not returning and self._stands(waited + to_wait, now, count=not ahead_of_thread)
        admission = (runtime or self._runtime).admission
        refusal = admission.decide(
            waited,
            predicted,
            deadline_s=deadline_s,
            behind=behind,
            standing=standing,
            returning=returning == LET_IN,
            to_wait_s=to_wait,
        )
        if refusal is None:
            return None
        if ahead_of_thread:  # what the door in the thread would have counted
            self._metrics.observe_wait(waited)
            if not returning:
                self._stands(waited + to_wait, now, count=True)
        if batcher is not None:
            # Demand unmet, for the pace (Gate.admit says which counts).
            follow_up = environ.get(FOLLOW_UP_ENVIRON_KEY, True)
            batcher.gate.refused(items, waited if follow_up else None, environ.get(WAITING_ENVIRON_KEY))
        return self._refused(environ, refusal, runtime, rule, now)

    def _stands(self, waited: float, now: float, *, count: bool) -> bool:
        """The standing queue's verdict on a request that waited ``waited``, counting its wait or not."""
        with self._lock:
            return (self._standing.standing if count else self._standing.stands)(waited, now)

    def _refused(
        self,
        environ: dict[str, Any],
        refusal: AdmissionRefusal,
        runtime: ModelRuntime | None,
        rule: str,
        now: float,
    ) -> Refusal:
        """The 503 for ``refusal``, counted in the metrics, in the route's error shape."""
        self._last_refusal = now
        # Counted under the model the URL names (or the lone one); one the unread body names is unknown.
        model = (runtime.served_name if runtime is not None else None) or NO_MODEL
        environ[MODEL_ENVIRON_KEY] = model
        exc = Overloaded(refusal.message, reason="over_budget", retry_after_s=refusal.retry_after_s)
        self._metrics.count_error(exc, model)
        # In the route's own error shape: OpenAI's, Cohere's, TEI's or the service's.
        status, document = error_document(environ.get("PATH_INFO", ""), 503, refusal.message, exc)
        body = orjson.dumps(document)
        headers = [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Retry-After", str(refusal.retry_after_s)),
            (REQUEST_ID_HEADER, request_id(environ.get("HTTP_X_REQUEST_ID"))),
        ]
        # Counted with the other answers, so 503s add up in serve_http_requests_total.
        self._metrics.observe_request(rule, 503, time.monotonic() - now, model)
        admission = (runtime or self._runtime).admission
        settings = (runtime or self._runtime).settings
        hold_s = hold_seconds(refusal.retry_after_s, admission.budget_s) if settings.hold_refused else 0.0
        return Refusal(f"{status} Service Unavailable", headers, body, hold_s)


def _thread_wait(environ: dict[str, Any], batcher: Batcher | None) -> float:
    """How long a request the gthread worker's event loop checks will wait for a request thread."""
    return 0.0 if batcher is None else batcher.gate.thread_wait(environ.get(WAITING_ENVIRON_KEY) or 0)


def _content_length(environ: dict[str, Any]) -> int | None:
    return header_number(environ.get("CONTENT_LENGTH"))


def _deadline_s(environ: dict[str, Any], timeout_ms: int) -> float:
    """The request's time to its deadline: the request timeout, or less if its client asks.

    A header that is not a positive integer is the route's to refuse (400); here it is ignored.
    """
    asked = header_number(environ.get(TIMEOUT_ENVIRON_KEY))
    if asked:
        timeout_ms = min(timeout_ms, asked)
    return timeout_ms / 1000

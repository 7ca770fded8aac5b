"""The one inference path every protocol shares: body, deadline, admission, batcher, outputs.

A protocol module only translates: it turns its request body into raw items
and the outputs into its own response. Everything between runs here, once for
all of them: the body limit, readiness, the deadline (SERVE_REQUEST_TIMEOUT_MS,
lowered by X-Request-Timeout-Ms), validation of every item by the model
(``service.http.payload.prepare_items``, called by each protocol's parser),
the batcher's queue bound, and waiting for the batch. The access line and the
request metrics come from the middleware around the app, and the bearer token
from a request hook; both see every route (``service.http.access``,
``service.http.routes.require_token``; the direct routes,
``service.http.direct``, check the token themselves).

``serve_batched`` and ``serve_naive`` take the request's WSGI environ rather
than Flask's request, so that the direct routes run them without a request
context. Each inference route is a ``Handler`` giving an ``Answer``, which the
direct routes and the route's Flask view (``Answer.response``) write alike.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qs

import orjson
from flask import Response, current_app
from werkzeug.exceptions import ClientDisconnected, HTTPException
from werkzeug.wsgi import get_content_length, get_input_stream

from service.batching.batcher import Batcher
from service.batching.waiting import wait_result
from service.errors import BadRequest, Overloaded, PayloadTooLarge
from service.http.access import note_batch_size
from service.http.arrival import (
    ARRIVAL_ENVIRON_KEY,
    FOLLOW_UP_ENVIRON_KEY,
    HANDLER_ENVIRON_KEY,
    LET_IN,
    MODEL_ENVIRON_KEY,
    RETURNING_ENVIRON_KEY,
    TIMEOUT_ENVIRON_KEY,
    WAITING_ENVIRON_KEY,
)
from service.http.resend import BODY_ENVIRON_KEY, HELD_DIGEST_ENVIRON_KEY, is_resend
from service.http.tei_codec import PATHS as TEI_PATHS
from service.model_set import ModelSet
from service.models import Model
from service.models.base import Outputs
from service.runtime import EXTENSION, ModelRuntime

TIMEOUT_HEADER = "X-Request-Timeout-Ms"
# A body this small is read without taking room in the worker's bound on bodies.
SMALL_BODY_BYTES = 64 << 10
BATCH_SIZE_HEADER = "X-Batch-Size"

# The model a request names, by the name its body gives (None: the default
# model): what a parser calls once it has read the name (ModelSet.pick).
Choose = Callable[[Any], Model]
# Turns a request body into the prepared items of the model it chose, or raises a ServeError.
Parser = Callable[[bytes, Choose], list[Any]]
T = TypeVar("T")


def runtime() -> ModelSet:
    models: ModelSet = current_app.extensions[EXTENSION]
    return models


def json_bytes(document: object) -> bytes:
    """A JSON body as every route writes it; numpy arrays and scalars included."""
    return orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)


def json_response(document: object, status: int = 200) -> Response:
    return Response(json_bytes(document), status=status, mimetype="application/json")


def is_inference_path(path: str) -> bool:
    """Whether ``path`` runs the model: the routes that SERVE_API_TOKEN guards."""
    return (
        path.startswith(("/predict", "/rerank/"))
        or path in ("/v1/embeddings", "/v1/rerank", "/v2/rerank")
        or path in TEI_PATHS
        or (path.startswith("/v2/models/") and path.endswith("/infer"))
    )


def query_model(environ: dict[str, Any]) -> str | None:
    """The model the URL's ``?model=`` names (the last, if several); None without one."""
    query = environ.get("QUERY_STRING")
    return parse_qs(query).get("model", [None])[-1] if query else None


def deadline(started: float, limit_ms: int, environ: dict[str, Any]) -> float:
    """The request's monotonic deadline: ``limit_ms`` (SERVE_REQUEST_TIMEOUT_MS), or less if asked."""
    raw = environ.get(TIMEOUT_ENVIRON_KEY)
    if raw is not None:
        try:
            asked = int(raw)
        except ValueError:
            asked = 0
        if asked < 1:
            raise BadRequest(f"{TIMEOUT_HEADER} must be a positive integer of milliseconds, got {raw!r}")
        limit_ms = min(limit_ms, asked)
    return started + limit_ms / 1000


def read_body(environ: dict[str, Any], limit: int) -> bytes:
    """The request body, refused when it is over ``limit`` (SERVE_MAX_BODY_BYTES) or its framing is broken."""
    known = get_content_length(environ)  # None: chunked, or no length given
    if known is not None and known > limit:
        raise _over(limit)
    try:
        if known is not None:
            body = _read_length(environ["wsgi.input"], known)
        else:
            # What Flask's request.get_data reads, with MAX_CONTENT_LENGTH at one byte over the limit.
            body = get_input_stream(environ, max_content_length=limit + 1).read()
    except HTTPException:
        raise  # werkzeug's own: 413 for a body over the limit, 400 for a client gone mid-body
    except Exception as exc:
        # The server could not decode the body's framing (gunicorn raises its
        # InvalidChunkSize on a malformed chunked body): the client's fault, not ours.
        raise BadRequest(f"the request body could not be read ({type(exc).__name__})") from None
    if len(body) > limit:
        # werkzeug refuses a Content-Length, or a chunked body as it streams,
        # past limit + 1 bytes; a body of exactly limit + 1 is refused here.
        raise _over(limit)
    # Kept for its digest, should the request be refused and its connection held.
    environ[BODY_ENVIRON_KEY] = body
    return body


def _over(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body is over {limit} bytes (SERVE_MAX_BODY_BYTES)")


def _read_length(stream: Any, length: int) -> bytes:
    """A body of ``length`` bytes, its Content-Length, read straight from the server's stream.

    werkzeug's LimitedStream reads the same in 64 KiB steps through a buffer
    it allocates for each, and asks once more to find the end: a tenth of a
    small request's Python time under gevent (docs/bench-request-path.md). A
    body of known length needs one read. A short body or a failed read is a
    client gone mid-body, as LimitedStream tells it.
    """
    try:
        body: bytes = stream.read(length)
        while len(body) < length:  # a stream may hand over less than asked: the rest, or the end
            more = stream.read(length - len(body))
            if not more:
                raise ClientDisconnected()
            body += more
    except (OSError, ValueError) as exc:
        raise ClientDisconnected() from exc
    return body


def take_body_room(rt: ModelSet, environ: dict[str, Any], until: float) -> int:
    """Room in the worker's bound on bodies (ModelSet.bodies) for this request's: what to give back.

    A body is weighed by its Content-Length, a chunked one as the limit. Bodies
    of SMALL_BODY_BYTES or less take none (the threads or connections a worker
    has bound them). A request that finds no room by ``until`` (its latency
    budget or its deadline) gets 503 rather than hold its thread longer.
    """
    limit = rt.settings.max_body_bytes
    declared = environ.get("CONTENT_LENGTH")
    if declared and declared.isdigit():
        weight = min(int(declared), limit)
    elif "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower():
        weight = limit
    else:
        return 0
    if weight <= SMALL_BODY_BYTES:
        return 0
    taken = rt.bodies.take(weight, max(0.0, until - time.monotonic()))
    if taken is None:
        raise Overloaded(
            f"this worker holds {rt.bodies.held} bytes of request bodies, its bound is "
            f"{rt.bodies.capacity} (four bodies of SERVE_MAX_BODY_BYTES, at least 64 MiB); retry",
            reason="queue_full",
        )
    return taken


@dataclass(frozen=True)
class Batched:
    model: Model
    outputs: Outputs
    # Items in the batch this request ran in.
    batch_size: int


def serve_batched(models: ModelSet, environ: dict[str, Any], parse: Parser) -> Batched:
    """Parse the request's body with ``parse`` and run its items through its model's batcher."""
    arrived = _arrival(environ)
    until = deadline(arrived, models.settings.request_timeout_ms, environ)
    if models.single:
        rt = models.default
        if rt.served_name is not None:
            environ[MODEL_ENVIRON_KEY] = rt.served_name
        model, batcher = rt.require_ready()
        # The lone model's batcher counts the request from before its body is read:
        # a request being read is one that gathering may wait for.
        with batcher.in_flight():
            choose = _lone(models, model)
            items, size = _read_items(models, environ, parse, choose, until=until, arrived=arrived)
            return _run(model, batcher, items, environ, body_bytes=size, until=until, arrived=arrived)
    models.require_ready()
    with contextlib.ExitStack() as stack:
        # With several, the body says whose the request is: counted from then.
        choose, chosen = _chooser(models, environ, stack)
        items, size = _read_items(models, environ, parse, choose, until=until, arrived=arrived)
        rt = chosen[0] if chosen else models.default
        model, batcher = rt.require_ready()
        return _run(model, batcher, items, environ, body_bytes=size, until=until, arrived=arrived)


def serve_in_thread(models: ModelSet, environ: dict[str, Any], work: Callable[[bytes, float], T]) -> T:
    """``work(body, until)`` for a route that answers in the request thread (TEI's ``/tokenize``).

    Its body is read as a batched route reads its own: within the worker's
    bound on bodies, and by the request's deadline ``until``, which ``work``
    keeps to as it goes.
    """
    arrived = _arrival(environ)
    until = deadline(arrived, models.settings.request_timeout_ms, environ)
    return _with_body(models, environ, lambda body: work(body, until), until=until, arrived=arrived)


def _arrival(environ: dict[str, Any]) -> float:
    # From the request's arrival (service.http.door), not from now: its wait for
    # a thread counts toward its deadline and its latency budget.
    arrived = environ.get(ARRIVAL_ENVIRON_KEY)
    return arrived if isinstance(arrived, float) else time.monotonic()


def _read_items(
    models: ModelSet, environ: dict[str, Any], parse: Parser, choose: Choose, *, until: float, arrived: float
) -> tuple[list[Any], int]:
    """The request's prepared items, and its body's size; its body held within the worker's bound."""
    return _with_body(
        models, environ, lambda body: (parse(body, choose), len(body)), until=until, arrived=arrived
    )


def _with_body(
    models: ModelSet, environ: dict[str, Any], use: Callable[[bytes], T], *, until: float, arrived: float
) -> T:
    """``use`` of the request's body, which holds room in the worker's bound on bodies meanwhile."""
    settings = models.settings
    room = take_body_room(models, environ, min(until, arrived + settings.latency_budget_s))
    try:
        return use(read_body(environ, settings.max_body_bytes))
    finally:
        if room:
            models.bodies.give_back(room)


def _run(
    model: Model,
    batcher: Batcher,
    items: list[Any],
    environ: dict[str, Any],
    *,
    body_bytes: int,
    until: float,
    arrived: float,
) -> Batched:
    """Queue the request's items and wait for their answer."""
    returning = environ.get(RETURNING_ENVIRON_KEY)
    # Read after a hold: the refused request again, or a new one (an open-loop
    # client's next, another client's through a proxy), which is new demand.
    resend = returning is not None and is_resend(
        environ.get(HELD_DIGEST_ENVIRON_KEY), environ.get(BODY_ENVIRON_KEY, b"")
    )
    pending = batcher.submit(
        items,
        until,
        arrived,
        returning=returning == LET_IN,
        resend=resend,
        first_on_connection=not environ.get(FOLLOW_UP_ENVIRON_KEY, True),
        queue_wait=_queue_wait(environ, arrived),
        body_bytes=body_bytes,
        waiting=environ.get(WAITING_ENVIRON_KEY),
    )
    outputs = wait_result(pending.future, until - time.monotonic(), client_gone(environ))
    note_batch_size(environ, pending.batch_size)
    return Batched(model, outputs, pending.batch_size)


def _lone(models: ModelSet, model: Model) -> Choose:
    """A lone model's chooser: its own name (or none) at once; any other is the set's to refuse."""

    def choose(name: Any) -> Model:
        if name is None or name == model.name:
            return model
        models.pick(name)  # another name of it (an alias), or 404 naming it
        return model

    return choose


def _chooser(
    models: ModelSet, environ: dict[str, Any], stack: contextlib.ExitStack
) -> tuple[Choose, list[ModelRuntime]]:
    """The parser's way to name its model, and the list the choice lands in.

    The chosen model's batcher counts the request in flight from then. A parser
    that named a model twice gets its first choice again.
    """
    chosen: list[ModelRuntime] = []

    def choose(name: Any) -> Model:
        if chosen:
            return chosen[0].require_ready()[0]
        rt = models.pick(name)
        environ[MODEL_ENVIRON_KEY] = rt.label
        model, batcher = rt.require_ready()
        stack.enter_context(batcher.in_flight())
        chosen.append(rt)
        return model

    return choose, chosen


def _queue_wait(environ: dict[str, Any], arrived: float) -> float | None:
    """How long the request waited before its handler (None: the server does not say)."""
    handler_at = environ.get(HANDLER_ENVIRON_KEY)
    return max(0.0, handler_at - arrived) if isinstance(handler_at, float) else None


def client_gone(environ: dict[str, Any]) -> Callable[[], bool] | None:
    """Whether the request's client hung up, from its connection (None: the server gives none).

    Looked at without reading: a client that waits for its answer sends
    nothing, so a readable socket that peeks empty is one that closed.
    """
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return None

    def gone() -> bool:
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
        except ValueError:
            return False  # a socket that cannot peek (TLS): no telling, so not gone
        except OSError:
            return True  # reset, or closed under us

    return gone


def serve_naive(models: ModelSet, environ: dict[str, Any], parse: Parser) -> Batched:
    """Parse the request's body and run its items in this thread (the comparison route)."""
    models.require_ready()
    if models.single:
        rt = models.default
        choose = _lone(models, rt.require_ready()[0])
        if rt.served_name is not None:
            environ[MODEL_ENVIRON_KEY] = rt.served_name
        chosen = [rt]
    else:
        choose, chosen = _chooser(models, environ, contextlib.ExitStack())
    room = take_body_room(models, environ, time.monotonic() + models.settings.request_timeout_ms / 1000)
    try:
        items = parse(read_body(environ, models.settings.max_body_bytes), choose)
    finally:
        if room:
            models.bodies.give_back(room)
    rt = chosen[0] if chosen else models.default
    outputs = rt.predict_naive(items)
    note_batch_size(environ, len(items))
    return Batched(rt.require_ready()[0], outputs, len(items))


@dataclass(frozen=True)
class Answer:
    """A route's answer to a request it served, written by Flask or by the direct routes alike."""

    body: bytes
    content_type: str
    # After Content-Type and Content-Length, in order.
    headers: tuple[tuple[str, str], ...]

    def response(self) -> Response:
        """The answer as a Flask view returns it."""
        response = Response(self.body, content_type=self.content_type)
        for name, value in self.headers:
            response.headers[name] = value
        return response


# A route as the direct routes call it (service.http.direct): the worker's models, the
# request's environ and the route's arguments (v2's model name) to its answer.
Handler = Callable[[ModelSet, dict[str, Any], Mapping[str, Any]], Answer]


def json_answer(document: object, batch_size: int) -> Answer:
    """A JSON document, as json_response writes it, with the batch size the request ran in."""
    return Answer(json_bytes(document), "application/json", (batch_size_header(batch_size),))


def batch_size_header(batch_size: int) -> tuple[str, str]:
    # Lets a client (and the tests) see batching at work without scraping metrics.
    return BATCH_SIZE_HEADER, str(batch_size)

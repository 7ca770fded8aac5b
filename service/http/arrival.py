"""When a request arrived, as the worker saw it or as a proxy in front vouches. Pure: no clock, no I/O.

The latency budget counts from a request's arrival, not from when its handler
began: under overload most of the wait is before the handler (nginx, the
kernel's accept backlog, gthread's queue of connections waiting for a thread).
The gthread worker (service.host.worker) stamps when it accepted the connection
or saw it readable again, and both worker classes take the kernel's word when
the request's bytes arrived earlier (service.host.tcp_info: the accept queue, a
poller behind); behind nginx, ``X-Request-Start: t=<unix seconds>``
(deploy/nginx.conf) also covers the time in nginx.

It also holds the keys by which the service asks the worker to hold a refused
client's connection, and the worker marks the request it reads after a hold
(service.host.hold). Only this module, service.http.resend and their callers
know the environ keys, so neither imports more than the standard library: the
gunicorn master imports them through the worker class.
"""

from __future__ import annotations

from service.http.resend import note_refused_body

# The client's own deadline for a request, in milliseconds, as WSGI names the header
# (X-Request-Timeout-Ms): the door reads it before the route does.
TIMEOUT_ENVIRON_KEY = "HTTP_X_REQUEST_TIMEOUT_MS"

# The served name of the model a request was routed to (service.models_set), once
# known: for the model label of its request and shedding metrics (service.http.access).
MODEL_ENVIRON_KEY = "serve.model"

# The monotonic time the worker stamped, then the arrival the door settled on.
ARRIVAL_ENVIRON_KEY = "serve.arrived"

# The monotonic time the worker handed the request to the app: with the arrival,
# its wait before the handler (admission.Pace), the body's reading left out.
HANDLER_ENVIRON_KEY = "serve.handler_at"

# Set by the worker on a request that is not the first on its connection: its
# wait before the handler says how long the worker's queue is (admission.Pace);
# a first request's may be the first pass of clients that all connected at once.
FOLLOW_UP_ENVIRON_KEY = "serve.follow_up"

# Set by the gthread worker: the requests still waiting for a request thread
# when this one got its own, the queue before the handler (admission.Pace).
WAITING_ENVIRON_KEY = "serve.waiting"

# Seconds the worker holds a connection after a request on it was refused with
# 503, before it reads the next one (service.host.hold); absent: no hold.
HOLD_ENVIRON_KEY = "serve.hold_s"
# Set by the worker on the first request it reads after a hold, whose client was
# refused and then waited by the worker's choice, not in a queue: LET_IN when it
# was let in early because the batcher had room for it (service.host.hold.let_in),
# HELD_OUT when its hold simply ended.
RETURNING_ENVIRON_KEY = "serve.returning"
LET_IN = "let in"
HELD_OUT = "held out"
# The longest hold: long enough that an immediate resender costs a refusal a
# second at most, short enough that a connection its client closed meanwhile
# is not kept long, whatever Retry-After a slow model's queue asks for.
MAX_HOLD_S = 2.0

# A proxy's stamp implying a longer wait than this is a clock out of step (or
# made up), not a request that waited: it is ignored rather than trusted to
# refuse every request.
MAX_PROXY_WAIT_S = 600.0


def proxy_wait(header: str | None, now_unix: float) -> float:
    """Seconds since the proxy's ``X-Request-Start``; 0 when absent or not sane.

    Accepts nginx's ``t=1700000000.123`` (seconds) and the millisecond and
    microsecond integers other proxies send. A client may send the header too,
    but the door takes the larger of this and the worker's own wait, so a forged
    value can only make its own request look older (and refused), never let it
    skip ahead; a time in the future or absurdly far back counts as nothing.
    """
    if not header:
        return 0.0
    raw = header.strip().removeprefix("t=")
    if len(raw) > 24:
        return 0.0
    try:
        stamp = float(raw)
    except ValueError:
        return 0.0
    if stamp > 1e14:  # microseconds
        stamp /= 1e6
    elif stamp > 1e11:  # milliseconds
        stamp /= 1e3
    waited = now_unix - stamp
    # NaN fails the comparison and counts as nothing too.
    if not 0.0 <= waited <= MAX_PROXY_WAIT_S:
        return 0.0
    return waited


def settle_wait(worker_stamp: object, now: float, proxy_waited: float) -> float:
    """Seconds the request has waited: the longer of the worker's and the proxy's view.

    ``worker_stamp``: the worker's monotonic stamp from the environ (absent
    outside the gthread worker, or garbage: then only the proxy's view counts).
    """
    own = now - worker_stamp if isinstance(worker_stamp, float) else 0.0
    return max(0.0, own, proxy_waited)


def hold_seconds(retry_after_s: float, budget_s: float) -> float:
    """How long to hold a refused client's connection after its 503.

    A refused client's connection is left unread for its Retry-After, at most
    MAX_HOLD_S and half the latency budget, or until the batcher has room for
    its resend (service.host.hold): a client that resends at once then waits
    its turn, and costs a refusal a second at most instead of thousands.

    A proxy's kept-alive connection is held too, though the next request on it
    may be another client's: through nginx, 64 clients that resend at once got
    0.17x of capacity with proxied connections left unheld, since every resend
    came back at once through nginx's other connections. Held, they got 0.96x.
    The next request on a held connection waits only until the batcher has room
    for it, as it would have in the queue, and the wait counts toward its budget.
    """
    # A resend sent at once has waited the hold when its hold ends, and the hold
    # counts toward its budget: at most half of it, so that a resend whose hold
    # ends can still be admitted with a fresh request's margin (AdmissionRule.decide).
    # Longer holds mean fewer refusals from clients waiting their turn: 256 such
    # clients kept 0.72 to 0.81x of capacity with a quarter, 0.81 to 0.89x with half.
    return min(float(retry_after_s), MAX_HOLD_S, budget_s / 2)


def ask_to_hold(environ: dict[str, object], retry_after_s: float, budget_s: float) -> None:
    """Ask the worker to hold this connection after its 503, for ``hold_seconds``."""
    hold(environ, hold_seconds(retry_after_s, budget_s))


def hold(environ: dict[str, object], hold_s: float) -> None:
    """Ask the worker to hold this connection after its 503 for ``hold_s``."""
    environ[HOLD_ENVIRON_KEY] = hold_s
    # For the connection to tell its next request a resend or a new one; a
    # body not read yet leaves its digest as service.http.linger drains it.
    note_refused_body(environ)

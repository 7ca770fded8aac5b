# design:
# - The event loop (gthread's main thread) hands a connection to the thread
#   pool when it is accepted or, kept alive, becomes readable again: that is
#   when its request arrived. Under overload it then waits in the pool's queue
#   for a free thread, out of the batcher's sight. enqueue_req stamps the
#   connection then (time.monotonic()); the pool thread that takes it copies
#   the stamp into a thread-local, and the WSGI callable puts it into the
#   request's environ under ARRIVAL_ENVIRON_KEY, where service.http.door counts
#   the wait toward the request's latency budget.
# - A stamp is written before the connection is submitted to the pool and read
#   by the one thread that runs it: the pool's queue orders the two.
# - Balance: see service.host.balance; the event loop alone reads and updates it.
# - Holds: see service.host.hold. The request thread copies the door's hold
#   from the environ onto its connection; the event loop parks the connection
#   in HeldConnections instead of its poller, and releases it when due or, once
#   its client has resent, as soon as the batcher has room (let_in), after any
#   turn of the loop. InTransit counts those let in and not yet picked up by a
#   thread: the event loop adds, request threads take off.
# - Refusals in the event loop: while the door is refusing, enqueue_req peeks
#   at a kept-alive connection's socket and, for a whole plain request
#   (service.http.request_head), asks the door (Door.check, ahead_of_thread).
#   A refusal is taken off the socket, answered with one send and held as a
#   thread's would be (finish_request with KEPT_ALIVE); anything else is left
#   in the socket for a thread, which reads it as it always did. The door's
#   verdict is made of the same reads a request thread makes, under the same
#   locks, so the loop and the threads may ask at once.
# - A new connection's first request, likewise: while the door is refusing, one
#   whose request is not in yet waits for it in the poller (gthread's pending
#   connections) rather than in a thread, and is checked when it is. Clients
#   that open a connection a request, or a pool that closes what it cannot keep,
#   bring a new connection with a good share of an open loop's requests.

"""gunicorn's gthread worker: it stamps each request's arrival, and accepts only its share of connections.

``gunicorn_conf.py`` names this class as the worker class wherever the plan says
gthread, and hands each worker its ``Balance`` in ``post_fork`` when
SERVE_BALANCE_CONNECTIONS is on. Without one it accepts as gthread does.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from gunicorn import SERVER
from gunicorn.http2.negotiation import prior_knowledge_allowed
from gunicorn.workers.gthread import _DEFER, ThreadWorker

from service.batching.admission import predict_wait
from service.host.balance import Balanced
from service.host.hold import PEEK_NOW, HeldConnections, peek
from service.host.lifecycle import door_of, runtime_of
from service.host.one_write import http_date, one_write
from service.host.tcp_info import since_last_data
from service.http.arrival import (
    ARRIVAL_ENVIRON_KEY,
    FOLLOW_UP_ENVIRON_KEY,
    HANDLER_ENVIRON_KEY,
    HELD_OUT,
    HOLD_ENVIRON_KEY,
    LET_IN,
    RETURNING_ENVIRON_KEY,
    WAITING_ENVIRON_KEY,
)
from service.http.request_head import RequestHead, read_head
from service.http.resend import HELD_DIGEST_ENVIRON_KEY, REFUSED_DIGEST_ENVIRON_KEY, digest

if TYPE_CHECKING:
    from service.http.door import Refusal
    from service.runtime import ModelRuntime

T = TypeVar("T")
log = logging.getLogger(__name__)
# A request let in reaches a thread within milliseconds; one that has not after
# this long never will (its client hung up), and no longer takes room.
IN_TRANSIT_TTL_S = 1.0
# Bytes peeked at for a request checked in the event loop: a larger request goes the usual way.
PEEK_BYTES = 65536
WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class BalancedThreadWorker(Balanced, ThreadWorker):  # type: ignore[misc]  # gunicorn ships no type hints
    nr_conns: int  # gthread's count of the connections it holds open
    nr: int  # requests answered, toward max_requests
    max_requests: int
    max_keepalived: int
    keepalived_conns: deque[Any]
    poller: selectors.BaseSelector
    _configured_connections: int
    wsgi: Any
    alive: bool
    _arrivals: threading.local
    _held: HeldConnections[tuple[Any, Future[Any]]]

    # gthread's event loop accepts while ``nr_conns < worker_connections`` and
    # re-reads both on every turn, so this property is where a worker that holds
    # more than its share stops accepting: it answers "no room" until the
    # others have caught up. The configured limit still applies on top.
    @property
    def worker_connections(self) -> int:
        if self.balance is None or self.balance.may_accept(self.nr_conns):
            return self._configured_connections
        return min(self.nr_conns, self._configured_connections)

    @worker_connections.setter
    def worker_connections(self, value: int) -> None:
        self._configured_connections = value

    def load_wsgi(self) -> None:
        super().load_wsgi()
        # Read once: the settings are a worker's for its life (a reload starts new
        # workers), and each read goes through gunicorn's settings lookup.
        self._plain_listeners = plain_listeners(self.cfg)
        self._arrivals = arrivals_local(threading.local)
        self._held = HeldConnections()
        self._in_transit = InTransit()
        # One entry per connection handed to the pool and not yet taken by a thread:
        # the event loop appends, request threads pop (deque operations are atomic).
        self._waiting: deque[None] = deque()
        self._door: Any = None  # the app's door, once looked up; False: none
        self.wsgi = StampedApp(self.wsgi, self._arrivals)

    def enqueue_req(self, conn: Any) -> None:
        if self._awaits_first_request(conn):
            return
        # A resend sent during a hold arrived when the worker first saw it, at the latest.
        held_since, conn.serve_held_since = getattr(conn, "serve_held_since", None), None
        conn.serve_arrived = time.monotonic() if held_since is None else held_since
        conn.serve_requests = getattr(conn, "serve_requests", 0) + 1
        if self._refused_here(conn):
            return
        self._waiting.append(None)  # until a request thread takes it (handle)
        super().enqueue_req(conn)

    def _refused_here(self, conn: Any) -> bool:
        """Check a connection's request at the door in the event loop; whether it was refused or closed here.

        Only while the door is refusing (it refused within the last second), and
        only for a request whose bytes are all in and plain (service.http.request_head):
        the rest go to a request thread as always. A refusal is answered and its
        connection held (or put back in the poller) without a thread; a request
        the door would let in goes to a thread untouched, to be checked there.
        A request read after a hold is checked as the door checks it in a thread:
        as returning (RETURNING_ENVIRON_KEY). A kept-alive connection's or a new
        one's; one its client closed is closed here.
        """
        if not self._refusing():
            return False
        if not (self._plain_keep_alive(conn) if conn.initialized else self._plain_new(conn)):
            return False
        try:
            data = conn.sock.recv(PEEK_BYTES, PEEK_NOW)
        except OSError:
            return False
        if not data:
            # Its client closed it (a pool that keeps only so many idle): closed
            # here, as a thread would, without one.
            self._close_here(conn)
            return True
        door = self._door
        stamps = {
            ARRIVAL_ENVIRON_KEY: kernel_arrival(conn.serve_arrived, conn.sock),
            FOLLOW_UP_ENVIRON_KEY: conn.serve_requests > 1,
            WAITING_ENVIRON_KEY: len(self._waiting),
            RETURNING_ENVIRON_KEY: getattr(conn, "serve_returning", None),
        }
        refused = check_ahead(door, data, stamps)
        if refused is None:
            return False
        self._answer_refusal(conn, *refused)
        return True

    def _awaits_first_request(self, conn: Any) -> bool:
        """Whether a new connection, its request not in yet, was left to the poller to wait for it.

        Only while the door is refusing: its request is then checked in the
        event loop when it arrives (gthread's "pending" connections), where a
        refusal costs no thread. Otherwise a thread takes the connection at
        once and waits for its request, as gthread does.
        """
        if conn.initialized or conn.data_ready or not self._refusing() or not self._plain_new(conn):
            return False
        try:
            if conn.sock.recv(1, PEEK_NOW):
                conn.data_ready = True  # so that gthread's thread does not wait for it again
                return False
        except (BlockingIOError, InterruptedError):
            super().finish_request(conn, AWAITING_DATA)
            return True
        except OSError:
            pass
        return False  # closed or broken: enqueue_req goes on, and finds out

    def _refusing(self) -> bool:
        door = self._door
        if door is None:
            door = self._door = door_of(self) or False
        return door is not False and bool(door.refusing(time.monotonic()))

    def _landed(self, conn: Any) -> None:
        """A connection let in from a hold has reached its check: it no longer counts as in transit."""
        if getattr(conn, "serve_in_transit", False):
            conn.serve_in_transit = False
            self._in_transit.landed()

    def _close_here(self, conn: Any) -> None:
        self._landed(conn)
        self.nr_conns -= 1
        conn.close()

    def _answer_refusal(self, conn: Any, head: RequestHead, refusal: Refusal) -> None:
        """Take the refused request off the socket, answer it and hold (or keep) its connection."""
        if not conn.initialized:
            conn.init()  # a new connection's parser, for the requests after this one
        # Refused again: no thread will take it, so it is no longer in transit or returning.
        conn.serve_returning = None
        self._landed(conn)
        try:
            taken = conn.sock.recv(head.size, socket.MSG_DONTWAIT)
            if len(taken) != head.size:
                raise ConnectionError("the peeked request changed")  # cannot happen on a stream socket
            answer = answer_bytes(refusal.status, refusal.headers, refusal.body)
            if conn.sock.send(answer, socket.MSG_DONTWAIT) < len(answer):
                # Its send buffer is full: a client that sends and does not read. The
                # loop never waits on one client, so the connection closes.
                raise ConnectionError("the client is not reading its answers")
        except OSError:
            self.nr_conns -= 1
            conn.close()
            return
        self.nr += 1  # toward max_requests, as a request a thread answers
        conn.serve_hold_s = refusal.hold_s
        conn.serve_refused_digest = digest(head.body) if refusal.hold_s > 0 else None
        self.finish_request(conn, KEPT_ALIVE)

    def _plain_keep_alive(self, conn: Any) -> bool:
        """Whether ``conn`` is a kept-alive HTTP/1.1 connection whose next request only its socket holds.

        One whose bytes gunicorn has read ahead into its buffer is not in the socket.
        """
        if (
            not self.alive
            or not conn.initialized
            or conn.parser is None
            or conn.is_http2
            or not self._plain_listeners
        ):
            return False
        return self._may_keep_alive() and not conn.parser.unreader.buf.getvalue()

    def _plain_new(self, conn: Any) -> bool:
        """Whether ``conn`` is a new connection whose first request the loop may check, as a kept-alive one's.

        Not over TLS, and not where gunicorn would first read something else
        from it: an HTTP/2 preface (prior knowledge) or a PROXY protocol header.
        """
        if not self.alive or conn.initialized or not self._plain_listeners:
            return False
        return self._may_keep_alive() and not prior_knowledge_allowed(self.cfg, conn.client)

    def _may_keep_alive(self) -> bool:
        # Where gunicorn would answer "Connection: close" (keep-alive off or at its
        # limit, the worker's last request before max_requests), its thread answers.
        if not self.cfg.keepalive or len(self.keepalived_conns) >= self.max_keepalived:
            return False
        return self.nr + 1 < self.max_requests

    def handle(self, conn: Any) -> Any:
        with contextlib.suppress(IndexError):
            self._waiting.pop()
        self._arrivals.waiting = len(self._waiting)
        self._landed(conn)
        self._arrivals.at = kernel_arrival(getattr(conn, "serve_arrived", None), conn.sock)
        self._arrivals.follow_up = getattr(conn, "serve_requests", 1) > 1
        self._arrivals.returning, conn.serve_returning = getattr(conn, "serve_returning", None), None
        # What the request refused before this one on the connection was, to tell a resend.
        self._arrivals.held_digest = getattr(conn, "serve_refused_digest", None)
        self._arrivals.hold_s = 0.0
        try:
            return super().handle(conn)
        finally:
            self._arrivals.at = None
            self._arrivals.returning = None
            conn.serve_hold_s = self._arrivals.hold_s
            conn.serve_refused_digest = take_refused_digest(self._arrivals)

    def finish_request(self, conn: Any, fs: Future[Any]) -> None:
        # In the event loop. Only a kept-alive connection (the result True) is held:
        # one to be closed or deferred goes its usual way at once.
        hold_s = getattr(conn, "serve_hold_s", 0.0)
        conn.serve_hold_s = 0.0
        kept_alive = not fs.cancelled() and fs.exception() is None and fs.result() is True
        if hold_s > 0 and self.alive and kept_alive:
            now = time.monotonic()
            # A client refused again keeps its place: first come, first let in.
            conn.serve_first_held = getattr(conn, "serve_first_held", None) or now
            conn.serve_hold_key = self._held.hold((conn, fs), now, hold_s, first=conn.serve_first_held)
            if conn.parser.unreader.buf.getvalue():
                # A body drain read ahead into its next request: it is already here.
                conn.serve_held, conn.serve_sent_at = "sent", now
                self._held.ready(conn.serve_hold_key)
                return
            # Watched while held: a client that closes is let go at once rather
            # than keep its place among the worker's connections, and a resend is
            # seen when it arrives, to be let in as soon as there is room.
            conn.serve_held = "watched"
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._held_readable, conn))
            return
        conn.serve_first_held = None
        super().finish_request(conn, fs)

    def _held_readable(self, conn: Any, _sock: Any) -> None:
        said = peek(conn.sock)
        if said is None:
            return
        self.poller.unregister(conn.sock)
        if said == "closed":
            conn.serve_held = "gone"
            self.nr_conns -= 1
            conn.close()
        else:
            # Its resend waits in the socket until it is let in; watching on would spin.
            conn.serve_held, conn.serve_sent_at = "sent", time.monotonic()
            self._held.ready(conn.serve_hold_key)

    def wait_for_and_dispatch_events(self, timeout: float) -> None:
        wait = self._held.seconds_to_next(time.monotonic())
        super().wait_for_and_dispatch_events(timeout if wait is None else min(timeout, wait))
        self._release_held()

    def _release_held(self) -> None:
        # After every turn of the loop: a turn follows each answer written
        # (gthread's method queue), which is when room appears in the batcher.
        now = time.monotonic()
        # A stopping worker lets every held connection go: its next request is
        # answered with "Connection: close", as gthread answers any then.
        for conn, fs in self._held.due(now, everything=not self.alive):
            self._let_go(conn, fs, HELD_OUT)
        if not self._held:
            return
        fits = room_test(self, self._in_transit.count(now), now, _sent_at)
        if fits is None:
            return
        for conn, fs in self._held.let_in(fits):
            self._let_go(conn, fs, LET_IN)

    def _let_go(self, conn: Any, fs: Future[Any], how: str) -> None:
        held, conn.serve_held = conn.serve_held, None
        if held == "gone":
            return
        if held == "watched":
            self.poller.unregister(conn.sock)
        elif held == "sent":
            conn.serve_held_since = conn.serve_sent_at
            conn.serve_in_transit = True
            self._in_transit.sent(time.monotonic())
        conn.serve_returning = how
        if held == "sent" and self.alive:
            # Its request is here already: no need for the poller to say so (two
            # epoll_ctl calls and a turn of the loop).
            self.enqueue_req(conn)
            return
        super().finish_request(conn, fs)

    def run(self) -> None:
        if self.balance is not None:
            self.poller.register(self.balance.wakeup_fd, selectors.EVENT_READ, self._woken)
        super().run()

    def accept(self, listener: Any) -> None:
        before = self.nr_conns
        super().accept(listener)
        if self.balance is not None and self.nr_conns != before:
            self.balance.accepted(self.nr_conns)

    def _woken(self, _fd: Any) -> None:
        if self.balance is not None:  # registered only with one
            self.balance.woken()


def plain_listeners(cfg: Any) -> bool:
    """Whether requests reach the worker as their clients sent them: not over TLS, no PROXY header first."""
    return not cfg.is_ssl and cfg.proxy_protocol == "off"


def check_ahead(door: Any, data: bytes, stamps: dict[str, Any]) -> tuple[RequestHead, Refusal] | None:
    """The request at the start of ``data`` and the door's refusal of it, checked before a worker parses it.

    None where the door lets it in, or where it is not whole and plain
    (service.http.request_head): the worker then reads it as it always does.
    ``stamps``: what the worker puts into a request's environ (its arrival, and so on).
    """
    try:
        head = read_head(data)
        refusal = None if head is None else door.check({**head.environ, **stamps}, ahead_of_thread=True)
    except Exception:
        # Nothing a request sends may stop a worker's event loop: one the check
        # failed on is read the usual way, where an error is that request's alone.
        log.exception("checking a request before it was parsed failed; it is read the usual way")
        return None
    return None if head is None or refusal is None else (head, refusal)


def _kept_alive(result: Any) -> Future[Any]:
    done: Future[Any] = Future()
    done.set_result(result)
    return done


# What finish_request is given for a request answered in the event loop: gthread's "keep alive".
KEPT_ALIVE = _kept_alive(True)
# For a new connection whose request is not in yet: gthread's "wait for it in the poller".
AWAITING_DATA = _kept_alive(_DEFER)


def answer_bytes(status: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    """An HTTP/1.1 answer that keeps its connection open, as gunicorn would write it for a WSGI app."""
    head = [f"HTTP/1.1 {status}", f"Server: {SERVER}", f"Date: {http_date()}", "Connection: keep-alive"]
    head += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def _sent_at(entry: tuple[Any, Future[Any]]) -> float:
    sent_at: float = entry[0].serve_sent_at
    return sent_at


class InTransit:
    """Requests let in from a hold and not yet taken by a request thread (or greenlet).

    The batcher does not count them yet, so the room left for more is what it
    holds plus these. ``sent`` is called where they are let in, ``landed`` where
    they are picked up, possibly in another thread: that side only appends to a
    deque (thread-safe), and ``count``, on the letting side, takes them off. One
    not picked up within ``ttl_s`` (its client hung up first) stops counting, so
    that a worker that runs for days does not see less room with each.
    """

    def __init__(self, ttl_s: float = IN_TRANSIT_TTL_S) -> None:
        self._ttl_s = ttl_s
        self._sent: deque[float] = deque()  # when each was let in, oldest first
        self._landed: deque[None] = deque()

    def sent(self, now: float) -> None:
        self._sent.append(now)

    def landed(self) -> None:
        self._landed.append(None)

    def count(self, now: float) -> int:
        """Only from the side that calls ``sent``."""
        while self._landed:
            self._landed.popleft()
            if self._sent:
                self._sent.popleft()
        while self._sent and self._sent[0] < now - self._ttl_s:
            self._sent.popleft()
        return len(self._sent)


def room_test(
    worker: Any, in_transit: int, now: float, arrived: Callable[[T], float]
) -> Callable[[T, int], bool] | None:
    """``fits(item, i)`` for HeldConnections.let_in, from the worker's batcher now; None before it has one.

    ``arrived(item)``: when the held client's next request arrived.
    """
    models = getattr(worker, "_serve_runtime", None)
    if models is None:
        models = worker._serve_runtime = runtime_of(worker)
    # The default model's: a held request's body, which would name another, is not read yet.
    runtime: ModelRuntime | None = getattr(models, "default", None)
    batcher = getattr(runtime, "batcher", None)
    if runtime is None or batcher is None:
        return None
    load = batcher.gate.load()
    rule = runtime.admission
    deadline_s = runtime.settings.request_timeout_ms / 1000
    # A held request's items are not read yet: each counts as the recent mean.
    per_request = load.items_per_request
    ahead = load.outstanding + in_transit * per_request

    # A held request is let in on a fresh request's terms, its wait counted. Let
    # in at a turn of the loop that follows an answer, it reaches the door before
    # the resend of the client just answered: held clients get the room that
    # answer made before the clients just served can take it back.
    def fits(item: T, released: int) -> bool:
        own = round(per_request)
        predicted = predict_wait(round(ahead + released * per_request), load.seconds_per_item, own)
        return rule.admits_fresh(now - arrived(item), predicted, deadline_s, load.behind)

    return fits


# What a request thread (or a connection's greenlet) knows of the request it
# serves, as kept in its local; each attribute has this value until set.
# Class attributes, so that a read of one not yet set is an attribute lookup
# rather than getattr's AttributeError caught, about half a microsecond each.
ARRIVAL_DEFAULTS: dict[str, Any] = {
    "at": None,  # when it arrived (monotonic), if known
    "next_at": None,  # when the connection's next request arrived during a hold (gevent)
    "follow_up": True,  # not the connection's first request
    "returning": None,  # LET_IN or HELD_OUT: how its hold ended
    "held_digest": None,  # the digest of the request refused before it on the connection
    "waiting": None,  # connections waiting for a thread when it was taken (gthread)
    "in_transit": False,  # counted as let in from a hold and not yet landed (gevent)
    "first_held": None,  # when the connection was first held, of holds in a row (gevent)
    "answered_first": False,  # its connection's first request was refused before gunicorn read it (gevent)
    "hold_s": 0.0,  # the hold its answer asked for
    "environ": None,  # its environ, until its answer is closed
}


def arrivals_local(base: type) -> Any:
    """A new thread-local (``base``: threading's, or gevent's) whose attributes start at ARRIVAL_DEFAULTS."""
    return type("Arrivals", (base,), dict(ARRIVAL_DEFAULTS))()


def take_refused_digest(arrivals: Any) -> bytes | None:
    """The digest a held refusal left in its environ (service.http.resend), once its answer is closed.

    For the connection to keep until its next request; None when the request
    was not held or its body's digest is unknown. Drops the local's environ.
    """
    environ, arrivals.environ = arrivals.environ, None
    if environ is None or not arrivals.hold_s:
        return None
    digest = environ.get(REFUSED_DIGEST_ENVIRON_KEY)
    return digest if isinstance(digest, bytes) else None


class StampedApp:
    """The app, with each request's arrival put into its environ, and the door's hold taken from it.

    Every other attribute is the app's: the lifecycle hooks find the service's
    runtime through ``worker.wsgi.extensions`` (service.host.lifecycle).
    """

    def __init__(self, app: WsgiApp, arrivals: threading.local) -> None:
        self._app = app
        self._arrivals = arrivals

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        arrivals = self._arrivals
        arrived = arrivals.at
        if arrived is not None:
            environ[ARRIVAL_ENVIRON_KEY] = arrived
        returning = arrivals.returning
        if returning:
            environ[RETURNING_ENVIRON_KEY] = returning
            environ[HELD_DIGEST_ENVIRON_KEY] = arrivals.held_digest
        # A refusal's digest is known only once its answer is closed (service.http.linger).
        arrivals.environ = environ
        environ[FOLLOW_UP_ENVIRON_KEY] = arrivals.follow_up
        waiting = arrivals.waiting
        if waiting is not None:
            environ[WAITING_ENVIRON_KEY] = waiting
        environ[HANDLER_ENVIRON_KEY] = time.monotonic()
        one_write(start_response)
        answer = self._app(environ, start_response)
        arrivals.hold_s = environ.get(HOLD_ENVIRON_KEY, 0.0)
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._app, name)


def kernel_arrival(stamp: float | None, sock: Any) -> float | None:
    """The earlier of the worker's ``stamp`` and when the kernel received the request's last bytes.

    A request that waited in the accept queue, or readable while the event loop
    was behind, arrived before the worker stamped it (service.host.tcp_info).
    """
    since = since_last_data(sock)
    if since is None:
        return stamp
    arrived = time.monotonic() - since
    return arrived if stamp is None else min(stamp, arrived)

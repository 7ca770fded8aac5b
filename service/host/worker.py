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
#   in HeldConnections instead of its poller and releases it when due.

"""gunicorn's gthread worker: it stamps each request's arrival, and accepts only its share of connections.

``gunicorn_conf.py`` names this class as the worker class wherever the plan says
gthread, and hands each worker its ``Balance`` in ``post_fork`` when
SERVE_BALANCE_CONNECTIONS is on. Without one it accepts as gthread does.
"""

from __future__ import annotations

import selectors
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from functools import partial
from typing import Any

from gunicorn.workers.gthread import ThreadWorker

from service.host.balance import Balance
from service.host.hold import HeldConnections, peek
from service.http.arrival import ARRIVAL_ENVIRON_KEY, HOLD_ENVIRON_KEY, RETURNING_ENVIRON_KEY

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class BalancedThreadWorker(ThreadWorker):  # type: ignore[misc]  # gunicorn ships no type hints
    balance: Balance | None = None
    nr_conns: int  # gthread's count of the connections it holds open
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
        self._arrivals = threading.local()
        self._held = HeldConnections()
        self.wsgi = StampedApp(self.wsgi, self._arrivals)

    def enqueue_req(self, conn: Any) -> None:
        # A resend sent during a hold arrived when the hold began, at the latest.
        held_since, conn.serve_held_since = getattr(conn, "serve_held_since", None), None
        conn.serve_arrived = time.monotonic() if held_since is None else held_since
        super().enqueue_req(conn)

    def handle(self, conn: Any) -> Any:
        self._arrivals.at = getattr(conn, "serve_arrived", None)
        self._arrivals.returning, conn.serve_returning = getattr(conn, "serve_returning", False), False
        self._arrivals.hold_s = 0.0
        try:
            return super().handle(conn)
        finally:
            self._arrivals.at = None
            self._arrivals.returning = False
            conn.serve_hold_s = self._arrivals.hold_s

    def finish_request(self, conn: Any, fs: Future[Any]) -> None:
        # In the event loop. Only a kept-alive connection (the result True) is held:
        # one to be closed or deferred goes its usual way at once.
        hold_s = getattr(conn, "serve_hold_s", 0.0)
        conn.serve_hold_s = 0.0
        kept_alive = not fs.cancelled() and fs.exception() is None and fs.result() is True
        if hold_s > 0 and self.alive and kept_alive:
            self._held.hold((conn, fs), time.monotonic(), hold_s)
            # Watched while held, so that a client that closes is let go at once
            # rather than keep its place among the worker's connections.
            conn.serve_held = "watched"
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._held_readable, conn))
            return
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
            # Its resend waits in the socket until the hold ends; watching on would spin.
            conn.serve_held = "sent"

    def wait_for_and_dispatch_events(self, timeout: float) -> None:
        wait = self._held.seconds_to_next(time.monotonic())
        super().wait_for_and_dispatch_events(timeout if wait is None else min(timeout, wait))
        self._release_held()

    def _release_held(self) -> None:
        # A stopping worker lets every held connection go: its next request is
        # answered with "Connection: close", as gthread answers any then.
        for (conn, fs), since in self._held.due(time.monotonic(), everything=not self.alive):
            held, conn.serve_held = conn.serve_held, None
            if held == "gone":
                continue
            if held == "watched":
                self.poller.unregister(conn.sock)
            if held == "sent" or conn.parser.unreader.buf.getvalue():
                conn.serve_held_since = since
            conn.serve_returning = True
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


class StampedApp:
    """The app, with each request's arrival put into its environ, and the door's hold taken from it.

    Every other attribute is the app's: the lifecycle hooks find the service's
    runtime through ``worker.wsgi.extensions`` (service.host.lifecycle).
    """

    def __init__(self, app: WsgiApp, arrivals: threading.local) -> None:
        self._app = app
        self._arrivals = arrivals

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        arrived = getattr(self._arrivals, "at", None)
        if arrived is not None:
            environ[ARRIVAL_ENVIRON_KEY] = arrived
        if getattr(self._arrivals, "returning", False):
            environ[RETURNING_ENVIRON_KEY] = True
        answer = self._app(environ, start_response)
        self._arrivals.hold_s = environ.get(HOLD_ENVIRON_KEY, 0.0)
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._app, name)

"""gunicorn's gevent worker, with ``subprocess`` left native.

gunicorn's gevent worker monkey-patches everything, ``subprocess`` included.
gevent's ``subprocess`` can only watch its children from the main thread's
hub, and the model loads in a native OS thread (service.runtime): a library
that starts a process while it is imported there fails with "child watchers
are only available on the default loop". One such import is common:
``ctypes.util.find_library`` runs ``ldconfig``, and trio calls it at import,
which httpx's transport imports whenever trio is installed, and transformers
imports httpx. The service never starts a process from a request greenlet,
so a native ``subprocess`` costs the event loop nothing.

With SERVE_BALANCE_CONNECTIONS on, it accepts only its share of the
connections, as gthread's worker does (service.host.gevent_accept).

It also holds a refused client's connection for the Retry-After it was told
before reading its next request (service.host.hold): the connection's greenlet
waits, which holds no thread. The request that arrives during the hold is
checked at the door before gunicorn parses it, and a refusal answered there;
so is a new connection's first request, while the door is refusing.
"""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any

import gevent
from gevent import monkey
from gevent.event import Event
from gevent.local import local
from gevent.socket import wait_read
from gunicorn.http.body import LengthReader
from gunicorn.http2.negotiation import prior_knowledge_allowed
from gunicorn.workers import ggevent
from gunicorn.workers.ggevent import GeventWorker as _GeventWorker

from service.host.balance import Balanced
from service.host.gevent_accept import SharedAccept
from service.host.hold import HeldConnections, peek
from service.host.lifecycle import door_of
from service.host.one_write import send_all
from service.host.worker import (
    PEEK_BYTES,
    InTransit,
    StampedApp,
    answer_bytes,
    arrivals_local,
    check_ahead,
    kernel_arrival,
    plain_listeners,
    room_test,
    take_refused_digest,
)
from service.http.arrival import (
    ARRIVAL_ENVIRON_KEY,
    FOLLOW_UP_ENVIRON_KEY,
    HELD_OUT,
    LET_IN,
    RETURNING_ENVIRON_KEY,
)
from service.http.request_head import RequestHead
from service.http.resend import digest

if TYPE_CHECKING:
    from service.http.door import Refusal


class GeventWorker(Balanced, _GeventWorker):  # type: ignore[misc]  # gunicorn ships no type hints
    sockets: list[Any]
    wsgi: Any
    alive: bool
    _requests: (
        Any  # one per connection's greenlet: the hold its last answer asked for, and whether it was held
    )

    def patch(self) -> None:
        monkey.patch_all(subprocess=False)
        # As gunicorn's own patch(): the listening sockets, re-made as gevent sockets.
        self.sockets = [
            socket.socket(s.FAMILY, socket.SOCK_STREAM, fileno=s.sock.detach()) for s in self.sockets
        ]

    def load_wsgi(self) -> None:
        super().load_wsgi()
        self._requests = arrivals_local(local)
        self._lot = Lot(self)
        self._door: Any = None  # the app's door, once looked up; False: none
        self._plain_listeners = plain_listeners(self.cfg)  # read once, as gthread's worker does
        self.wsgi = StampedApp(self.wsgi, self._requests)
        self._accept: SharedAccept | None = None

    def _the_door(self) -> Any:
        """The app's door (service.http.door), looked up once; False where the app has none."""
        if self._door is None:
            self._door = door_of(self) or False
        return self._door

    def _refusing(self) -> bool:
        door = self._the_door()
        return door is not False and door.refusing(time.monotonic())

    def run(self) -> None:
        if self.balance is not None:
            self._accept = SharedAccept(self.balance, self._refusing)
            # gunicorn's run builds each listener's server by this module-level name
            # and keeps them to itself; built here, they can be told to stop accepting.
            # Only this worker's process runs gunicorn's gevent worker.
            ggevent.StreamServer = self._accept.server
            gevent.spawn(self._accept.watch_wakeups)
        super().run()

    def notify(self) -> None:
        super().notify()  # gunicorn's heartbeat, once a second from run's loop
        if self._accept is not None:
            self._accept.settle()

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        accept = self._accept
        if accept is not None:
            accept.opened()
        try:
            self._handle(listener, client, addr)
        finally:
            if accept is not None:
                accept.closed()

    def _handle(self, listener: Any, client: Any, addr: Any) -> None:
        client.setblocking(1)  # as gunicorn's own handle: gevent's blocking, for the waits below
        try:
            if self._refused_first(client, addr):
                while self._refused_ahead(None, client):
                    pass  # refused and held again
                if _peek_now(client) == b"":
                    # Its client hung up during the hold, as most refused clients do
                    # that open a connection a request: nothing for gunicorn's parser.
                    client.close()
                    return
        except OSError:
            client.close()  # its client went away mid-answer, as gunicorn's handle would close it
            return
        super().handle(listener, client, addr)

    def _refused_first(self, sock: Any, addr: Any) -> bool:
        """Answer a new connection's first request here if the door refuses it; whether it was also held.

        As gthread's event loop does (service.host.worker), and as for a request
        that arrives during a hold: only while the door is refusing, only for a
        whole plain HTTP/1.x request, and not where gunicorn would first read
        something else (TLS, an HTTP/2 preface, a PROXY protocol header).
        Clients that open a connection a request, and pools that close what they
        cannot keep, bring a good share of an open loop's requests this way.
        """
        door = self._the_door()
        if door is False or not door.refusing(time.monotonic()) or not self.alive or not self.cfg.keepalive:
            return False
        if not self._plain_listeners or prior_knowledge_allowed(self.cfg, addr):
            return False
        try:
            data = _peek_now(sock)
            if data is None:
                # gunicorn's parser would wait for it just so, for as long.
                wait_read(sock.fileno(), timeout=self.cfg.keepalive)
                data = sock.recv(PEEK_BYTES, socket.MSG_PEEK)
        except (TimeoutError, OSError):
            return False  # gunicorn reads what there is, and closes what it must
        stamps = {ARRIVAL_ENVIRON_KEY: kernel_arrival(None, sock), FOLLOW_UP_ENVIRON_KEY: False}
        refused = check_ahead(door, data, stamps) if data else None
        if refused is None:
            return False
        self._requests.answered_first = True  # what gunicorn reads next is not the connection's first
        return self._answer_ahead(sock, *refused)

    def handle_request(self, listener_name: Any, req: Any, sock: Any, addr: Any) -> None:
        requests = self._requests
        requests.at, requests.next_at = kernel_arrival(requests.next_at, sock), None
        requests.follow_up = getattr(req, "req_number", 1) > 1 or requests.answered_first
        if requests.in_transit:
            requests.in_transit = False
            self._lot.in_transit.landed()
        requests.hold_s = 0.0
        try:
            super().handle_request(listener_name, req, sock, addr)  # raises to close the connection
        finally:
            requests.at = None
            requests.returning = None
            requests.held_digest = None
            refused_digest = take_refused_digest(requests)
            # An answer is out: the batcher may have room for a held client, whose
            # request should reach it before the resend of the client just answered.
            self._lot.poke()
        if requests.hold_s > 0 and self.alive:
            self._hold(sock, requests.hold_s, refused_digest)
            while self._refused_ahead(req, sock):
                pass  # refused and held again
        else:
            requests.first_held = None

    def _hold(self, sock: Any, hold_s: float, refused_digest: bytes | None) -> None:
        """Hold the connection of a refused request (service.host.hold), for the one it reads next."""
        requests = self._requests
        # A client refused again keeps its place: first come, first let in.
        requests.first_held = requests.first_held or time.monotonic()
        arrived, early = self._lot.wait_out(sock, hold_s, requests.first_held)
        if arrived is not None:
            requests.next_at = arrived  # its resend arrived then
            requests.in_transit = True
        requests.returning = LET_IN if early else HELD_OUT  # for the request it reads next
        requests.held_digest = refused_digest  # to tell whether that request is a resend

    def _refused_ahead(self, req: Any, sock: Any) -> bool:
        """Answer the request that arrived during a hold here, if the door refuses it; whether it did.

        As gthread's event loop does (service.host.worker): only while the door
        is refusing, and only for a whole plain request (service.http.request_head),
        without gunicorn's parser or a WSGI environ. A request the door would let
        in, or any other, is left in the socket for gunicorn to read as always.
        A refusal is held again, as the door's would be.
        """
        requests = self._requests
        door = self._the_door()
        if requests.next_at is None or door is False or not door.refusing(time.monotonic()):
            return False
        if not self.alive or (req is not None and not _read_to_its_end(req)):
            return False
        stamps = {
            ARRIVAL_ENVIRON_KEY: kernel_arrival(requests.next_at, sock),
            FOLLOW_UP_ENVIRON_KEY: True,
            RETURNING_ENVIRON_KEY: requests.returning,
        }
        # Its request is in the socket: the peek does not wait.
        refused = check_ahead(door, sock.recv(PEEK_BYTES, socket.MSG_PEEK), stamps)
        if refused is None:
            return False
        return self._answer_ahead(sock, *refused)

    def _answer_ahead(self, sock: Any, head: RequestHead, refusal: Refusal) -> bool:
        """Take a refused request off ``sock``, answer it, and hold the connection; whether it was held."""
        requests = self._requests
        taken = 0
        while taken < head.size:
            chunk = sock.recv(head.size - taken)
            if not chunk:
                raise ConnectionError("the client closed its connection")  # gunicorn closes it
            taken += len(chunk)
        send_all(sock, answer_bytes(refusal.status, refusal.headers, refusal.body))
        requests.next_at = requests.returning = requests.held_digest = None
        if requests.in_transit:
            requests.in_transit = False
            self._lot.in_transit.landed()
        if refusal.hold_s <= 0:
            requests.first_held = None
            return False
        self._hold(sock, refusal.hold_s, digest(head.body))
        return True


class Lot:
    """The gevent worker's held connections: each greenlet waits out its own hold, or is let in early.

    A greenlet whose client resent during its hold parks here, and is let in,
    first held first, as the batcher has room (HeldConnections.let_in). Room
    appears when an answer is written (every request the batcher holds, a shed
    one included, ends in one), so the greenlet that has just written an answer
    lets in what fits before it yields: the held get the room that answer made
    before the resend of the client just answered is even read. A resend that
    finds room already is let in as it parks. Nothing else makes room, so no
    greenlet polls for it: a releaser that also looked every 5 ms held a
    worker's GIL about 12 ms a second at five times its capacity (py-spy), for
    room the answers had already handed out.
    """

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self._held: HeldConnections[tuple[Event, float]] = HeldConnections()
        self.in_transit = InTransit()

    def poke(self) -> None:
        """An answer is out: let in what the room it made fits."""
        if self._held:
            self._let_in(time.monotonic())

    def wait_out(self, sock: Any, seconds: float, first: float) -> tuple[float | None, bool]:
        """Leave ``sock`` unread for ``seconds``, until its client hangs up, or until it is let in.

        When its client's next request arrived (None: it sent none meanwhile),
        and whether it was let in before its hold ended.
        """
        began = time.monotonic()
        try:
            wait_read(sock.fileno(), timeout=seconds)
        except TimeoutError:
            return None, False
        if peek(sock) != "sent":
            return None, False  # hung up: the caller reads the end and closes
        # Its resend waits in the socket; the rest of the hold needs no watching.
        sent_at = time.monotonic()
        let_in_early = Event()
        key = self._held.hold((let_in_early, sent_at), began, seconds, first=first)
        self._held.ready(key)
        self._let_in(sent_at)  # room already: its event is set, and the wait below returns at once
        early = let_in_early.wait(timeout=max(0.0, began + seconds - time.monotonic()))
        self._held.let_go(key)
        if not early:
            self.in_transit.sent(time.monotonic())  # one let in early was counted as it was let in
        return sent_at, bool(early)

    def _let_in(self, now: float) -> None:
        # Holds that ended first (their greenlets wake on their own timeouts):
        # with nothing polling, they are cleared here, at each answer and park.
        self._held.due(now)
        fits = room_test(self._worker, self.in_transit.count(now), now, _sent_at)
        if fits is not None:
            for let_in_early, _ in self._held.let_in(fits):
                let_in_early.set()  # its greenlet runs before the hub next polls sockets
                # Counted now, not when its greenlet runs: a resend parking meanwhile
                # must see the room this one takes.
                self.in_transit.sent(now)


def _peek_now(sock: Any) -> bytes | None:
    """What the client has sent and the socket holds, read without taking it or waiting; None: nothing yet.

    b"" where the client hung up. On loopback and on a busy worker, a new
    connection's first request is usually in before the hub accepts it: a wait
    for it would cost a timer and two switches through the hub on each.
    """
    sock.settimeout(0.0)  # gevent's recv then raises instead of waiting
    try:
        data: bytes = sock.recv(PEEK_BYTES, socket.MSG_PEEK)
    except BlockingIOError:
        return None
    finally:
        sock.settimeout(None)  # blocking again, as gunicorn's handle expects
    return data


def _read_to_its_end(req: Any) -> bool:
    """Whether ``req``'s body was all read, so that the socket holds only what follows it.

    gunicorn's gevent worker drains what is left of a body only when it reads the
    next request; a body the service did not read to its end (past the lingering
    close's bounds) would be read here as if it were that request.
    """
    body: Any = getattr(req, "body", None)
    reader = getattr(body, "reader", None)
    return (
        isinstance(reader, LengthReader)
        and reader.length == 0
        and not body.buf.getvalue()
        and not req.unreader.buf.getvalue()
    )


def _sent_at(entry: tuple[Event, float]) -> float:
    return entry[1]

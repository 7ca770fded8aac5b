"""The gthread worker's event loop answers the door's refusals itself, on real loopback sockets.

The worker is built without gunicorn's arbiter (``object.__new__``) and the door
is a stand-in that says whether it refuses: what is tested is the worker's side,
what it reads, writes and does with the connection. The door's own rule is in
test_door.py, and tests/e2e/test_overload.py runs both in real gunicorn.
"""

from __future__ import annotations

import dataclasses
import io
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from service.host.hold import HeldConnections
from service.host.worker import KEPT_ALIVE, BalancedThreadWorker, InTransit, plain_listeners
from service.http.arrival import (
    ARRIVAL_ENVIRON_KEY,
    FOLLOW_UP_ENVIRON_KEY,
    HELD_OUT,
    LET_IN,
    RETURNING_ENVIRON_KEY,
    WAITING_ENVIRON_KEY,
)
from service.http.door import Refusal
from service.http.resend import digest
from tests.support.raw_http import read_response

BODY = b'{"inputs": ["a sentence"]}'
REQUEST = (
    b"POST /predict/batched HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY
)
REFUSAL = Refusal(
    "503 Service Unavailable",
    [
        ("Content-Type", "application/json"),
        ("Content-Length", "15"),
        ("Retry-After", "1"),
        ("X-Request-ID", "r1"),
    ],
    b'{"error":"no"}\n',
    hold_s=0.5,
)


class StandInDoor:
    def __init__(self, refusing: bool, refusal: Refusal | None, fails: bool = False) -> None:
        self._refusing = refusing
        self._refusal = refusal
        self._fails = fails
        self.checked: list[dict[str, Any]] = []
        self.ahead_of_thread: list[bool] = []

    def refusing(self, now: float) -> bool:
        return self._refusing

    def check(self, environ: dict[str, Any], *, ahead_of_thread: bool = False) -> Refusal | None:
        self.checked.append(dict(environ))
        self.ahead_of_thread.append(ahead_of_thread)
        if self._fails:
            raise ValueError("a request the check cannot take")
        return self._refusal


def worker(door: StandInDoor) -> Any:
    made: Any = object.__new__(BalancedThreadWorker)
    made._door = door
    made.alive = True
    made.cfg = SimpleNamespace(is_ssl=False, keepalive=2, proxy_protocol="off", http2_cleartext="off")
    made.nr, made.max_requests, made.max_keepalived = 0, 1000, 100
    made.poller = selectors.DefaultSelector()
    made.keepalived_conns = deque()
    made._held = HeldConnections()
    made._waiting = deque([None, None, None])  # three requests waiting for a thread
    made.nr_conns = 1
    made.pending_conns = deque()
    made._plain_listeners = plain_listeners(made.cfg)
    return made


@pytest.fixture
def connected() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        served, _ = listener.accept()
    served.setblocking(False)  # as gthread leaves a kept-alive connection in its poller
    with client, served:
        yield client, served


def kept_alive(sock: socket.socket) -> Any:
    return SimpleNamespace(
        sock=sock,
        initialized=True,
        is_http2=False,
        parser=SimpleNamespace(unreader=SimpleNamespace(buf=io.BytesIO())),
        serve_arrived=time.monotonic(),
        serve_requests=2,
        timeout=None,
        set_timeout=lambda: None,
        close=sock.close,
    )


def new(sock: socket.socket) -> Any:
    """A connection just accepted, as gthread's TConn is before a thread reads from it."""
    conn = SimpleNamespace(
        sock=sock,
        client=sock.getpeername(),
        initialized=False,
        data_ready=False,
        is_http2=False,
        parser=None,
        timeout=None,
        set_timeout=lambda: None,
        close=sock.close,
    )

    def init() -> None:  # as TConn.init makes the parser, for plain HTTP/1.x
        conn.initialized = True
        conn.parser = SimpleNamespace(unreader=SimpleNamespace(buf=io.BytesIO()))

    conn.init = init
    return conn


def in_transit(loop: Any) -> None:
    """One request let in from a hold and not yet taken by a thread."""
    loop._in_transit = InTransit()
    loop._in_transit.sent(time.monotonic())


def sent(client: socket.socket, served: socket.socket, data: bytes) -> None:
    """Send ``data`` and return once all of it waits in ``served``, as the loop's peek will find it."""
    before = len(_peeked(served) or b"")
    client.sendall(data)
    _until(lambda: len(_peeked(served) or b"") >= before + len(data))


def closed_by_client(client: socket.socket, served: socket.socket) -> None:
    """Close the client's end and return once ``served`` reads its end."""
    client.close()
    _until(lambda: _peeked(served) == b"")


def _peeked(sock: socket.socket) -> bytes | None:
    try:
        return sock.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None


def _until(arrived: Callable[[], bool], timeout_s: float = 10.0) -> None:
    # Loopback delivers in the sender's system call on an idle machine, but a busy
    # one may defer it: wait for the socket rather than for a guessed time.
    deadline = time.monotonic() + timeout_s
    while not arrived():
        assert time.monotonic() < deadline, "the bytes never reached the served socket"
        time.sleep(0.001)


def test_a_refusal_is_answered_and_its_connection_held_without_a_thread(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    client, served = connected
    door = StandInDoor(refusing=True, refusal=REFUSAL)
    loop, conn = worker(door), kept_alive(served)
    sent(client, served, REQUEST + b"GET /next")  # and the start of the client's next request

    assert loop._refused_here(conn) is True
    [environ] = door.checked
    assert environ["PATH_INFO"] == "/predict/batched" and environ["REQUEST_METHOD"] == "POST"
    assert environ[FOLLOW_UP_ENVIRON_KEY] is True and environ[WAITING_ENVIRON_KEY] == 3
    assert environ[ARRIVAL_ENVIRON_KEY] <= time.monotonic()

    head, body = read_response(client)
    status, *lines = head.split(b"\r\n")
    assert status == b"HTTP/1.1 503 Service Unavailable"
    assert {b"Connection: keep-alive", b"Retry-After: 1", b"X-Request-ID: r1", b"Server: gunicorn"} <= set(
        lines
    )
    assert any(line.startswith(b"Date: ") for line in lines)
    assert body == REFUSAL.body
    # The request was taken from the socket, and only it: the next one's bytes wait there.
    assert served.recv(100, socket.MSG_PEEK) == b"GET /next"
    # Held, watched for its client's next request, with the refused body's digest to tell a resend.
    assert len(loop._held) == 1 and conn.serve_held == "watched"
    assert conn.serve_refused_digest == digest(BODY)
    assert loop.poller.get_key(served) is not None
    assert len(loop._waiting) == 3  # no request thread was asked for
    assert loop.nr == 1  # counted toward max_requests


def test_with_holds_off_a_refused_connection_goes_back_to_the_poller(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    client, served = connected
    loop, conn = (
        worker(StandInDoor(refusing=True, refusal=dataclasses.replace(REFUSAL, hold_s=0.0))),
        kept_alive(served),
    )
    sent(client, served, REQUEST)
    assert loop._refused_here(conn) is True
    assert read_response(client)[0].startswith(b"HTTP/1.1 503")
    assert len(loop._held) == 0 and list(loop.keepalived_conns) == [conn]


def test_a_request_read_after_a_hold_is_checked_as_returning_and_refused_again_leaves_transit(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    client, served = connected
    door = StandInDoor(refusing=True, refusal=REFUSAL)
    loop, conn = worker(door), kept_alive(served)
    in_transit(loop)
    conn.serve_returning, conn.serve_in_transit = HELD_OUT, True
    sent(client, served, REQUEST)
    assert loop._refused_here(conn) is True
    assert door.checked[0][RETURNING_ENVIRON_KEY] == HELD_OUT
    assert conn.serve_returning is None and conn.serve_in_transit is False
    assert loop._in_transit.count(time.monotonic()) == 0
    assert read_response(client)[0].startswith(b"HTTP/1.1 503")


def test_a_request_the_door_would_let_in_stays_in_the_socket_for_its_thread(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    client, served = connected
    door = StandInDoor(refusing=True, refusal=None)
    loop, conn = worker(door), kept_alive(served)
    sent(client, served, REQUEST)
    assert loop._refused_here(conn) is False
    assert door.ahead_of_thread == [True]  # counted only by the door in its thread
    assert served.recv(len(REQUEST) + 10, socket.MSG_PEEK) == REQUEST


@pytest.mark.parametrize(
    ("refusing", "data", "setup"),
    [
        pytest.param(False, REQUEST, None, id="the door is not refusing"),
        pytest.param(True, REQUEST[:-4], None, id="the body is not all in"),
        pytest.param(True, REQUEST.replace(b"HTTP/1.1", b"HTTP/1.0"), None, id="not plain"),
        pytest.param(True, REQUEST, "read ahead", id="bytes in gunicorn's buffer"),
        pytest.param(True, REQUEST, "proxy protocol", id="a new connection behind the PROXY protocol"),
        pytest.param(True, REQUEST, "h2c", id="a new connection that may speak HTTP/2 first"),
        pytest.param(True, REQUEST, "stopping", id="the worker is stopping"),
        pytest.param(True, REQUEST, "last request", id="the worker's last before max_requests"),
        pytest.param(True, REQUEST, "keep-alive full", id="gunicorn would close the connection"),
    ],
)
def test_what_the_loop_does_not_check_goes_to_a_thread_untouched(
    connected: tuple[socket.socket, socket.socket], refusing: bool, data: bytes, setup: str | None
) -> None:
    client, served = connected
    door = StandInDoor(refusing=refusing, refusal=REFUSAL)
    loop, conn = worker(door), kept_alive(served)
    if setup == "read ahead":
        conn.parser.unreader.buf.write(b"POST")
    elif setup == "proxy protocol":
        conn, loop.cfg.proxy_protocol = new(served), "v1"
        loop._plain_listeners = plain_listeners(loop.cfg)  # as the worker reads it when it starts
    elif setup == "h2c":
        conn, loop.cfg.http2_cleartext = new(served), "prior-knowledge"
        loop.cfg.http_protocols, loop.cfg.protocol = ["h1", "h2"], "http"
        conn.client = ""  # a Unix socket's peer, which gunicorn trusts to speak it
    elif setup == "stopping":
        loop.alive = False
    elif setup == "last request":
        loop.nr = loop.max_requests - 1
    elif setup == "keep-alive full":
        loop.max_keepalived = 0
    sent(client, served, data)
    assert loop._refused_here(conn) is False
    assert door.checked == []
    assert served.recv(len(data) + 10, socket.MSG_PEEK) == data


def test_a_new_connections_first_request_is_refused_in_the_loop_and_the_connection_held(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    # Clients that open a connection a request, and pools that close what they
    # cannot keep, bring a good share of an open loop's requests on new connections.
    client, served = connected
    door = StandInDoor(refusing=True, refusal=REFUSAL)
    loop, conn = worker(door), new(served)
    conn.serve_arrived, conn.serve_requests = time.monotonic(), 1
    sent(client, served, REQUEST)
    assert loop._refused_here(conn) is True
    [environ] = door.checked
    assert environ[FOLLOW_UP_ENVIRON_KEY] is False  # a connection's first request
    assert read_response(client)[0].startswith(b"HTTP/1.1 503")
    assert conn.initialized  # with gunicorn's parser, for the requests that follow
    with pytest.raises(BlockingIOError):  # the request was taken from the socket
        served.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    assert len(loop._held) == 1 and conn.serve_held == "watched"
    assert len(loop._waiting) == 3 and loop.nr == 1


def test_a_new_connection_waits_for_its_request_in_the_poller_while_the_door_refuses(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    client, served = connected
    loop, conn = worker(StandInDoor(refusing=True, refusal=REFUSAL)), new(served)
    assert loop._awaits_first_request(conn) is True
    # gthread's pending connections: no thread, the poller says when its request is in.
    assert list(loop.pending_conns) == [conn] and loop.poller.get_key(served) is not None
    assert conn.timeout is not None

    loop.poller.unregister(served)
    loop.pending_conns.clear()
    sent(client, served, REQUEST)
    assert loop._awaits_first_request(conn) is False  # it is in: checked now
    assert conn.data_ready is True  # and a thread that takes it does not wait for it again

    # While the door lets requests in, a new connection goes to a thread at once, as in gthread.
    other = new(served)
    assert worker(StandInDoor(refusing=False, refusal=None))._awaits_first_request(other) is False
    assert other.data_ready is False


def test_a_connection_its_client_closed_is_closed_in_the_loop_while_the_door_refuses(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    # A pool that keeps only so many idle connections closes the rest: under an
    # open loop, thousands a second, each of which would take a thread to find out.
    client, served = connected
    door = StandInDoor(refusing=True, refusal=REFUSAL)
    loop, conn = worker(door), kept_alive(served)
    in_transit(loop)
    conn.serve_in_transit = True
    closed_by_client(client, served)
    assert loop._refused_here(conn) is True
    assert served.fileno() == -1 and loop.nr_conns == 0
    assert door.checked == [] and len(loop._waiting) == 3
    assert loop._in_transit.count(time.monotonic()) == 0


def test_a_check_that_fails_leaves_the_request_to_a_thread_and_the_loop_running(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    client, served = connected
    loop, conn = worker(StandInDoor(refusing=True, refusal=REFUSAL, fails=True)), kept_alive(served)
    sent(client, served, REQUEST)
    assert loop._refused_here(conn) is False  # no exception reaches the event loop
    assert served.recv(len(REQUEST) + 10, socket.MSG_PEEK) == REQUEST


class FullSendBuffer:
    """The served socket of a client that sends and does not read: its send buffer takes a byte."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.closed = False

    def recv(self, *args: Any) -> bytes:
        return self._sock.recv(*args)

    def send(self, data: bytes, flags: int = 0) -> int:
        return 1

    def setblocking(self, flag: bool) -> None:
        raise AssertionError("the event loop must not block on one client")

    def getsockopt(self, *args: Any) -> Any:
        return self._sock.getsockopt(*args)

    def close(self) -> None:
        self.closed = True


def test_a_client_that_does_not_read_is_closed_not_waited_for(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    client, served = connected
    loop = worker(StandInDoor(refusing=True, refusal=REFUSAL))
    full = FullSendBuffer(served)
    conn = kept_alive(served)
    conn.sock, conn.close = full, full.close
    sent(client, served, REQUEST)
    assert loop._refused_here(conn) is True
    assert full.closed and loop.nr_conns == 0
    assert len(loop._held) == 0


def test_a_held_connection_whose_resend_arrived_goes_straight_to_its_check(
    connected: tuple[socket.socket, socket.socket],
) -> None:
    _, served = connected
    loop, conn = worker(StandInDoor(refusing=False, refusal=None)), kept_alive(served)
    loop._in_transit = InTransit()
    enqueued: list[Any] = []
    loop.enqueue_req = enqueued.append  # the poller is not asked to say what is known
    conn.serve_held, conn.serve_sent_at = "sent", 5.0
    loop._let_go(conn, KEPT_ALIVE, LET_IN)
    assert enqueued == [conn]
    assert conn.serve_returning == LET_IN and conn.serve_held_since == 5.0
    assert loop.poller.get_map() == {} and list(loop.keepalived_conns) == []
    assert loop._in_transit.count(time.monotonic()) == 1


def test_gevent_checks_what_follows_a_request_only_once_its_body_was_all_read() -> None:
    # gunicorn's gevent worker drains a body's unread rest only when it reads the
    # next request; until then the socket's next bytes may be that rest.
    from gunicorn.http.body import Body, ChunkedReader, LengthReader

    from service.host.gevent_worker import _read_to_its_end

    def request(body: Body, buffered: bytes = b"") -> Any:
        return SimpleNamespace(body=body, unreader=SimpleNamespace(buf=io.BytesIO(buffered)))

    unreader = SimpleNamespace(buf=io.BytesIO())
    assert _read_to_its_end(request(Body(LengthReader(unreader, 0))))
    assert not _read_to_its_end(request(Body(LengthReader(unreader, 12))))  # 12 bytes of it unread
    assert not _read_to_its_end(request(Body(LengthReader(unreader, 0)), buffered=b"POST"))
    assert not _read_to_its_end(request(Body(ChunkedReader(SimpleNamespace(), unreader))))


@pytest.mark.parametrize(
    ("refusing", "data", "refused"),
    [
        pytest.param(True, REQUEST, True, id="refused"),
        pytest.param(False, REQUEST, False, id="the door is not refusing"),
        pytest.param(True, REQUEST[:-4], False, id="the body is not all in"),
    ],
)
def test_gevent_answers_a_new_connections_first_request_the_door_refuses_before_gunicorn_reads_it(
    connected: tuple[socket.socket, socket.socket], refusing: bool, data: bytes, refused: bool
) -> None:
    from service.host.gevent_worker import GeventWorker
    from service.host.worker import arrivals_local

    client, served = connected
    served.setblocking(True)  # as gunicorn's handle leaves it
    door = StandInDoor(refusing=refusing, refusal=dataclasses.replace(REFUSAL, hold_s=0.0))
    made: Any = object.__new__(GeventWorker)
    made._door, made.alive = door, True
    made.cfg = SimpleNamespace(is_ssl=False, keepalive=2, proxy_protocol="off", http2_cleartext="off")
    made._plain_listeners = plain_listeners(made.cfg)
    made._requests = arrivals_local(threading.local)
    sent(client, served, data)
    assert made._refused_first(served, served.getpeername()) is False  # not held: its hold is 0
    if not refused:
        assert served.recv(len(data) + 10, socket.MSG_PEEK) == data  # left for gunicorn
        assert made._requests.answered_first is False
        return
    assert door.checked[0][FOLLOW_UP_ENVIRON_KEY] is False
    assert read_response(client)[0].startswith(b"HTTP/1.1 503")
    with pytest.raises(BlockingIOError):  # taken from the socket
        served.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    # What gunicorn reads next on the connection is not its first request.
    assert made._requests.answered_first is True


@pytest.mark.parametrize(
    ("is_ssl", "proxy_protocol", "plain"),
    [(False, "off", True), (True, "off", False), (False, "v1", False), (False, "auto", False)],
)
def test_only_plain_listeners_let_the_loop_read_a_request_as_sent(
    is_ssl: bool, proxy_protocol: str, plain: bool
) -> None:
    assert plain_listeners(SimpleNamespace(is_ssl=is_ssl, proxy_protocol=proxy_protocol)) is plain


def test_gevent_peeks_at_a_connection_without_waiting(connected: tuple[socket.socket, socket.socket]) -> None:
    from service.host.gevent_worker import _peek_now

    client, served = connected
    served.setblocking(True)  # as gunicorn's handle leaves it
    assert _peek_now(served) is None  # nothing sent yet: no wait
    assert served.gettimeout() is None  # blocking again
    sent(client, served, REQUEST)
    assert _peek_now(served) == REQUEST
    assert _peek_now(served) == REQUEST  # peeked, not taken
    assert served.recv(len(REQUEST)) == REQUEST
    closed_by_client(client, served)
    assert _peek_now(served) == b""  # hung up

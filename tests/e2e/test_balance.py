"""End to end: two workers, gthread or gevent, share the open connections evenly (service.host.balance)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.e2e.test_metrics import TWO_MLP_WORKERS as TWO_WORKERS
from tests.support.raw_http import read_response
from tests.support.server import Server, gunicorn

pytestmark = pytest.mark.e2e


class Connection:
    """One kept-alive client connection, on which requests go one at a time."""

    def __init__(self, server: Server) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)

    def send_info(self) -> None:
        self.sock.sendall(b"GET /info HTTP/1.1\r\nHost: test\r\n\r\n")

    def pid(self) -> int:
        """The pid in the /info answer: which worker holds this connection."""
        _, body = read_response(self.sock)
        return int(json.loads(body)["pid"])

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def connections(server: Server, count: int) -> Iterator[list[Connection]]:
    opened = [Connection(server) for _ in range(count)]
    try:
        yield opened
    finally:
        for connection in opened:
            connection.close()


def holders(opened: list[Connection]) -> Counter[int]:
    # All connect, then all ask, as a pool of clients starting together does.
    for connection in opened:
        connection.send_info()
    return Counter(connection.pid() for connection in opened)


WORKER_CLASSES = {
    "gthread": "service.host.worker.BalancedThreadWorker",
    "gevent": "service.host.gevent_worker.GeventWorker",
}


@pytest.mark.parametrize("worker_class", sorted(WORKER_CLASSES))
def test_a_burst_of_connections_is_split_evenly_between_the_workers(worker_class: str) -> None:
    with gunicorn({**TWO_WORKERS, "SERVE_WORKER_CLASS": worker_class}) as server:
        assert f"Using worker: {WORKER_CLASSES[worker_class]}" in server.log()
        with connections(server, 16) as opened:
            split = holders(opened)
        assert sorted(split) == sorted(server.workers())
        # Within one connection: a count read one accept late can cost that much.
        assert max(split.values()) - min(split.values()) <= 2, split


@pytest.mark.parametrize("worker_class", sorted(WORKER_CLASSES))
def test_a_frozen_worker_does_not_stop_the_other_from_accepting(worker_class: str) -> None:
    settings = {**TWO_WORKERS, "SERVE_WORKER_CLASS": worker_class}
    with gunicorn(settings) as server, connections(server, 8) as first:
        split = holders(first)
        assert len(split) == 2, split
        frozen, other = sorted(split)
        os.kill(frozen, signal.SIGSTOP)  # alive, holding its connections, accepting nothing
        try:
            with connections(server, 4) as later:
                # The other worker is soon ahead of the frozen one's last count; once that
                # count is stale it accepts regardless, so every request is answered.
                assert holders(later) == {other: 4}
        finally:
            os.kill(frozen, signal.SIGCONT)


def test_balancing_can_be_turned_off() -> None:
    with gunicorn({**TWO_WORKERS, "SERVE_BALANCE_CONNECTIONS": "off"}) as server:
        # The same worker class, which also stamps arrivals; it gets no Balance.
        assert "Using worker: service.host.worker.BalancedThreadWorker" in server.log()
        with connections(server, 4) as opened:
            assert sum(holders(opened).values()) == 4

"""A gevent worker's share of the connections (service.host.gevent_accept), on a real gevent server.

The other worker is played by its entry in the shared counts; the server, the
balance, the eventfd and the hub are the ones a gevent worker runs.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import gevent
import pytest

from service.host.balance import Balance, ConnectionShares
from service.host.gevent_accept import SharedAccept


class Worker:
    """Slot 0's accepting, with slot 1's count set by hand."""

    def __init__(self) -> None:
        self.shares = ConnectionShares(2)
        self.refusing = False
        self.accept = SharedAccept(Balance(self.shares, 0), lambda: self.refusing)
        self.held: list[Any] = []  # the connections it accepted, kept open as kept-alive ones are
        self.server = self.accept.server(("127.0.0.1", 0), handle=self._handle)
        self.clients: list[socket.socket] = []

    def _handle(self, client: Any, _addr: Any) -> None:
        self.accept.opened()
        self.held.append(client)
        gevent.sleep(60)  # open until the test ends, as the worker's greenlet would serve it

    def other_holds(self, connections: int) -> None:
        self.shares.publish(1, connections, time.monotonic(), os.getpid())

    def other_accepts(self, connections: int) -> None:
        """Slot 1 accepts a connection: its count goes up, and a refusing slot 0 is woken."""
        Balance(self.shares, 1).accepted(connections)

    def connect(self, expected: int) -> int:
        """Open a client connection; how many the server has accepted (see ``settled``)."""
        self.clients.append(socket.create_connection(self.server.address))
        return self.settled(expected)

    def settled(self, expected: int) -> int:
        """How many it has accepted once ``expected`` have been (or 10 s passed), and 0.1 s later."""
        deadline = time.monotonic() + 10  # a busy machine may run the hub late; it is not timed here
        while len(self.held) < expected and time.monotonic() < deadline:
            gevent.sleep(0.01)
        gevent.sleep(0.1)
        return len(self.held)


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker()
    w.other_holds(0)
    w.server.start()
    watcher = gevent.spawn(w.accept.watch_wakeups)
    try:
        yield w
    finally:
        watcher.kill()
        w.server.stop(timeout=0)
        for client in w.clients:
            client.close()


def test_a_worker_ahead_of_the_other_leaves_new_connections_to_it(worker: Worker) -> None:
    assert worker.connect(expected=1) == 1  # 0 against 0: it accepts
    assert worker.connect(expected=1) == 1  # 1 against 0: the next is left to the other worker


def test_another_workers_accept_lets_it_accept_again(worker: Worker) -> None:
    assert worker.connect(expected=1) == 1
    assert worker.connect(expected=1) == 1
    worker.other_accepts(1)  # 1 against 1: the eventfd wakes it, and the waiting connection is taken
    assert worker.settled(2) == 2


def test_while_its_door_refuses_it_accepts_past_its_share(worker: Worker) -> None:
    assert worker.connect(expected=1) == 1
    assert worker.connect(expected=1) == 1
    worker.refusing = True
    worker.accept.settle()  # at the next close, wake-up or heartbeat
    assert worker.settled(2) == 2
    assert worker.connect(expected=3) == 3


def test_nothing_is_published_before_the_worker_serves() -> None:
    shares = ConnectionShares(2)
    SharedAccept(Balance(shares, 0), lambda: False).settle()
    # Not live: the other worker does not hold back for a worker that is still loading its model.
    assert shares.live(1, time.monotonic()) == []

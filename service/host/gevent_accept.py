"""The gevent worker's share of the connections: its servers accept while the balance says so.

gthread's event loop asks the balance (service.host.balance) before each
accept. gevent's servers accept in the hub by themselves, so the gevent worker
(service.host.gevent_worker) tells this object of every connection it opens and
closes, and this object stops the servers' accepting while the worker holds more
than its share, and starts it again when the count allows: at a close, when
another worker's accept wakes it (the balance's eventfd), and at gunicorn's
heartbeat once a second, which also keeps the published count fresh.

While its door is refusing (service.http.door), a worker accepts whatever its
share. Under overload both workers are busy, and a connection left in the
listen backlog waits there unseen, out of every latency budget, for a worker
that is not accepting to look again: at five times capacity of one-text
requests, balanced that way, two runs in four let accepted requests wait past
4 s (p99) where none did unbalanced. Accepted, the request is refused in
a fraction of a millisecond and its connection held.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gevent.server import StreamServer
from gevent.socket import wait_read

from service.host.balance import Balance


class SharedAccept:
    def __init__(self, balance: Balance, refusing: Callable[[], bool]) -> None:
        self._balance = balance
        self._refusing = refusing  # whether the worker's door refuses now
        self._servers: list[StreamServer] = []
        self.open = 0  # connections this worker holds, one greenlet each

    def server(self, *args: Any, **kwargs: Any) -> StreamServer:
        """A listener's server, as gunicorn builds it, kept so that its accepting can be stopped."""
        server = StreamServer(*args, **kwargs)
        self._servers.append(server)
        return server

    def opened(self) -> None:
        self.open += 1
        self.settle(accepted=True)  # published at once, and refusing workers look again

    def closed(self) -> None:
        self.open -= 1
        self.settle()

    def settle(self, *, accepted: bool = False) -> None:
        """Accept, or stop accepting, as the balance says for the connections held now.

        Each ask publishes the count, so a worker that opens and closes nothing
        still counts as live. Both calls are idempotent in gevent, and each is
        made every time rather than on a change: a server whose pool fills
        stops itself and starts again when a connection ends, whatever this
        object decided.
        """
        if not self._servers:
            return  # not serving yet: nothing is published, so the others do not wait for it
        # Asked first whatever the door says: the ask publishes the count.
        accept = self._balance.may_accept(self.open, accepted=accepted) or self._refusing()
        for server in self._servers:
            if not server.started:
                continue  # closed: the worker is stopping
            if accept:
                server.start_accepting()
            else:
                server.stop_accepting()

    def watch_wakeups(self) -> None:
        """A greenlet: each time another worker accepts while this one refuses, look again."""
        try:
            while True:
                wait_read(self._balance.wakeup_fd)
                self._balance.woken()
                self.settle()
        except OSError:
            return  # the eventfd closed with the worker

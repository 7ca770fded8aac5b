# design:
# - gthread: the event loop (the worker's main thread) alone owns HeldConnections.
#   A request thread only marks its connection with the hold that was asked
#   for; the loop's finish_request, which would put a kept-alive connection back
#   in its poller for its next request, parks it here instead, watched only for
#   a hang-up, and the loop releases it when due, before it next waits for
#   events. No thread waits out a hold.
# - gevent: the connection's own greenlet waits the hold out, woken early only
#   by a hang-up, before it reads the next request; it holds no thread.

"""Holding a refused client's connection before reading its next request, without holding a thread.

Closed-loop clients that resend the moment they are refused (wrk, Locust's
default users, most hand-written loops) ignore ``Retry-After``. Each refusal
costs the worker a fraction of a millisecond of CPU, and with nothing to slow
them 64 such clients send thousands a second: the refusals take the cores from
the model, the queue stays long, and the door keeps refusing. The overload
feeds itself and outlasts what caused it.

So when the door refuses a request that came straight from its client
(service.http.door), the worker leaves that connection unread for the
Retry-After it sent. A client that honours the header sees no difference; one
that resends at once waits as if it had honoured it, and its resend costs
nothing until then. A resend sent during the hold counts as arriving when the
hold began, so the hold counts toward its latency budget: a request is
admitted only if it can still be answered in time counted from when it was
sent, and a hold is at most a quarter of the budget. Such a returning request is
exempt from the door's standing-queue test (it waited by the worker's choice,
not in a queue; otherwise clients that had all been refused once would be
refused for good), and is admitted while the work ahead fits what is left of
its budget, where a fresh request needs half of it spare: under a long
overload clients take turns. A client that hangs up during the hold is let go
at once (gthread watches the held socket; gevent's greenlet waits on it), so it
does not keep its place among the worker's connections.
"""

from __future__ import annotations

import heapq
import itertools
import socket
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class HeldConnections(Generic[T]):
    """Connections (or anything) parked until a time. Pure: the caller passes the time."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, float, T]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def hold(self, item: T, now: float, seconds: float) -> None:
        heapq.heappush(self._heap, (now + seconds, next(self._order), now, item))

    def seconds_to_next(self, now: float) -> float | None:
        """Until the first release is due (0 if one is); None when nothing is held."""
        if not self._heap:
            return None
        return max(0.0, self._heap[0][0] - now)

    def due(self, now: float, everything: bool = False) -> list[tuple[T, float]]:
        """Each item whose hold has ended (all of them with ``everything``), with when its hold began."""
        released = []
        while self._heap and (everything or self._heap[0][0] <= now):
            _, _, since, item = heapq.heappop(self._heap)
            released.append((item, since))
        return released


def peek(sock: Any) -> str | None:
    """What the client did since its last answer, read without taking it from the socket.

    "closed" (it hung up, or the connection broke), "sent" (its next request is
    waiting), or None (nothing yet). For a socket the poller or the hub has
    reported readable; it never blocks.
    """
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return "closed"
    return "sent" if data else "closed"

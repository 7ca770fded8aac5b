# design:
# - gthread: the event loop (the worker's main thread) alone owns HeldConnections.
#   A request thread only marks its connection with the hold that was asked
#   for; the loop's finish_request, which would put a kept-alive connection back
#   in its poller for its next request, parks it here instead, watched for a
#   hang-up or a resend, and after every turn the loop releases what is due and
#   lets resends in while the batcher has room (let_in). No thread waits out a hold.
# - gevent: the connection's own greenlet waits for a hang-up or a resend; a
#   resend parks its greenlet in the worker's Lot, from which the greenlet that
#   writes the next answer lets it in (let_in), or its own timeout ends the
#   hold. No thread waits, and nothing polls.

"""Holding a refused client's connection before reading its next request, without holding a thread.

Closed-loop clients that resend the moment they are refused (wrk, Locust's
default users, most hand-written loops) ignore ``Retry-After``. Each refusal
costs the worker a fraction of a millisecond of CPU, and with nothing to slow
them 64 such clients send thousands a second: the refusals take the cores from
the model, the queue stays long, and the door keeps refusing. The overload
feeds itself and outlasts what caused it.

So when the door refuses a request (service.http.door), or the batcher
does, the worker leaves that connection unread for the
Retry-After it sent, or until the batcher has room for it, whichever comes
first. A client that honours the header sees no difference; one that resends
at once waits its turn, and its resend costs nothing until then. Held resends
are let in longest held first (a client refused again keeps its place), as
soon as the work ahead leaves the margin a fresh request needs, right after
an answer is written: before the client just answered can resend, so the held
take the room first. A resend counts as arriving when the worker saw it, so
the hold counts toward its latency budget: a request is admitted only if it
can still be answered in time counted from when it was sent, and a hold is at
most half the budget. Such a returning request is exempt from the door's
standing-queue test (it waited by the worker's choice, not in a queue;
otherwise clients that had all been refused once would be refused for good).
One let in early is admitted with a smaller margin than a fresh request
(admission.RETURNING_MARGIN), so the few fresh requests that reach the queue
beside it do not turn it away; one whose hold simply ended needs a fresh
request's margin. A client
that hangs up during the hold is let go at once (gthread watches the held
socket; gevent's greenlet waits on it), so it does not keep its place among
the worker's connections.
"""

from __future__ import annotations

import heapq
import itertools
import socket
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class HeldConnections(Generic[T]):
    """Connections (or anything) parked until a time, or let in earlier. Pure: the caller passes the time.

    Each has when its current hold began (``since``) and when its client was
    first held (``first``), which a connection keeps while it is refused and
    held again. Those whose next request has arrived (``ready``) can be let in
    before their hold ends (``let_in``), first held first: first come, first
    served among the refused, however often each was turned away. Both orders
    are heaps with entries left behind by what was taken out of the other, so
    each turn costs a few operations however many are held.
    """

    def __init__(self) -> None:
        self._by_due: list[tuple[float, int]] = []  # (due, key); a key no longer live is skipped
        self._ready: list[tuple[float, int]] = []  # (first, key) of those whose request arrived; likewise
        self._live: dict[int, tuple[float, T]] = {}  # key -> (first, item)
        self._keys = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def hold(self, item: T, now: float, seconds: float, first: float | None = None) -> int:
        """Park ``item`` for ``seconds`` from ``now``; its key, for ``ready`` and ``let_go``."""
        key = next(self._keys)
        self._live[key] = (now if first is None else min(first, now), item)
        heapq.heappush(self._by_due, (now + seconds, key))
        return key

    def ready(self, key: int) -> None:
        """The held client's next request has arrived: it may be let in before its hold ends."""
        if key in self._live:
            heapq.heappush(self._ready, (self._live[key][0], key))

    def seconds_to_next(self, now: float) -> float | None:
        """Until the first release is due (0 if one is); None when nothing is held."""
        if not self._skip_gone(self._by_due):
            return None
        return max(0.0, self._by_due[0][0] - now)

    def due(self, now: float, everything: bool = False) -> list[T]:
        """Each item whose hold has ended (all of them with ``everything``), in the order their holds end."""
        released = []
        while self._skip_gone(self._by_due) and (everything or self._by_due[0][0] <= now):
            _, key = heapq.heappop(self._by_due)
            released.append(self._live.pop(key)[1])
        self._tidy()
        return released

    def let_in(self, fits: Callable[[T, int], bool]) -> list[T]:
        """Let ready items in before their holds end, first held first, while ``fits(item, i)``.

        ``fits(item, i)``: whether ``item`` would be admitted behind the ``i``
        let in before it now. The first that does not fit ends the turn, so no
        client jumps ahead of one held longer.
        """
        released: list[T] = []
        while self._skip_gone(self._ready):
            key = self._ready[0][1]
            item = self._live[key][1]
            if not fits(item, len(released)):
                break
            heapq.heappop(self._ready)
            del self._live[key]
            released.append(item)
        self._tidy()
        return released

    def let_go(self, key: int) -> None:
        """Take an item out before its hold ends; a key already let go is ignored."""
        self._live.pop(key, None)
        self._tidy()

    def _skip_gone(self, heap: list[tuple[float, int]]) -> bool:
        while heap and heap[0][1] not in self._live:
            heapq.heappop(heap)
        return bool(heap)

    def _tidy(self) -> None:
        # Entries of items taken out through the other heap are skipped when they
        # reach the top; with nothing held, none is left behind to skip.
        if not self._live:
            self._by_due.clear()
            self._ready.clear()


# A look at what waits in a socket that neither takes it nor blocks. Combined once:
# ``socket.MSG_PEEK | socket.MSG_DONTWAIT`` builds an enum member each time (enum's
# ``__or__``), a cost the event loop pays on every refusal under overload.
PEEK_NOW = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)


def peek(sock: Any) -> str | None:
    """What the client did since its last answer, read without taking it from the socket.

    "closed" (it hung up, or the connection broke), "sent" (its next request is
    waiting), or None (nothing yet). For a socket the poller or the hub has
    reported readable; it never blocks.
    """
    try:
        data = sock.recv(1, PEEK_NOW)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return "closed"
    return "sent" if data else "closed"

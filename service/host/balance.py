# design:
# - Gunicorn's workers share one listening socket, and the kernel hands each new
#   connection to whichever worker accepts first. A keep-alive connection then
#   stays with that worker for good, and each worker batches only its own
#   connections. Left to chance, 64 clients land 39 and 25 or worse on two
#   workers about one time in ten, and the first worker's requests then wait
#   1.5 times as long; a burst of 8 can land all on one worker while the other
#   idles.
# - Here the workers agree on the split: each publishes how many connections
#   it holds open into memory the gunicorn master shares with its forks
#   (ConnectionShares, one entry per worker slot), and a worker that holds more
#   connections than the least-loaded live worker (give or take SLACK) stops
#   accepting until the others catch up (gthread's event loop asks may_accept()
#   on every turn, service.host.worker; gevent's servers are stopped and started
#   by service.host.gevent_accept). The kernel then gives the next connection to
#   a worker that still accepts.
# - Nobody is starved: the least-loaded worker always accepts. An entry
#   that has not been refreshed for STALE_S (a dead or wedged worker's) no
#   longer counts, so a worker that stops serving cannot stop the others
#   accepting. The master forgets a slot as soon as its worker exits.
# - Wake-ups: a worker that stops accepting looks again only when its event
#   loop turns, which an idle worker does once a second; meanwhile the others
#   may have caught up and stopped too, and new connections would wait in the
#   kernel's backlog. So each slot has an eventfd, made by the master and
#   inherited: a worker that stops marks itself as refusing, and a worker that
#   accepts a connection writes to the eventfd of every refusing worker, whose
#   loop then turns and looks again (service.host.worker registers the eventfd in
#   its poller).
# - Each worker writes only its own entry. A reader may see a count one accept
#   old; that costs at most a connection's worth of imbalance, never a lost
#   connection (an unaccepted connection waits in the backlog).

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Callable, Iterable
from multiprocessing.sharedctypes import RawArray

# A worker's event loop turns at least once a second (gthread polls with a 1 s
# timeout), so an entry three seconds old belongs to a worker that is not running.
STALE_S = 3.0
# How many connections more than the least-loaded worker a worker may hold and
# still accept. With 0 no two workers end more than one connection apart; the
# least-loaded worker always qualifies, so some worker always accepts.
SLACK = 0


def may_accept(mine: int, others: Iterable[int], slack: int) -> bool:
    """Whether a worker holding ``mine`` open connections should accept another."""
    fewest = min(others, default=mine)
    return mine <= fewest + slack


class ConnectionShares:
    """Open connections per worker slot, in memory that forked workers share.

    Created in the gunicorn master before it forks; a slot at or past
    ``capacity`` (more workers than planned, from TTIN) takes no part.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._counts = RawArray("q", capacity)
        self._seen = RawArray("d", capacity)  # time.monotonic() of the last publish; 0: none
        self._pids = RawArray("q", capacity)
        self._refusing = RawArray("b", capacity)
        self.wakeup_fds = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(capacity)]
        # Closed with this object in the process that drops it (the master, on a
        # reload); each forked worker holds its own copies.
        weakref.finalize(self, _close_all, list(self.wakeup_fds))

    def publish(self, slot: int, connections: int, now: float, pid: int) -> None:
        self._pids[slot] = pid
        self._counts[slot] = connections
        self._seen[slot] = now

    def forget(self, slot: int, pid: int) -> None:
        """Worker ``pid`` has exited (called in the master).

        Only if it still owns the entry: after a reload the new workers reuse
        the old ones' slot numbers, and an old worker exits after its successor
        has published.
        """
        if 0 <= slot < self.capacity and self._pids[slot] == pid:
            self._seen[slot] = 0.0

    def live(self, slot: int, now: float, stale_s: float = STALE_S) -> list[int]:
        """The slots of every other live worker."""
        return [
            other
            for other in range(self.capacity)
            if other != slot and self._seen[other] > 0 and now - self._seen[other] <= stale_s
        ]

    def count(self, slot: int) -> int:
        return int(self._counts[slot])

    def set_refusing(self, slot: int, refusing: bool) -> None:
        self._refusing[slot] = refusing

    def wake_refusing(self, slots: Iterable[int]) -> None:
        """Make the event loop of each refusing worker among ``slots`` turn."""
        for other in slots:
            if self._refusing[other]:
                with contextlib.suppress(BlockingIOError):  # the counter is full: it is awake already
                    os.eventfd_write(self.wakeup_fds[other], 1)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Balanced:
    """A worker class that accepts only its share of the connections once handed a Balance (post_fork)."""

    balance: Balance | None = None


class Balance:
    """One worker's part: publish its own count, decide whether to accept, wake the others."""

    def __init__(
        self,
        shares: ConnectionShares,
        slot: int,
        slack: int = SLACK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._shares = shares
        self._slot = slot
        self._slack = slack
        self._clock = clock
        self._pid = os.getpid()  # made in the worker, after the fork (post_fork)

    @property
    def wakeup_fd(self) -> int:
        """Readable when another worker has accepted a connection since this one refused."""
        return self._shares.wakeup_fds[self._slot]

    def may_accept(self, open_connections: int, *, accepted: bool = False) -> bool:
        """Publish the count, and whether to accept another; ``accepted``: one was just accepted.

        Then refusing workers are woken to look again, as ``accepted()`` does,
        from the same reading of who is live: gevent's worker asks once per
        accept for both.
        """
        now = self._clock()
        self._shares.publish(self._slot, open_connections, now, self._pid)
        live = self._shares.live(self._slot, now)
        if accepted:
            self._shares.wake_refusing(live)
        others = [self._shares.count(other) for other in live]
        accept = may_accept(open_connections, others, self._slack)
        self._shares.set_refusing(self._slot, not accept)
        return accept

    def accepted(self, open_connections: int) -> None:
        """After each accept: publish the new count at once, and let refusing workers look again."""
        now = self._clock()
        self._shares.publish(self._slot, open_connections, now, self._pid)
        self._shares.wake_refusing(self._shares.live(self._slot, now))

    def woken(self) -> None:
        """Reset the wake-up eventfd (the event loop turns, and looks again, anyway)."""
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.wakeup_fd)

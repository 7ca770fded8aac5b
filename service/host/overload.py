# design:
# - Each worker's pace (service.batching.admission.Pace) sees only the requests
#   on its own connections. Open-loop load does not stay split between workers:
#   a client with a pool of kept-alive connections (an HTTP library's pool, a
#   proxy's upstream connections, the open-loop benchmark) sends each request
#   on a free connection. A worker that refuses frees its connections at once,
#   so it is sent more and more of the load, while each connection of a worker
#   that admits waits for its answer. That worker then sees one request per
#   connection, as from a closed loop: it keeps up, and admits up to the
#   deadline behind a standing queue as long as the pool has connections on it.
#   At 2x capacity one of two MiniLM workers held about 4 s of work that way
#   for the whole overload while the other refused, and accepted p99 was
#   2.8 to 4.5 s against a 2 s budget.
# - The overload is the service's, so the verdict is too: a worker is behind
#   when its own pace says so or another worker's said so within FRESH_S.
#   Each worker publishes only its own pace's verdict, never the combined one,
#   so that two workers cannot hold each other behind once neither's demand
#   outruns its answers.
# - Shared as balance.ConnectionShares is: an array the gunicorn master makes
#   before it forks, one entry per worker slot, written by that slot's worker
#   alone (a double is written whole on the machines torch runs on). A worker
#   that dies or stops serving stops refreshing its entry, which goes stale
#   within FRESH_S; a behind worker refreshes it on every request it admits
#   or refuses.

"""Whether any worker of the service is behind: each worker's pace verdict, shared with the others."""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.sharedctypes import RawArray

# A worker's "behind" counts for the others this long after it last said so.
# It says so on every request it admits or refuses, so under an overload its
# entry is milliseconds old; once it is no longer behind it clears its entry at
# once. Short enough that a worker that died while behind holds the others
# back for a second at most.
FRESH_S = 1.0


class OverloadShares:
    """When each worker slot's pace last said the service is behind (0: not behind), shared by forked workers.

    Created in the gunicorn master before it forks; a slot at or past
    ``capacity`` (more workers than planned, from TTIN) neither publishes nor
    is seen.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._behind_at = RawArray("d", capacity)  # time.monotonic() of the slot's last "behind"; 0: none

    def publish(self, slot: int, behind: bool, now: float) -> None:
        if 0 <= slot < self.capacity:
            self._behind_at[slot] = now if behind else 0.0

    def others_behind(self, slot: int, now: float, fresh_s: float = FRESH_S) -> bool:
        """Whether another slot's worker said it is behind within ``fresh_s``."""
        return any(
            other != slot and at > 0.0 and now - at <= fresh_s for other, at in enumerate(self._behind_at)
        )

    def for_slot(self, slot: int, clock: Callable[[], float] = time.monotonic) -> Callable[[bool], bool]:
        """The service's verdict for ``slot``'s worker from its own: published, then ORed with the others'."""

        def verdict(own: bool) -> bool:
            now = clock()
            self.publish(slot, own, now)
            return own or self.others_behind(slot, now)

        return verdict

# design:
# - Request threads (or greenlets) and the batch thread append to deques: an
#   append is atomic and takes no lock. A flush pops what is there and writes
#   it, one flush at a time (a native lock, never held by a recorder): the
#   increments (counters, a histogram's buckets and sum) would add up in any
#   order, but of a gauge's values set one after the other the later must be
#   written last. The in-flight gauge is not recorded at all: each flush sets
#   it to the requests between enter and leave, which the tally counts anyway.
# - When to flush: when the first request enters an idle worker and when the
#   last one in flight leaves (so a client that sends one request at a time, a
#   test among them, reads exact figures from the next scrape, a long request
#   in flight included), when something is recorded with nothing in flight (the
#   door's refusals at low load), before this worker renders a scrape, and,
#   under a load that never leaves a worker idle, every FLUSH_EVERY_S from an
#   OS thread started on the first record left waiting.
# - The thread holds the tally weakly and ends once it is gone, so that the
#   apps the tests build one after another do not each leave a thread behind.

"""Metric updates recorded by request threads, written to prometheus_client a batch at a time.

Under gunicorn every update of a prometheus_client value takes the library's
process-wide lock, checks the pid and writes the worker's mmap file: about
2 us each here (one a getpid system call), and a batched request made nine
(in flight up and down, the wait before the handler, its count, its duration,
the queue depth as it is queued and as it is taken), and each batch another
nine or so (its size, items, model time, every request's queue wait, tokens).
With 72 request threads per worker the lock is also where they queue. Recorded here, a burst of
requests costs a deque append each, and a flush writes each counter, gauge
and histogram bucket once for all of them: a histogram's observations are
counted into its buckets first (``observe_all``); of a gauge's values, the
last.

A scrape shows what was flushed: exact once a worker has nothing in flight,
and at most FLUSH_EVERY_S behind under a load that keeps it busy.
"""

from __future__ import annotations

import bisect
import logging
import math
import weakref
from collections import defaultdict, deque
from typing import Any

from service.batching import native

log = logging.getLogger(__name__)

# Under a load that never leaves the worker idle: well inside any scrape interval.
FLUSH_EVERY_S = 0.5


class Tally:
    """Increments and observations for prometheus_client metric children, written in batches."""

    def __init__(self, every_s: float = FLUSH_EVERY_S, in_flight: Any = None) -> None:
        """``in_flight``: a gauge each flush sets to the requests between ``enter`` and ``leave``."""
        self._every_s = every_s
        self._in_flight_gauge = in_flight
        self._incs: deque[tuple[Any, float]] = deque()  # (counter or gauge child, amount)
        self._observations: deque[tuple[Any, float]] = deque()  # (histogram child, value)
        self._sets: deque[tuple[Any, float]] = deque()  # (gauge child, value): the last one counts
        self._in_flight: deque[None] = deque()  # one entry per request between enter and leave
        self._flusher_started = False
        # One flush at a time, so that of two gauge values the later is written last.
        self._flushing = native.allocate_lock()

    # -- recording (any thread or greenlet) ---------------------------------------

    def inc(self, child: Any, amount: float = 1.0) -> None:
        self._incs.append((child, amount))

    def observe(self, child: Any, value: float) -> None:
        self._observations.append((child, value))

    def observe_many(self, child: Any, values: list[float]) -> None:
        self._observations.extend([(child, value) for value in values])

    def set(self, child: Any, value: float) -> None:
        self._sets.append((child, value))

    def enter(self) -> None:
        """A request began: the first one in flushes, so it shows at once; what is recorded after waits."""
        self._in_flight.append(None)
        if len(self._in_flight) == 1:
            self.flush()
        else:
            self._ensure_flusher()

    def leave(self) -> None:
        """A request ended: the last one out flushes."""
        self._in_flight.pop()
        self.settle()

    def settle(self) -> None:
        """After recording: flush now if nothing is in flight, else leave it to the next flush."""
        if not self._in_flight:
            self.flush()
        else:
            self._ensure_flusher()

    def defer(self) -> None:
        """After recording what the caller's next update will flush: leave it to that, or to the flusher."""
        self._ensure_flusher()

    def _ensure_flusher(self) -> None:
        if not self._flusher_started:
            self._flusher_started = True
            _start_flusher(weakref.ref(self), self._every_s)

    # -- writing ------------------------------------------------------------------

    def flush(self) -> None:
        """Write everything recorded so far."""
        with self._flushing:
            totals: defaultdict[Any, float] = defaultdict(float)
            for child, amount in _drain(self._incs):
                totals[child] += amount
            observed: defaultdict[Any, list[float]] = defaultdict(list)
            for child, value in _drain(self._observations):
                observed[child].append(value)
            latest = dict(_drain(self._sets))
            for child, total in totals.items():
                child.inc(total)
            for child, values in observed.items():
                observe_all(child, values)
            for child, value in latest.items():
                child.set(value)
            if self._in_flight_gauge is not None:
                self._in_flight_gauge.set(len(self._in_flight))


def _drain(pending: deque[tuple[Any, float]]) -> list[tuple[Any, float]]:
    """What is in ``pending`` now, taken out oldest first; what is appended meanwhile stays."""
    taken = []
    for _ in range(len(pending)):
        taken.append(pending.popleft())
    return taken


def observe_all(histogram: Any, values: list[float]) -> None:
    """``histogram.observe(v)`` for each of ``values``, with each bucket and the sum written once.

    prometheus_client has no call for many observations at once, so this reads
    the fields its ``Histogram.observe`` updates (tests/unit/test_tally.py checks
    that both give the same exposition); a version without them gets one
    ``observe`` call per value.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(values) == 1:
        for value in values:
            histogram.observe(value)
        return
    counts: defaultdict[int, int] = defaultdict(int)
    for value in values:
        # observe() counts a value in the first bucket whose bound is >= it, and NaN in none.
        if not math.isnan(value):
            counts[bisect.bisect_left(bounds, value)] += 1
    total.inc(sum(values))
    for index, count in counts.items():
        buckets[index].inc(count)


def _start_flusher(tally: weakref.ref[Tally], every_s: float) -> None:
    def run() -> None:
        while True:
            native.sleep(every_s)
            live = tally()
            if live is None:
                return
            try:
                live.flush()
            except Exception:  # a metrics write must never end the thread that writes the rest
                log.exception("metrics flush failed")
            del live

    native.start_thread(run)

# design:
# - Each model a worker serves has its own batch thread (service.batching.batcher),
#   and all of them run on the same torch threads: the plan gives the worker
#   SERVE_TORCH_THREADS for the cores it owns, not that many per model. Two
#   model calls at once would each run on the full pool and oversubscribe the
#   cores, as concurrent request threads do on the naive route.
# - So a model call takes the worker's model time first: one call at a time.
#   When it is handed back, the asking model that has used the least model time
#   goes next (fair queueing by time, not by calls: a rerank call of 64 pairs
#   costs ten embedding calls of a few texts, and turns by call would give the
#   costlier model nearly all the time). With two models busy each gets half, so
#   a flood of one model's requests slows another's to about twice its time
#   alone, and cannot starve it. A call is one length-sorted sub-batch, which
#   the batcher cuts to about SHARED_CALL_S of model time while another model is
#   active, so no model holds the time for long; with its neighbours quiet, a
#   model's calls are what they would be alone.
# - A model back from idle banks little credit: when it asks, having had no turn
#   for IDLE_S, its count is raised to within CREDIT_S of the least of the
#   models already holding or asking, as start-time fair queueing does; else a
#   model back from a quiet minute would hold the time for a minute. A busy
#   model asks again as soon as its turn ends, so its count is never touched,
#   however long the others' calls.
# - The locks are service.batching.native's: batch threads are OS threads, also
#   in a gevent worker.
# - A lone model has no ModelTime (None), and its calls take no turn at all.

"""The model time one worker's models share: one model call at a time, in turns."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from service.batching import native

# How far behind the others a model back from idle may start: a few calls' worth.
CREDIT_S = 0.1
# A model that asks this long after its last turn ended comes back from idle.
IDLE_S = 0.05
# A model that had a turn this recently still shares the time: its neighbours' calls stay cut.
ACTIVE_S = 1.0
# The longest a length-aware model's call is cut to while models share the time
# (Batcher._call_tokens): what another model's request may wait for one call.
SHARED_CALL_S = 0.1


class ModelTime:
    def __init__(self) -> None:
        self._lock = native.allocate_lock()
        self._holder: int | None = None
        # The models asking for the time now (a model has one batch thread: one call each).
        self._asking: set[int] = set()
        # A lock per blocked asker, released (all of them) when the time is handed back.
        self._gates: list[Any] = []
        # Seconds of model time each model has used (raised when it comes back from idle).
        self._used: list[float] = []
        # When each model's last turn ended (monotonic; None: never had one).
        self._ended: list[float | None] = []
        # Each model's work queued and not yet run, in seconds of model time (the batchers publish it).
        self._backlogs: list[Callable[[], float]] = []

    def join(self, backlog: Callable[[], float]) -> int:
        """A model joins: ``backlog()`` gives its queued work in seconds of model time. Returns its index.

        Models join from their loader threads, so under the lock.
        """
        with self._lock:
            self._backlogs.append(backlog)
            self._used.append(0.0)
            self._ended.append(None)
            return len(self._backlogs) - 1

    def others_backlog(self, index: int) -> float:
        """The seconds of model time the other models' queued work holds: read without their locks."""
        return sum(backlog() for i, backlog in enumerate(self._backlogs) if i != index)

    def others_active(self, index: int, now: float) -> bool:
        """Whether another model holds or asks for the time, or had it within the last ACTIVE_S.

        While one does, calls are cut to SHARED_CALL_S (Batcher._call_tokens); a model
        whose neighbours are quiet runs its calls as it would alone. Read without the lock.
        """
        if any(i != index for i in (*self._asking, self._holder) if i is not None):
            return True
        return any(i != index and e is not None and now - e < ACTIVE_S for i, e in enumerate(self._ended))

    @contextlib.contextmanager
    def turn(self, index: int) -> Iterator[float]:
        """Hold the model time for one call of model ``index``; yields the seconds waited for it."""
        asked = time.monotonic()
        self._take(index)
        started = time.monotonic()
        try:
            yield started - asked
        finally:
            with self._lock:
                ended = time.monotonic()
                self._used[index] += ended - started
                self._ended[index] = ended
                self._holder = None
                gates, self._gates = self._gates, []
            # Every blocked asker looks again; the least served takes it. A model
            # with more calls to make asks again at once, before the woken ones
            # run, so it keeps the time while it is the one behind.
            for gate in gates:
                gate.release()

    def _take(self, index: int) -> None:
        self._lock.acquire()
        try:
            ended = self._ended[index]
            others = [self._used[i] for i in (*self._asking, self._holder) if i is not None and i != index]
            if others and (ended is None or time.monotonic() - ended > IDLE_S):
                # Back from idle: behind the others by CREDIT_S at most.
                self._used[index] = max(self._used[index], min(others) - CREDIT_S)
            self._asking.add(index)
            try:
                while self._holder is not None or index != min(self._asking, key=self._used.__getitem__):
                    gate = native.allocate_lock()
                    gate.acquire()
                    self._gates.append(gate)
                    self._lock.release()
                    try:
                        gate.acquire()  # until the time is handed back
                    finally:
                        self._lock.acquire()
            finally:
                # Taken, or given up on (an exception): either way no longer asking,
                # so that it never stands as the least served while it waits for nothing.
                self._asking.discard(index)
            self._holder = index
        finally:
            self._lock.release()

# design:
# - Each model a worker serves has its own batch thread (service.batching.batcher),
#   and all of them run on the same torch threads: the plan gives the worker
#   SERVE_TORCH_THREADS for the cores it owns, not that many per model. Two
#   model calls at once would each run on the full pool and oversubscribe the
#   cores, as concurrent request threads do on the naive route.
# - So a model call takes the worker's model time first: one call at a time,
#   handed over first come, first served. Two models with work waiting then
#   alternate call by call (a call is one length-sorted sub-batch, bounded by
#   SERVE_MAX_BATCH_TOKENS), so a flood of one model's requests delays another
#   model's request by at most one of its calls at a time: fair shares of model
#   time, without a deadline scheduler that a flood with earlier deadlines could
#   starve the other model by.
# - The locks are service.batching.native's: batch threads are OS threads, also
#   in a gevent worker.
# - A lone model has no ModelTime (None), and its calls take no turn at all.

"""The model time one worker's models share: one model call at a time, in turns."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from service.batching import native


class ModelTime:
    def __init__(self) -> None:
        self._lock = native.allocate_lock()
        self._busy = False
        # A lock per waiting call, held until the call before it hands over.
        self._waiting: deque[Any] = deque()
        # Each model's work queued and not yet run, in seconds of model time (the batchers publish it).
        self._backlogs: list[Callable[[], float]] = []

    def join(self, backlog: Callable[[], float]) -> int:
        """A model joins: ``backlog()`` gives its queued work in seconds of model time. Returns its index."""
        self._backlogs.append(backlog)
        return len(self._backlogs) - 1

    def others_backlog(self, index: int) -> float:
        """The seconds of model time the other models' queued work holds: read without their locks."""
        return sum(backlog() for i, backlog in enumerate(self._backlogs) if i != index)

    @contextlib.contextmanager
    def turn(self) -> Iterator[float]:
        """Hold the model time for one call; yields the seconds waited for it."""
        asked = time.monotonic()
        with self._lock:
            if not self._busy:
                self._busy = True
                mine = None
            else:
                mine = native.allocate_lock()
                mine.acquire()
                self._waiting.append(mine)
        if mine is not None:
            mine.acquire()  # released by the call before this one, which hands the time over
        try:
            yield time.monotonic() - asked
        finally:
            with self._lock:
                if self._waiting:
                    self._waiting.popleft().release()  # still busy: the next call holds it now
                else:
                    self._busy = False

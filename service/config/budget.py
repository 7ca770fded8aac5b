# design:
# - One Budget per worker for each thing whose size a client chooses and the
#   worker must hold in memory at once: the bytes of request bodies being read
#   and parsed (service.http.inference) and the pixels of images being decoded
#   (service.models.imaging). Only request threads (gthread) or greenlets
#   (gevent) take from it and give back; the batch thread never touches it.
# - The condition is ``threading``'s, looked up when the budget is made. In a
#   gevent worker that is gevent's (the worker patches before the app, and so
#   before any budget, is made), so a greenlet that waits yields to the one
#   that will give back; under gthread it is an OS condition.
# - An amount larger than the whole budget is taken as the whole budget, so it
#   waits for everything else to give back but never forever; what one request
#   may hold is bounded elsewhere (the body limit, the pixel limit).

"""A bound on what the requests of one worker hold at once, counted in bytes or pixels."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

# A worker's bodies held at once: room for four bodies at the limit, never less than this.
MIN_BODY_BUDGET_BYTES = 64 << 20


def body_budget_bytes(max_body_bytes: int) -> int:
    """Bytes of request bodies one worker holds at once: four at SERVE_MAX_BODY_BYTES, at least 64 MiB."""
    return max(MIN_BODY_BUDGET_BYTES, 4 * max_body_bytes)


class Budget:
    """``capacity`` units shared by the requests of one worker; ``hold`` waits until its amount fits."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a budget needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity
        self._held = 0
        self._changed = threading.Condition()

    @property
    def held(self) -> int:
        return self._held

    def take(self, amount: int, timeout: float | None = None) -> int | None:
        """Take ``amount`` (at most the capacity) once it fits: what was taken; None after ``timeout`` s."""
        amount = max(0, min(amount, self.capacity))
        with self._changed:
            if not self._changed.wait_for(lambda: self._held + amount <= self.capacity, timeout):
                return None
            self._held += amount
        return amount

    def give_back(self, amount: int) -> None:
        """Return what ``take`` gave."""
        with self._changed:
            self._held -= amount
            self._changed.notify_all()

    @contextmanager
    def hold(self, amount: int) -> Iterator[None]:
        """Hold ``amount`` for the block, waiting for it as long as it takes."""
        taken = self.take(amount) or 0  # no timeout: never None
        try:
            yield
        finally:
            self.give_back(taken)

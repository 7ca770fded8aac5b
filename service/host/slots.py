"""Stable worker slots: gunicorn numbers workers by age only, so the plan's slots are kept here.

Used by the gunicorn master alone, from its hooks, one call at a time. A worker
takes the lowest slot no live worker holds when it is forked (``pre_fork``) and
gives it back when it dies (``child_exit``), so the replacement of a dead worker
takes its slot, and with it its device.
"""

from __future__ import annotations

from collections.abc import Iterable


class SlotTable:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # slot -> worker id (gunicorn's worker age)

    def assign(self, worker_id: int, live: Iterable[int] = ()) -> int:
        """The lowest free slot, now held by ``worker_id``.

        ``live`` lists the workers still alive: a worker that left without a
        ``child_exit`` (gunicorn drops a worker that vanished before it could be
        signalled) must not keep its slot forever.
        """
        alive = set(live)
        self._holders = {slot: held_by for slot, held_by in self._holders.items() if held_by in alive}
        slot = next(s for s in range(len(self._holders) + 1) if s not in self._holders)
        self._holders[slot] = worker_id
        return slot

    def release(self, worker_id: int) -> int | None:
        """Free ``worker_id``'s slot; returns it (None if it held none)."""
        for slot, held_by in list(self._holders.items()):
            if held_by == worker_id:
                del self._holders[slot]
                return slot
        return None

    def holders(self) -> dict[int, int]:
        return dict(self._holders)

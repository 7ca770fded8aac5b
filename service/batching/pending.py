"""A request's place in the batcher: the request as queued (Pending) and the items a batch runs of it (Part).

Shared by the batcher (service.batching.batcher), which queues and runs them,
and its gate (service.batching.gate), which admits them and counts them out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from service.batching.reply import Reply


@dataclass(eq=False)
class Pending:
    """One request's place in the queue; only the caller and the batch thread hold it."""

    items: list[Any]
    deadline: float
    # Each item's size (the model's units, e.g. tokens), or None when the model reports none.
    sizes: list[int] | None = None
    enqueued_at: float = field(default_factory=time.monotonic)
    # Created before it is queued; its locks are native, so the batch thread may complete it under gevent.
    future: Reply = field(default_factory=Reply)
    # When its batch began, set by the batch thread before the future completes;
    # cleared again for a request refused before its model call (Gate.shed_late).
    started_at: float | None = None
    batch_size: int = 0
    # When the request reached the service, for the latency budget (None: when it was queued).
    arrived: float | None = None
    # Small enough to go ahead of bulk work (Batcher's express lane).
    express: bool = False
    # The batch thread's alone, for a request larger than a batch, taken in parts:
    taken: int = 0  # items taken into batches so far
    ran: int = 0  # items of it that batches ran, for the service meter
    claimed: bool = False
    rows: list[Any] | None = None
    answered_rows: int = 0
    array: bool = True  # every part's rows came from an array: answer with one
    finite: bool = True  # every part's call was checked whole and held neither NaN nor infinity

    @property
    def budget_from(self) -> float:
        """When its latency budget and its deadline count from."""
        return self.enqueued_at if self.arrived is None else self.arrived


@dataclass(frozen=True)
class Part:
    """Items ``start:end`` of a request, as one batch runs them; most requests are one part."""

    pending: Pending
    start: int
    end: int

    @property
    def items(self) -> list[Any]:
        return self.pending.items if self.whole else self.pending.items[self.start : self.end]

    @property
    def sizes(self) -> list[int]:
        return (self.pending.sizes or [])[self.start : self.end]

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end == len(self.pending.items)

    @property
    def last(self) -> bool:
        """Whether the request's answer waits for no later part."""
        return self.end == len(self.pending.items)

"""Answers put together from rows: a length-aware batch's, in size order, and a large request's parts.

Run by the batch thread (service.batching.batcher) alone. A length-aware batch
runs its items sorted by size, as consecutive sub-batches; Assembly keeps each
part's rows as they come back and says when a part is complete. A request
larger than a batch runs in parts, a batch at a time; complete() keeps a part's
rows until its last part's are in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.batching.gate import Needs
from service.batching.pending import Part
from service.batching.reply import Reply, deliver, fail
from service.batching.subbatch import Cost
from service.errors import ModelError
from service.models.base import Outputs
from service.outputs import check_finite


class Assembly:
    """The items of one length-aware batch, in size order, and each part's rows as they come back."""

    def __init__(self, live: list[Part]) -> None:
        self.live = live
        # (size, part index, item index in the part), sorted by size; sort() is
        # stable, so equal sizes keep arrival order.
        self.order = sorted(
            ((size, r, i) for r, part in enumerate(live) for i, size in enumerate(part.sizes)),
            key=lambda entry: entry[0],
        )
        self.rows: list[list[Any]] = [[None] * (part.end - part.start) for part in live]
        self.left = [part.end - part.start for part in live]
        self.array = [True] * len(live)  # every row came from an array: answer with one
        self.failed: set[int] = set()
        self.finite = True  # every call so far returned only finite outputs
        self.ranges: list[tuple[int, int]] = []
        self.last: list[int] = []  # each part's last sub-batch

    def plan(self, ranges: list[tuple[int, int]]) -> None:
        """The sub-batches ``order`` runs as, and the last one each part waits for."""
        self.ranges = ranges
        self.last = [0] * len(self.live)
        for k, (start, end) in enumerate(ranges):
            for _, r, _ in self.order[start:end]:
                self.last[r] = k

    def needs(self, k: int, waiting: list[int], estimate: Cost) -> Needs:
        """``needs`` for Gate.shed_late before sub-batch ``k``: each waiting part's model time to its end.

        ``waiting``: part indices. Only the rows of the parts kept count, so a
        call shrinks (or is skipped) as requests are refused.
        """

        def needs(kept: list[int]) -> list[float]:
            alive = {waiting[i] for i in kept}
            ahead, until = 0.0, []
            for start, end in self.ranges[k:]:
                rows = [size for size, r, _ in self.order[start:end] if r in alive]
                if rows:
                    ahead += estimate.of(len(rows), max(rows))
                until.append(ahead)
            return [until[self.last[waiting[i]] - k] for i in kept]

        return needs

    def items(self, entries: list[tuple[int, int, int]]) -> list[Any]:
        return [self.live[r].pending.items[self.live[r].start + i] for _, r, i in entries]

    def store(self, entries: list[tuple[int, int, int]], outputs: Outputs) -> list[int]:
        """Keep each entry's output row; the parts this completed, by index."""
        done = []
        is_array = isinstance(outputs, np.ndarray)
        for (_, r, i), row in zip(entries, outputs, strict=True):
            if r in self.failed:
                continue
            self.rows[r][i] = row
            self.array[r] = self.array[r] and is_array
            self.left[r] -= 1
            if self.left[r] == 0:
                done.append(r)
        return done

    def result(self, r: int) -> Outputs:
        rows = self.rows[r]
        return np.stack(rows) if self.array[r] else rows


def complete(part: Part, rows: Outputs, finite: bool) -> None:
    """A part's outputs are in: answer its request, or keep them until its last part's are.

    ``finite``: the call they came from was checked whole and held neither NaN nor infinity.
    """
    pending = part.pending
    if part.whole:
        _answer(pending.future, rows, finite)
        return
    if pending.future.done():
        return  # an earlier part failed it, or the watchdog did
    if pending.rows is None:
        pending.rows = [None] * len(pending.items)
    pending.rows[part.start : part.end] = list(rows)
    pending.array = pending.array and isinstance(rows, np.ndarray)
    pending.finite = pending.finite and finite
    pending.answered_rows += part.end - part.start
    if pending.answered_rows == len(pending.items):
        result: Outputs = np.stack(pending.rows) if pending.array else pending.rows
        pending.rows = None
        _answer(pending.future, result, pending.finite)


def _answer(future: Reply, result: Outputs, finite: bool) -> None:
    """Deliver a request's outputs, or fail it with a 500 if they hold NaN or infinity.

    ``finite``: the call they came from was checked whole and held neither.
    """
    if not finite:
        try:
            check_finite(result)
        except ModelError as refused:
            fail(future, refused)
            return
    deliver(future, result)

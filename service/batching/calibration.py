"""The cost model's first measurements, taken at load, before the batch thread starts.

Runs in the runtime's loader thread. It times the model on a few batch shapes
built from sample items, so the very first batches are already cut by a cost
measured on this machine; every sub-batch the batch thread runs afterwards
refines it (service.batching.subbatch.CostModel).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from service.batching.subbatch import CostModel
from service.models.base import Outputs

log = logging.getLogger(__name__)

# Batch shapes to time: enough spread in padded tokens to separate a call's
# fixed cost from its cost per token.
ROWS = (1, 2, 4, 8, 16)
ROUNDS = 3


def calibrate(
    predict: Callable[[list[Any]], Outputs],
    items: Sequence[Any],
    size: Callable[[Any], int],
    *,
    max_rows: int,
    cost: CostModel | None = None,
) -> CostModel:
    """A cost model fed with timed calls on ``items`` (prepared, of mixed sizes).

    Each shape runs once untimed (the first call of a shape allocates) and then
    ``ROUNDS`` times; the median goes in, so one preempted call does not skew
    the line. A model that fails here is logged; the batch thread then learns
    the cost from the batches it runs.
    """
    cost = cost or CostModel()
    if not items:
        return cost
    for rows in (r for r in ROWS if r <= max_rows):
        batch = [items[k % len(items)] for k in range(rows)]
        padded = cost.tokens(rows, max(size(item) for item in batch))
        try:
            predict(batch)
            times = []
            for _ in range(ROUNDS):
                started = time.monotonic()
                predict(batch)
                times.append(time.monotonic() - started)
        except Exception:
            log.warning("cost calibration failed on a batch of %d; learning from live batches", rows)
            return cost
        cost.observe(padded, statistics.median(times))
    estimate = cost.estimate()
    if estimate is not None:
        log.info(
            "batch cost measured: %.2f ms per call + %.1f us per padded token",
            estimate.overhead_s * 1000,
            estimate.per_token_s * 1e6,
        )
    return cost

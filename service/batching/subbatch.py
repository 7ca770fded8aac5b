"""Length-aware batches: how a gathered batch is cut into sub-batches. Pure: no clock, no model.

A padded batch costs what its longest item costs, times its rows: one long
sentence among thirty short ones makes every short one pay for its length.
When a model reports each item's size (a text model: its token count), the
batch thread sorts the gathered items by size and runs them as consecutive
sub-batches, cut where the estimated cost is lowest:

    cost(sub-batch) = overhead + per_token * rows * longest

``CostModel`` learns ``overhead`` (a model call's fixed cost) and ``per_token``
(each padded token's) from timed calls on the machine it runs on: a few at
load (service.runtime calibrates) and every sub-batch after. ``cut`` finds the
cheapest cuts by dynamic programming, each sub-batch within the padded-token
budget (``SERVE_MAX_BATCH_TOKENS``), which bounds the activation memory one
call may need.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

# A model's padded call shape for (rows, longest), where it pads further than
# its longest item (service.models.shapes); None: rows times longest.
Shape = Callable[[int, int], tuple[int, int]]

# The dynamic programme looks back at most this many rows per sub-batch, so a
# batch of thousands of tiny items costs O(n * 512) to plan, not O(n^2); past
# a few hundred rows the per-call overhead is spread thin enough that longer
# sub-batches save nothing measurable.
MAX_ROWS_CONSIDERED = 512


@dataclass(frozen=True)
class Cost:
    """A model call's estimated cost in seconds: ``overhead_s + per_token_s * padded tokens``.

    With ``largest``, padded tokens past it cost nothing more: a line not drawn
    past the largest call it was measured on (CostModel.floor).
    """

    overhead_s: float
    per_token_s: float
    largest: float = math.inf
    shape: Shape | None = None

    def of(self, rows: int, longest: int) -> float:
        return self.of_tokens(self.tokens(rows, longest))

    def of_tokens(self, padded_tokens: int) -> float:
        """The cost of a call of ``padded_tokens`` (as ``tokens`` counts them)."""
        return self.overhead_s + self.per_token_s * min(padded_tokens, self.largest)

    def tokens(self, rows: int, longest: int) -> int:
        """The padded tokens a call of ``rows`` items, the longest ``longest``, runs."""
        if self.shape is None:
            return rows * longest
        padded_rows, length = self.shape(rows, longest)
        return padded_rows * length


class CostModel:
    """A least-squares line through timed calls, weighted towards the recent ones.

    Each observation is one model call: its padded tokens and its seconds.
    Older observations fade by ``decay`` per new one, so the line follows a
    machine whose speed changes (a neighbour's load, a GPU's clocks) within a
    few dozen calls. Not thread-safe: only the batch thread (and, before it
    starts, the loader thread) touches it.
    """

    def __init__(self, decay: float = 0.98, shape: Shape | None = None) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self._decay = decay
        self.shape = shape
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._largest = 0.0  # the largest call seen, in padded tokens
        # floor() as of the last observation: asked before every model call, it
        # changes only with an observation (two dataclass copies a batch, else).
        self._floor: Cost | None = None
        self._floor_shape: Shape | None = None

    def observe(self, padded_tokens: int, seconds: float) -> None:
        if padded_tokens <= 0 or seconds < 0:
            return
        d = self._decay
        x, y = float(padded_tokens), seconds
        self._largest = max(self._largest, x)
        self._w = d * self._w + 1
        self._x = d * self._x + x
        self._y = d * self._y + y
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * y
        self._floor = None

    @property
    def observed(self) -> bool:
        return self._w > 0

    def tokens(self, rows: int, longest: int) -> int:
        """The padded tokens of a call, as the model pads it (what ``observe`` takes)."""
        return Cost(0.0, 0.0, shape=self.shape).tokens(rows, longest)

    def estimate(self) -> Cost | None:
        """The fitted cost, or None before any observation."""
        if self._w == 0:
            return None
        line = self._line()
        if line is not None:
            return replace(line, shape=self.shape)
        # Every call the same size so far (or a line that falls): the time per
        # token of what was seen, no overhead. Cuts then only avoid padding.
        mean_x, mean_y = self._x / self._w, self._y / self._w
        return Cost(0.0, mean_y / mean_x if mean_x > 0 else 0.0, shape=self.shape)

    def floor(self) -> Cost | None:
        """The least a call may cost given what was seen, for a decision to refuse; None before any.

        The estimate, never drawn past the largest call seen: a model's time
        does not fall as its batch grows, but how far it rises past what was
        measured is a guess. Read as a time per item, one call of one item
        would refuse a batch of twelve that runs in about the same time (the
        reason to batch at all); and two nearly flat sizes give a slope that,
        drawn out to a large batch, refuses it just the same. A refusal made on
        a guess turns away work the service could do; one missed leaves the
        next call's check and the door to catch up.
        """
        if self._floor is not None and self._floor_shape is self.shape:
            return self._floor
        estimate = self.estimate()
        if estimate is None:
            return None
        self._floor, self._floor_shape = replace(estimate, largest=self._largest), self.shape
        return self._floor

    def _line(self) -> Cost | None:
        """The line through calls of different sizes, if they show time growing with size."""
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x <= 1e-9 * max(1.0, mean_x * mean_x):
            return None
        slope = (self._xy / self._w - mean_x * mean_y) / var_x
        if slope <= 0:
            return None
        intercept = mean_y - slope * mean_x
        if intercept < 0:
            # Timing noise can tip the intercept below zero: keep the slope
            # through the mean, with no overhead.
            return Cost(0.0, mean_y / mean_x)
        return Cost(intercept, slope)


def cut(sizes: Sequence[int], cost: Cost, *, max_tokens: int, max_rows: int) -> list[tuple[int, int]]:
    """Cheapest split of ``sizes`` (sorted ascending) into consecutive ``(start, end)`` ranges.

    Each range holds at most ``max_rows`` items and at most ``max_tokens``
    padded tokens (rows times its longest item); an item larger than the
    budget alone runs alone. Ties go to fewer, longer sub-batches. Rows and
    padded tokens are counted as ``cost`` pads a call (``Cost.shape``).
    """
    n = len(sizes)
    if any(sizes[i] > sizes[i + 1] for i in range(n - 1)):
        raise ValueError("sizes must be sorted ascending")
    if n == 0:
        return []
    limit = min(max_rows, MAX_ROWS_CONSIDERED)
    best = [0.0] + [float("inf")] * n
    start_of = [0] * (n + 1)
    # This runs in the batch thread before every batch, holding the GIL: a full
    # batch of 64 weighs about two thousand ranges, so each weighs one call.
    tokens, of_tokens = cost.tokens, cost.of_tokens
    for end in range(1, n + 1):
        longest = sizes[end - 1]
        for start in range(end - 1, max(-1, end - 1 - limit), -1):
            rows = end - start
            padded = tokens(rows, longest)
            if rows > 1 and padded > max_tokens:
                break  # longer ranges ending here only get bigger
            total = best[start] + of_tokens(padded)
            if total <= best[end]:
                best[end], start_of[end] = total, start
    cuts = []
    end = n
    while end > 0:
        cuts.append((start_of[end], end))
        end = start_of[end]
    return cuts[::-1]


# Rows whose requests arrived, on average, within this much of each other count
# as having waited alike: a burst of requests, or one gathering's, still runs
# shortest first, as a mean latency is lowest that way.
WAITED_ALIKE_S = 0.005


def oldest_first(ranges: list[tuple[int, int]], arrived: Sequence[float]) -> list[tuple[int, int]]:
    """The order to run the sub-batches in: those whose rows have waited longest, on average, first.

    ``arrived``: when each row's request arrived, in the sorted order ``ranges``
    cut. Run shortest first, a closed-loop client whose short text is answered
    early in one batch comes back and waits for that batch to end, and if its
    next text is long it runs last in the next: close to two batch times, where
    most wait one. Putting the sub-batches that hold the longest-waiting rows
    first takes that tail down (p99 4% lower at 32 clients of mixed-length text,
    the same p50: scripts/bench/closed_loop_model.py) and costs no padding:
    the cut is the same. Within WAITED_ALIKE_S, shortest first.
    """
    if len(ranges) < 2:
        return ranges
    means = [sum(arrived[start:end]) / (end - start) for start, end in ranges]
    oldest = min(means)
    ticks = [int((mean - oldest) / WAITED_ALIKE_S) for mean in means]
    # sorted() is stable: ranges that waited alike keep their shortest-first order.
    return [ranges[k] for k in sorted(range(len(ranges)), key=ticks.__getitem__)]

"""How long the batch thread waits for a batch to fill (GatherPolicy): pure, no clock and no queue.

The batch thread (service.batching.batcher) asks it, with the times it saw,
until when to wait for the next request.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatherPolicy:
    """How long the batch thread waits for a batch to fill. Pure: no clock, no queue.

    ``delay_s`` > 0 is the classic fixed window, counted from the first request's
    arrival. With no fixed window, ``adaptive`` waits only while more requests are
    expected than the batch holds yet. Closed-loop clients answered together come
    back within a few milliseconds of each other, and gathering them costs far
    less than running the first alone while the rest wait a whole model call. A
    lone client is never expected to send more, so it never waits.

    The adaptive window is ``fraction`` of a model call (at most ``max_wait_s``)
    from when gathering began. It stretches while requests keep arriving, each
    within ``arrival_gap_s`` of the one before, up to ``stretch_fraction`` of a
    model call: dozens of clients take longer than the base window to come back
    through HTTP, and one that misses the batch waits a whole model call plus
    the next gathering, twice what the others wait.
    """

    delay_s: float = 0.0
    adaptive: bool = True
    fraction: float = 0.25
    max_wait_s: float = 0.05
    # Python's GIL switch interval (5 ms): a request thread that is ready to
    # submit can wait that long for its turn.
    arrival_gap_s: float = 0.005
    stretch_fraction: float = 0.5

    def deadline(
        self,
        *,
        first_arrival: float,
        gather_start: float,
        last_arrival: float,
        requests: int,
        expected: int,
        model_time_s: float,
    ) -> float | None:
        """Until when to wait for the next request; None: take only what is queued."""
        if self.delay_s > 0:
            return first_arrival + self.delay_s
        if not (self.adaptive and requests < expected and model_time_s > 0):
            return None
        base = gather_start + min(self.fraction * model_time_s, self.max_wait_s)
        stretched = min(
            last_arrival + self.arrival_gap_s, gather_start + self.stretch_fraction * model_time_s
        )
        return max(base, stretched)

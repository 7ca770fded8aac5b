"""Admission: whether a newcomer can still be answered within the latency budget. Pure: no clock, no lock.

A request is worth taking only if it will be answered in time. Two things say
it will not: it already waited past its budget before its handler ran (in the
kernel's accept backlog, in gthread's queue of connections waiting for a
thread, in nginx), or the work ahead of it will take longer than what is left.
Refusing such a request at once costs a fraction of a millisecond; taking it
costs a model call's share and ends in a 504 anyway, after the client waited.

The work ahead is predicted from the measured service rate: how fast the batch
thread has been answering requests while it had work, whatever it does inside
(one batch, sub-batches, sorting by size). :class:`ServiceMeter` keeps that
rate and counts the requests accepted and not yet answered; the caller passes
it the time, so the tests need neither a clock nor threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Completions the service-time average spans, roughly: a few full batches, so
# that one slow batch moves it little and a change of load is seen within a
# second or two.
DEFAULT_WINDOW = 256
# Batches the quick view of the speed spans: the model time per request served
# of about the last two batches. The meter reports the slower of it and the
# long average, so a sudden loss of speed (a burst of thousands of refusals a
# second taking the cores, a noisy neighbour) is believed within a batch or
# two: at 20x capacity the long average alone kept admitting on the speed
# before the burst, and those requests were answered late. Counted per batch,
# not per completion: a batch's requests complete together, and the first
# carries the whole batch's time.
RECENT_BATCHES = 2
# Served requests before the measured rate is trusted: a rate learned from the
# first few, often run alone or in small batches, would refuse the burst after
# them that larger batches serve in good time.
MIN_SERVED = 32


# The predicted wait is an average over recent batches; under contention for
# the cores one batch can take twice as long as the last ones did. Admitting
# only what is predicted to finish within half of what is left of the budget
# keeps accepted requests inside it, while the queue still holds more than a
# batch of work, so the model never idles for lack of it.
PREDICTION_MARGIN = 2.0
# A held request let in because the batcher had room for it needs less: it
# was let in on a fresh request's terms, and only the requests that reached the
# queue beside it since count against it (AdmissionRule.decide). With no margin
# (1.0), under 20x capacity those admitted with the work ahead filling the whole
# budget were among the late answers.
RETURNING_MARGIN = 1.5


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused, and when its client may try again."""

    message: str
    retry_after_s: int


class ServiceMeter:
    """The batch thread's measured service time per request, and the requests it holds.

    ``busy_s / answered`` over the recent past, each sum decayed by
    ``1 - 1/window`` per completion; or, when slower, the model time per
    request of the last RECENT_BATCHES batches (``batch_ran``), so that the
    meter believes a slowdown within a batch or two and a speed-up only as
    the long average sees it. The model time leaves out gathering, so in a
    steady state the long average is the slower. A completion adds the time since the later
    of its own arrival and the previous completion: while the thread has a
    backlog, the gaps between completions sum to the time it worked; after an
    idle spell, the newcomer's whole stay counts. Idle time never lowers the
    rate. Requests that left without being served (cancelled by their caller,
    expired in the queue) leave the count but add no time.
    """

    def __init__(self, window: int = DEFAULT_WINDOW, min_served: int = MIN_SERVED) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self._min_served = min_served
        self._long = _Average(window)
        self._recent = _Average(RECENT_BATCHES)
        self._served = 0
        self._last_done: float | None = None
        self.outstanding = 0

    def submitted(self) -> None:
        self.outstanding += 1

    def completed(self, now: float, arrived: float, served: bool) -> None:
        self.outstanding = max(0, self.outstanding - 1)
        if not served:
            return
        since = arrived if self._last_done is None else max(arrived, self._last_done)
        self._long.add(max(0.0, now - since))
        self._served += 1
        self._last_done = now if self._last_done is None else max(now, self._last_done)

    @property
    def seconds_per_request(self) -> float | None:
        """Mean service time per request; None until ``min_served`` have been served."""
        if self._served < self._min_served:
            return None
        return max(self._long.mean, self._recent.mean)

    def batch_ran(self, seconds: float, served: int) -> None:
        """A batch's model time and the requests it served: the quick view of the speed."""
        if served > 0:
            self._recent.add(seconds, served)


class _Average:
    """A weighted mean whose samples fade by ``1 - 1/window`` per new one."""

    def __init__(self, window: int) -> None:
        self._decay = 1 - 1 / window
        self._sum = 0.0
        self._weight = 0.0

    def add(self, total: float, weight: float = 1.0) -> None:
        self._sum = self._sum * self._decay + total
        self._weight = self._weight * self._decay + weight

    @property
    def mean(self) -> float:
        return self._sum / self._weight if self._weight else 0.0


def predict_wait(ahead: int, seconds_per_request: float | None) -> float:
    """Seconds until a newcomer behind ``ahead`` requests is answered.

    Its own service counts too: with ``ahead`` at zero it still waits one
    request's time. Unknown (too few served yet, see MIN_SERVED): zero, so a
    fresh worker takes its first requests and learns its rate from them.
    """
    if seconds_per_request is None:
        return 0.0
    return (max(0, ahead) + 1) * seconds_per_request


class StandingQueue:
    """Whether the wait before the handler has become a standing queue (CoDel's test).

    A queue that empties now and then absorbs bursts; one in which every request
    for a whole ``interval_s`` waited ``target_s`` or more is overload, and in a
    first-come queue it makes every request wait the same long time, refused
    ones included. While it stands, the door refuses what waited longer than
    ``target_s`` (service.http.door): the head of the queue is shed quickly and
    the requests still taken wait little. The first request that waited less
    than the target ends the spell.
    """

    def __init__(self, target_s: float, interval_s: float) -> None:
        self.target_s = target_s
        self.interval_s = interval_s
        self._above_since: float | None = None

    def standing(self, waited_s: float, now: float) -> bool:
        if waited_s < self.target_s:
            self._above_since = None
            return False
        if self._above_since is None:
            self._above_since = now
        return now - self._above_since >= self.interval_s


@dataclass(frozen=True)
class AdmissionRule:
    """Refuse a request that cannot be answered within ``budget_s`` of its arrival."""

    budget_s: float

    @property
    def door_target_s(self) -> float:
        """The wait before the handler that, standing, counts as overload (StandingQueue)."""
        # A tenth of the budget: well above a thread's ordinary wait for its
        # turn (the GIL's switch interval is 5 ms), well below the budget.
        return self.budget_s / 10

    def standing_queue(self) -> StandingQueue:
        return StandingQueue(self.door_target_s, interval_s=self.door_target_s)

    def admits_fresh(self, waited_s: float, predicted_s: float) -> bool:
        """Whether a request that waited ``waited_s`` fits with the margin a fresh one needs.

        The test for letting a held request in before its hold ends
        (service.host.hold.let_in); the door then admits it with a smaller
        margin (``decide`` with ``returning``), whatever the few requests that
        reach the queue beside it add.
        """
        return waited_s + PREDICTION_MARGIN * predicted_s <= self.budget_s

    def decide(
        self, waited_s: float, predicted_s: float, standing: bool = False, returning: bool = False
    ) -> Refusal | None:
        """None to admit, else why not.

        ``waited_s``: since the request arrived; ``predicted_s``: predict_wait's
        answer; ``standing``: StandingQueue's verdict on the wait before the handler;
        ``returning``: the request was let in from a hold because the batcher
        had room for it (service.host.hold.let_in).

        Such a request is admitted while the work ahead fits with
        RETURNING_MARGIN to spare, any other only with PREDICTION_MARGIN: the
        few fresh requests that reach the queue beside one let in do not turn
        it away. Held clients are let in longest held first, so under a long
        overload they take turns; one whose hold simply ended meets the fresh
        requests' margin, which keeps accepted latency well within the budget.
        """
        if waited_s >= self.budget_s or (standing and waited_s >= self.door_target_s):
            limit = self.budget_s if waited_s >= self.budget_s else self.door_target_s
            return Refusal(
                f"the request waited {waited_s * 1000:.0f} ms before the service could read it, past "
                f"the {limit * 1000:.0f} ms it may wait there; the service is overloaded, retry shortly",
                1,
            )
        margin = RETURNING_MARGIN if returning else PREDICTION_MARGIN
        if waited_s + margin * predicted_s > self.budget_s:
            return Refusal(
                f"the work queued ahead would take about {predicted_s * 1000:.0f} ms, past the "
                f"{self.budget_s * 1000:.0f} ms latency budget; the service is overloaded, retry shortly",
                # By then the work now ahead is done, and a retry has a fair chance.
                max(1, math.ceil(predicted_s)),
            )
        return None

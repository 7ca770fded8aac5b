"""Admission: whether a newcomer can still be answered in time. Pure: no clock, no lock.

A request is worth taking only if it will be answered in time. Two things say
it will not: it already waited past its budget before its handler ran (in the
kernel's accept backlog, in gthread's queue of connections waiting for a
thread, in nginx), or the work ahead of it will take longer than what is left.
Refusing such a request at once costs a fraction of a millisecond; taking it
costs a model call's share and ends in a 504 anyway, after the client waited.

Work is counted in items, not requests. The work ahead is predicted from the
measured service rate: how fast the batch thread has been answering items
while it had work, whatever it does inside (one batch, sub-batches, sorting by
size). :class:`ServiceMeter` keeps that rate and counts the items accepted and
not yet answered; :class:`Pace` tells a service that keeps up from one whose
arrivals outrun its answers, which decides what a request may wait
(:class:`AdmissionRule`). The caller passes the time, so the tests need neither
a clock nor threads. Each batcher's gate (service.batching.gate) holds the
state these are applied to, under the batcher's lock, and applies them.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

# Completions the service-time average spans, roughly: a few full batches, so
# that one slow batch moves it little and a change of load is seen within a
# second or two.
DEFAULT_WINDOW = 256
# Batches the quick view of the speed spans: the model time per item served
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
# While the service keeps up (Pace), the work ahead of a request must leave its
# deadline this margin: the standing queue of a closed loop is steady, so the
# prediction is close, but a deadline missed is a 504 after the whole wait.
DEADLINE_MARGIN = 1.2


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused, and when its client may try again."""

    message: str
    retry_after_s: int


class ServiceMeter:
    """The batch thread's measured service time per item, and the items it holds.

    Work is counted in items, not requests: a request of 64 texts weighs 64
    times one of a single text, in the queue and in the prediction alike.
    ``busy_s / items answered`` over the recent past, each sum decayed by
    ``1 - 1/window`` per completion; or, when slower, the model time per item
    of the last RECENT_BATCHES batches (``batch_ran``), so that the meter
    believes a slowdown within a batch or two and a speed-up only as the long
    average sees it. The model time leaves out gathering, so in a steady state
    the long average is the slower. A completion adds the time since the later
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
        # Seconds the batch thread waited for other models' turns since the last completion.
        self._paused = 0.0
        # seconds_per_item as of the last change: read about ten times a request
        # (the door, admission, the late-request check), changed once a completion.
        self._per_item: float | None = None
        self._measured()
        self.outstanding = 0  # items accepted and not yet answered

    def submitted(self, items: int = 1) -> None:
        self.outstanding += items

    def completed(
        self, now: float, arrived: float, served: bool, items: int = 1, ran: int | None = None
    ) -> None:
        """A request of ``items`` left; ``served``: the batch thread ran (``ran`` of) its items."""
        self.outstanding = max(0, self.outstanding - items)
        if not served:
            return
        since = arrived if self._last_done is None else max(arrived, self._last_done)
        # Time the other models of the worker had is not this model's service time.
        spent, self._paused = max(0.0, now - since - self._paused), 0.0
        # A large request that failed after some of its parts: only what ran took the time.
        self._long.add(spent, items if ran is None else ran)
        self._served += 1
        self._last_done = now if self._last_done is None else max(now, self._last_done)
        self._measured()

    def paused(self, seconds: float) -> None:
        """The batch thread waited ``seconds`` for another model's turn (service.batching.model_time)."""
        self._paused += seconds

    @property
    def seconds_per_item(self) -> float | None:
        """Mean service time per item; None until ``min_served`` requests have been served."""
        return self._per_item

    def _measured(self) -> None:
        """Set seconds_per_item after a change of what it is made of."""
        if self._served >= self._min_served:
            self._per_item = max(self._long.mean, self._recent.mean)

    @property
    def recent_seconds_per_item(self) -> float | None:
        """The model time per item of the last RECENT_BATCHES batches; None before the first."""
        return self._recent.mean or None

    def batch_ran(self, seconds: float, items: int) -> None:
        """A batch's model time and the items it served: the quick view of the speed."""
        if items > 0:
            self._recent.add(seconds, items)
            self._measured()


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


def predict_wait(ahead: int, seconds_per_item: float | None, own: int = 1) -> float:
    """Seconds until a newcomer of ``own`` items behind ``ahead`` items is answered.

    Its own service counts too: with ``ahead`` at zero it still waits for its
    own items. Unknown (too few served yet, see MIN_SERVED): zero, so a fresh
    worker takes its first requests and learns its rate from them.
    """
    if seconds_per_item is None:
        return 0.0
    return (max(0, ahead) + max(1, own)) * seconds_per_item


def alone_past_deadline(items: int, seconds_per_item: float | None, deadline_s: float) -> str | None:
    """Why a request of ``items`` cannot be answered by its deadline even alone; None if it can.

    Its own model time at the measured rate, with DEADLINE_MARGIN to spare,
    passes its deadline. Then no retry can succeed: the request is too large
    for this service (413, which an SDK does not send again), not refused for
    an overload (503, which it does). On the 2-core development machine 2,048
    sentences of MiniLM take about 29 s on one worker, at the 30 s deadline.
    """
    if seconds_per_item is None or seconds_per_item <= 0:
        return None
    own_s = items * seconds_per_item
    if DEADLINE_MARGIN * own_s <= deadline_s:
        return None
    fits = max(1, math.floor(deadline_s / (DEADLINE_MARGIN * seconds_per_item)))
    return (
        f"the request is too large for its deadline: its {items} items would take about "
        f"{own_s:.1f} s of the model alone, at the "
        f"{1 / seconds_per_item:.0f} items a second this service answers now, past the request's "
        f"{deadline_s:.0f} s deadline; send at most about {fits} items a request "
        "(SERVE_REQUEST_TIMEOUT_MS sets the deadline)"
    )


# The pace's windows last long enough for the service to answer this many
# requests of the recent mean size, and at least PACE_MIN_WINDOW_S: each must
# see more growth than a closed loop's jitter of a request or so.
PACE_WINDOW_REQUESTS = 8
PACE_MIN_WINDOW_S = 0.5
# Growth in this many windows running, each, says the demand outruns the
# answers. One step of new clients (a closed loop starting, a job joining) lands
# in one window, or across the boundary of two; growth that goes on through
# three windows is a rate, not a step.
PACE_WINDOWS = 3
# A window's growth counts when it passes this share of what the service
# answers in a window (at least two requests, the windows being eight): above
# the jitter of a closed loop's mean backlog (a cold 32-client loop on MiniLM
# read three rises of a tenth running within 15 s), below what 1.5x overload
# adds (half a window's answers) and far below 2x's (all of them).
PACE_TOLERANCE = 0.3
# A rate's rises keep their size window after window; a step that straddled two
# windows leaves a third rise that has faded to jitter, which may still pass the
# tolerance. So the last rise must also be at least this share of the largest
# of the three: 256 closed-loop clients meeting a cold service revealed their
# wait for a thread at once, rises of 129 and 106 items then 23 against a
# tolerance of 18, and the worker refused them for the rest of the run.
PACE_RATE_SHARE = 0.25
# Requests the mean request size spans, roughly.
PACE_MEAN_REQUESTS = 64


class Pace:
    """Whether requests arrive faster than they are answered, or the service keeps up.

    A service that keeps up may hold a long standing queue: closed-loop clients
    (indexing jobs, SDK loops, load tools) send their next request only when
    the last is answered, so the queue holds one request per client, however
    long its wait, and never grows. Every such request can be answered by its
    deadline, and refusing one only sends its client back. A service that falls
    behind is one whose arrivals outrun its answers (open-loop users, more of
    them every second): its queue grows for as long as that lasts, and only
    shedding early keeps the answers it gives timely.

    The backlog of demand, ``offered - answered`` in items, tells the two apart:
    offered counts every fresh request, admitted or refused (a resend of a
    refused one is not fresh: the same request again on the connection held
    after its refusal, told by its body, service.http.resend), answered every
    item served. A closed loop keeps it flat; an open-loop overload makes it
    grow without end, its refusals included.

    Requests the service has not read yet count too: where the request
    threads are fewer than the clients, the queue grows there. The gthread
    worker counts those waiting for a thread when a request gets its own
    (``waiting``, at the recent mean items a request): clients that connect at
    once fill that queue at once, a step. Without that count (gevent, whose
    only such queue is the accept backlog), the wait before its handler of the
    last fresh request tells it, at the service rate. Only a request that
    follows another on its connection tells that wait: clients that connect at
    once are read one by one, each waiting longer, and would look like a
    growing queue where a closed loop is only starting. (The waits of the
    requests that follow grow too as such clients come round again, over a
    whole pass of the queue: 256 clients joining a warm service read as a rate
    that way, and the worker refused them for the rest of the run.)

    Time is cut into windows in which the service answers PACE_WINDOW_REQUESTS
    requests of the mean size, and each window keeps its mean backlog over
    time (a closed loop's backlog dips at each answer and fills again within
    milliseconds; the mean barely moves). The service falls behind when the
    mean grew, by more than PACE_TOLERANCE of a window's answers, in each of
    the last PACE_WINDOWS windows, the last rise not faded below
    PACE_RATE_SHARE of the largest (a step's rises fade, a rate's do not); it
    is behind until the mean grows by less than that over those windows
    together. (Shedding empties the queue before the handler at once, a drop
    that must not read as recovery while the refused demand still grows.)
    Pure: the caller passes the time.
    """

    def __init__(self, windows: int = PACE_WINDOWS, tolerance: float = PACE_TOLERANCE) -> None:
        self._tolerance = tolerance
        self._backlog = 0
        self._before = 0.0  # the items waiting before the handler, as the last fresh request saw them
        self.request_items = 1.0  # the mean items a request, recent
        self._window_s = PACE_MIN_WINDOW_S  # of the window now open, set when it opened
        self._started: float | None = None  # when the window now open opened
        self._last = 0.0  # the last event in it
        self._area = 0.0  # the backlog's integral over the window so far
        self._closed: deque[float] = deque(maxlen=windows + 1)  # the mean of each window closed since
        self._behind = False
        # The verdict changes only as a window closes or the rate moves: asked by the
        # door, by admission and before each batch, it is worked out once for both.
        self._closes = 0
        self._verdict_for: tuple[int, float] | None = None

    def offered(
        self,
        items: int,
        now: float,
        waited_s: float | None = 0.0,
        seconds_per_item: float | None = None,
        waiting: int | None = None,
    ) -> None:
        """A fresh request of ``items`` arrived (admitted or refused), ``waited_s`` before its handler.

        ``waiting``: the requests still waiting for a thread when it got its own (gthread), if known.
        """
        self._advance(now, seconds_per_item)
        self._backlog += items
        self.request_items += (items - self.request_items) / PACE_MEAN_REQUESTS
        # What waits before the handler, in items: the wait at the rate the service answers.
        # None: a wait that tells nothing of it (a connection's first request: clients
        # that connect at once are read one by one, each having waited longer).
        if waiting is not None:
            self._before = waiting * self.request_items
        elif waited_s is not None:
            self._before = waited_s / seconds_per_item if seconds_per_item else 0.0

    def answered(self, items: int, now: float, seconds_per_item: float | None = None) -> None:
        """``items`` were served."""
        self._advance(now, seconds_per_item)
        self._backlog -= items

    @property
    def _level(self) -> float:
        return self._backlog + self._before

    def behind(self, now: float, seconds_per_item: float | None) -> bool:
        """Whether the demand has outrun the answers through the last windows."""
        self._advance(now, seconds_per_item)
        if seconds_per_item is None or len(self._closed) < (self._closed.maxlen or 0):
            return False
        inputs = (self._closes, seconds_per_item)
        if inputs == self._verdict_for:
            return self._behind
        self._verdict_for = inputs
        means = list(self._closed)
        step = max(1.0, self._tolerance * self._window_s / seconds_per_item)
        if self._behind:
            self._behind = means[-1] - means[0] > step * (len(means) - 1)
        else:
            rises = [b - a for a, b in itertools.pairwise(means)]
            self._behind = min(rises) > step and rises[-1] > PACE_RATE_SHARE * max(rises)
        return self._behind

    def _advance(self, now: float, seconds_per_item: float | None) -> None:
        if self._started is None:
            self._started = self._last = now
            return
        end = self._started + self._window_s
        if now < end:
            self._area += self._level * (now - self._last)
            self._last = now
            return
        # The open window closes at its end; the backlog held since its last event.
        self._area += self._level * (end - self._last)
        self._closed.append(self._area / self._window_s)
        self._closes += 1
        idle = math.floor((now - end) / self._window_s)
        for _ in range(min(idle, self._closed.maxlen or 0)):
            self._closed.append(self._level)  # windows with no event held the backlog as it is
        if seconds_per_item:
            answering = PACE_WINDOW_REQUESTS * self.request_items * seconds_per_item
            self._window_s = max(PACE_MIN_WINDOW_S, answering)
        self._started = self._last = now
        self._area = 0.0


class StandingQueue:
    """Whether the wait before the handler has become a standing queue (CoDel's test).

    A queue that empties now and then absorbs bursts; one in which every request
    for a whole ``interval_s`` waited ``target_s`` or more is overload, and in a
    first-come queue it makes every request wait the same long time, refused
    ones included. While it stands and the service is behind (Pace), the door
    refuses what waited longer than ``target_s`` (service.http.door): the head
    of the queue is shed quickly and the requests still taken wait little. The
    first request that waited less than the target ends the spell.
    """

    def __init__(self, target_s: float, interval_s: float) -> None:
        self.target_s = target_s
        self.interval_s = interval_s
        self._above_since: float | None = None

    def stands(self, waited_s: float, now: float) -> bool:
        """What ``standing`` would answer for this wait, without counting it."""
        return (
            waited_s >= self.target_s
            and self._above_since is not None
            and now - self._above_since >= self.interval_s
        )

    def standing(self, waited_s: float, now: float) -> bool:
        if waited_s < self.target_s:
            self._above_since = None
            return False
        if self._above_since is None:
            self._above_since = now
        return now - self._above_since >= self.interval_s


@dataclass(frozen=True)
class AdmissionRule:
    """Refuse a request that cannot be answered in time: by its deadline, or within ``budget_s`` when behind.

    While the service keeps up (Pace), a request is admitted if the work ahead
    leaves it DEADLINE_MARGIN to spare before its deadline (the request timeout,
    or less if its client asks): closed-loop clients with long standing queues
    are all answered. Once demand outruns the answers, it must also fit the
    latency budget, with PREDICTION_MARGIN to spare: overload is shed early and
    what is accepted is answered within the budget.
    """

    budget_s: float

    @property
    def door_target_s(self) -> float:
        """The wait before the handler that, standing, counts as overload (StandingQueue)."""
        # A tenth of the budget: well above a thread's ordinary wait for its
        # turn (the GIL's switch interval is 5 ms), well below the budget.
        return self.budget_s / 10

    def standing_queue(self) -> StandingQueue:
        return StandingQueue(self.door_target_s, interval_s=self.door_target_s)

    def limit_s(self, deadline_s: float, behind: bool) -> float:
        """How long after its arrival a request may be answered: its deadline, and the budget when behind.

        Without a budget (SERVE_LATENCY_BUDGET_MS=0) admission is off: no limit
        here, and only the queue bound and the deadline's own expiry (504) act.
        """
        if math.isinf(self.budget_s):
            return math.inf
        return min(self.budget_s, deadline_s) if behind else deadline_s

    def admits_fresh(self, waited_s: float, predicted_s: float, deadline_s: float, behind: bool) -> bool:
        """Whether a request that waited ``waited_s`` fits with the margin a fresh one needs.

        The test for letting a held request in before its hold ends
        (service.host.hold.let_in); the door then admits it with a smaller
        margin (``decide`` with ``returning``), whatever the few requests that
        reach the queue beside it add.
        """
        margin = PREDICTION_MARGIN if behind else DEADLINE_MARGIN
        return waited_s + margin * predicted_s <= self.limit_s(deadline_s, behind)

    def decide(
        self,
        waited_s: float,
        predicted_s: float,
        *,
        deadline_s: float,
        behind: bool,
        standing: bool = False,
        returning: bool = False,
        to_wait_s: float = 0.0,
    ) -> Refusal | None:
        """None to admit, else why not.

        ``waited_s``: since the request arrived; ``predicted_s``: predict_wait's
        answer; ``deadline_s``: from its arrival to its deadline; ``behind``:
        Pace's verdict; ``standing``: StandingQueue's verdict on the wait
        before the handler; ``returning``: the request was let in from a hold
        because the batcher had room for it (service.host.hold.let_in);
        ``to_wait_s``: how much longer it will wait before the handler (for a
        request thread), where that is foreseen: it is judged as it will be then.

        While behind, such a request is admitted while the work ahead fits the
        budget with RETURNING_MARGIN to spare, any other only with
        PREDICTION_MARGIN: the few fresh requests that reach the queue beside
        one let in do not turn it away. Held clients are let in longest held
        first, so under a long overload they take turns; one whose hold simply
        ended meets the fresh requests' margin, which keeps accepted latency
        well within the budget.
        """
        limit = self.limit_s(deadline_s, behind)
        before_handler = waited_s + to_wait_s
        if before_handler >= limit or (behind and standing and before_handler >= self.door_target_s):
            cap = limit if before_handler >= limit else self.door_target_s
            more = f" and would wait about {to_wait_s * 1000:.0f} ms more for a thread" if to_wait_s else ""
            return Refusal(
                f"the request waited {waited_s * 1000:.0f} ms{more} before the service could read it, past "
                f"the {cap * 1000:.0f} ms it may wait there; the service is overloaded, retry shortly",
                1,
            )
        margin = DEADLINE_MARGIN if not behind else RETURNING_MARGIN if returning else PREDICTION_MARGIN
        if before_handler + margin * predicted_s > limit:
            # Worded only for a refusal: every request asks, few are refused.
            past = (
                f"{limit * 1000:.0f} ms latency budget; arrivals outrun the answers"
                if behind
                else f"request's {limit * 1000:.0f} ms deadline; the service is overloaded"
            )
            return Refusal(
                f"the work queued ahead would take about {predicted_s * 1000:.0f} ms, "
                f"past the {past}, retry shortly",
                # By then the work now ahead is done, and a retry has a fair chance.
                max(1, math.ceil(predicted_s)),
            )
        return None

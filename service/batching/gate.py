# design:
# - One Gate per Batcher (service.batching.batcher): the batcher's admission,
#   its state and its decisions. The rules are pure (service.batching.admission);
#   the gate holds what they are applied to (the service meter, the pace, the
#   items held in the express lane, a body's bytes per item) and applies them.
# - Who calls it, from which thread: the door (service.http.door) and the holds
#   (service.host.worker) ask from request threads or greenlets before a body
#   is read (estimate_items, too_large, door_outlook, refused, load). The
#   batcher's submit() asks it to admit or refuse each request (admit). The
#   batch thread records what ran (batch_ran, paused) and, before each model
#   call, has it refuse what would be answered late (shed_late). Each request's
#   done callback records its answer (answered), in whichever thread completes
#   the request's reply: the batch thread, the watchdog, or a caller cancelling.
# - Latency budget: admit() refuses (503, over_budget) a request that the work
#   held would take past its limit (AdmissionRule), and before each model call
#   shed_late() refuses the same way each request the calls ahead of its answer
#   would take past it, by the cost model's floor (the batcher asks only once it
#   has one, and not before the item-by-item re-run of a failed sub-batch).
# - Locking: the gate has no lock of its own. Its state changes under the
#   batcher's lock, which the batcher hands it, as it did when this state was
#   the batcher's own: submit() holds that lock across its own checks, admit()
#   and its own counts, so a request is judged and counted in one step (a burst
#   of greenlets can pass the door's check at once; each is judged here with
#   those before it counted). Every other method takes the lock itself, and no
#   caller holds it then. The lock is not reentrant, so no reply may be
#   completed under it (answered() runs in the completing thread and takes it):
#   the batcher and shed_late() complete replies outside it. too_large,
#   estimate_items and backlog_s read without it and may see the state a
#   request old: they are asked before a body is read, or by another model.

"""The batcher's admission: who is taken, who is refused, and what the door may predict."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.batching.admission import AdmissionRule, Pace, ServiceMeter, alone_past_deadline, predict_wait
from service.batching.model_time import ModelTime
from service.batching.pending import Part, Pending
from service.batching.reply import error_of, fail
from service.batching.subbatch import Cost
from service.errors import Overloaded, PayloadTooLarge

log = logging.getLogger(__name__)

# Requests the mean of a body's bytes per item spans, roughly.
REQUEST_MEAN_WINDOW = 64

# ``needs(kept)``: for the parts at the indices ``kept``, each one's model time
# still ahead of its answer in this batch if only those ran (Gate.shed_late).
Needs = Callable[[list[int]], list[float]]


@dataclass(frozen=True)
class Load:
    """What the batcher holds and how fast it serves, for the door and the holds to predict with."""

    outstanding: int  # items accepted and not yet answered
    seconds_per_item: float | None
    behind: bool  # admission.Pace's verdict
    items_per_request: float  # the recent mean, for requests whose items are not known yet


class Gate:
    def __init__(
        self,
        lock: Any,
        *,
        rule: AdmissionRule | None,
        queue_limit: int,
        max_batch_size: int,
        express_items: int,
        pace: Pace | None = None,
        model_time: ModelTime | None = None,
    ) -> None:
        # The batcher's lock (see the design notes): guards everything below that changes.
        self._lock = lock
        # Refuses work that cannot be answered in time (None: the queue bound alone).
        self._rule = rule
        # Items the worker may hold accepted and not yet answered.
        self._queue_limit = queue_limit
        self._max_batch_size = max_batch_size
        self._express_items = express_items
        # Service rate, items held and the pace of demand, for predicting a newcomer's wait.
        self._meter = ServiceMeter()
        self._pace = pace or Pace()
        self._express_outstanding = 0
        self._was_behind = False
        self._bytes_per_item = 0.0  # a body's bytes per item, recent mean (0: none seen)
        # Shared with the worker's other models: they read this one's backlog, it theirs.
        self._model_time = model_time
        # This model's index in the model time (-1: alone), which the batcher's turns use too.
        self.share = model_time.join(self.backlog_s) if model_time is not None else -1

    # -- before the body is read: the door and the holds --------------------------

    def predicted_wait(self, items: int = 1) -> float:
        """Seconds a request of ``items`` submitted now would take to be answered, from the measured rate."""
        with self._lock:
            return self._predict_locked(items)

    def backlog_s(self) -> float:
        """Seconds of model time in the work accepted and not yet answered, for the other models' predictions.

        Read from their threads without the lock: a prediction may see a count a request old.
        """
        spi = self._meter.seconds_per_item
        return self._meter.outstanding * spi if spi else 0.0

    def load(self) -> Load:
        """What the batcher holds now, for predictions made before a request's items are known."""
        with self._lock:
            spi = self._meter.seconds_per_item
            behind = self._behind(time.monotonic())
            return Load(self._meter.outstanding, spi, behind, self._pace.request_items)

    def too_large(self, items: int, deadline_s: float) -> str | None:
        """Why a request of ``items`` cannot be answered within ``deadline_s`` even alone; None if it can.

        Read without the lock (the door asks before the body is read): the
        rate may be a request old. None while admission is off or the rate untrusted.
        """
        if self._rule is None or math.isinf(self._rule.budget_s):
            return None
        return alone_past_deadline(items, self._meter.seconds_per_item, deadline_s)

    def estimate_items(self, body_bytes: int | None) -> int:
        """The items a body of ``body_bytes`` likely holds, from the bytes per item of recent requests.

        What the door weighs a request by before its body is read; the exact
        count follows at submit(). Unknown length or no history: one.
        """
        per_item = self._bytes_per_item
        if not body_bytes or per_item <= 0:
            return 1
        return max(1, round(body_bytes / per_item))

    def door_outlook(self, items: int) -> tuple[float, bool]:
        """For the door: a request of ``items``'s predicted wait, and whether the service is behind."""
        with self._lock:
            behind = self._behind(time.monotonic())
            return self._predict_locked(items), behind

    def thread_wait(self, waiting: int) -> float:
        """How long a request behind ``waiting`` others waiting for a request thread will wait for one.

        Every request thread holds a request the batcher answers, so threads
        come free as fast as requests are answered: the recent mean request at
        the service rate, each. Read without the lock, as too_large is: the
        rate may be a request old.
        """
        seconds_per_item = self._meter.seconds_per_item
        if waiting <= 0 or seconds_per_item is None:  # None: no trusted rate yet, and no prediction
            return 0.0
        return waiting * self._pace.request_items * seconds_per_item

    def refused(self, items: int, waited_s: float | None, waiting: int | None = None) -> None:
        """A request of about ``items`` was refused at the door, before submit(): demand unmet.

        ``waited_s``: its wait before the handler, for the pace (None: not telling, as a
        connection's first request's is not; see admission.Pace); ``waiting``: the requests
        still waiting for a thread when it got its own, where the worker counts them.
        """
        with self._lock:
            self._pace.offered(items, time.monotonic(), waited_s, self._meter.seconds_per_item, waiting)

    # -- submit(): admit or refuse -------------------------------------------------

    def admit(
        self,
        pending: Pending,
        queued_items: int,
        *,
        returning: bool,
        resend: bool,
        first_on_connection: bool,
        queue_wait: float | None,
        body_bytes: int | None,
        waiting: int | None,
    ) -> None:
        """Count ``pending`` as held, or raise PayloadTooLarge or Overloaded; called under the lock.

        ``queued_items``: the items queued and not yet taken into a batch. The
        other arguments are submit()'s (Batcher.submit says what each means).
        """
        count = len(pending.items)
        now = pending.enqueued_at
        # Before the pace counts it: no wait could make it timely, so it is no demand to meet.
        too_large = self.too_large(count, pending.deadline - pending.budget_from)
        if too_large is not None:
            raise PayloadTooLarge(too_large)
        # Demand, for the pace: a fresh request, taken or not, and any request
        # refused. A resend of a refused request is counted only if refused
        # again, the refused one having been counted then. (Refused at the door,
        # before its body is read, a request on a held connection is counted
        # whichever it is.)
        waited: float | None = now - pending.budget_from if queue_wait is None else queue_wait
        if first_on_connection:
            waited = None
        if not resend:
            self._pace.offered(count, now, waited, self._meter.seconds_per_item, waiting)
        self._learn_request(count, body_bytes)
        try:
            self._check(pending, count, now, queued_items, returning=returning)
        except Overloaded:
            if resend:
                self._pace.offered(count, now, waited, self._meter.seconds_per_item, waiting)
            raise
        self._meter.submitted(count)
        if pending.express:
            self._express_outstanding += count

    def _check(self, pending: Pending, count: int, now: float, queued_items: int, *, returning: bool) -> None:
        """Raise Overloaded if the queue is full or the request cannot be answered in time; under the lock."""
        if queued_items > 0 and queued_items + count > self._queue_limit:
            raise Overloaded(
                f"the queue is full ({queued_items} items waiting, {count} more asked, "
                f"the limit is {self._queue_limit}: SERVE_MAX_QUEUE); retry shortly",
                reason="queue_full",
            )
        if self._rule is None:
            return
        # Checked again here, under the lock: many requests can pass the
        # door's check at once before any of them is queued (a burst of greenlets).
        start = pending.budget_from
        refusal = self._rule.decide(
            now - start,
            self._predict_locked(count),
            deadline_s=pending.deadline - start,
            behind=self._behind(now),
            returning=returning,
        )
        if refusal is not None:
            raise Overloaded(refusal.message, refusal.retry_after_s, reason="over_budget")

    def _learn_request(self, items: int, body_bytes: int | None) -> None:
        # A recent mean, for the door's estimate of requests not yet read (estimate_items); under the lock.
        if body_bytes and items > 0:
            per_item = body_bytes / items
            if self._bytes_per_item <= 0:
                self._bytes_per_item = per_item
            else:
                self._bytes_per_item += (per_item - self._bytes_per_item) / REQUEST_MEAN_WINDOW

    # -- the batch thread and the done callbacks: what ran ---------------------------

    def answered(self, pending: Pending) -> None:
        """``pending``'s reply is complete: it leaves the count, and its service time teaches the meter."""
        now = time.monotonic()
        count = len(pending.items)
        # started_at is set only for requests the batch thread served (not those it refused).
        served = pending.started_at is not None and pending.ran > 0
        with self._lock:
            self._meter.completed(now, pending.enqueued_at, served, count, ran=pending.ran)
            # Answered, or gone for a reason of its own (cancelled, its client gone,
            # its deadline): no longer demand. One refused for overload still is.
            refused = not served and isinstance(error_of(pending.future), Overloaded)
            if not refused:
                self._pace.answered(count, now, self._meter.seconds_per_item)
            if pending.express:
                self._express_outstanding = max(0, self._express_outstanding - count)

    def batch_ran(self, seconds: float, items: int) -> None:
        """A batch's model time and the items it served: the meter's quick view of the speed."""
        with self._lock:
            self._meter.batch_ran(seconds, items)

    def paused(self, seconds: float) -> None:
        """The batch thread waited ``seconds`` for another model's turn: not this model's service time."""
        with self._lock:
            # The meter's rate is this model's own: sharing enters predictions once (_predict_locked).
            self._meter.paused(seconds)

    def shed_late(self, waiting: list[Part], needs: Needs) -> set[int]:
        """Refuse (503) the requests that would be answered past their limit; their indices in ``waiting``.

        ``needs(kept)``: for the parts of ``waiting`` at the indices ``kept``,
        each one's model time still ahead of its answer in this batch (its own
        call and those before it) if only those ran. A request's limit is its
        deadline, and its latency budget too while the service is behind
        (AdmissionRule.limit_s). The door and submit() admit on a prediction;
        when the CPU is suddenly taken (a burst of refusals, a noisy neighbour)
        or the demand turns out to outrun the answers, batches end later than
        predicted, and without this their last requests would be answered late.
        Checked before each model call, with the time already spent, so a slow
        call sheds what comes after it. The latest is refused first and the rest
        judged again without it: a request refused here costs its client the
        wait, not a late answer, and its model time goes to the others. A
        request with parts still to come counts their items at the measured rate.
        Called by the batch thread, without the lock; it completes the replies
        of those it refuses outside the lock, as their done callbacks take it.
        """
        if self._rule is None or not waiting:
            return set()
        now = time.monotonic()
        with self._lock:
            # A request's parts still to come run in batches like those just run:
            # before the long average is trusted (MIN_SERVED), the quick view counts
            # them, else a lone large request on a fresh worker would be judged on
            # its current call alone and shed at its last calls, its work wasted.
            spi = self._meter.seconds_per_item or self._meter.recent_seconds_per_item or 0.0
            behind = self._behind(now)
        waited = [now - part.pending.budget_from for part in waiting]
        deadlines = [part.pending.deadline - part.pending.budget_from for part in waiting]
        limits = [self._rule.limit_s(deadline_s, behind) for deadline_s in deadlines]
        later = [(len(part.pending.items) - part.end) * spi for part in waiting]
        kept = list(range(len(waiting)))
        shed: set[int] = set()
        while kept:
            needed = zip(kept, needs(kept), strict=True)
            over = [waited[i] + need + later[i] - limits[i] for i, need in needed]
            latest = max(range(len(kept)), key=over.__getitem__)
            if over[latest] <= 0:
                break
            index = kept.pop(latest)
            shed.add(index)
            pending = waiting[index].pending
            pending.started_at = None  # not served: the service meter learns no time from it
            more_ms = (over[latest] + limits[index] - waited[index]) * 1000
            what = "latency budget" if limits[index] < deadlines[index] else "deadline"
            too_large = alone_past_deadline(len(pending.items), spi or None, deadlines[index])
            fail(
                pending.future,
                PayloadTooLarge(too_large)
                if too_large is not None
                else Overloaded(
                    f"the request waited {waited[index] * 1000:.0f} ms and would need about "
                    f"{more_ms:.0f} ms more of the model, past its {limits[index] * 1000:.0f} ms "
                    f"{what}; the service is overloaded, retry shortly",
                    1,
                    reason="over_budget",
                ),
            )
        return shed

    # -- under the lock -------------------------------------------------------------

    def _predict_locked(self, items: int) -> float:
        ahead = self._meter.outstanding
        if 0 < items <= self._express_items:
            # The express lane: the small requests ahead, at half a batch a batch while
            # bulk work waits (so twice their items' time), and the batch running.
            ahead = min(ahead, 2 * self._express_outstanding + self._max_batch_size)
        own = predict_wait(ahead, self._meter.seconds_per_item, items)
        if self._model_time is None:
            return own
        # The other models take turns with this one, call by call: while this
        # request's work and the work ahead of it run, at most as much of theirs does.
        return own + min(own, self._model_time.others_backlog(self.share))

    def _behind(self, now: float) -> bool:
        """The pace's verdict now; a change is logged, as an operator wants to know of it."""
        behind = self._pace.behind(now, self._meter.seconds_per_item)
        if behind != self._was_behind:
            self._was_behind = behind
            if behind:
                log.warning(
                    "arrivals outrun the answers: requests are admitted within the latency budget only"
                )
            else:
                log.info(
                    "the answers keep up with the arrivals again: requests are admitted up to their deadline"
                )
        return behind


def one_call(parts: list[Part], floor: Cost) -> Needs:
    """``needs`` for a batch run as one call: each part waits for the whole call of the parts kept.

    With no item sizes, an item is the cost model's unit: one call costs its
    overhead plus a share per item.
    """

    def needs(kept: list[int]) -> list[float]:
        return [floor.of(sum(len(parts[i].items) for i in kept), 1)] * len(kept)

    return needs

# design:
# - One Batcher per worker process, driven by one OS thread (service.batching.native, so
#   it stays a real thread under gevent). Request threads or greenlets call
#   submit(), which creates the request's Reply (service.batching.reply) *before* it
#   enqueues it, and then wait on it (service.batching.waiting); nothing else links a request to
#   its result, so a caller that gives up leaves nothing behind.
# - The batch thread alone takes from the queue: it blocks for the first request,
#   takes what is already queued, may wait a bounded time for more (GatherPolicy),
#   and runs the batch. What it took waits in its own list (_waiting) until a
#   batch takes it: small requests first within half a batch (the express
#   lane), then bulk requests in arrival order; a request larger than a batch
#   runs in parts, a batch at a time (Part), and is answered after its last.
# - Every future it takes gets a result or an exception, whatever the model does;
#   cancelled futures are skipped, expired ones fail before inference. If a batch
#   fails, its requests are re-run one by one so only the culprit fails.
# - Length-aware batches: when the model reports item sizes (``sizer``, called in
#   the request thread by submit()), the batch thread sorts the gathered items by
#   size and runs them as consecutive sub-batches cut by service.batching.subbatch,
#   each within the padded-token budget. A request is answered as soon as its
#   last item is done, so short requests leave before the long ones run; one
#   whose items span several sub-batches waits for all of them. A failed
#   sub-batch is re-run item by item, and a bad item fails only its own request.
#   A long item waits at most for the batch it was taken into.
# - Shutdown: stop() enqueues a sentinel behind everything already accepted, so
#   the thread drains the queue, answers every request, then exits; submit()
#   refuses new work from that moment.
# - Faults: if the thread dies or stalls, the watchdog (service.batching.watchdog) calls
#   abandon() from its own thread, which fails every request still held. Each
#   future is completed once, by whichever side reaches it first (_claim,
#   _fail, _deliver), so a stalled thread that wakes up later cannot answer twice.
# - Metrics hooks (BatchObserver) run inside submit() and the batch loop; each
#   call goes through notify(), which logs an exception and carries on, so a
#   broken hook can neither leave the depth miscounted nor lose a request.
# - Latency budget: submit() also refuses (503, over_budget) a request that the
#   work held would take past its budget (service.batching.admission), and
#   before each model call the batch thread refuses the same way each request
#   the calls ahead of its answer would take past its budget (_shed_late), by
#   the cost model's floor (none before it has one; not before the
#   item-by-item re-run of a failed sub-batch). The
#   service meter changes under _lock: in submit(), and in each future's done
#   callback, run by whichever thread completes it (batch thread, watchdog, or
#   a caller cancelling), none of which holds _lock then.

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.batching import native
from service.batching.admission import AdmissionRule, Pace, ServiceMeter, alone_past_deadline, predict_wait
from service.batching.model_time import SHARED_CALL_S, ModelTime
from service.batching.reply import Reply
from service.batching.subbatch import Cost, CostModel, cut
from service.batching.waiting import end_of_hub_turn
from service.errors import (
    DeadlineExceeded,
    ModelError,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    ServeError,
)
from service.models.base import Outputs
from service.outputs import check_count, check_finite, client_error, first_non_finite

log = logging.getLogger(__name__)

_STOP = object()
# The express lane takes requests of at most max_batch_size // EXPRESS_SHARE items
# (8 of the default 64): a query or a few texts, not an indexing job's batch.
EXPRESS_SHARE = 8
# Requests the means of a request's items and of its body's bytes per item span, roughly.
REQUEST_MEAN_WINDOW = 64
# While models share the time, a call is cut to SHARED_CALL_S, but never below
# this share of SERVE_MAX_BATCH_TOKENS (_call_tokens).
MIN_CALL_SHARE = 8


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
    # cleared again for a request refused before its model call (_shed_late).
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


class BatchObserver:
    """Hooks for metrics. The base class ignores them.

    ``on_batch`` runs in the batch thread, ``on_queue_depth`` in whichever
    thread changed the depth, one call at a time (changes made during a call
    coalesce into the next; the last call gets the depth as it is),
    ``on_model_loaded`` in the runtime's loader
    thread. Each must be quick. One that raises is logged and ignored (see
    notify): a metrics fault must not lose a request or stop the batch thread.
    """

    def on_batch(self, items: int, requests: int, queue_waits: list[float], model_seconds: float) -> None:
        pass

    def on_queue_depth(self, depth: int) -> None:
        pass

    def on_sub_batches(self, real_tokens: int, padded_tokens: int, sub_batches: int) -> None:
        """One length-aware batch ran as ``sub_batches`` model calls (models that report sizes)."""

    def on_model_loaded(self, device: str, seconds: float) -> None:
        pass

    def on_model_info(self, name: str, task: str, precision: str = "float32", reason: str = "asked") -> None:
        """The loaded model's name, task (models.base.task_of), precision and why, from the loader thread."""

    def on_precision(self, exactness: dict[str, float]) -> None:
        """How far the precision in use is from float32 on the sample items (empty for float32)."""


@dataclass(frozen=True)
class Load:
    """What the batcher holds and how fast it serves, for the door and the holds to predict with."""

    outstanding: int  # items accepted and not yet answered
    seconds_per_item: float | None
    behind: bool  # admission.Pace's verdict
    items_per_request: float  # the recent mean, for requests whose items are not known yet


class Batcher:
    def __init__(
        self,
        predict: Callable[[list[Any]], Outputs],
        *,
        max_batch_size: int,
        queue_limit: int,
        policy: GatherPolicy | None = None,
        observer: BatchObserver | None = None,
        sizer: Callable[[Any], int] | None = None,
        max_tokens: int | None = None,
        cost: CostModel | None = None,
        admission: AdmissionRule | None = None,
        express_items: int | None = None,
        pace: Pace | None = None,
        model_time: ModelTime | None = None,
    ) -> None:
        self._predict = predict
        self._sizer = sizer
        # No budget: a sub-batch is bounded by max_batch_size alone.
        self._max_tokens = max_tokens if max_tokens is not None else 1 << 62
        self.cost = cost or CostModel()
        self._max_batch_size = max_batch_size
        # Items the worker may hold accepted and not yet answered.
        self._queue_limit = queue_limit
        # Requests of at most this many items go ahead of bulk work (_select); 0: none do.
        self._express_items = max_batch_size // EXPRESS_SHARE if express_items is None else express_items
        self._policy = policy or GatherPolicy()
        self._observer = observer or BatchObserver()
        # Refuses work that cannot be answered in time (None: the queue bound alone).
        self._admission = admission
        # Service rate, items held and the pace of demand, for predicting a
        # newcomer's wait; all change under _lock.
        self._meter = ServiceMeter()
        self._pace = pace or Pace()
        self._express_outstanding = 0
        self._was_behind = False
        self._bytes_per_item = 0.0  # a body's bytes per item, recent mean (0: none seen)
        self._queue: native.SimpleQueue[Any] = native.SimpleQueue()
        # Guards _depth, _accepting, the meter, the pace and the in-flight counts.
        self._lock = native.allocate_lock()
        self._depth = 0
        self._queued_items = 0  # the items of those requests not yet taken into a batch; under _lock
        self._depth_stale = False
        self._reporting = native.allocate_lock()  # held by the one thread writing the depth (_report_depth)
        self._accepting = True
        # Taken from the queue and not yet wholly into a batch, in arrival order; the batch thread's alone.
        self._waiting: list[Pending] = []
        self._draining = False  # the stop sentinel was reached: end once _waiting is empty
        # Requests inside their handlers now, and the most there were since the
        # last batch started: in a closed loop, the clients this worker serves,
        # whose next requests gathering may wait for. Both change under _lock.
        self._in_flight = 0
        self._cycle_peak = 1
        self._model_time_s = 0.0
        self._exited = native.allocate_lock()
        self._batch: list[Part] = []  # the batch being run, for abandon()
        self.running = False
        # Watchdog inputs: when the current batch started (None when idle), and
        # what ended the thread if something other than stop() did.
        self.busy_since: float | None = None
        self.crash: str | None = None
        # Shared with the worker's other models (service.batching.model_time); None when alone.
        self._model_time = model_time
        self._share = model_time.join(self.backlog_s) if model_time is not None else -1
        # Seconds this batch's calls waited for the other models' (left out of its model time).
        self._turn_waits_s = 0.0
        self._last_turn_wait_s = 0.0

    # -- caller side ------------------------------------------------------------

    @property
    def depth(self) -> int:
        """Requests accepted and not yet wholly taken into a batch."""
        return self._depth

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """Count a request from when its handler starts until it is answered.

        A request being parsed is one the batch thread may wait for: it will be
        queued within a millisecond or two.
        """
        with self._lock:
            self._in_flight += 1
            self._cycle_peak = max(self._cycle_peak, self._in_flight)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1

    def predicted_wait(self, items: int = 1) -> float:
        """Seconds a request of ``items`` submitted now would take to be answered, from the measured rate."""
        with self._lock:
            return self._predict_locked(items)

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
        return own + min(own, self._model_time.others_backlog(self._share))

    def backlog_s(self) -> float:
        """Seconds of model time in the work accepted and not yet answered, for the other models' predictions.

        Read from their threads without this batcher's lock: a prediction may see
        a count a request old.
        """
        spi = self._meter.seconds_per_item
        return self._meter.outstanding * spi if spi else 0.0

    def load(self) -> Load:
        """What the batcher holds now, for predictions made before a request's items are known."""
        with self._lock:
            spi = self._meter.seconds_per_item
            behind = self._behind(time.monotonic())
            return Load(self._meter.outstanding, spi, behind, self._pace.request_items)

    def _behind(self, now: float) -> bool:
        """The pace's verdict now (under _lock); a change is logged, as an operator wants to know of it."""
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

    def too_large(self, items: int, deadline_s: float) -> str | None:
        """Why a request of ``items`` cannot be answered within ``deadline_s`` even alone; None if it can.

        Read without the lock (the door asks before the body is read): the
        rate may be a request old. None while admission is off or the rate untrusted.
        """
        if self._admission is None or math.isinf(self._admission.budget_s):
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

    def refused(self, items: int, waited_s: float | None, waiting: int | None = None) -> None:
        """A request of about ``items`` was refused at the door, before submit(): demand unmet.

        ``waited_s``: its wait before the handler, for the pace (None: not telling, as a
        connection's first request's is not; see admission.Pace); ``waiting``: the requests
        still waiting for a thread when it got its own, where the worker counts them.
        """
        with self._lock:
            self._pace.offered(items, time.monotonic(), waited_s, self._meter.seconds_per_item, waiting)

    def submit(
        self,
        items: list[Any],
        deadline: float,
        arrived: float | None = None,
        *,
        returning: bool = False,
        resend: bool = False,
        first_on_connection: bool = False,
        queue_wait: float | None = None,
        body_bytes: int | None = None,
        waiting: int | None = None,
    ) -> Pending:
        """Queue a request, or refuse it (503) when the queue is full or it cannot be answered in time.

        ``arrived``: when the request reached the service (monotonic), for the
        latency budget; None counts from now. ``returning``: its client was
        refused before and was let in from its hold early (AdmissionRule.decide);
        ``resend``: it is the request refused before on its connection, sent
        again, so it is no fresh demand (admission.Pace; service.http.resend
        tells it from a new request read after a hold). ``first_on_connection``:
        its wait before the handler tells the pace nothing (admission.Pace). ``queue_wait``: its wait before
        its handler (None: since it arrived). ``body_bytes``: the
        size of the body its items came from, to learn what the door may
        expect of a body (estimate_items). ``waiting``: the requests still
        waiting for a thread when it got its own (gthread; admission.Pace).
        """
        # Sized here, in the request thread, so the batch thread only sorts.
        sizes = None if self._sizer is None else [self._sizer(item) for item in items]
        count = len(items)
        pending = Pending(items, deadline, sizes, arrived=arrived, express=count <= self._express_items)
        now = pending.enqueued_at
        with self._lock:
            if not self._accepting:
                raise NotReady("the worker is shutting down; retry on another worker", reason="shutting_down")
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
                self._admit(pending, count, now, returning=returning)
            except Overloaded:
                if resend:
                    self._pace.offered(count, now, waited, self._meter.seconds_per_item, waiting)
                raise
            self._depth += 1
            self._queued_items += count
            self._meter.submitted(count)
            if pending.express:
                self._express_outstanding += count
        self._report_depth()
        # Runs in whichever thread completes the future: the batch thread, the
        # watchdog, or the caller cancelling it. None of them holds _lock then.
        pending.future.add_done_callback(lambda _: self._answered(pending))
        self._queue.put(pending)
        return pending

    def _admit(self, pending: Pending, count: int, now: float, *, returning: bool) -> None:
        """Raise Overloaded if the queue is full or the request cannot be answered in time; under _lock."""
        if self._queued_items > 0 and self._queued_items + count > self._queue_limit:
            raise Overloaded(
                f"the queue is full ({self._queued_items} items waiting, {count} more asked, "
                f"the limit is {self._queue_limit}: SERVE_MAX_QUEUE); retry shortly",
                reason="queue_full",
            )
        if self._admission is None:
            return
        # Checked again here, under the lock: many requests can pass the
        # door's check at once before any of them is queued (a burst of greenlets).
        start = pending.budget_from
        refusal = self._admission.decide(
            now - start,
            self._predict_locked(count),
            deadline_s=pending.deadline - start,
            behind=self._behind(now),
            returning=returning,
        )
        if refusal is not None:
            raise Overloaded(refusal.message, refusal.retry_after_s, reason="over_budget")

    def _learn_request(self, items: int, body_bytes: int | None) -> None:
        # A recent mean, for the door's estimate of requests not yet read (estimate_items); under _lock.
        if body_bytes and items > 0:
            per_item = body_bytes / items
            if self._bytes_per_item <= 0:
                self._bytes_per_item = per_item
            else:
                self._bytes_per_item += (per_item - self._bytes_per_item) / REQUEST_MEAN_WINDOW

    def _answered(self, pending: Pending) -> None:
        now = time.monotonic()
        count = len(pending.items)
        # started_at is set only for requests the batch thread served (not those it refused).
        served = pending.started_at is not None and pending.ran > 0
        with self._lock:
            self._meter.completed(now, pending.enqueued_at, served, count, ran=pending.ran)
            # Answered, or gone for a reason of its own (cancelled, its client gone,
            # its deadline): no longer demand. One refused for overload still is.
            refused = not served and isinstance(_error_of(pending.future), Overloaded)
            if not refused:
                self._pace.answered(count, now, self._meter.seconds_per_item)
            if pending.express:
                self._express_outstanding = max(0, self._express_outstanding - count)

    def start(self) -> None:
        """Run the batch loop in a new OS thread."""
        self._exited.acquire()
        self.running = True
        native.start_thread(self.run)

    @property
    def stopping(self) -> bool:
        """True once stop() or abandon() was called: new work is refused."""
        return not self._accepting

    def stop(self, timeout: float | None = None) -> bool:
        """Refuse new work, let the thread answer everything accepted, wait for it."""
        with self._lock:
            if self._accepting:
                self._accepting = False
                self._queue.put(_STOP)
        return self.wait_exit(timeout)

    def wait_exit(self, timeout: float | None = None) -> bool:
        """Block until the batch thread has ended, for at most ``timeout`` seconds."""
        if not self.running:
            return True
        acquired = self._exited.acquire(timeout=-1 if timeout is None else timeout)
        if acquired:
            self._exited.release()
        return bool(acquired)

    def abandon(self, error: ServeError) -> int:
        """Fail every request still held with ``error`` and refuse new ones.

        Called by the watchdog once the batch thread has died or stalled, when
        nothing else would answer them. Returns how many requests it failed.
        """
        with self._lock:
            self._accepting = False
        held = [part.pending for part in self._batch] + list(self._waiting)
        while True:
            try:
                entry = self._take(0)
            except native.Empty:
                break
            if entry is not _STOP:
                held.append(entry)
        # A thread that recovers finds the sentinel and ends instead of waiting.
        self._queue.put(_STOP)
        with self._lock:
            self._depth = self._queued_items = 0
        self._report_depth()
        return sum(_fail(pending.future, error) for pending in held)

    # -- batch thread -------------------------------------------------------------

    def run(self) -> None:
        try:
            while (batch := self._gather()) is not None:
                self._batch = batch
                self.busy_since = time.monotonic()
                try:
                    self._run_batch(batch)
                finally:
                    self.busy_since = None
                    self._batch = []
        except BaseException as exc:
            self.crash = type(exc).__name__
            log.exception("batch thread crashed")
            raise
        finally:
            self.running = False
            if self._exited.locked():
                self._exited.release()

    def _take(self, timeout: float | None) -> Any:
        """The next queued entry: blocks for ``timeout`` seconds (None: forever, 0: not at all)."""
        return self._queue.get(timeout != 0, timeout or None)

    def _report_depth(self) -> None:
        """Report the queue depth after a change, outside _lock; concurrent reports coalesce.

        Reporting is a metrics write, too slow to hold the batcher's lock for
        (every request thread and the batch thread take it). Whoever holds
        _reporting writes the depth as it is then; a change made meanwhile only
        marks the depth stale, and the holder writes again before it leaves, so
        the last write always follows the last change.
        """
        self._depth_stale = True
        while self._depth_stale and self._reporting.acquire(False):
            try:
                self._depth_stale = False
                notify(self._observer.on_queue_depth, self._depth)
            finally:
                self._reporting.release()

    def _wait(self, entry: Any) -> bool:
        """Keep a queued entry among the waiting; False for the stop sentinel (remembered)."""
        if entry is _STOP:
            self._draining = True
            return False
        self._waiting.append(entry)
        return True

    def _gather(self) -> list[Part] | None:
        """The next batch, or None once the sentinel is reached and nothing is left."""
        if not self._waiting:
            if self._draining:
                return None
            idle = self._queue.empty()
            if not self._wait(self._take(None)):
                return None
            if idle:
                # Woken by the first request of an idle spell: under gevent,
                # those the hub is parsing now join it. Not when requests were
                # already queued: the model would idle through the hub's turn.
                end_of_hub_turn()
        # Everything queued already waits too: the batch is chosen among them all (_select).
        while not self._draining:
            try:
                entry = self._take(0)
            except native.Empty:
                break
            self._wait(entry)
        first = self._waiting[0]
        gather_start = last_arrival = time.monotonic()
        while not self._draining and self._waiting_items() < self._max_batch_size:
            wait_until = self._policy.deadline(
                first_arrival=first.enqueued_at,
                gather_start=gather_start,
                last_arrival=last_arrival,
                requests=len(self._waiting),
                expected=max(self._cycle_peak, self._in_flight),
                model_time_s=self._model_time_s,
            )
            if wait_until is None:
                break
            try:
                entry = self._take(max(0.0, wait_until - time.monotonic()))
            except native.Empty:
                break
            self._wait(entry)
            # When it was taken, not when it was queued: the batch thread can wait
            # a switch interval for the GIL after each put, and by then a window
            # counted from the put would already be over.
            last_arrival = time.monotonic()
        return self._select()

    def _waiting_items(self) -> int:
        return sum(len(pending.items) - pending.taken for pending in self._waiting)

    def _drop_finished(self) -> None:
        """Forget waiting requests already finished (cancelled, their client gone, a part failed)."""
        finished = [p for p in self._waiting if p.future.done()]
        if not finished:
            return
        self._waiting = [p for p in self._waiting if not p.future.done()]
        with self._lock:
            self._depth -= len(finished)
            self._queued_items -= sum(len(p.items) - p.taken for p in finished)
        self._report_depth()

    def _select(self) -> list[Part]:
        """The waiting items the next batch runs: small requests first, within a bound, then in arrival order.

        The express lane: a request of at most ``express_items`` goes ahead of
        bulk requests, so a one-text query that arrives during an indexing job
        waits for one batch, not for the job. While bulk work waits, express
        requests take at most half of a batch's rows (they go on in arrival
        order among themselves), so bulk work keeps at least half of the
        model time however many small requests come. Bulk requests run in
        arrival order: the first takes what rows are left (one larger than a
        batch runs in parts, a batch at a time), and a later one that does not
        fit whole heads the next batch.
        """
        self._drop_finished()
        room = self._max_batch_size
        bulk = [p for p in self._waiting if not p.express]
        express = [p for p in self._waiting if p.express]
        parts: list[Part] = []
        used = 0

        def take(pending: Pending, count: int) -> None:
            nonlocal used
            parts.append(Part(pending, pending.taken, pending.taken + count))
            pending.taken += count
            used += count

        cap = max(1, room // 2) if bulk else room
        for pending in express:
            if used + len(pending.items) > cap and parts:
                break
            take(pending, len(pending.items))
        for index, pending in enumerate(bulk):
            left = len(pending.items) - pending.taken
            if used + left <= room:
                take(pending, left)
                continue
            if index == 0 and used < room:
                # The head of the bulk work takes what room is left, the rest of it the next batches':
                # a request larger than a batch runs a batch at a time, and express requests never
                # keep the head from starting.
                take(pending, room - used)
            break
        if all(pending.taken == len(pending.items) for pending in bulk):
            for pending in express:  # no bulk work left waiting: the rows it did not need
                if pending.taken == 0 and used + len(pending.items) <= room:
                    take(pending, len(pending.items))
        self._waiting = [p for p in self._waiting if p.taken < len(p.items)]
        finished = sum(1 for part in parts if part.last)
        with self._lock:
            self._depth -= finished
            self._queued_items -= used
        if finished:
            self._report_depth()
        return parts

    def _run_batch(self, batch: list[Part]) -> None:
        live: list[Part] = []
        now = time.monotonic()
        for part in batch:
            pending = part.pending
            if not pending.claimed:
                if not _claim(pending.future):
                    continue  # the caller gave up while it was queued
                pending.claimed = True
                if pending.deadline <= now:
                    waited_ms = (now - pending.enqueued_at) * 1000
                    _fail(
                        pending.future,
                        DeadlineExceeded(
                            f"the request's deadline passed after {waited_ms:.0f} ms in the queue",
                            reason="expired_in_queue",
                        ),
                    )
                    continue
                pending.started_at = now
            elif pending.future.done():
                continue  # an earlier part failed it
            elif pending.deadline <= now:
                _fail(
                    pending.future,
                    DeadlineExceeded(
                        "the request's deadline passed before its last items ran", reason="expired_in_batch"
                    ),
                )
                continue
            live.append(part)
            pending.ran += part.end - part.start
        if not live:
            return
        with self._lock:
            # Counted afresh over this batch's run: its own requests, those queued
            # behind it and those still arriving.
            self._cycle_peak = max(len(live), self._in_flight)
        try:
            if self._sizer is None:
                self._predict_and_deliver(live)
            else:
                self._run_sorted(live)
        finally:
            for part in live:
                if part.last:
                    # A no-op unless delivery itself broke; no caller may hang on it.
                    unanswered = ModelError("the batch ended without a result for this request")
                    _fail(part.pending.future, unanswered)

    def _shed_late(self, waiting: list[Part], needs: Callable[[list[int]], list[float]]) -> set[int]:
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
        """
        if self._admission is None or not waiting:
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
        limits = [self._admission.limit_s(deadline_s, behind) for deadline_s in deadlines]
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
            _fail(
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

    def _predict_and_deliver(self, live: list[Part]) -> None:
        # With no item sizes, an item is the cost model's unit: one call costs
        # its overhead plus a share per item.
        floor = self.cost.floor()
        if floor is not None:

            def needs(kept: list[int]) -> list[float]:
                return [floor.of(sum(len(live[i].items) for i in kept), 1)] * len(kept)

            shed = self._shed_late(live, needs)
            live = [part for index, part in enumerate(live) if index not in shed]
            if not live:
                return
        items = [item for part in live for item in part.items]
        self._turn_waits_s = 0.0
        started = time.monotonic()
        outputs = self._call(items)
        if not isinstance(outputs, ServeError):
            self.cost.observe(len(items), time.monotonic() - started - self._last_turn_wait_s)
        if isinstance(outputs, ServeError):
            if len(live) == 1 or isinstance(outputs, Overloaded):
                for part in live:
                    part.pending.batch_size = len(items)
                    _fail(part.pending.future, outputs)
                return
            log.warning("batch of %d requests failed; re-running them one by one", len(live))
            for part in live:
                self._predict_and_deliver([part])
            return
        self._batch_ran(live, len(items), started)
        # One look at the whole batch answers the usual case; only a batch that
        # holds NaN or infinity is looked at request by request.
        finite = first_non_finite(outputs) is None
        start = 0
        for part in live:
            end = start + len(part.items)
            part.pending.batch_size = len(items)
            _complete(part, outputs[start:end], finite)
            start = end

    def _call(self, items: list[Any]) -> Outputs | ServeError:
        """The model's outputs for ``items``, or the error its callers are told (client_error logs why).

        With other models in the worker, the call first takes its turn of the
        model time; the wait is kept in _last_turn_wait_s, apart from the call's own time.
        """
        if self._model_time is None:
            return self._call_model(items)
        with self._model_time.turn(self._share) as waited:
            self._last_turn_wait_s = waited
            self._turn_waits_s += waited
            with self._lock:
                # The meter's rate is this model's own: sharing enters predictions once (_predict_locked).
                self._meter.paused(waited)
            return self._call_model(items)

    def _call_model(self, items: list[Any]) -> Outputs | ServeError:
        try:
            outputs = self._predict(items)
            check_count(outputs, len(items))
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return client_error(exc, len(items))
        return outputs

    def _run_sorted(self, live: list[Part]) -> None:
        """Run a batch of sized items as length-sorted sub-batches (see the design notes)."""
        batch = _Assembly(live)
        sizes = [size for size, _, _ in batch.order]
        estimate = self.cost.estimate()
        if estimate is None:
            ranges = [(0, len(sizes))]  # nothing measured yet: one call, as without sizes
        else:
            ranges = cut(
                sizes, estimate, max_tokens=self._call_tokens(estimate), max_rows=self._max_batch_size
            )
        # Before any sub-batch runs: a request is answered as soon as its last
        # sub-batch does, and its thread reads batch_size for X-Batch-Size then.
        for part in live:
            part.pending.batch_size = len(batch.order)
        batch.plan(ranges)
        self._turn_waits_s = 0.0
        started = time.monotonic()
        padded = real = calls = 0
        shed: set[int] = set()
        floor = self.cost.floor()
        for k, (start, end) in enumerate(ranges):
            if floor is not None:
                waiting = [r for r in range(len(live)) if r not in batch.failed and batch.left[r] > 0]
                dropped = self._shed_late([live[r] for r in waiting], batch.needs(k, waiting, floor))
                shed.update(waiting[i] for i in dropped)
                batch.failed.update(waiting[i] for i in dropped)
            entries = [e for e in batch.order[start:end] if e[1] not in batch.failed]
            if entries:
                padded += self._run_entries(batch, entries)
                real += sum(size for size, _, _ in entries)
                calls += 1
        served = [part for r, part in enumerate(live) if r not in shed]
        self._batch_ran(served, sum(len(part.items) for part in served), started)
        notify(self._observer.on_sub_batches, real, padded, calls)

    def _call_tokens(self, estimate: Cost) -> int:
        """A call's padded-token budget: SERVE_MAX_BATCH_TOKENS, or a slice while another model is active.

        The model time is handed over between calls, never during one: a call
        bounded to a slice keeps the other models' requests from waiting behind
        one long call of this one's.
        """
        shared = self._model_time
        if (
            shared is None
            or estimate.per_token_s <= 0
            or not shared.others_active(self._share, time.monotonic())
        ):
            return self._max_tokens
        sliced = (SHARED_CALL_S - estimate.overhead_s) / estimate.per_token_s
        # Never so small that the calls' overhead eats the time (a model slow to call at all).
        return max(self._max_tokens // MIN_CALL_SHARE, min(self._max_tokens, int(sliced)))

    def _batch_ran(self, live: list[Part], items: int, started: float) -> None:
        """Record a batch that ran from ``started``: the model time gathering expects, and the metrics."""
        # The model's own time: waits for the other models' turns are left out.
        elapsed = max(0.0, time.monotonic() - started - self._turn_waits_s)
        self._turn_waits_s = 0.0
        # Smoothed so one slow batch does not stretch the next gathering window much.
        self._model_time_s = elapsed if self._model_time_s == 0 else 0.8 * self._model_time_s + 0.2 * elapsed
        with self._lock:
            self._meter.batch_ran(elapsed, items)
        waits = [started - part.pending.enqueued_at for part in live]
        notify(self._observer.on_batch, items, len(live), waits, elapsed)

    def _run_entries(self, batch: _Assembly, entries: list[tuple[int, int, int]]) -> int:
        """One model call on ``entries``; answers the requests it completes. Returns its padded tokens."""
        items = batch.items(entries)
        padded = self.cost.tokens(len(entries), max(size for size, _, _ in entries))
        started = time.monotonic()
        outputs = self._call(items)
        if isinstance(outputs, ServeError):
            if len(entries) == 1 or isinstance(outputs, Overloaded):
                for r in {r for _, r, _ in entries}:
                    batch.failed.add(r)
                    _fail(batch.live[r].pending.future, outputs)
                return padded
            log.warning("sub-batch of %d items failed; re-running them one by one", len(entries))
            return sum(self._run_entries(batch, [e]) for e in entries if e[1] not in batch.failed)
        self.cost.observe(padded, time.monotonic() - started - self._last_turn_wait_s)
        # A request's rows may come from several calls: its result is looked at
        # row by row once any call of this batch returned NaN or infinity.
        batch.finite = batch.finite and first_non_finite(outputs) is None
        for r in batch.store(entries, outputs):
            _complete(batch.live[r], batch.result(r), batch.finite)
        return padded


class _Assembly:
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

    def needs(self, k: int, waiting: list[int], estimate: Cost) -> Callable[[list[int]], list[float]]:
        """``needs`` for _shed_late before sub-batch ``k``: each waiting part's model time to its end.

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


def _complete(part: Part, rows: Outputs, finite: bool) -> None:
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


def _error_of(future: Reply) -> BaseException | None:
    """The exception a finished future holds; None if it was answered or cancelled."""
    if future.cancelled():
        return None
    try:
        return future.exception(timeout=0)
    except Exception:  # not finished: cannot happen in a done-callback
        return None


def _claim(future: Reply) -> bool:
    """Mark a queued request's future as running; False if it needs no answer.

    That is when its caller cancelled it, or when the watchdog already failed
    it (a stalled thread waking up after abandon()).
    """
    try:
        return future.set_running_or_notify_cancel()
    except RuntimeError:  # already finished
        return False


def _fail(future: Reply, error: BaseException) -> bool:
    """Fail a future unless another thread already completed it; True if this call did."""
    try:
        future.set_exception(error)
    except InvalidStateError:
        return False
    return True


def _answer(future: Reply, result: Outputs, finite: bool) -> None:
    """Deliver a request's outputs, or fail it with a 500 if they hold NaN or infinity.

    ``finite``: the call they came from was checked whole and held neither.
    """
    if not finite:
        try:
            check_finite(result)
        except ModelError as refused:
            _fail(future, refused)
            return
    _deliver(future, result)


def _deliver(future: Reply, result: Outputs) -> None:
    with contextlib.suppress(InvalidStateError):  # the watchdog already failed it
        future.set_result(result)


def notify(hook: Callable[..., None], *args: Any) -> None:
    """Call an observer hook; one that raises is logged, never passed to the caller.

    The hooks run where a failure would do harm: inside submit() after the depth
    was counted, in the batch thread between taking a request and running it.
    """
    try:
        hook(*args)
    except Exception:
        log.exception("the batch observer's %s failed; ignored", getattr(hook, "__name__", hook))

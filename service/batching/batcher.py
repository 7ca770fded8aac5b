# design:
# - One Batcher per worker process, driven by one OS thread (service.batching.native, so
#   it stays a real thread under gevent). Request threads or greenlets call
#   submit(), which creates the request's Reply (service.batching.reply) *before* it
#   enqueues it, and then wait on it (service.batching.waiting); nothing else links a request to
#   its result, so a caller that gives up leaves nothing behind.
# - The batch thread alone takes from the queue: it blocks for the first request,
#   takes what is already queued, may wait a bounded time for more (GatherPolicy),
#   and runs the batch. A request that does not fit in the batch is carried over
#   to head the next one, so arrival order is kept.
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
#   Gathering is unchanged, so batches stay FIFO: a long item waits at most for
#   the batch it was gathered into.
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
import time
from collections.abc import Callable, Iterator
from concurrent.futures import InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.batching import native
from service.batching.admission import AdmissionRule, ServiceMeter, predict_wait
from service.batching.reply import Reply
from service.batching.subbatch import Cost, CostModel, cut
from service.batching.waiting import end_of_hub_turn
from service.errors import DeadlineExceeded, ModelError, NotReady, Overloaded, ServeError
from service.models.base import Outputs
from service.outputs import check_count, check_finite, client_error, first_non_finite

log = logging.getLogger(__name__)

_STOP = object()


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

    def on_model_info(self, name: str, task: str) -> None:
        """The loaded model's name and task (service.models.base.task_of), from the loader thread."""


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
    ) -> None:
        self._predict = predict
        self._sizer = sizer
        # No budget: a sub-batch is bounded by max_batch_size alone.
        self._max_tokens = max_tokens if max_tokens is not None else 1 << 62
        self.cost = cost or CostModel()
        self._max_batch_size = max_batch_size
        self._queue_limit = queue_limit
        self._policy = policy or GatherPolicy()
        self._observer = observer or BatchObserver()
        # Refuses work that cannot be answered within the latency budget (None: the count bound alone).
        self._admission = admission
        # Service rate and requests held, for predicting a newcomer's wait; changes under _lock.
        self._meter = ServiceMeter()
        self._queue: native.SimpleQueue[Any] = native.SimpleQueue()
        self._lock = native.allocate_lock()  # guards _depth, _accepting and the in-flight counts
        self._depth = 0
        self._depth_stale = False
        self._reporting = native.allocate_lock()  # held by the one thread writing the depth (_report_depth)
        self._accepting = True
        self._carry: Pending | None = None
        # Requests inside their handlers now, and the most there were since the
        # last batch started: in a closed loop, the clients this worker serves,
        # whose next requests gathering may wait for. Both change under _lock.
        self._in_flight = 0
        self._cycle_peak = 1
        self._model_time_s = 0.0
        self._exited = native.allocate_lock()
        self._batch: list[Pending] = []  # the batch being run, for abandon()
        self.running = False
        # Watchdog inputs: when the current batch started (None when idle), and
        # what ended the thread if something other than stop() did.
        self.busy_since: float | None = None
        self.crash: str | None = None

    # -- caller side ------------------------------------------------------------

    @property
    def depth(self) -> int:
        """Requests accepted and not yet taken into a batch."""
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

    def predicted_wait(self) -> float:
        """Seconds a request submitted now would take to be answered, from the measured rate."""
        with self._lock:
            return predict_wait(self._meter.outstanding, self._meter.seconds_per_request)

    def load(self) -> tuple[int, float | None]:
        """Requests accepted and not yet answered, and the measured seconds per request (None: unknown)."""
        with self._lock:
            return self._meter.outstanding, self._meter.seconds_per_request

    def submit(
        self, items: list[Any], deadline: float, arrived: float | None = None, returning: bool = False
    ) -> Pending:
        """Queue a request, or refuse it (503) when the queue is full or it cannot be answered in time.

        ``arrived``: when the request reached the service (monotonic), for the
        latency budget; None counts from now. ``returning``: its client was
        refused before and waited (AdmissionRule.decide).
        """
        # Sized here, in the request thread, so the batch thread only sorts.
        sizes = None if self._sizer is None else [self._sizer(item) for item in items]
        pending = Pending(items, deadline, sizes, arrived=arrived)
        with self._lock:
            if not self._accepting:
                raise NotReady("the worker is shutting down; retry on another worker", reason="shutting_down")
            if self._depth >= self._queue_limit:
                raise Overloaded(
                    f"the queue is full ({self._queue_limit} requests waiting); retry shortly",
                    reason="queue_full",
                )
            if self._admission is not None:
                # Checked again here, under the lock: many requests can pass the
                # door's check at once before any of them is queued (a burst of greenlets).
                waited = 0.0 if arrived is None else pending.enqueued_at - arrived
                refusal = self._admission.decide(
                    waited,
                    predict_wait(self._meter.outstanding, self._meter.seconds_per_request),
                    returning=returning,
                )
                if refusal is not None:
                    raise Overloaded(refusal.message, refusal.retry_after_s, reason="over_budget")
            self._depth += 1
            self._meter.submitted()
        self._report_depth()
        # Runs in whichever thread completes the future: the batch thread, the
        # watchdog, or the caller cancelling it. None of them holds _lock then.
        pending.future.add_done_callback(lambda _: self._answered(pending))
        self._queue.put(pending)
        return pending

    def _answered(self, pending: Pending) -> None:
        with self._lock:
            # started_at is set only for requests the batch thread served (not those it refused).
            self._meter.completed(time.monotonic(), pending.enqueued_at, pending.started_at is not None)

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
        held = list(self._batch)
        if self._carry is not None:
            held.append(self._carry)
        while True:
            try:
                entry = self._take(0)
            except native.Empty:
                break
            if entry is not _STOP:
                held.append(entry)
        # A thread that recovers finds the sentinel and ends instead of waiting.
        self._queue.put(_STOP)
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
        item = self._queue.get(timeout != 0, timeout or None)
        if item is not _STOP:
            with self._lock:
                self._depth -= 1
            self._report_depth()
        return item

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

    def _gather(self) -> list[Pending] | None:
        """The next batch, or None once the sentinel is reached and nothing is left."""
        first: Any = self._carry
        self._carry = None
        if first is None:
            idle = self._queue.empty()
            first = self._take(None)
            if idle and first is not _STOP:
                # Woken by the first request of an idle spell: under gevent,
                # those the hub is parsing now join it. Not when requests were
                # already queued: the model would idle through the hub's turn.
                end_of_hub_turn()
        if first is _STOP:
            return None
        batch = [first]
        size = len(first.items)
        gather_start = last_arrival = time.monotonic()
        while size < self._max_batch_size:
            wait_until = self._policy.deadline(
                first_arrival=first.enqueued_at,
                gather_start=gather_start,
                last_arrival=last_arrival,
                requests=len(batch),
                expected=max(self._cycle_peak, self._in_flight),
                model_time_s=self._model_time_s,
            )
            try:
                nxt = self._take(0 if wait_until is None else max(0.0, wait_until - time.monotonic()))
            except native.Empty:
                break
            if nxt is _STOP:
                # Re-queue the sentinel behind this batch so the loop ends after it.
                self._queue.put(_STOP)
                break
            if size + len(nxt.items) > self._max_batch_size:
                self._carry = nxt
                break
            batch.append(nxt)
            size += len(nxt.items)
            # When it was taken, not when it was queued: the batch thread can wait
            # a switch interval for the GIL after each put, and by then a window
            # counted from the put would already be over.
            last_arrival = time.monotonic()
        return batch

    def _run_batch(self, batch: list[Pending]) -> None:
        live: list[Pending] = []
        now = time.monotonic()
        for pending in batch:
            if not _claim(pending.future):
                continue  # the caller gave up while it was queued
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
            live.append(pending)
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
            for pending in live:
                # A no-op unless delivery itself broke; no caller may hang on it.
                _fail(pending.future, ModelError("the batch ended without a result for this request"))

    def _shed_late(self, waiting: list[Pending], needs: Callable[[list[int]], list[float]]) -> set[int]:
        """Refuse (503) the requests that would be answered past their latency budget; their indices.

        ``needs(kept)``: for the requests of ``waiting`` at the indices
        ``kept``, each one's model time still ahead of its answer (its own call
        and those before it) if only those ran. The door and submit() admit on
        a prediction; when the CPU is suddenly taken (a burst of refusals, a
        noisy neighbour) batches run slower than predicted, and without this
        their last requests would be answered late. Checked before each model
        call, with the time already spent, so a slow call sheds what comes
        after it. The latest is refused first and the rest judged again
        without it: a request refused here costs its client the wait, not a
        late answer, and its model time goes to the others.
        """
        if self._admission is None or not waiting:
            return set()
        budget = self._admission.budget_s
        now = time.monotonic()
        waited = [now - (p.enqueued_at if p.arrived is None else p.arrived) for p in waiting]
        kept = list(range(len(waiting)))
        shed: set[int] = set()
        while kept:
            ends = [waited[i] + need for i, need in zip(kept, needs(kept), strict=True)]
            latest = max(range(len(kept)), key=ends.__getitem__)
            if ends[latest] <= budget:
                break
            index = kept.pop(latest)
            shed.add(index)
            pending = waiting[index]
            pending.started_at = None  # not served: the service meter learns no time from it
            _fail(
                pending.future,
                Overloaded(
                    f"the request waited {waited[index] * 1000:.0f} ms and would need about "
                    f"{(ends[latest] - waited[index]) * 1000:.0f} ms more of the model, past the "
                    f"{budget * 1000:.0f} ms latency budget; the service is overloaded, retry shortly",
                    1,
                    reason="over_budget",
                ),
            )
        return shed

    def _predict_and_deliver(self, live: list[Pending]) -> None:
        # With no item sizes, an item is the cost model's unit: one call costs
        # its overhead plus a share per item.
        floor = self.cost.floor()
        if floor is not None:

            def needs(kept: list[int]) -> list[float]:
                return [floor.of(sum(len(live[i].items) for i in kept), 1)] * len(kept)

            shed = self._shed_late(live, needs)
            live = [pending for index, pending in enumerate(live) if index not in shed]
            if not live:
                return
        items = [item for pending in live for item in pending.items]
        started = time.monotonic()
        outputs = self._call(items)
        if not isinstance(outputs, ServeError):
            self.cost.observe(len(items), time.monotonic() - started)
        if isinstance(outputs, ServeError):
            if len(live) == 1 or isinstance(outputs, Overloaded):
                for pending in live:
                    pending.batch_size = len(items)
                    _fail(pending.future, outputs)
                return
            log.warning("batch of %d requests failed; re-running them one by one", len(live))
            for pending in live:
                self._predict_and_deliver([pending])
            return
        self._batch_ran(live, len(items), started)
        # One look at the whole batch answers the usual case; only a batch that
        # holds NaN or infinity is looked at request by request.
        finite = first_non_finite(outputs) is None
        start = 0
        for pending in live:
            end = start + len(pending.items)
            pending.batch_size = len(items)
            _answer(pending.future, outputs[start:end], finite)
            start = end

    def _call(self, items: list[Any]) -> Outputs | ServeError:
        """The model's outputs for ``items``, or the error its callers are told (client_error logs why)."""
        try:
            outputs = self._predict(items)
            check_count(outputs, len(items))
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return client_error(exc, len(items))
        return outputs

    def _run_sorted(self, live: list[Pending]) -> None:
        """Run a batch of sized items as length-sorted sub-batches (see the design notes)."""
        batch = _Assembly(live)
        sizes = [size for size, _, _ in batch.order]
        estimate = self.cost.estimate()
        if estimate is None:
            ranges = [(0, len(sizes))]  # nothing measured yet: one call, as without sizes
        else:
            ranges = cut(sizes, estimate, max_tokens=self._max_tokens, max_rows=self._max_batch_size)
        # Before any sub-batch runs: a request is answered as soon as its last
        # sub-batch does, and its thread reads batch_size for X-Batch-Size then.
        for pending in live:
            pending.batch_size = len(batch.order)
        batch.plan(ranges)
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
        served = [pending for r, pending in enumerate(live) if r not in shed]
        self._batch_ran(served, sum(len(pending.items) for pending in served), started)
        notify(self._observer.on_sub_batches, real, padded, calls)

    def _batch_ran(self, live: list[Pending], items: int, started: float) -> None:
        """Record a batch that ran from ``started``: the model time gathering expects, and the metrics."""
        elapsed = time.monotonic() - started
        # Smoothed so one slow batch does not stretch the next gathering window much.
        self._model_time_s = elapsed if self._model_time_s == 0 else 0.8 * self._model_time_s + 0.2 * elapsed
        with self._lock:
            self._meter.batch_ran(elapsed, len(live))
        notify(self._observer.on_batch, items, len(live), [started - p.enqueued_at for p in live], elapsed)

    def _run_entries(self, batch: _Assembly, entries: list[tuple[int, int, int]]) -> int:
        """One model call on ``entries``; answers the requests it completes. Returns its padded tokens."""
        items = batch.items(entries)
        padded = len(entries) * max(size for size, _, _ in entries)
        started = time.monotonic()
        outputs = self._call(items)
        if isinstance(outputs, ServeError):
            if len(entries) == 1 or isinstance(outputs, Overloaded):
                for r in {r for _, r, _ in entries}:
                    batch.failed.add(r)
                    _fail(batch.live[r].future, outputs)
                return padded
            log.warning("sub-batch of %d items failed; re-running them one by one", len(entries))
            return sum(self._run_entries(batch, [e]) for e in entries if e[1] not in batch.failed)
        self.cost.observe(padded, time.monotonic() - started)
        # A request's rows may come from several calls: its result is looked at
        # row by row once any call of this batch returned NaN or infinity.
        batch.finite = batch.finite and first_non_finite(outputs) is None
        for r in batch.store(entries, outputs):
            _answer(batch.live[r].future, batch.result(r), batch.finite)
        return padded


class _Assembly:
    """The items of one length-aware batch, in size order, and each request's rows as they come back."""

    def __init__(self, live: list[Pending]) -> None:
        self.live = live
        # (size, request index, item index), sorted by size; sort() is stable, so
        # equal sizes keep arrival order.
        self.order = sorted(
            ((size, r, i) for r, pending in enumerate(live) for i, size in enumerate(pending.sizes or ())),
            key=lambda entry: entry[0],
        )
        self.rows: list[list[Any]] = [[None] * len(pending.items) for pending in live]
        self.left = [len(pending.items) for pending in live]
        self.array = [True] * len(live)  # every row came from an array: answer with one
        self.failed: set[int] = set()
        self.finite = True  # every call so far returned only finite outputs
        self.ranges: list[tuple[int, int]] = []
        self.last: list[int] = []  # each request's last sub-batch

    def plan(self, ranges: list[tuple[int, int]]) -> None:
        """The sub-batches ``order`` runs as, and the last one each request waits for."""
        self.ranges = ranges
        self.last = [0] * len(self.live)
        for k, (start, end) in enumerate(ranges):
            for _, r, _ in self.order[start:end]:
                self.last[r] = k

    def needs(self, k: int, waiting: list[int], estimate: Cost) -> Callable[[list[int]], list[float]]:
        """``needs`` for _shed_late before sub-batch ``k``: each waiting request's model time to its end.

        ``waiting``: request indices. Only the rows of the requests kept count,
        so a call shrinks (or is skipped) as requests are refused.
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
        return [self.live[r].items[i] for _, r, i in entries]

    def store(self, entries: list[tuple[int, int, int]], outputs: Outputs) -> list[int]:
        """Keep each entry's output row; the requests this completed, by index."""
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

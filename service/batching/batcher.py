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
# - A lone request to a model cheaper to call than the hand-off (a call under
#   RUN_HERE_BELOW_S, as measured; a small MLP, a stand-in model) is run by its
#   own thread (_run_here): with nothing to batch it with, waking the batch
#   thread and being woken by it cost more CPU than the call. Whoever gathers
#   and runs a batch holds the runner lock, so the batch thread and such a
#   request never run at once, and a request that arrives meanwhile is queued
#   for the batch thread as before. Under load (another request in a handler,
#   or the last one answered less than RUN_HERE_AFTER_S before) the batch
#   thread runs everything. A model measured slower than that (any
#   transformer) always goes through the batch thread: its calls stay on one
#   thread, whose intra-op thread pool is the only one it needs.
# - Under gevent, requests to such a cheap model are not handed to the batch
#   thread at all (_on_hub): a request greenlet queues its request on a list of
#   the hub's thread, and the first of a turn spawns one greenlet that starts
#   after the turn's I/O and runs everything queued by then, in batches, under
#   the runner lock. No thread is woken, no GIL passed, no wake-up of the hub
#   asked from another thread. If the batch thread holds the runner lock then,
#   the requests go to it instead.
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
#   future is completed once, by whichever side reaches it first (the reply
#   module's claim, fail, deliver), so a stalled thread that wakes up later cannot answer twice.
# - Metrics hooks (BatchObserver) run inside submit() and the batch loop; each
#   call goes through notify(), which logs an exception and carries on, so a
#   broken hook can neither leave the depth miscounted nor lose a request.
# - Admission is the gate's (service.batching.gate, on the rules of
#   service.batching.admission): submit() asks it to admit or refuse, the batch
#   thread tells it what ran and has it refuse before each model call what would
#   be answered late, and each future's done callback tells it of the answer.
#   Its state changes under _lock, which it shares (the gate's notes say how).

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from service.batching import native
from service.batching.admission import AdmissionRule, Pace
from service.batching.assembly import Assembly, complete
from service.batching.gate import Gate, one_call
from service.batching.gather import GatherPolicy
from service.batching.model_time import SHARED_CALL_S, ModelTime
from service.batching.observer import BatchObserver, notify
from service.batching.pending import Part, Pending
from service.batching.reply import claim, fail
from service.batching.subbatch import Cost, CostModel, cut, oldest_first
from service.batching.waiting import end_of_hub_turn, on_hub_thread, spawn_on_hub
from service.errors import DeadlineExceeded, ModelError, NotReady, Overloaded, ServeError
from service.models.base import Outputs
from service.outputs import check_count, client_error, first_non_finite

log = logging.getLogger(__name__)

_STOP = object()
_NOTHING = object()  # _first: nothing taken from the queue, the waiting list starts the batch
# A lone request to a model whose calls take less than this is run by its own
# thread (Batcher._run_here): a hand-off to the batch thread and back costs
# 0.1 to 0.15 ms of CPU, two thread switches, more than the call.
RUN_HERE_BELOW_S = 0.0002
# ...when it came to a worker with no request in a handler for this long. Under a
# stream of requests (one answered, the next in within a millisecond) the batch
# thread's wake-up lets a few gather into one batch, whose own costs (its
# metrics, the late-request check) they then share: run here one by one, each
# paid them, and at saturation that cost more than the hand-offs it saved.
RUN_HERE_AFTER_S = 0.001
# The express lane takes requests of at most max_batch_size // EXPRESS_SHARE items
# (8 of the default 64): a query or a few texts, not an indexing job's batch.
EXPRESS_SHARE = 8
# While models share the time, a call is cut to SHARED_CALL_S, but never below
# this share of SERVE_MAX_BATCH_TOKENS (_call_tokens).
MIN_CALL_SHARE = 8


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
        run_here_below_s: float = 0.0,
        run_here_after_s: float = RUN_HERE_AFTER_S,
        run_in_callers: bool = True,
    ) -> None:
        self._predict = predict
        self._run_here_below_s = run_here_below_s
        self._run_here_after_s = run_here_after_s
        # Whether any request thread may run a lone cheap call (_run_here); a greenlet
        # on the gevent hub's thread always may, that being one OS thread.
        self._run_in_callers = run_in_callers
        # When the last request in a handler left, and whether the one that came
        # next found the worker quiet that long (_run_here); both under _lock.
        self._last_out = -math.inf
        self._came_after_quiet = False
        self._sizer = sizer
        # No budget: a sub-batch is bounded by max_batch_size alone.
        self._max_tokens = max_tokens if max_tokens is not None else 1 << 62
        self.cost = cost or CostModel()
        self._max_batch_size = max_batch_size
        # Requests of at most this many items go ahead of bulk work (_select); 0: none do.
        self._express_items = max_batch_size // EXPRESS_SHARE if express_items is None else express_items
        self._policy = policy or GatherPolicy()
        self._observer = observer or BatchObserver()
        self._queue: native.SimpleQueue[Any] = native.SimpleQueue()
        # Guards _depth, _queued_items, _accepting, the in-flight counts, and the gate's state.
        self._lock = native.allocate_lock()
        # Admits or refuses each request, and predicts waits for the door.
        self.gate = Gate(
            self._lock,
            rule=admission,
            queue_limit=queue_limit,
            max_batch_size=max_batch_size,
            express_items=self._express_items,
            pace=pace,
            model_time=model_time,
        )
        self._depth = 0
        self._queued_items = 0  # the items of those requests not yet taken into a batch; under _lock
        self._depth_stale = False
        self._reporting = native.allocate_lock()  # held by the one thread writing the depth (_report_depth)
        self._accepting = True
        # Taken from the queue and not yet wholly into a batch, in arrival order; the runner's alone.
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
        # Held by whoever gathers and runs a batch: the batch thread, or a request
        # thread running its own cheap call (_run_here). It guards _waiting,
        # _draining, _batch and the cost model, which only that holder touches.
        self._runner = native.allocate_lock()
        # Requests for a run on the gevent hub's thread (_on_hub), and whether that run
        # is due; only that thread touches them.
        self._hub_queue: list[Pending] = []
        self._hub_run_due = False
        self.running = False
        # Watchdog inputs: when the current batch started (None when idle), and
        # what ended the thread if something other than stop() did.
        self.busy_since: float | None = None
        self.crash: str | None = None
        # Shared with the worker's other models (service.batching.model_time); None when alone.
        # The gate joined it with this model's backlog: _share is this model's index there.
        self._model_time = model_time
        self._share = self.gate.share
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
            if self._in_flight == 0:
                self._came_after_quiet = time.monotonic() - self._last_out >= self._run_here_after_s
            self._in_flight += 1
            self._cycle_peak = max(self._cycle_peak, self._in_flight)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._last_out = time.monotonic()

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
        expect of a body (Gate.estimate_items). ``waiting``: the requests still
        waiting for a thread when it got its own (gthread; admission.Pace).
        Refused too large for its deadline even alone: 413 (PayloadTooLarge).
        A lone request to a model cheaper to call than a hand-off is run
        here, in the caller's thread (_run_here): the returned request is then
        already answered.
        """
        # Sized here, in the request thread, so the batch thread only sorts.
        sizes = None if self._sizer is None else [self._sizer(item) for item in items]
        count = len(items)
        pending = Pending(items, deadline, sizes, arrived=arrived, express=count <= self._express_items)
        with self._lock:
            if not self._accepting:
                raise NotReady("the worker is shutting down; retry on another worker", reason="shutting_down")
            # Under the lock with the counts below: judged and counted in one step.
            self.gate.admit(
                pending,
                self._queued_items,
                returning=returning,
                resend=resend,
                first_on_connection=first_on_connection,
                queue_wait=queue_wait,
                body_bytes=body_bytes,
                waiting=waiting,
            )
            self._depth += 1
            self._queued_items += count
        self._report_depth()
        # Runs in whichever thread completes the future: the batch thread, the
        # watchdog, or the caller cancelling it. None of them holds _lock then.
        pending.future.add_done_callback(lambda _: self.gate.answered(pending))
        if not self._run_here(pending) and not self._on_hub(pending):
            self._queue.put(pending)
        return pending

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
        held = [part.pending for part in self._batch] + list(self._waiting) + self._hub_queue
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
        return sum(fail(pending.future, error) for pending in held)

    # -- batch thread -------------------------------------------------------------

    def run(self) -> None:
        try:
            while True:
                first = self._first()
                with self._runner:
                    batch = self._gather(first)
                    if batch is None:
                        return
                    if batch:
                        self._run_one(batch)
        except BaseException as exc:
            self.crash = type(exc).__name__
            log.exception("batch thread crashed")
            raise
        finally:
            self.running = False
            if self._exited.locked():
                self._exited.release()

    def _run_one(self, batch: list[Part]) -> None:
        self._batch = batch
        self.busy_since = time.monotonic()
        try:
            self._run_batch(batch)
        finally:
            self.busy_since = None
            self._batch = []

    def _run_here(self, pending: Pending) -> bool:
        """Run ``pending`` in the calling thread if it is alone and its call cheap; True if it ran.

        Only when the model's calls are cheaper than ``run_here_below_s`` (0,
        the default: never; the service passes RUN_HERE_BELOW_S), the request
        fits one batch, and it is alone: it found the worker quiet for
        ``run_here_after_s``, no other request came into a handler since (so
        the gathering would not wait for one), and none is queued or running.
        With nothing to batch it with, the batch thread, woken for it, would
        only add two thread switches. A request that arrives meanwhile is
        queued for the batch thread, which runs it once this call ends (the
        runner lock). Under load the batch thread runs everything: what it pays
        once a batch (the batch's metrics, the late-request check) is then
        shared, where here each request would pay it. With ``run_in_callers``
        off, only a caller on the gevent hub's thread runs its own: a torch
        model with more than one intra-op thread starts a pool in every OS
        thread that calls it, so its calls stay on the batch thread (or the hub's).
        """
        if not (
            self._cheap()
            # No other request in a handler since the last batch began (so none now either),
            # and this one came to a worker quiet for a while: not one of a stream.
            and self._cycle_peak <= 1
            and self._came_after_quiet
            and len(pending.items) <= self._max_batch_size
        ):
            return False
        if not self._run_in_callers and not on_hub_thread():
            return False
        if not self._runner.acquire(False):
            return False
        try:
            if self._waiting or self._draining or not self._queue.empty():
                return False  # queued requests go first, and with it: the batch thread's
            self._waiting.append(pending)
            self._run_one(self._select())
        finally:
            self._runner.release()
        return True

    def _on_hub(self, pending: Pending) -> bool:
        """Queue ``pending`` for a batch run on the gevent hub's thread after its turn; True if queued.

        Only for a model whose calls are cheaper than ``run_here_below_s`` and a
        caller on the hub's thread (a request greenlet). The batch thread's
        hand-off there costs more than the call: a wake-up of the thread, the
        GIL passed to it and back, the hub woken from another thread.
        """
        if not (self._cheap() and on_hub_thread()):
            return False
        self._hub_queue.append(pending)
        if not self._hub_run_due:
            self._hub_run_due = True
            spawn_on_hub(self._run_on_hub)
        return True

    def _cheap(self) -> bool:
        """Whether a call measures cheaper than a hand-off (``run_here_below_s``) and nothing asks to wait."""
        return 0 < self._model_time_s < self._run_here_below_s and self._policy.delay_s <= 0

    def _run_on_hub(self) -> None:
        """Run what was queued for the hub, in batches; if the batch thread holds the runner, hand it over."""
        self._hub_run_due = False
        taken, self._hub_queue = self._hub_queue, []
        if not self._runner.acquire(False):
            for pending in taken:
                self._queue.put(pending)
            return
        try:
            self._waiting.extend(taken)
            while self._waiting:
                self._run_one(self._select())
        except Exception:
            # Not raised on: in a greenlet of its own it would only be printed. No caller may hang on it.
            log.exception("a batch run on the hub's thread failed")
            error = ModelError("the batch ended without a result for this request")
            for pending in taken + self._waiting:
                fail(pending.future, error)
        finally:
            self._runner.release()

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

    def _first(self) -> Any:
        """The entry that starts the next batch, blocking for one when nothing waits; else _NOTHING.

        Called without the runner lock: while this thread blocks here, a
        request thread may run its own call (_run_here).
        """
        if self._waiting or self._draining:
            return _NOTHING
        idle = self._queue.empty()
        entry = self._take(None)
        if idle:
            # Woken by the first request of an idle spell: under gevent,
            # those the hub is parsing now join it. Not when requests were
            # already queued: the model would idle through the hub's turn.
            end_of_hub_turn()
        return entry

    def _gather(self, first: Any) -> list[Part] | None:
        """The next batch ([] if none waits), or None once the sentinel is reached and nothing is left."""
        if first is not _NOTHING:
            self._wait(first)
        if not self._waiting:
            return None if self._draining else []
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
                if not claim(pending.future):
                    continue  # the caller gave up while it was queued
                pending.claimed = True
                if pending.deadline <= now:
                    waited_ms = (now - pending.enqueued_at) * 1000
                    fail(
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
                fail(
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
                    fail(part.pending.future, unanswered)

    def _predict_and_deliver(self, live: list[Part]) -> None:
        floor = self.cost.floor()
        if floor is not None:
            shed = self.gate.shed_late(live, one_call(live, floor))
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
                    fail(part.pending.future, outputs)
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
            complete(part, outputs[start:end], finite)
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
            self.gate.paused(waited)
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
        batch = Assembly(live)
        sizes = [size for size, _, _ in batch.order]
        estimate = self.cost.estimate()
        if estimate is None:
            ranges = [(0, len(sizes))]  # nothing measured yet: one call, as without sizes
        else:
            ranges = cut(
                sizes, estimate, max_tokens=self._call_tokens(estimate), max_rows=self._max_batch_size
            )
            # The cheapest cut, run longest-waiting first: the tail of a closed loop (subbatch.oldest_first).
            ranges = oldest_first(ranges, [live[r].pending.budget_from for _, r, _ in batch.order])
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
                dropped = self.gate.shed_late([live[r] for r in waiting], batch.needs(k, waiting, floor))
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
        self.gate.batch_ran(elapsed, items)
        waits = [started - part.pending.enqueued_at for part in live]
        notify(self._observer.on_batch, items, len(live), waits, elapsed)

    def _run_entries(self, batch: Assembly, entries: list[tuple[int, int, int]]) -> int:
        """One model call on ``entries``; answers the requests it completes. Returns its padded tokens."""
        items = batch.items(entries)
        padded = self.cost.tokens(len(entries), max(size for size, _, _ in entries))
        started = time.monotonic()
        outputs = self._call(items)
        if isinstance(outputs, ServeError):
            if len(entries) == 1 or isinstance(outputs, Overloaded):
                for r in {r for _, r, _ in entries}:
                    batch.failed.add(r)
                    fail(batch.live[r].pending.future, outputs)
                return padded
            log.warning("sub-batch of %d items failed; re-running them one by one", len(entries))
            return sum(self._run_entries(batch, [e]) for e in entries if e[1] not in batch.failed)
        self.cost.observe(padded, time.monotonic() - started - self._last_turn_wait_s)
        # A request's rows may come from several calls: its result is looked at
        # row by row once any call of this batch returned NaN or infinity.
        batch.finite = batch.finite and first_non_finite(outputs) is None
        for r in batch.store(entries, outputs):
            complete(batch.live[r], batch.result(r), batch.finite)
        return padded

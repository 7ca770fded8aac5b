"""The batcher's admission (service.batching.gate): the queue bound, and the latency budget at submit()
and before each model call.

Deterministic: they wait on events, never on sleeps, except two models that
take real time on purpose, because the check before each call must see the
time the calls before it took.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from service.batching import native
from service.batching.admission import AdmissionRule, Pace, ServiceMeter
from service.batching.gate import Gate
from service.batching.pending import Pending
from service.batching.waiting import wait_result
from service.errors import Overloaded, PayloadTooLarge
from tests.batcher.test_batcher import FAR, GatedPredict, started
from tests.batcher.test_lanes import queued_behind_a_running_call
from tests.batcher.test_sized_batches import Recorder, cost, sized_batcher


@pytest.fixture
def gated() -> GatedPredict:
    return GatedPredict()


class Behind(Pace):
    """A pace that says the arrivals outrun the answers: the latency budget applies."""

    def __init__(self) -> None:
        super().__init__()

    def behind(self, now: float, seconds_per_item: float | None) -> bool:
        return True


def test_a_request_that_arrived_past_its_budget_is_refused_at_submit_while_behind() -> None:
    batcher = started(lambda items: items, admission=AdmissionRule(budget_s=1.0), pace=Behind())
    try:
        with pytest.raises(Overloaded, match="past the 1000 ms it may wait") as refused:
            batcher.submit([1], FAR, arrived=time.monotonic() - 2)
        assert refused.value.reason == "over_budget"
        assert batcher.depth == 0
        # One that arrived just now goes through.
        assert wait_result(batcher.submit([2], FAR, arrived=time.monotonic()).future, 10) == [2]
    finally:
        batcher.stop(10)


def test_the_gate_judges_and_counts_a_request_without_a_batch_thread() -> None:
    lock = native.allocate_lock()
    gate = Gate(lock, rule=AdmissionRule(budget_s=1.0), queue_limit=4, max_batch_size=8, express_items=1)
    arrival = {
        "returning": False,
        "resend": False,
        "first_on_connection": False,
        "queue_wait": None,
        "waiting": None,
    }
    held = Pending(["a", "b"], FAR)
    with lock:  # as submit() calls it: judged and counted under the batcher's lock
        gate.admit(held, 0, body_bytes=200, **arrival)
    assert gate.load().outstanding == 2
    assert gate.estimate_items(1000) == 10  # 100 bytes an item, as the one body seen
    with lock, pytest.raises(Overloaded, match="queue is full") as refused:
        gate.admit(Pending(["c"] * 3, FAR), 2, body_bytes=None, **arrival)
    assert refused.value.reason == "queue_full"
    assert gate.load().outstanding == 2  # the refused request was never counted
    assert held.future.cancel()
    gate.answered(held)  # what the done callback does
    assert gate.load().outstanding == 0


def test_a_full_queue_refuses_at_once(gated: GatedPredict) -> None:
    batcher = started(gated, queue_limit=2)
    try:
        batcher.submit(["running"], FAR)
        gated.wait_entered()
        batcher.submit(["q1"], FAR)
        batcher.submit(["q2"], FAR)
        with pytest.raises(Overloaded, match="queue is full") as raised:
            batcher.submit(["q3"], FAR)
        assert raised.value.reason == "queue_full"
    finally:
        gated.gate.set()
        batcher.stop(10)


def test_the_prediction_counts_the_requests_held_and_forgets_the_answered(gated: GatedPredict) -> None:
    batcher = started(gated, max_batch_size=1)
    batcher.gate._meter = ServiceMeter(min_served=1)  # trust the rate from the first request on
    try:
        assert batcher.gate.predicted_wait() == 0.0  # nothing served yet: no rate to predict from
        first = batcher.submit(["a"], FAR)
        gated.wait_entered()
        gated.gate.set()
        wait_result(first.future, 10)
        alone = batcher.gate.predicted_wait()  # one request's service time
        assert alone > 0
        gated.gate.clear()
        held = [batcher.submit([str(i)], FAR) for i in range(4)]
        gated.wait_entered()
        # Four held: a newcomer waits for them and for itself.
        assert batcher.gate.predicted_wait() == pytest.approx(5 * alone, rel=1e-6)
        gated.gate.set()
        for pending in held:
            wait_result(pending.future, 10)
        # Everything answered: only the newcomer's own time is left.
        assert batcher.gate.predicted_wait() == pytest.approx(batcher.gate._meter.seconds_per_item)
    finally:
        gated.gate.set()
        batcher.stop(10)


def test_a_cancelled_request_leaves_the_count(gated: GatedPredict) -> None:
    batcher = started(gated, max_batch_size=1)
    batcher.gate._meter = ServiceMeter(min_served=1)  # trust the rate from the first request on
    try:
        first = batcher.submit(["a"], FAR)
        gated.wait_entered()
        gated.gate.set()
        wait_result(first.future, 10)
        alone = batcher.gate.predicted_wait()
        gated.gate.clear()
        running = batcher.submit(["b"], FAR)
        gated.wait_entered()
        queued = batcher.submit(["c"], FAR)
        assert batcher.gate.predicted_wait() == pytest.approx(3 * alone, rel=1e-6)
        assert queued.future.cancel()  # its caller gave up while it was queued
        assert batcher.gate.predicted_wait() == pytest.approx(2 * alone, rel=1e-6)
        gated.gate.set()
        wait_result(running.future, 10)
    finally:
        gated.gate.set()
        batcher.stop(10)


def test_a_small_request_is_predicted_to_wait_for_the_small_work_ahead_and_a_batch() -> None:
    gated = GatedPredict()
    batcher = queued_behind_a_running_call(gated, max_batch_size=16, queue_limit=1000)
    try:
        # Nothing measured yet: no prediction at all.
        assert batcher.gate.predicted_wait(1) == 0.0
        batcher.gate._meter = ServiceMeter(min_served=0)
        batcher.gate._meter.batch_ran(0.1, 10)  # 10 ms an item
        for _ in range(10):
            batcher.submit([f"b{n}" for n in range(16)], FAR)
        # 161 items held: a bulk request waits for them all, a query for a batch of them.
        assert batcher.gate.predicted_wait(16) > 1.7
        assert batcher.gate.predicted_wait(1) < 0.2
    finally:
        gated.gate.set()
        batcher.stop(10)


def test_the_requests_their_batch_would_answer_past_the_budget_are_refused_latest_first(
    gated: GatedPredict,
) -> None:
    # 0.1 s a item, no overhead per call (a model that reports no item sizes: an item is the unit).
    batcher = started(gated, admission=AdmissionRule(budget_s=2.0), cost=cost(0.0, 0.1), pace=Behind())
    try:
        first = batcher.submit(["a"], FAR)
        gated.wait_entered()
        # All three pass submit() (too few served yet for a prediction) and wait behind the first batch.
        now = time.monotonic()
        late = batcher.submit(["b"] * 3, FAR, arrived=now - 1.5)
        middle = batcher.submit(["c"] * 3, FAR, arrived=now - 1.25)
        fresh = batcher.submit(["d"] * 3, FAR, arrived=now)
        gated.gate.set()
        wait_result(first.future, 10)
        # Their 9 items would take 0.9 s: the first two would end past 2 s. Without the
        # latest, 6 items take 0.6 s, and the middle one ends at about 1.85 s: in time.
        with pytest.raises(Overloaded, match="past its 2000 ms latency budget") as refused:
            wait_result(late.future, 10)
        assert refused.value.reason == "over_budget"
        assert wait_result(middle.future, 10) == ["out:c"] * 3
        assert wait_result(fresh.future, 10) == ["out:d"] * 3
        assert gated.batches == [["a"], ["c"] * 3 + ["d"] * 3]  # the refused request never reached the model
        # It left the meter's count too (the count drops in the reply's callbacks, just after the wake).
        deadline = time.monotonic() + 10
        while batcher.gate.load().outstanding != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batcher.gate.load().outstanding == 0
    finally:
        gated.gate.set()
        batcher.stop(10)


class FirstCallSlow:
    """A sized model (an item's size is its value) whose first call takes ``first_s``."""

    def __init__(self, first_s: float) -> None:
        self.first_s = first_s
        self.calls: list[list[int]] = []

    def __call__(self, batch: list[int]) -> np.ndarray:
        if not self.calls:
            time.sleep(self.first_s)  # the model's own time, which the check must see
        self.calls.append(list(batch))
        return np.array([[float(item)] for item in batch])


def sized_batch(predict: FirstCallSlow, recorder: Recorder) -> tuple[Pending, Pending]:
    """A short request and a long one that already waited 0.3 s, run as two sub-batches of one batch.

    The short one waited a little longer still, so that its call runs first (subbatch.oldest_first).
    """
    batcher = sized_batcher(
        predict,
        recorder,
        cost=cost(0.001, 1e-4),  # the long item's call: about 0.3 s
        admission=AdmissionRule(budget_s=1.0),
        pace=Behind(),
    )
    short = batcher.submit([2], FAR, arrived=time.monotonic() - 0.35)
    long = batcher.submit([3000], FAR, arrived=time.monotonic() - 0.3)
    batcher.start()
    try:
        wait_result(short.future, 10)
        with contextlib.suppress(Overloaded):
            wait_result(long.future, 10)
        assert recorder.done.wait(10), "the batch never ended"
    finally:
        batcher.stop(10)
    return short, long


def test_a_slow_call_sheds_the_requests_the_calls_after_it_would_answer_late() -> None:
    # As estimated, the long request is answered in time: 0.3 s waited, 0.3 s of calls ahead of it.
    quick, recorder = FirstCallSlow(first_s=0.0), Recorder()
    _, long = sized_batch(quick, recorder)
    assert long.future.result(0) == [[3000.0]]
    assert quick.calls == [[2], [3000]]
    assert recorder.batches == [(2, 2)]
    # The first call takes 0.7 s instead of 1 ms: the long one's call would now end past the budget.
    slow, recorder = FirstCallSlow(first_s=0.7), Recorder()
    short, long = sized_batch(slow, recorder)
    assert short.future.result(0) == [[2.0]]
    with pytest.raises(Overloaded, match="latency budget") as refused:
        long.future.result(0)
    assert refused.value.reason == "over_budget"
    assert slow.calls == [[2]]  # its call never ran
    # The metrics count what ran: one request, one item, one call.
    assert recorder.batches == [(1, 1)]
    assert recorder.sub_batches == [(2, 2, 1)]


class FlatPredict:
    """A model with no item sizes whose call takes ``seconds`` whatever its batch: batching's premise."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.batches: list[list[str]] = []

    def __call__(self, batch: list[str]) -> list[str]:
        self.batches.append(list(batch))
        time.sleep(self.seconds)
        return [f"out:{item}" for item in batch]


def test_a_batch_is_not_refused_on_a_guess_from_calls_of_one_size() -> None:
    predict = FlatPredict(0.2)
    batcher = started(predict, admission=AdmissionRule(budget_s=1.0), pace=Behind())
    try:
        # Every call so far held one item, so nothing shows how time grows with items.
        assert wait_result(batcher.submit(["a"], FAR).future, 10) == ["out:a"]
        running = batcher.submit(["b"], FAR)
        deadline = time.monotonic() + 10
        while len(predict.batches) < 2:
            assert time.monotonic() < deadline, "the second call never started"
            time.sleep(0.005)
        # Eight requests queue behind the running call. Read as 0.2 s an item, their
        # batch would end past the budget; it takes 0.2 s, and none is refused.
        queued = [batcher.submit([f"c{i}"], FAR) for i in range(8)]
        assert wait_result(running.future, 10) == ["out:b"]
        assert [wait_result(p.future, 10) for p in queued] == [[f"out:c{i}"] for i in range(8)]
        assert predict.batches[2:] == [[f"c{i}" for i in range(8)]]
    finally:
        batcher.stop(10)


def test_while_the_service_keeps_up_a_request_past_its_budget_is_answered_by_its_deadline() -> None:
    # Closed-loop clients queue longer than the budget; they are not overload.
    batcher = started(lambda items: items, admission=AdmissionRule(budget_s=1.0))
    try:
        assert wait_result(batcher.submit([1], FAR, arrived=time.monotonic() - 2).future, 10) == [1]
        # Its deadline still rules: one that arrived past it is refused.
        now = time.monotonic()
        with pytest.raises(Overloaded, match="past the 1500 ms it may wait") as refused:
            batcher.submit([2], now - 0.5, arrived=now - 2.0)
        assert refused.value.reason == "over_budget"
    finally:
        batcher.stop(10)


def test_a_request_queued_behind_work_past_its_deadline_is_refused_before_its_model_call(
    gated: GatedPredict,
) -> None:
    # 0.1 s an item: behind the running call, three items (0.3 s) cannot end within a 0.2 s deadline.
    batcher = started(gated, admission=AdmissionRule(budget_s=1.0), cost=cost(0.0, 0.1))
    try:
        first = batcher.submit(["a"], FAR)
        gated.wait_entered()
        now = time.monotonic()
        short = batcher.submit(["b"] * 3, now + 0.2, arrived=now)
        gated.gate.set()
        wait_result(first.future, 10)
        with pytest.raises(Overloaded, match="past its 200 ms deadline"):
            wait_result(short.future, 10)
        assert gated.batches == [["a"]]
    finally:
        gated.gate.set()
        batcher.stop(10)


class PerItem:
    """A model with no item sizes whose call takes ``seconds`` an item, recording its calls."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.calls: list[int] = []

    def __call__(self, batch: list[int]) -> list[int]:
        self.calls.append(len(batch))
        time.sleep(self.seconds * len(batch))
        return batch


def test_a_request_too_large_for_its_deadline_alone_is_refused_413_and_is_no_demand() -> None:
    predict = PerItem(0.01)
    batcher = started(predict, admission=AdmissionRule(budget_s=1.0))
    batcher.gate._meter = ServiceMeter(min_served=1)  # trust the rate from the first request on
    try:
        assert wait_result(batcher.submit(list(range(10)), FAR).future, 10) == list(range(10))
        backlog = batcher.gate._pace._backlog
        now = time.monotonic()
        # 100 items at 0.01 s an item, with the deadline margin, pass a 1 s deadline: no retry could succeed.
        with pytest.raises(PayloadTooLarge, match=r"its 100 items would take about \d+\.\d s") as refused:
            batcher.submit(list(range(100)), now + 1.0, arrived=now)
        assert refused.value.status == 413
        assert batcher.depth == 0
        assert batcher.gate._pace._backlog == backlog  # not counted as demand unmet
        # A fifth as many fit, and are answered (with room for a busy machine's slower sleeps).
        now = time.monotonic()
        fifth = batcher.submit(list(range(20)), now + 1.0, arrived=now)
        assert wait_result(fifth.future, 10) == list(range(20))
    finally:
        batcher.stop(10)


def test_a_fresh_worker_sheds_a_request_too_large_for_its_deadline_after_its_first_call() -> None:
    # The long average is not trusted yet (MIN_SERVED); the first call's time per item says
    # that the 192 items still to come (1.9 s) cannot end within the 1 s deadline.
    predict = PerItem(0.01)
    batcher = started(predict, admission=AdmissionRule(budget_s=1.0), max_batch_size=8)
    try:
        now = time.monotonic()
        large = batcher.submit(list(range(200)), now + 1.0, arrived=now)
        with pytest.raises(PayloadTooLarge, match="too large for its deadline: its 200 items"):
            wait_result(large.future, 10)
        assert len(predict.calls) <= 2
    finally:
        batcher.stop(10)


def test_a_new_request_let_in_from_a_hold_is_demand_and_a_resend_is_not(gated: GatedPredict) -> None:
    # The pace's demand: every new request, admitted or refused. A request let in
    # from a hold (returning) is new unless it is the refused one sent again.
    batcher = started(gated, max_batch_size=1)
    try:
        backlog = batcher.gate._pace._backlog
        new = batcher.submit(["a", "b"], FAR, returning=True, resend=False)
        assert batcher.gate._pace._backlog == backlog + 2
        again = batcher.submit(["c"], FAR, returning=True, resend=True)
        assert batcher.gate._pace._backlog == backlog + 2
        gated.gate.set()
        wait_result(new.future, 10)
        wait_result(again.future, 10)
    finally:
        gated.gate.set()
        batcher.stop(10)

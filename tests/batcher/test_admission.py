"""The batcher's latency-budget check at submit(): deterministic, waits on events, never on sleeps."""

from __future__ import annotations

import time

import pytest

from service.batching.admission import AdmissionRule, ServiceMeter
from service.batching.waiting import wait_result
from service.errors import Overloaded
from tests.batcher.test_batcher import FAR, GatedPredict, started


@pytest.fixture
def gated() -> GatedPredict:
    return GatedPredict()


def test_a_request_that_arrived_past_its_budget_is_refused_at_submit() -> None:
    batcher = started(lambda items: items, admission=AdmissionRule(budget_s=1.0))
    try:
        with pytest.raises(Overloaded, match="past the 1000 ms it may wait") as refused:
            batcher.submit([1], FAR, arrived=time.monotonic() - 2)
        assert refused.value.reason == "over_budget"
        assert batcher.depth == 0
        # One that arrived just now goes through.
        assert wait_result(batcher.submit([2], FAR, arrived=time.monotonic()).future, 10) == [2]
    finally:
        batcher.stop(10)


def test_the_prediction_counts_the_requests_held_and_forgets_the_answered(gated: GatedPredict) -> None:
    batcher = started(gated, max_batch_size=1)
    batcher._meter = ServiceMeter(min_served=1)  # trust the rate from the first request on
    try:
        assert batcher.predicted_wait() == 0.0  # nothing served yet: no rate to predict from
        first = batcher.submit(["a"], FAR)
        gated.wait_entered()
        gated.gate.set()
        wait_result(first.future, 10)
        alone = batcher.predicted_wait()  # one request's service time
        assert alone > 0
        gated.gate.clear()
        held = [batcher.submit([str(i)], FAR) for i in range(4)]
        gated.wait_entered()
        # Four held: a newcomer waits for them and for itself.
        assert batcher.predicted_wait() == pytest.approx(5 * alone, rel=1e-6)
        gated.gate.set()
        for pending in held:
            wait_result(pending.future, 10)
        # Everything answered: only the newcomer's own time is left.
        assert batcher.predicted_wait() == pytest.approx(batcher._meter.seconds_per_request)
    finally:
        gated.gate.set()
        batcher.stop(10)


def test_a_cancelled_request_leaves_the_count(gated: GatedPredict) -> None:
    batcher = started(gated, max_batch_size=1)
    batcher._meter = ServiceMeter(min_served=1)  # trust the rate from the first request on
    try:
        first = batcher.submit(["a"], FAR)
        gated.wait_entered()
        gated.gate.set()
        wait_result(first.future, 10)
        alone = batcher.predicted_wait()
        gated.gate.clear()
        running = batcher.submit(["b"], FAR)
        gated.wait_entered()
        queued = batcher.submit(["c"], FAR)
        assert batcher.predicted_wait() == pytest.approx(3 * alone, rel=1e-6)
        assert queued.future.cancel()  # its caller gave up while it was queued
        assert batcher.predicted_wait() == pytest.approx(2 * alone, rel=1e-6)
        gated.gate.set()
        wait_result(running.future, 10)
    finally:
        gated.gate.set()
        batcher.stop(10)

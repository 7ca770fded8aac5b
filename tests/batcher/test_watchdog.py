"""The watchdog and Batcher.abandon(): a dead or stalled batch thread hangs no request."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest

from service.batching.batcher import Batcher
from service.batching.gather import GatherPolicy
from service.batching.pending import Pending
from service.batching.waiting import wait_result
from service.batching.watchdog import Watchdog, check_interval, diagnose
from service.errors import DeadlineExceeded, ModelError, NotReady
from tests.batcher.test_batcher import FAR, GatedPredict

pytestmark = pytest.mark.timeout(60)


class Faults:
    """Records the watchdog's reports; tests wait on ``reported``."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.reported = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.reported.set()


def watched(predict: Any, limit_s: float, **kwargs: Any) -> tuple[Batcher, Faults]:
    batcher = Batcher(predict, max_batch_size=kwargs.pop("max_batch_size", 64), queue_limit=100, **kwargs)
    faults = Faults()
    batcher.start()
    Watchdog(batcher, limit_s=limit_s, on_fault=faults).start()
    return batcher, faults


class TestDiagnose:
    def test_a_thread_that_was_stopped_is_fine(self) -> None:
        assert diagnose(exited=True, stopping=True, crash=None, busy_since=None, now=9, limit_s=1) is None

    def test_a_thread_that_crashed_is_dead(self) -> None:
        reason = diagnose(exited=True, stopping=False, crash="SystemExit", busy_since=None, now=9, limit_s=1)
        assert reason == "died (SystemExit)"

    def test_a_crash_while_draining_is_still_a_death(self) -> None:
        reason = diagnose(exited=True, stopping=True, crash="MemoryError", busy_since=None, now=9, limit_s=1)
        assert reason == "died (MemoryError)"

    def test_a_batch_over_the_limit_is_a_stall_naming_both_numbers(self) -> None:
        reason = diagnose(exited=False, stopping=False, crash=None, busy_since=1.0, now=4.5, limit_s=2)
        assert reason == "is stuck: one batch has run for 3.5 s (limit 2 s)"

    def test_an_idle_or_busy_thread_within_the_limit_is_fine(self) -> None:
        assert diagnose(exited=False, stopping=False, crash=None, busy_since=None, now=99, limit_s=1) is None
        assert diagnose(exited=False, stopping=False, crash=None, busy_since=9.5, now=10, limit_s=1) is None

    def test_checks_often_enough_for_short_limits_and_at_most_each_second(self) -> None:
        assert check_interval(0.4) == 0.1
        assert check_interval(60) == 1.0


def test_a_batch_thread_that_dies_fails_every_queued_request_with_503() -> None:
    gated = GatedPredict()

    def predict(batch: list[Any]) -> list[Any]:
        if "die" in batch:
            raise SystemExit("injected")
        return gated(batch)

    batcher, faults = watched(predict, limit_s=60, max_batch_size=1)
    first = batcher.submit(["first"], FAR)
    gated.wait_entered()
    dying = batcher.submit(["die"], FAR)
    queued = [batcher.submit([f"q{i}"], FAR) for i in range(3)]
    gated.gate.set()
    assert faults.reported.wait(10)
    assert faults.reasons == ["died (SystemExit)"]
    assert wait_result(first.future, 10) == ["out:first"]
    with pytest.raises(ModelError, match="without a result"):
        wait_result(dying.future, 10)  # its own batch fails it as the thread unwinds
    # The runtime reacts to the report by abandoning the batcher:
    assert batcher.abandon(NotReady("the batch thread died")) == 3
    for pending in queued:
        with pytest.raises(NotReady, match="died"):
            wait_result(pending.future, 10)
    with pytest.raises(NotReady):
        batcher.submit(["late"], FAR)


def test_a_stalled_batch_is_reported_and_abandoning_it_answers_everyone() -> None:
    first_gate, stall_gate, entered = threading.Event(), threading.Event(), threading.Semaphore(0)
    calls: list[list[Any]] = []

    def predict(batch: list[Any]) -> list[Any]:
        calls.append(batch)
        entered.release()
        assert (first_gate if len(calls) == 1 else stall_gate).wait(30)
        return [f"out:{item}" for item in batch]

    batcher, faults = watched(predict, limit_s=0.2, max_batch_size=2, policy=GatherPolicy(adaptive=False))
    warm = batcher.submit(["warm"], FAR)
    assert entered.acquire(timeout=10)
    stuck = batcher.submit(["a"], FAR)
    carried = batcher.submit(["b", "c"], FAR)  # cannot join ["a"]: waits as the next batch's head
    first_gate.set()
    assert entered.acquire(timeout=10)  # ["a"] is in the model, and stays there
    assert faults.reported.wait(10)
    assert faults.reasons[0].startswith("is stuck: one batch has run for")
    assert wait_result(warm.future, 10) == ["out:warm"]
    assert batcher.abandon(NotReady("stuck")) == 2
    for pending in (stuck, carried):
        with pytest.raises(NotReady):
            wait_result(pending.future, 10)
    # The model wakes up at last: the thread must neither answer twice nor crash.
    stall_gate.set()
    assert batcher.wait_exit(10)
    assert batcher.crash is None
    assert isinstance(stuck.future.exception(timeout=0), NotReady)
    assert calls == [["warm"], ["a"]]


def test_a_clean_stop_is_not_a_fault() -> None:
    batcher, faults = watched(lambda batch: batch, limit_s=0.2)
    assert wait_result(batcher.submit([1], FAR).future, 10) == [1]
    assert batcher.stop(timeout=10)
    assert not faults.reported.wait(0.5)


def test_a_burst_of_timeouts_leaves_no_request_behind() -> None:
    gated = GatedPredict()
    batcher = Batcher(gated, max_batch_size=64, queue_limit=1000, policy=GatherPolicy(adaptive=False))
    batcher.start()
    try:
        batcher.submit(["busy"], FAR)
        gated.wait_entered()
        for i in range(200):
            pending = batcher.submit([i], FAR)
            with pytest.raises(DeadlineExceeded):
                wait_result(pending.future, 0)
        del pending
        gated.gate.set()
        assert batcher.stop(timeout=10)
        assert batcher.depth == 0
        gc.collect()
        assert [obj for obj in gc.get_objects() if type(obj) is Pending] == []
        assert gated.batches == [["busy"]]  # every timed-out request was dropped unseen
    finally:
        gated.gate.set()
        batcher.stop(timeout=10)

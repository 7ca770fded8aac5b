"""Deterministic batcher tests: they wait on events, never on sleeps."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from service.batching.batcher import Batcher
from service.batching.gather import GatherPolicy
from service.batching.waiting import wait_result
from service.errors import DeadlineExceeded, ModelError, NotReady, Overloaded

FAR = 1e18  # a deadline that never passes


class GatedPredict:
    """A model whose every call waits at a gate, so tests decide when batches finish."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.batches: list[list[Any]] = []
        self.entered = threading.Semaphore(0)
        self.gate = threading.Event()
        self.fail_on = fail_on

    def __call__(self, batch: list[Any]) -> list[Any]:
        self.batches.append(list(batch))
        self.entered.release()
        assert self.gate.wait(10), "test never opened the gate"
        if self.fail_on is not None and self.fail_on in batch:
            raise ValueError("bad item")
        return [f"out:{item}" for item in batch]

    def wait_entered(self) -> None:
        assert self.entered.acquire(timeout=10), "the batch thread never called the model"


@pytest.fixture
def gated() -> GatedPredict:
    return GatedPredict()


def started(predict: Any, **kwargs: Any) -> Batcher:
    options: dict[str, Any] = {
        "max_batch_size": 64,
        "queue_limit": 100,
        "policy": GatherPolicy(adaptive=False),
    }
    options.update(kwargs)
    batcher = Batcher(predict, **options)
    batcher.start()
    return batcher


@pytest.fixture
def cleanup() -> Iterator[list[Batcher]]:
    batchers: list[Batcher] = []
    yield batchers
    for batcher in batchers:
        batcher.stop(timeout=10)


def test_lone_request_runs_at_once(cleanup: list[Batcher]) -> None:
    calls: list[list[Any]] = []
    batcher = started(lambda batch: calls.append(batch) or [x * 2 for x in batch])
    cleanup.append(batcher)
    pending = batcher.submit([21], FAR)
    assert wait_result(pending.future, 10) == [42]
    assert calls == [[21]]
    assert pending.batch_size == 1


def test_requests_queued_behind_a_busy_model_run_as_one_batch(
    gated: GatedPredict, cleanup: list[Batcher]
) -> None:
    batcher = started(gated)
    cleanup.append(batcher)
    first = batcher.submit(["a"], FAR)
    gated.wait_entered()  # the model is busy with the first request
    others = [batcher.submit([f"b{i}", f"c{i}"], FAR) for i in range(3)]
    gated.gate.set()
    assert wait_result(first.future, 10) == ["out:a"]
    for i, pending in enumerate(others):
        assert wait_result(pending.future, 10) == [f"out:b{i}", f"out:c{i}"]
        assert pending.batch_size == 6
    assert [len(b) for b in gated.batches] == [1, 6]


def test_a_request_that_does_not_fit_heads_the_next_batch(
    gated: GatedPredict, cleanup: list[Batcher]
) -> None:
    batcher = started(gated, max_batch_size=4)
    cleanup.append(batcher)
    batcher.submit(["x"], FAR)
    gated.wait_entered()
    big, mid, small = (batcher.submit(items, FAR) for items in (["a"] * 3, ["b"] * 2, ["c"]))
    gated.gate.set()
    for pending in (big, mid, small):
        wait_result(pending.future, 10)
    assert gated.batches == [["x"], ["a", "a", "a"], ["b", "b", "c"]]


def test_a_bad_item_fails_only_its_own_request(cleanup: list[Batcher]) -> None:
    gated = GatedPredict(fail_on="bad")
    batcher = started(gated)
    cleanup.append(batcher)
    batcher.submit(["warmup"], FAR)
    gated.wait_entered()
    good1, bad, good2 = (batcher.submit(items, FAR) for items in (["a"], ["b", "bad"], ["c"]))
    gated.gate.set()
    assert wait_result(good1.future, 10) == ["out:a"]
    assert wait_result(good2.future, 10) == ["out:c"]
    with pytest.raises(ModelError, match="ValueError"):
        wait_result(bad.future, 10)
    # The whole batch ran once, then each request alone.
    assert gated.batches[1:] == [["a", "b", "bad", "c"], ["a"], ["b", "bad"], ["c"]]


def test_the_thread_survives_model_exceptions(cleanup: list[Batcher]) -> None:
    def predict(batch: list[Any]) -> list[Any]:
        if batch == ["raise"]:
            raise RuntimeError("model broke")
        return batch

    batcher = started(predict)
    cleanup.append(batcher)
    with pytest.raises(ModelError):
        wait_result(batcher.submit(["raise"], FAR).future, 10)
    assert wait_result(batcher.submit(["fine"], FAR).future, 10) == ["fine"]
    assert batcher.running


def test_output_count_mismatch_names_both_numbers(cleanup: list[Batcher]) -> None:
    batcher = started(lambda batch: batch[:-1])
    cleanup.append(batcher)
    with pytest.raises(ModelError, match="model returned 3 outputs for 4 inputs"):
        wait_result(batcher.submit([1, 2, 3, 4], FAR).future, 10)


def test_non_finite_outputs_fail_only_the_request_that_holds_them(
    gated: GatedPredict, cleanup: list[Batcher]
) -> None:
    def predict(batch: list[float]) -> np.ndarray:
        gated(batch)
        return np.array([[x, 1.0] for x in batch], dtype=np.float32)

    batcher = started(predict)
    cleanup.append(batcher)
    batcher.submit([0.0], FAR)
    gated.wait_entered()
    fine, nan = batcher.submit([1.0], FAR), batcher.submit([2.0, math.nan], FAR)
    gated.gate.set()
    np.testing.assert_array_equal(wait_result(fine.future, 10), [[1.0, 1.0]])
    with pytest.raises(ModelError, match=r"non-finite value .* for input 1"):
        wait_result(nan.future, 10)


def test_cancelled_requests_never_reach_the_model(gated: GatedPredict, cleanup: list[Batcher]) -> None:
    batcher = started(gated)
    cleanup.append(batcher)
    batcher.submit(["first"], FAR)
    gated.wait_entered()
    gone = batcher.submit(["gone"], FAR)
    assert gone.future.cancel()
    kept = batcher.submit(["kept"], FAR)
    gated.gate.set()
    assert wait_result(kept.future, 10) == ["out:kept"]
    assert ["gone"] not in gated.batches and all("gone" not in b for b in gated.batches)


def test_an_expired_request_is_dropped_before_inference(gated: GatedPredict, cleanup: list[Batcher]) -> None:
    batcher = started(gated)
    cleanup.append(batcher)
    batcher.submit(["first"], FAR)
    gated.wait_entered()
    expired = batcher.submit(["late"], time.monotonic())  # its deadline has already passed
    gated.gate.set()
    with pytest.raises(DeadlineExceeded, match="in the queue") as raised:
        wait_result(expired.future, 10)
    assert raised.value.reason == "expired_in_queue"
    assert all("late" not in b for b in gated.batches)


def test_a_caller_that_times_out_leaves_nothing_behind(gated: GatedPredict, cleanup: list[Batcher]) -> None:
    batcher = started(gated)
    cleanup.append(batcher)
    running = batcher.submit(["first"], FAR)
    gated.wait_entered()
    queued = batcher.submit(["queued"], FAR)
    with pytest.raises(DeadlineExceeded) as in_queue:
        wait_result(queued.future, 0)
    assert queued.future.cancelled()
    assert in_queue.value.reason == "expired_in_queue"
    with pytest.raises(DeadlineExceeded) as in_batch:
        wait_result(running.future, 0)  # running: cannot cancel; its result is dropped
    assert in_batch.value.reason == "expired_in_batch"
    gated.gate.set()
    assert batcher.stop(timeout=10)
    assert running.future.result(timeout=0) == ["out:first"]
    assert batcher.depth == 0
    assert gated.batches == [["first"]]


def test_stop_answers_everything_accepted_then_refuses(gated: GatedPredict) -> None:
    batcher = started(gated)
    accepted = [batcher.submit([i], FAR) for i in range(5)]
    gated.wait_entered()
    stopper = threading.Thread(target=batcher.stop, kwargs={"timeout": 10})
    stopper.start()
    gated.gate.set()
    stopper.join(10)
    assert [wait_result(p.future, 10) for p in accepted] == [[f"out:{i}"] for i in range(5)]
    assert not batcher.running
    with pytest.raises(NotReady, match="shutting down") as raised:
        batcher.submit([9], FAR)
    assert raised.value.reason == "shutting_down"


class TestGatherPolicy:
    def test_no_wait_by_default_for_a_lone_request(self) -> None:
        policy = GatherPolicy()
        assert (
            policy.deadline(
                first_arrival=0, gather_start=0, last_arrival=0, requests=1, expected=1, model_time_s=0.05
            )
            is None
        )

    def test_fixed_delay_counts_from_the_first_arrival(self) -> None:
        policy = GatherPolicy(delay_s=0.01)
        assert (
            policy.deadline(
                first_arrival=5.0,
                gather_start=5.004,
                last_arrival=5.004,
                requests=1,
                expected=1,
                model_time_s=0,
            )
            == 5.01
        )

    def test_adaptive_waits_a_fraction_of_the_model_time_while_more_are_expected(self) -> None:
        policy = GatherPolicy(fraction=0.25, max_wait_s=1)
        assert (
            policy.deadline(
                first_arrival=0, gather_start=2, last_arrival=2, requests=1, expected=8, model_time_s=0.04
            )
            == 2.01
        )

    def test_adaptive_wait_is_capped(self) -> None:
        policy = GatherPolicy(fraction=0.5, max_wait_s=0.02)
        assert (
            policy.deadline(
                first_arrival=0, gather_start=0, last_arrival=0, requests=1, expected=8, model_time_s=10
            )
            == 0.02
        )

    def test_adaptive_does_not_wait_before_a_model_time_is_known(self) -> None:
        assert (
            GatherPolicy().deadline(
                first_arrival=0, gather_start=0, last_arrival=0, requests=1, expected=8, model_time_s=0
            )
            is None
        )

    def test_adaptive_window_stretches_while_requests_keep_arriving(self) -> None:
        policy = GatherPolicy(fraction=0.25, max_wait_s=1, arrival_gap_s=0.005, stretch_fraction=0.5)
        kwargs = {
            "first_arrival": 0.0,
            "gather_start": 0.0,
            "requests": 3,
            "expected": 8,
            "model_time_s": 0.1,
        }
        assert policy.deadline(last_arrival=0.0, **kwargs) == 0.025  # the base window
        assert policy.deadline(last_arrival=0.03, **kwargs) == pytest.approx(0.035)  # a gap after the last
        assert policy.deadline(last_arrival=0.048, **kwargs) == 0.05  # never past half a model call

    def test_eager_never_waits(self) -> None:
        policy = GatherPolicy(adaptive=False)
        assert (
            policy.deadline(
                first_arrival=0, gather_start=0, last_arrival=0, requests=1, expected=8, model_time_s=1
            )
            is None
        )


def test_adaptive_gathering_waits_for_a_request_still_being_parsed(cleanup: list[Batcher]) -> None:
    seen: list[list[Any]] = []
    # A window far longer than the test: only the arrival of B may end it.
    policy = GatherPolicy(fraction=1e9, max_wait_s=30)
    batcher = started(lambda batch: seen.append(list(batch)) or batch, policy=policy)
    cleanup.append(batcher)
    assert wait_result(batcher.submit(["warmup"], FAR).future, 10) == ["warmup"]
    with batcher.in_flight(), batcher.in_flight():  # A and B are both inside their handlers
        a = batcher.submit(["a"], FAR)
        assert not a.future.done()  # held back: B is known to be coming
        b = batcher.submit(["b"], FAR)
        assert wait_result(a.future, 10) == ["a"] and wait_result(b.future, 10) == ["b"]
    assert seen[-1] == ["a", "b"]


def test_adaptive_gathering_takes_requests_that_keep_arriving_past_the_base_window(
    cleanup: list[Batcher],
) -> None:
    seen: list[list[Any]] = []
    # A 1 ms base window and arrivals 50 ms apart: each one, coming within the gap
    # of the last, keeps the window open.
    policy = GatherPolicy(max_wait_s=0.001, arrival_gap_s=0.5, stretch_fraction=1e9)
    batcher = started(lambda batch: seen.append(list(batch)) or batch, policy=policy)
    cleanup.append(batcher)
    assert wait_result(batcher.submit(["warmup"], FAR).future, 10) == ["warmup"]
    with contextlib.ExitStack() as handlers:
        for _ in range(5):  # five clients inside their handlers; three of them will send
            handlers.enter_context(batcher.in_flight())
        sent = []
        for item in ("a", "b", "c"):
            sent.append(batcher.submit([item], FAR))
            time.sleep(0.05)
        # Two never come: the batch runs once no request has arrived for the gap.
        assert [wait_result(p.future, 10) for p in sent] == [["a"], ["b"], ["c"]]
    assert seen[-1] == ["a", "b", "c"]


def test_adaptive_gathering_never_holds_a_lone_request(cleanup: list[Batcher]) -> None:
    policy = GatherPolicy(fraction=1e9, max_wait_s=30)
    batcher = started(lambda batch: batch, policy=policy)
    cleanup.append(batcher)
    for item in ("first", "second"):
        with batcher.in_flight():
            pending = batcher.submit([item], FAR)
            # With a 30 s window, only a batcher that does not wait answers in time.
            assert wait_result(pending.future, 5) == [item]


def test_non_finite_values_in_nested_lists_and_numpy_scalars_fail_their_request(
    cleanup: list[Batcher],
) -> None:
    def predict(batch: list[str]) -> list[Any]:
        kinds: dict[str, Any] = {"nested": [[1.0], [math.nan]], "scalar": np.float32(math.inf)}
        return [kinds.get(item, [1.0]) for item in batch]

    gated = GatedPredict()
    batcher = started(lambda batch: (gated(batch), predict(batch))[1])
    cleanup.append(batcher)
    batcher.submit(["warmup"], FAR)
    gated.wait_entered()
    fine, nested, scalar = (batcher.submit(items, FAR) for items in (["ok"], ["ok", "nested"], ["scalar"]))
    gated.gate.set()
    assert wait_result(fine.future, 10) == [[1.0]]
    with pytest.raises(ModelError, match=r"non-finite value .* for input 1$"):
        wait_result(nested.future, 10)
    with pytest.raises(ModelError, match=r"non-finite value .* for input 0$"):
        wait_result(scalar.future, 10)
    assert nested.batch_size == 4  # they ran as one batch; only the culprits failed


def test_a_gpu_out_of_memory_fails_the_batch_with_503_without_rerunning_it(cleanup: list[Batcher]) -> None:
    from tests.support.models import OutOfMemoryError  # a mock: a real one needs a GPU

    calls: list[list[Any]] = []

    def predict(batch: list[Any]) -> list[Any]:
        calls.append(batch)
        if "big" in batch:
            raise OutOfMemoryError("CUDA out of memory (mock)")
        return batch

    batcher = started(predict)
    cleanup.append(batcher)
    with pytest.raises(Overloaded, match="GPU ran out of memory") as refused:
        wait_result(batcher.submit(["big"], FAR).future, 10)
    assert refused.value.reason == "gpu_out_of_memory"
    assert wait_result(batcher.submit(["small"], FAR).future, 10) == ["small"]
    assert calls == [["big"], ["small"]]

"""Length-aware batches: a model that reports item sizes gets sorted sub-batches (deterministic)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from service.batching.batcher import Batcher
from service.batching.gather import GatherPolicy
from service.batching.observer import BatchObserver
from service.batching.pending import Pending
from service.batching.subbatch import CostModel
from service.batching.waiting import wait_result
from service.errors import ModelError

FAR = 1e18


class SizedPredict:
    """Items are ints: an item's size is its absolute value, and a negative item is bad."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, batch: list[int]) -> np.ndarray:
        self.calls.append(list(batch))
        if any(item < 0 for item in batch):
            raise ValueError("a bad item")
        return np.array([[float(item), float(item) * 2] for item in batch])


class Recorder(BatchObserver):
    def __init__(self) -> None:
        self.sub_batches: list[tuple[int, int, int]] = []
        self.batches: list[tuple[int, int]] = []
        self.done = threading.Event()

    def on_batch(self, items: int, requests: int, queue_waits: list[float], model_seconds: float) -> None:
        self.batches.append((items, requests))

    def on_sub_batches(self, real_tokens: int, padded_tokens: int, sub_batches: int) -> None:
        self.sub_batches.append((real_tokens, padded_tokens, sub_batches))
        self.done.set()


def cost(overhead_s: float, per_token_s: float) -> CostModel:
    """A cost model that has seen calls of exactly this cost, up to 10,000 padded tokens."""
    model = CostModel(decay=1.0)
    for tokens in (1, 10, 100, 1000, 10_000):
        model.observe(tokens, overhead_s + per_token_s * tokens)
    return model


def sized_batcher(predict: Any, recorder: Recorder, **options: Any) -> Batcher:
    """A batcher, not started, for a model whose items are sized by their value, that gathers nothing."""
    return Batcher(
        predict,
        max_batch_size=64,
        queue_limit=100,
        policy=GatherPolicy(adaptive=False),
        observer=recorder,
        sizer=abs,
        **options,
    )


def one_batch(
    requests: list[list[int]], *, max_tokens: int = 1 << 20, model: CostModel | None = None
) -> tuple[SizedPredict, Recorder, list[Pending], Batcher]:
    """Queue every request before the thread starts, so that they gather into one batch."""
    predict, recorder = SizedPredict(), Recorder()
    batcher = sized_batcher(predict, recorder, max_tokens=max_tokens, cost=model or cost(0.001, 1e-4))
    pendings = [batcher.submit(items, FAR) for items in requests]
    batcher.start()
    assert recorder.done.wait(10), "the batch never ran"
    return predict, recorder, pendings, batcher


def test_a_batch_runs_sorted_by_size_and_short_items_leave_the_long_one() -> None:
    predict, recorder, pendings, batcher = one_batch([[3], [120], [5], [4], [2]])
    try:
        flat = [item for call in predict.calls for item in call]
        assert flat == sorted(flat) == [2, 3, 4, 5, 120]
        assert predict.calls[-1] == [120]  # the long one is cut off
        assert recorder.batches == [(5, 5)]
        real, padded, subs = recorder.sub_batches[0]
        assert real == 134 and subs == len(predict.calls) and padded < 5 * 120
        for pending, item in zip(pendings, [3, 120, 5, 4, 2], strict=True):
            np.testing.assert_array_equal(wait_result(pending.future, 10), [[item, item * 2]])
            assert pending.batch_size == 5
    finally:
        batcher.stop(timeout=10)


def test_the_sub_batch_whose_requests_waited_longest_runs_first() -> None:
    # A client answered early in one batch comes back and waits for it to end: its next
    # request, long or short, should not wait through a second batch as well.
    predict, recorder = SizedPredict(), Recorder()
    batcher = sized_batcher(predict, recorder, max_tokens=1 << 20, cost=cost(0.001, 1e-4))
    now = time.monotonic()
    waited = batcher.submit([120], FAR, arrived=now - 0.1)
    fresh = [batcher.submit([size], FAR, arrived=now) for size in (3, 2, 4)]
    batcher.start()
    try:
        assert recorder.done.wait(10), "the batch never ran"
        assert predict.calls == [[120], [2, 3, 4]]
        assert all(wait_result(p.future, 10) is not None for p in [waited, *fresh])
    finally:
        batcher.stop(timeout=10)


def test_every_call_keeps_within_the_token_budget() -> None:
    sizes = [7, 30, 2, 64, 9, 9, 31, 15, 3, 50, 18, 22]
    predict, _, pendings, batcher = one_batch([[s] for s in sizes], max_tokens=64, model=cost(0.0, 1e-5))
    try:
        assert all(len(call) * max(call) <= 64 for call in predict.calls)
        assert sorted(item for call in predict.calls for item in call) == sorted(sizes)
        assert all(wait_result(p.future, 10) is not None for p in pendings)
    finally:
        batcher.stop(timeout=10)


def test_a_request_split_across_sub_batches_gets_its_outputs_in_its_own_order() -> None:
    predict, _, pendings, batcher = one_batch([[90, 1, 45, 2], [1], [2]], model=cost(0.0, 1e-5))
    try:
        assert len(predict.calls) > 1
        first = wait_result(pendings[0].future, 10)
        np.testing.assert_array_equal(first, [[90, 180], [1, 2], [45, 90], [2, 4]])
        np.testing.assert_array_equal(wait_result(pendings[1].future, 10), [[1, 2]])
    finally:
        batcher.stop(timeout=10)


def test_a_nan_in_an_early_sub_batch_fails_its_request_though_its_last_call_is_finite() -> None:
    class NanForOne(SizedPredict):
        def __call__(self, batch: list[int]) -> np.ndarray:
            rows = super().__call__(batch)
            rows[[item == 1 for item in batch]] = np.nan
            return rows

    predict, recorder = NanForOne(), Recorder()
    batcher = sized_batcher(predict, recorder, max_tokens=1 << 20, cost=cost(0.0, 1e-5))
    # The 1 runs with the short items, the 90 alone after them: the last call is all finite.
    split, short = batcher.submit([90, 1], FAR), batcher.submit([2], FAR)
    batcher.start()
    try:
        assert recorder.done.wait(10), "the batch never ran"
        assert len(predict.calls) > 1 and predict.calls[-1] == [90]
        with pytest.raises(ModelError, match=r"non-finite value .* for input 1$"):
            wait_result(split.future, 10)
        np.testing.assert_array_equal(wait_result(short.future, 10), [[2, 4]])
    finally:
        batcher.stop(timeout=10)


def test_one_bad_item_among_many_sizes_fails_only_its_own_request() -> None:
    requests = [[5], [40, -6], [6], [70], [3, 8]]
    predict, _, pendings, batcher = one_batch(requests)
    try:
        with pytest.raises(ModelError):
            wait_result(pendings[1].future, 10)
        for index in (0, 2, 3, 4):
            rows = wait_result(pendings[index].future, 10)
            np.testing.assert_array_equal(rows[:, 0], requests[index])
        # The failed call was re-run item by item; the bad request's other item ran no further.
        assert [-6] in predict.calls
    finally:
        batcher.stop(timeout=10)


def test_before_any_measurement_a_batch_runs_as_one_call() -> None:
    predict, _, pendings, batcher = one_batch([[3], [100], [4]], model=CostModel())
    try:
        assert predict.calls == [[3, 4, 100]]
        assert [wait_result(p.future, 10)[0][0] for p in pendings] == [3, 100, 4]
    finally:
        batcher.stop(timeout=10)


def test_the_calls_it_runs_teach_the_cost_model() -> None:
    empty = CostModel()
    _, _, pendings, batcher = one_batch([[3], [100], [4]], model=empty)
    try:
        for pending in pendings:
            wait_result(pending.future, 10)
        assert batcher.cost.observed
    finally:
        batcher.stop(timeout=10)


def test_a_model_without_sizes_batches_as_before() -> None:
    calls: list[list[Any]] = []
    done = threading.Event()

    def predict(batch: list[Any]) -> list[Any]:
        calls.append(list(batch))
        done.set()
        return [x * 2 for x in batch]

    batcher = Batcher(predict, max_batch_size=64, queue_limit=100, policy=GatherPolicy(adaptive=False))
    pendings = [batcher.submit([x], FAR) for x in (120, 3, 50)]
    batcher.start()
    try:
        assert [wait_result(p.future, 10) for p in pendings] == [[240], [6], [100]]
        assert calls == [[120, 3, 50]]
    finally:
        batcher.stop(timeout=10)

"""What the batcher reports to its observer: batches, queue depth, model load."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from service.batching.batcher import Batcher
from service.batching.gather import GatherPolicy
from service.batching.observer import BatchObserver
from service.batching.waiting import wait_result
from tests.batcher.test_batcher import FAR, GatedPredict


class Recorder(BatchObserver):
    def __init__(self) -> None:
        self.batches: list[tuple[int, int, int, float]] = []
        self.depths: list[int] = []

    def on_batch(self, items: int, requests: int, queue_waits: list[float], model_seconds: float) -> None:
        self.batches.append((items, requests, len(queue_waits), model_seconds))

    def on_queue_depth(self, depth: int) -> None:
        self.depths.append(depth)


def started(predict: Any, observer: BatchObserver) -> Batcher:
    batcher = Batcher(
        predict, max_batch_size=64, queue_limit=1000, policy=GatherPolicy(adaptive=False), observer=observer
    )
    batcher.start()
    return batcher


def test_each_batch_reports_its_items_requests_and_waits() -> None:
    gated, recorder = GatedPredict(), Recorder()
    batcher = started(gated, recorder)
    try:
        first = batcher.submit(["a"], FAR)
        gated.wait_entered()
        queued = [batcher.submit(["b", "c"], FAR), batcher.submit(["d"], FAR)]
        assert recorder.depths == [1, 0, 1, 2]  # the first was taken at once, the others waited
        gated.gate.set()
        for pending in [first, *queued]:
            wait_result(pending.future, 10)
    finally:
        batcher.stop(timeout=10)
    assert [(items, requests, waits) for items, requests, waits, _ in recorder.batches] == [
        (1, 1, 1),
        (3, 2, 2),
    ]
    assert all(seconds > 0 for *_, seconds in recorder.batches)
    assert recorder.depths[-1] == 0


def test_the_last_reported_depth_is_the_real_one_under_concurrent_submits() -> None:
    recorder = Recorder()
    batcher = started(list, recorder)
    try:

        def submit_many() -> None:
            for i in range(50):
                wait_result(batcher.submit([i], FAR).future, 10)

        threads = [threading.Thread(target=submit_many) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        batcher.stop(timeout=10)
    # Reports that overlap coalesce, but one always follows the last change.
    assert batcher.depth == 0 and recorder.depths[-1] == 0
    assert 0 < len(recorder.depths) <= 2 * 8 * 50
    assert all(0 <= depth <= 8 for depth in recorder.depths)
    assert sum(items for items, *_ in recorder.batches) == 8 * 50


class Raising(BatchObserver):
    """An observer whose every hook fails, as a broken metrics backend would."""

    def __init__(self) -> None:
        self.calls = 0

    def on_batch(self, items: int, requests: int, queue_waits: list[float], model_seconds: float) -> None:
        self.calls += 1
        raise RuntimeError("metrics backend down")

    def on_queue_depth(self, depth: int) -> None:
        self.calls += 1
        raise RuntimeError("metrics backend down")


def test_an_observer_that_raises_loses_no_request_and_no_count(caplog: pytest.LogCaptureFixture) -> None:
    gated, observer = GatedPredict(), Raising()
    batcher = started(gated, observer)
    try:
        first = batcher.submit(["a"], FAR)  # raised out of submit, after counting it, before the fix
        gated.wait_entered()
        queued = batcher.submit(["b"], FAR)
        assert batcher.depth == 1
        gated.gate.set()
        assert wait_result(first.future, 10) == ["out:a"]
        assert wait_result(queued.future, 10) == ["out:b"]  # taken, then run, despite the hook
        assert batcher.depth == 0
        assert batcher.running
    finally:
        assert batcher.stop(timeout=10)
    assert observer.calls >= 6  # depth up and down for each request, and each batch
    assert "the batch observer's on_queue_depth failed; ignored" in caplog.text
    assert "the batch observer's on_batch failed; ignored" in caplog.text

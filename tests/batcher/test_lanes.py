"""Requests larger than a batch run a batch at a time; small ones go ahead of bulk work, within a bound."""

from __future__ import annotations

import numpy as np
import pytest

from service.batching.batcher import Batcher
from service.batching.waiting import wait_result
from service.errors import ServeError
from tests.batcher.test_batcher import FAR, GatedPredict, started
from tests.batcher.test_sized_batches import Recorder, SizedPredict, cost, sized_batcher


def test_a_request_larger_than_a_batch_runs_a_batch_at_a_time_and_gets_every_output_in_order() -> None:
    gated = GatedPredict()
    gated.gate.set()
    batcher = started(gated, max_batch_size=4)
    try:
        items = [f"i{n}" for n in range(10)]
        assert wait_result(batcher.submit(items, FAR).future, 10) == [f"out:i{n}" for n in range(10)]
        assert [len(batch) for batch in gated.batches] == [4, 4, 2]
        assert batcher.depth == 0
    finally:
        batcher.stop(10)


def test_a_sized_request_larger_than_a_batch_is_cut_into_batches_and_answered_whole() -> None:
    predict, recorder = SizedPredict(), Recorder()
    batcher = sized_batcher(predict, recorder, cost=cost(0.001, 1e-4))
    items = [(n % 7) + 1 for n in range(150)]
    pending = batcher.submit(items, FAR)
    batcher.start()
    try:
        outputs = wait_result(pending.future, 10)
        assert isinstance(outputs, np.ndarray)
        np.testing.assert_array_equal(outputs[:, 0], np.array(items, dtype=float))
        # No call held more than a batch's rows (64), and the batches took 64, 64 and 22 items.
        assert max(len(call) for call in predict.calls) <= 64
        assert [items for items, _ in recorder.batches] == [64, 64, 22]
    finally:
        batcher.stop(10)


def test_a_bad_item_in_a_later_part_fails_the_request_once_and_the_rest_go_on() -> None:
    gated = GatedPredict(fail_on="bad")
    gated.gate.set()
    batcher = started(gated, max_batch_size=4)
    try:
        big = batcher.submit(["a", "b", "c", "d", "e", "bad"], FAR)
        other = batcher.submit(["z"], FAR)
        with pytest.raises(ServeError):
            wait_result(big.future, 10)
        assert wait_result(other.future, 10) == ["out:z"]
    finally:
        batcher.stop(10)


def queued_behind_a_running_call(gated: GatedPredict, **options: int) -> Batcher:
    batcher = started(gated, **options)
    batcher.submit(["x"], FAR)
    gated.wait_entered()
    return batcher


def test_a_small_request_goes_ahead_of_bulk_requests_that_arrived_before_it() -> None:
    gated = GatedPredict()
    batcher = queued_behind_a_running_call(gated, max_batch_size=16)  # express: at most 2 items
    try:
        bulk = [batcher.submit([f"{name}{n}" for n in range(8)], FAR) for name in ("a", "b")]
        query = batcher.submit(["q"], FAR)
        gated.gate.set()
        for pending in (*bulk, query):
            wait_result(pending.future, 10)
        assert gated.batches[1] == ["q"] + [f"a{n}" for n in range(8)]
        assert gated.batches[2] == [f"b{n}" for n in range(8)]
        assert query.batch_size == 9
    finally:
        gated.gate.set()
        batcher.stop(10)


def test_small_requests_take_at_most_half_a_batch_while_bulk_work_waits() -> None:
    gated = GatedPredict()
    batcher = queued_behind_a_running_call(gated, max_batch_size=16)
    try:
        bulk = batcher.submit([f"a{n}" for n in range(16)], FAR)
        queries = [batcher.submit([f"q{n}"], FAR) for n in range(12)]
        gated.gate.set()
        for pending in (bulk, *queries):
            wait_result(pending.future, 10)
        # Eight queries and half of the bulk request, then the rest of it with the other four.
        assert gated.batches[1] == [f"q{n}" for n in range(8)] + [f"a{n}" for n in range(8)]
        assert gated.batches[2] == [f"q{n}" for n in range(8, 12)] + [f"a{n}" for n in range(8, 16)]
        assert wait_result(bulk.future, 1) == [f"out:a{n}" for n in range(16)]
    finally:
        gated.gate.set()
        batcher.stop(10)

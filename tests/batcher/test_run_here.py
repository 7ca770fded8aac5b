"""A lone request to a cheap model is run by its own thread; everything else by the batch thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from service.batching.batcher import RUN_HERE_BELOW_S, Batcher
from service.batching.gather import GatherPolicy
from service.batching.waiting import wait_result

FAR = 1e18  # a deadline that never passes


class Recorded:
    """A model that records which thread called it, and may wait at a gate."""

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)

    def __call__(self, batch: list[Any]) -> list[Any]:
        self.threads.append(threading.get_ident())
        self.entered.release()
        assert self.gate.wait(10), "the test never opened the gate"
        return [f"out:{item}" for item in batch]


@pytest.fixture
def batchers() -> Iterator[list[Batcher]]:
    made: list[Batcher] = []
    yield made
    for batcher in made:
        batcher.stop(timeout=10)


def started(made: list[Batcher], predict: Any, **kwargs: Any) -> Batcher:
    options: dict[str, Any] = {
        "max_batch_size": 8,
        "queue_limit": 100,
        "policy": GatherPolicy(),
        # Any call counts as cheap, so that a busy machine's slow call cannot decide a test;
        # test_a_slow_model_... checks the threshold itself.
        "run_here_below_s": 60.0,
        # Requests here follow each other at once: any gap counts as quiet, but in
        # test_a_request_that_follows_the_last_answer_closely_goes_to_the_batch_thread.
        "run_here_after_s": 0.0,
    }
    options.update(kwargs)
    batcher = Batcher(predict, **options)
    batcher.start()
    made.append(batcher)
    return batcher


def test_a_lone_request_to_a_cheap_model_is_answered_within_submit_by_its_own_thread(
    batchers: list[Batcher],
) -> None:
    model = Recorded()
    batcher = started(batchers, model)
    # The first call is timed by the batch thread: before it, nothing says the model is cheap.
    assert wait_result(batcher.submit(["a"], FAR).future, 10) == ["out:a"]
    assert model.threads[0] != threading.get_ident()
    with batcher.in_flight():
        pending = batcher.submit(["b", "c"], FAR)
        assert pending.future.done()  # answered before submit returned
    assert wait_result(pending.future, 10) == ["out:b", "out:c"]
    assert model.threads[1] == threading.get_ident()
    assert pending.batch_size == 2
    assert batcher.depth == 0


def test_a_request_beside_another_in_flight_goes_to_the_batch_thread(batchers: list[Batcher]) -> None:
    model = Recorded()
    batcher = started(batchers, model)
    wait_result(batcher.submit(["a"], FAR).future, 10)
    with batcher.in_flight(), batcher.in_flight():  # another request is in its handler
        pending = batcher.submit(["b"], FAR)
        assert wait_result(pending.future, 10) == ["out:b"]
    assert model.threads[1] != threading.get_ident()


def test_a_request_that_follows_the_last_answer_closely_goes_to_the_batch_thread(
    batchers: list[Batcher],
) -> None:
    model = Recorded()
    batcher = started(batchers, model, run_here_after_s=60.0)
    wait_result(batcher.submit(["a"], FAR).future, 10)
    with batcher.in_flight():  # the first request into a handler: the worker was quiet
        wait_result(batcher.submit(["b"], FAR).future, 10)
    with batcher.in_flight():  # within a minute of the last answer: one of a stream
        wait_result(batcher.submit(["c"], FAR).future, 10)
    assert model.threads[1] == threading.get_ident()
    assert model.threads[2] != threading.get_ident()


def test_a_slow_model_and_the_default_batcher_always_use_the_batch_thread(batchers: list[Batcher]) -> None:
    for predict, options in (
        (Recorded(), {"run_here_below_s": 1e-9}),  # every call measures slower than this
        (Recorded(), {"run_here_below_s": 0.0}),  # Batcher's default: never
    ):
        batcher = started(batchers, predict, **options)
        for item in "abc":
            with batcher.in_flight():
                assert wait_result(batcher.submit([item], FAR).future, 10) == [f"out:{item}"]
        assert threading.get_ident() not in predict.threads


def test_a_request_larger_than_a_batch_goes_to_the_batch_thread(batchers: list[Batcher]) -> None:
    model = Recorded()
    batcher = started(batchers, model, max_batch_size=2)
    wait_result(batcher.submit(["a"], FAR).future, 10)
    with batcher.in_flight():
        pending = batcher.submit(["b", "c", "d"], FAR)
        assert wait_result(pending.future, 10) == ["out:b", "out:c", "out:d"]
    assert threading.get_ident() not in model.threads


def test_the_batch_thread_waits_while_a_request_runs_its_own_call(batchers: list[Batcher]) -> None:
    model = Recorded()
    batcher = started(batchers, model)
    wait_result(batcher.submit(["a"], FAR).future, 10)
    assert model.entered.acquire(timeout=10)
    model.gate.clear()
    answers: dict[str, Any] = {}

    def lone() -> None:
        with batcher.in_flight():
            answers["b"] = wait_result(batcher.submit(["b"], FAR).future, 10)

    runner = threading.Thread(target=lone)
    runner.start()
    assert model.entered.acquire(timeout=10)  # "b" is in the model, in its own thread
    queued = batcher.submit(["c"], FAR)  # the runner lock is held: this one is queued
    assert not model.entered.acquire(timeout=0.2)  # and the batch thread does not call the model meanwhile
    model.gate.set()
    runner.join(10)
    assert answers["b"] == ["out:b"]
    assert wait_result(queued.future, 10) == ["out:c"]
    assert model.threads[1] == runner.ident
    assert model.threads[2] not in (runner.ident, threading.get_ident())  # the batch thread's
    assert batcher.depth == 0


def test_stop_still_answers_and_ends_after_requests_ran_in_their_own_threads(
    batchers: list[Batcher],
) -> None:
    model = Recorded()
    batcher = Batcher(
        model, max_batch_size=8, queue_limit=100, run_here_below_s=RUN_HERE_BELOW_S, run_here_after_s=0.0
    )
    batcher.start()
    wait_result(batcher.submit(["a"], FAR).future, 10)
    with batcher.in_flight():
        wait_result(batcher.submit(["b"], FAR).future, 10)
    assert batcher.stop(timeout=10)
    assert not batcher.running


def test_with_callers_kept_off_the_model_a_lone_request_goes_to_the_batch_thread(
    batchers: list[Batcher],
) -> None:
    # As the service runs a torch model with more than one intra-op thread (service.runtime).
    model = Recorded()
    batcher = started(batchers, model, run_in_callers=False)
    assert wait_result(batcher.submit(["a"], FAR).future, 10) == ["out:a"]
    with batcher.in_flight():
        pending = batcher.submit(["b"], FAR)
        assert wait_result(pending.future, 10) == ["out:b"]
    assert len(model.threads) == 2 and threading.get_ident() not in model.threads

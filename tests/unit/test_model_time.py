"""A worker's models share its model time: one call at a time, in turns (service.batching.model_time)."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from service.batching.admission import ServiceMeter
from service.batching.batcher import Batcher
from service.batching.model_time import ModelTime


def test_calls_of_two_models_never_overlap_and_alternate_when_both_wait() -> None:
    shared = ModelTime()
    running: list[str] = []
    order: list[str] = []
    overlap = threading.Event()
    start = threading.Barrier(2)

    def model(name: str) -> None:
        start.wait()
        for _ in range(20):
            with shared.turn():
                running.append(name)
                if len(running) > 1:
                    overlap.set()
                order.append(name)
                time.sleep(0.002)  # a call's worth of model time
                running.remove(name)

    threads = [threading.Thread(target=model, args=(n,)) for n in ("embed", "rerank")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not overlap.is_set()
    assert sorted(order) == ["embed"] * 20 + ["rerank"] * 20
    # Handed over first come, first served: once both wait, they alternate call by call
    # (only before the other thread has first asked may one run twice in a row).
    handovers = sum(1 for a, b in itertools.pairwise(order) if a != b)
    assert handovers >= 30, order


def test_a_turn_says_how_long_it_waited() -> None:
    shared = ModelTime()
    held = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with shared.turn():
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    threading.Timer(0.05, release.set).start()
    with shared.turn() as waited:
        assert waited >= 0.04
    t.join(10)
    with shared.turn() as waited:
        assert waited < 0.04  # free: taken at once


def test_a_prediction_counts_the_other_models_queued_work() -> None:
    shared = ModelTime()
    gate = threading.Event()

    def slow(batch: list[str]) -> list[int]:
        gate.wait(10)
        return [1] * len(batch)

    embed = Batcher(slow, max_batch_size=8, queue_limit=1000, model_time=shared)
    rerank = Batcher(lambda batch: [0] * len(batch), max_batch_size=8, queue_limit=1000, model_time=shared)
    for batcher in (embed, rerank):
        # As if measured: 10 ms an item, known at once.
        batcher._meter = ServiceMeter(min_served=0)
        batcher._meter.batch_ran(0.08, 8)
    alone = rerank.predicted_wait(4)
    assert alone == pytest.approx(4 * 0.01)
    embed._meter.outstanding = 500  # 5 s of the other model's work queued
    assert embed.backlog_s() == pytest.approx(500 * 0.01)
    # In turns, call by call: as much of the other's work runs as of this one's.
    assert rerank.predicted_wait(4) == pytest.approx(2 * alone)
    # And a lone model's prediction is its own work alone.
    lone = Batcher(lambda batch: [0] * len(batch), max_batch_size=8, queue_limit=1000)
    lone._meter = ServiceMeter(min_served=0)
    lone._meter.batch_ran(0.08, 8)
    assert lone.predicted_wait(4) == pytest.approx(alone)
    gate.set()

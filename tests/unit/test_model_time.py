"""A worker's models share its model time: one call at a time, in turns (service.batching.model_time)."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from service.batching import model_time
from service.batching.admission import ServiceMeter
from service.batching.batcher import Batcher
from service.batching.model_time import ModelTime


def test_calls_of_two_models_never_overlap_and_alternate_when_both_wait() -> None:
    shared = ModelTime()
    index = {name: shared.join(lambda: 0.0) for name in ("embed", "rerank")}
    running: list[str] = []
    order: list[str] = []
    overlap = threading.Event()
    start = threading.Barrier(2)

    def model(name: str) -> None:
        start.wait()
        for _ in range(20):
            with shared.turn(index[name]):
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
    # Calls of equal cost: once both wait, the time goes to the one that has used less
    # of it, which alternates them call by call.
    handovers = sum(1 for a, b in itertools.pairwise(order) if a != b)
    assert handovers >= 30, order


def test_a_turn_says_how_long_it_waited() -> None:
    shared = ModelTime()
    a, b = shared.join(lambda: 0.0), shared.join(lambda: 0.0)
    held = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with shared.turn(a):
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    threading.Timer(0.05, release.set).start()
    with shared.turn(b) as waited:
        assert waited >= 0.04
    t.join(10)
    with shared.turn(b) as waited:
        assert waited < 0.04  # free: taken at once


def busy_model(shared: ModelTime, index: int, call_s: float, until: float, used: list[float]) -> None:
    """A batch thread with work always queued: calls of ``call_s`` each, back to back, until ``until``."""
    while time.monotonic() < until:
        with shared.turn(index):
            started = time.monotonic()
            time.sleep(call_s)  # stands in for a model call
            used[index] += time.monotonic() - started


def share_busily(call_s: tuple[float, float], seconds: float) -> list[float]:
    """Two models with work always queued, calls of ``call_s`` each, for ``seconds``: the time each used."""
    shared = ModelTime()
    indices = [shared.join(lambda: 0.0) for _ in call_s]
    used = [0.0, 0.0]
    until = time.monotonic() + seconds
    threads = [
        threading.Thread(target=busy_model, args=(shared, index, call, until, used))
        for index, call in zip(indices, call_s, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return used


@pytest.fixture
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    # A busy thread that a loaded machine keeps off the CPU for a moment between two
    # turns is not one back from idle: what these tests measure is the sharing.
    monkeypatch.setattr(model_time, "IDLE_S", 1.0)


@pytest.mark.usefixtures("patient")
def test_the_time_is_shared_fairly_by_time_not_by_calls() -> None:
    # A reranker's calls cost ten times an embedder's: turns by call would give
    # it ten elevenths of the time; fair queueing by time gives each about half.
    embed, rerank = share_busily((0.002, 0.02), 1.0)
    assert 0.6 < embed / rerank < 1.6, (embed, rerank)


@pytest.mark.usefixtures("patient")
def test_calls_longer_than_the_credit_still_share_fairly() -> None:
    # A model whose calls are not cut (no item sizes) runs 0.3 s calls beside one of
    # 0.01 s: the busy short-call model keeps its count (it asks again at once, so it
    # is not taken for one back from idle) and still gets about half the time.
    short, long = share_busily((0.01, 0.3), 2.0)
    assert 0.6 < short / long < 1.6, (short, long)


def test_a_model_that_fails_while_asking_leaves_the_time_to_the_others() -> None:
    shared = ModelTime()
    a, b = shared.join(lambda: 0.0), shared.join(lambda: 0.0)
    holding, release = threading.Event(), threading.Event()

    def holder() -> None:
        with shared.turn(a):
            holding.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    holding.wait(10)
    broken = shared.turn(b)
    real_allocate = model_time.native.allocate_lock
    model_time.native.allocate_lock = lambda: (_ for _ in ()).throw(RuntimeError("no lock"))  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError), broken:
            pass
    finally:
        model_time.native.allocate_lock = real_allocate  # type: ignore[assignment]
    release.set()
    t.join(10)
    with shared.turn(a) as waited:  # b does not stand asking for ever
        assert waited < 1.0


def test_a_model_back_from_idle_banks_no_credit() -> None:
    # The embedder ran alone for a while; the reranker then starts. It must not
    # hold the time until its count catches up: they share from then on.
    shared = ModelTime()
    embed, rerank = shared.join(lambda: 0.0), shared.join(lambda: 0.0)
    used = [0.0, 0.0]
    busy_model(shared, embed, 0.01, time.monotonic() + 0.5, used)
    used = [0.0, 0.0]
    until = time.monotonic() + 0.6
    threads = [
        threading.Thread(target=busy_model, args=(shared, embed, 0.01, until, used)),
        threading.Thread(target=busy_model, args=(shared, rerank, 0.01, until, used)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert used[embed] > 0.15, used  # about half of the 0.6 s, not none


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
        batcher.gate._meter = ServiceMeter(min_served=0)
        batcher.gate._meter.batch_ran(0.08, 8)
    alone = rerank.gate.predicted_wait(4)
    assert alone == pytest.approx(4 * 0.01)
    embed.gate._meter.outstanding = 500  # 5 s of the other model's work queued
    assert embed.gate.backlog_s() == pytest.approx(500 * 0.01)
    # In turns, call by call: as much of the other's work runs as of this one's.
    assert rerank.gate.predicted_wait(4) == pytest.approx(2 * alone)
    # And a lone model's prediction is its own work alone.
    lone = Batcher(lambda batch: [0] * len(batch), max_batch_size=8, queue_limit=1000)
    lone.gate._meter = ServiceMeter(min_served=0)
    lone.gate._meter.batch_ran(0.08, 8)
    assert lone.gate.predicted_wait(4) == pytest.approx(alone)
    gate.set()


def test_the_meter_leaves_the_other_models_turns_out_of_its_rate() -> None:
    # 1 s between arrival and answer, half of it waiting for another model's turn:
    # this model's own rate is 0.05 s an item, and predictions add the sharing once.
    meter = ServiceMeter(min_served=0)
    meter.submitted(10)
    meter.paused(0.5)
    meter.completed(1.0, 0.0, True, 10)
    assert meter.seconds_per_item == pytest.approx(0.05)

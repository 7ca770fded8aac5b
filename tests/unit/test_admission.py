"""The admission rule, the wait prediction and the service meter: pure, given times, no clock or threads."""

from __future__ import annotations

import math

import pytest

from service.batching.admission import AdmissionRule, ServiceMeter, StandingQueue, predict_wait


def test_a_request_within_its_budget_is_admitted() -> None:
    assert AdmissionRule(budget_s=3.0).decide(waited_s=0.5, predicted_s=1.0) is None


def test_a_request_that_already_waited_its_budget_is_refused_whatever_the_queue() -> None:
    refusal = AdmissionRule(budget_s=3.0).decide(waited_s=3.0, predicted_s=0.0)
    assert refusal is not None
    assert "waited 3000 ms" in refusal.message and "past the 3000 ms it may wait" in refusal.message
    assert refusal.retry_after_s == 1


def test_a_request_the_work_ahead_would_take_past_its_budget_is_refused() -> None:
    rule = AdmissionRule(budget_s=3.0)
    # The prediction counts twice (PREDICTION_MARGIN): an average can be off by that much.
    assert rule.decide(waited_s=1.0, predicted_s=1.0) is None  # exactly on budget
    refusal = rule.decide(waited_s=1.0, predicted_s=1.5)
    assert refusal is not None
    assert "about 1500 ms" in refusal.message
    # Told to come back when the work now ahead is done.
    assert refusal.retry_after_s == 2


def test_the_predicted_wait_counts_the_work_ahead_and_the_newcomer_itself() -> None:
    assert predict_wait(0, 0.01) == pytest.approx(0.01)
    assert predict_wait(99, 0.01) == pytest.approx(1.0)
    assert predict_wait(-3, 0.01) == pytest.approx(0.01)


def test_an_infinite_budget_refuses_nothing() -> None:
    rule = AdmissionRule(budget_s=math.inf)
    assert rule.decide(waited_s=1e6, predicted_s=1e6, standing=True) is None
    assert not rule.standing_queue().standing(1e6, now=0.0)
    assert not rule.standing_queue().standing(1e6, now=1e9)


def test_an_unmeasured_service_predicts_no_wait() -> None:
    assert predict_wait(500, None) == 0.0
    assert ServiceMeter().seconds_per_request is None


def test_the_rate_is_trusted_only_after_enough_requests_were_served() -> None:
    # The first requests often run alone or in small batches: a rate learned
    # from them would refuse the burst that larger batches then serve in time.
    meter = ServiceMeter(window=10_000, min_served=3)
    meter.completed(now=1.0, arrived=0.0, served=True)
    meter.completed(now=1.1, arrived=0.0, served=True)
    assert meter.seconds_per_request is None
    meter.completed(now=1.2, arrived=0.0, served=True)
    assert meter.seconds_per_request == pytest.approx(1.2 / 3, rel=1e-3)


def test_the_meter_counts_the_requests_it_holds() -> None:
    meter = ServiceMeter()
    for _ in range(3):
        meter.submitted()
    meter.completed(now=1.0, arrived=0.0, served=True)
    assert meter.outstanding == 2
    meter.completed(now=1.0, arrived=0.0, served=False)
    meter.completed(now=1.0, arrived=0.0, served=False)
    meter.completed(now=1.0, arrived=0.0, served=False)  # more than held: never below zero
    assert meter.outstanding == 0


def test_a_backlog_served_in_batches_gives_the_time_per_request() -> None:
    # 64 requests queued at t=0, answered in batches of 16 every 0.4 s: 25 ms each.
    meter = ServiceMeter(window=10_000, min_served=1)
    for batch in range(1, 5):
        for _ in range(16):
            meter.completed(now=0.4 * batch, arrived=0.0, served=True)
    assert meter.seconds_per_request == pytest.approx(0.025, rel=0.05)


def test_idle_time_between_requests_does_not_lower_the_rate() -> None:
    # One request every second, each served in 10 ms: the service takes 10 ms per request, not 1 s.
    meter = ServiceMeter(window=10_000, min_served=1)
    for second in range(10):
        meter.completed(now=second + 0.01, arrived=float(second), served=True)
    assert meter.seconds_per_request == pytest.approx(0.01)


def test_requests_that_left_unserved_add_no_time() -> None:
    meter = ServiceMeter(window=10_000, min_served=1)
    meter.completed(now=0.01, arrived=0.0, served=True)
    meter.completed(now=5.0, arrived=0.0, served=False)  # expired in the queue
    assert meter.seconds_per_request == pytest.approx(0.01)


def test_the_meter_follows_a_change_of_speed() -> None:
    meter = ServiceMeter(window=32, min_served=1)
    t = 0.0
    for _ in range(200):  # 10 ms a request, then 40 ms: the average moves to the new speed
        t += 0.01
        meter.completed(now=t, arrived=0.0, served=True)
    for _ in range(200):
        t += 0.04
        meter.completed(now=t, arrived=0.0, served=True)
    assert meter.seconds_per_request == pytest.approx(0.04, rel=0.01)


def batches(meter: ServiceMeter, t: float, count: int, seconds: float, size: int = 16) -> float:
    """``count`` batches of ``size`` requests, each taking ``seconds`` of model time; the time after."""
    for _ in range(count):
        t += seconds + 0.01  # and 10 ms of gathering, which the model time leaves out
        for _ in range(size):
            meter.completed(now=t, arrived=0.0, served=True)
        meter.batch_ran(seconds, size)
    return t


def test_the_meter_believes_a_slowdown_within_a_batch_or_two() -> None:
    meter = ServiceMeter(min_served=1)
    t = batches(meter, 0.0, 100, seconds=0.15)  # 10 ms a request, gathering included
    # Steady: the long average (which counts the gathering) is the slower, and rules.
    assert meter.seconds_per_request == pytest.approx(0.01, rel=0.05)
    # The model becomes four times slower: one batch of it moves the long average by
    # little, and the meter believes most of it at once.
    t = batches(meter, t, 1, seconds=0.6)
    assert meter.seconds_per_request is not None and meter.seconds_per_request > 0.02
    t = batches(meter, t, 1, seconds=0.6)
    assert meter.seconds_per_request > 0.03
    # A speed-up is believed only as the long average sees it.
    t = batches(meter, t, 20, seconds=0.6)
    batches(meter, t, 2, seconds=0.15)  # back to 10 ms a request for two batches
    assert meter.seconds_per_request > 0.02


def test_a_batch_that_served_no_request_teaches_the_meter_nothing() -> None:
    meter = ServiceMeter(min_served=1)
    batches(meter, 0.0, 10, seconds=0.15)
    before = meter.seconds_per_request
    meter.batch_ran(5.0, 0)  # every request of it was refused before its model call
    assert meter.seconds_per_request == before


def test_a_meter_needs_a_positive_window() -> None:
    with pytest.raises(ValueError, match="window must be at least 1, got 0"):
        ServiceMeter(window=0)


def test_while_the_door_queue_stands_what_waited_past_a_tenth_of_the_budget_is_refused() -> None:
    rule = AdmissionRule(budget_s=2.0)
    assert rule.door_target_s == pytest.approx(0.2)
    assert rule.decide(waited_s=0.3, predicted_s=0.1) is None
    refusal = rule.decide(waited_s=0.3, predicted_s=0.1, standing=True)
    assert refusal is not None and "past the 200 ms it may wait there" in refusal.message
    assert rule.decide(waited_s=0.1, predicted_s=0.1, standing=True) is None


def test_a_queue_is_standing_once_every_wait_for_an_interval_was_over_the_target() -> None:
    queue = StandingQueue(target_s=0.1, interval_s=0.5)
    assert not queue.standing(0.2, now=10.0)  # over the target, but only just now
    assert not queue.standing(0.3, now=10.4)
    assert queue.standing(0.2, now=10.5)
    assert queue.standing(0.15, now=11.0)
    assert not queue.standing(0.05, now=11.1)  # one short wait: the queue emptied
    assert not queue.standing(0.2, now=11.2)  # and the interval starts again
    assert queue.standing(0.2, now=11.7)


def test_a_returning_client_is_let_in_with_a_smaller_margin() -> None:
    rule = AdmissionRule(budget_s=2.0)
    # 1.2 s of work ahead: past half the budget, within two thirds of it.
    assert rule.decide(0.0, 1.2) is not None
    assert rule.decide(0.0, 1.2, returning=True) is None
    # Past two thirds of the budget, a returning client is refused too.
    refusal = rule.decide(0.0, 1.4, returning=True)
    assert refusal is not None and refusal.retry_after_s == 2


def test_a_held_request_is_let_in_early_on_a_fresh_requests_terms() -> None:
    rule = AdmissionRule(budget_s=2.0)
    assert rule.admits_fresh(0.5, 0.75)  # 0.5 s waited, 2 x 0.75 s ahead: the whole budget, just in
    assert not rule.admits_fresh(0.5, 0.76)
    # What it lets in, the door admits, with room for a few that get there first.
    assert rule.decide(0.5, 0.75, returning=True) is None
    assert rule.decide(0.5, 0.95, returning=True) is None
    assert rule.decide(0.5, 1.05, returning=True) is not None

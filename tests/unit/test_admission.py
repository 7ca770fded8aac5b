"""The admission rule, the wait prediction, the service meter and the pace: pure, given times, no clock."""

from __future__ import annotations

import math
import random

import pytest

from service.batching.admission import (
    AdmissionRule,
    Pace,
    ServiceMeter,
    StandingQueue,
    alone_past_deadline,
    predict_wait,
)

# The request timeout by default: what a request may take while the service keeps up.
DEADLINE = 30.0


def behind(rule: AdmissionRule, waited: float, predicted: float, **options: float) -> object:
    """The rule's verdict on a request while arrivals outrun the answers, with the default deadline."""
    return rule.decide(waited, predicted, deadline_s=DEADLINE, behind=True, **options)


def test_a_request_within_its_budget_is_admitted() -> None:
    assert behind(AdmissionRule(budget_s=3.0), 0.5, 1.0) is None


def test_a_request_that_already_waited_its_budget_is_refused_whatever_the_queue() -> None:
    refusal = behind(AdmissionRule(budget_s=3.0), 3.0, 0.0)
    assert refusal is not None
    assert "waited 3000 ms" in refusal.message and "past the 3000 ms it may wait" in refusal.message
    assert refusal.retry_after_s == 1


def test_a_request_the_work_ahead_would_take_past_its_budget_is_refused() -> None:
    rule = AdmissionRule(budget_s=3.0)
    # The prediction counts twice (PREDICTION_MARGIN): an average can be off by that much.
    assert behind(rule, 1.0, 1.0) is None  # exactly on budget
    refusal = behind(rule, 1.0, 1.5)
    assert refusal is not None
    assert "about 1500 ms" in refusal.message
    # Told to come back when the work now ahead is done.
    assert refusal.retry_after_s == 2


def test_the_predicted_wait_counts_the_work_ahead_and_the_newcomer_itself() -> None:
    assert predict_wait(0, 0.01) == pytest.approx(0.01)
    assert predict_wait(99, 0.01) == pytest.approx(1.0)
    assert predict_wait(-3, 0.01) == pytest.approx(0.01)
    # Counted in items: a request of 32 texts waits for its own 32.
    assert predict_wait(64, 0.01, own=32) == pytest.approx(0.96)


def test_an_infinite_budget_refuses_nothing() -> None:
    rule = AdmissionRule(budget_s=math.inf)
    assert behind(rule, 1e6, 1e6, standing=True) is None
    assert rule.decide(1e6, 1e6, deadline_s=DEADLINE, behind=False) is None
    assert not rule.standing_queue().standing(1e6, now=0.0)
    assert not rule.standing_queue().standing(1e6, now=1e9)


def test_an_unmeasured_service_predicts_no_wait() -> None:
    assert predict_wait(500, None) == 0.0
    assert ServiceMeter().seconds_per_item is None


def test_the_rate_is_trusted_only_after_enough_requests_were_served() -> None:
    # The first requests often run alone or in small batches: a rate learned
    # from them would refuse the burst that larger batches then serve in time.
    meter = ServiceMeter(window=10_000, min_served=3)
    meter.completed(now=1.0, arrived=0.0, served=True)
    meter.completed(now=1.1, arrived=0.0, served=True)
    assert meter.seconds_per_item is None
    meter.completed(now=1.2, arrived=0.0, served=True)
    assert meter.seconds_per_item == pytest.approx(1.2 / 3, rel=1e-3)


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
    assert meter.seconds_per_item == pytest.approx(0.025, rel=0.05)


def test_idle_time_between_requests_does_not_lower_the_rate() -> None:
    # One request every second, each served in 10 ms: the service takes 10 ms per request, not 1 s.
    meter = ServiceMeter(window=10_000, min_served=1)
    for second in range(10):
        meter.completed(now=second + 0.01, arrived=float(second), served=True)
    assert meter.seconds_per_item == pytest.approx(0.01)


def test_requests_that_left_unserved_add_no_time() -> None:
    meter = ServiceMeter(window=10_000, min_served=1)
    meter.completed(now=0.01, arrived=0.0, served=True)
    meter.completed(now=5.0, arrived=0.0, served=False)  # expired in the queue
    assert meter.seconds_per_item == pytest.approx(0.01)


def test_the_meter_follows_a_change_of_speed() -> None:
    meter = ServiceMeter(window=32, min_served=1)
    t = 0.0
    for _ in range(200):  # 10 ms a request, then 40 ms: the average moves to the new speed
        t += 0.01
        meter.completed(now=t, arrived=0.0, served=True)
    for _ in range(200):
        t += 0.04
        meter.completed(now=t, arrived=0.0, served=True)
    assert meter.seconds_per_item == pytest.approx(0.04, rel=0.01)


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
    assert meter.seconds_per_item == pytest.approx(0.01, rel=0.05)
    # The model becomes four times slower: one batch of it moves the long average by
    # little, and the meter believes most of it at once.
    t = batches(meter, t, 1, seconds=0.6)
    assert meter.seconds_per_item is not None and meter.seconds_per_item > 0.02
    t = batches(meter, t, 1, seconds=0.6)
    assert meter.seconds_per_item > 0.03
    # A speed-up is believed only as the long average sees it.
    t = batches(meter, t, 20, seconds=0.6)
    batches(meter, t, 2, seconds=0.15)  # back to 10 ms a request for two batches
    assert meter.seconds_per_item > 0.02


def test_a_batch_that_served_no_request_teaches_the_meter_nothing() -> None:
    meter = ServiceMeter(min_served=1)
    batches(meter, 0.0, 10, seconds=0.15)
    before = meter.seconds_per_item
    meter.batch_ran(5.0, 0)  # every request of it was refused before its model call
    assert meter.seconds_per_item == before


def test_a_meter_needs_a_positive_window() -> None:
    with pytest.raises(ValueError, match="window must be at least 1, got 0"):
        ServiceMeter(window=0)


def test_while_the_door_queue_stands_what_waited_past_a_tenth_of_the_budget_is_refused() -> None:
    rule = AdmissionRule(budget_s=2.0)
    assert rule.door_target_s == pytest.approx(0.2)
    assert behind(rule, 0.3, 0.1) is None
    refusal = behind(rule, 0.3, 0.1, standing=True)
    assert refusal is not None and "past the 200 ms it may wait there" in refusal.message
    assert behind(rule, 0.1, 0.1, standing=True) is None


def test_a_request_checked_before_its_wait_for_a_thread_is_judged_on_the_wait_it_will_have() -> None:
    # The gthread worker's event loop asks before the request waits for a thread:
    # what the door in that thread would refuse for its wait is refused now.
    rule = AdmissionRule(budget_s=2.0)
    assert behind(rule, 0.05, 0.1, standing=True) is None
    refusal = behind(rule, 0.05, 0.1, standing=True, to_wait_s=0.3)
    assert refusal is not None
    assert "waited 50 ms and would wait about 300 ms more for a thread" in refusal.message
    assert "past the 200 ms it may wait there" in refusal.message
    # Its work ahead is counted from when it will reach the handler.
    assert behind(rule, 0.0, 0.5, to_wait_s=0.9) is None
    late = behind(rule, 0.0, 0.5, to_wait_s=1.5)
    assert late is not None and "work queued ahead" in late.message
    # While the service keeps up, a wait for a thread within the deadline is no reason.
    assert rule.decide(0.0, 0.1, deadline_s=DEADLINE, behind=False, standing=True, to_wait_s=3.0) is None


def test_a_queue_is_standing_once_every_wait_for_an_interval_was_over_the_target() -> None:
    queue = StandingQueue(target_s=0.1, interval_s=0.5)
    assert not queue.standing(0.2, now=10.0)  # over the target, but only just now
    assert not queue.standing(0.3, now=10.4)
    assert queue.standing(0.2, now=10.5)
    assert queue.standing(0.15, now=11.0)
    assert not queue.standing(0.05, now=11.1)  # one short wait: the queue emptied
    assert not queue.standing(0.2, now=11.2)  # and the interval starts again
    assert queue.standing(0.2, now=11.7)


def test_asking_whether_a_queue_stands_counts_nothing() -> None:
    queue = StandingQueue(target_s=0.1, interval_s=0.5)
    assert not queue.stands(0.2, now=10.0)
    assert not queue.stands(0.2, now=11.0)  # nothing was counted: no interval began
    assert not queue.standing(0.2, now=11.0)
    assert queue.stands(0.2, now=11.5) and not queue.stands(0.05, now=11.5)
    assert queue.stands(0.2, now=11.6)  # the short wait asked about did not end the spell
    assert queue.standing(0.2, now=11.6)


def test_a_returning_client_is_let_in_with_a_smaller_margin() -> None:
    rule = AdmissionRule(budget_s=2.0)
    # 1.2 s of work ahead: past half the budget, within two thirds of it.
    assert behind(rule, 0.0, 1.2) is not None
    assert behind(rule, 0.0, 1.2, returning=True) is None
    # Past two thirds of the budget, a returning client is refused too.
    refusal = behind(rule, 0.0, 1.4, returning=True)
    assert refusal is not None and refusal.retry_after_s == 2


def test_a_held_request_is_let_in_early_on_a_fresh_requests_terms() -> None:
    rule = AdmissionRule(budget_s=2.0)
    assert rule.admits_fresh(
        0.5, 0.75, DEADLINE, behind=True
    )  # 0.5 s waited, 2 x 0.75 s ahead: the whole budget, just in
    assert not rule.admits_fresh(0.5, 0.76, DEADLINE, behind=True)
    # What it lets in, the door admits, with room for a few that get there first.
    assert behind(rule, 0.5, 0.75, returning=True) is None
    assert behind(rule, 0.5, 0.95, returning=True) is None
    assert behind(rule, 0.5, 1.05, returning=True) is not None


def test_while_the_service_keeps_up_a_request_may_take_until_its_deadline() -> None:
    rule = AdmissionRule(budget_s=2.0)
    # 15 s of work ahead: far past the budget, within the deadline with DEADLINE_MARGIN to spare.
    assert rule.decide(0.5, 15.0, deadline_s=DEADLINE, behind=False) is None
    # The same request, once arrivals outrun the answers, is refused on the budget.
    refused = rule.decide(0.5, 15.0, deadline_s=DEADLINE, behind=True)
    assert refused is not None and "latency budget" in refused.message
    # Keeping up or not, a request whose deadline the work ahead would pass is refused, and told so.
    late = rule.decide(0.5, 25.0, deadline_s=DEADLINE, behind=False)
    assert late is not None and "past the request's 30000 ms deadline" in late.message
    assert late.retry_after_s == 25
    # A client's own, shorter deadline (X-Request-Timeout-Ms) is the limit.
    assert rule.decide(0.0, 1.0, deadline_s=1.1, behind=False) is not None


def test_while_the_service_keeps_up_a_standing_wait_before_the_handler_is_no_overload() -> None:
    # Closed-loop clients outnumbering the request threads wait for one, a standing
    # queue that never grows: only a service that is behind sheds on it.
    rule = AdmissionRule(budget_s=2.0)
    assert rule.decide(3.0, 0.1, deadline_s=DEADLINE, behind=False, standing=True) is None
    assert rule.decide(0.3, 0.1, deadline_s=DEADLINE, behind=True, standing=True) is not None
    # Past the deadline itself, no wait is admitted.
    assert rule.decide(DEADLINE, 0.0, deadline_s=DEADLINE, behind=False) is not None


def test_a_held_request_is_let_in_on_its_deadline_while_the_service_keeps_up() -> None:
    rule = AdmissionRule(budget_s=2.0)
    assert rule.admits_fresh(0.5, 10.0, DEADLINE, behind=False)
    assert not rule.admits_fresh(0.5, 10.0, DEADLINE, behind=True)
    assert rule.limit_s(DEADLINE, behind=False) == DEADLINE
    assert rule.limit_s(DEADLINE, behind=True) == 2.0
    assert rule.limit_s(1.0, behind=True) == 1.0  # a deadline shorter than the budget still rules


def test_the_meter_weighs_requests_by_their_items() -> None:
    meter = ServiceMeter(window=10_000, min_served=1)
    meter.submitted(64)
    meter.submitted(1)
    assert meter.outstanding == 65
    # A batch of 64 texts answered in 0.64 s: 10 ms an item, not 640 ms a request.
    meter.completed(now=0.64, arrived=0.0, served=True, items=64)
    assert meter.outstanding == 1
    assert meter.seconds_per_item == pytest.approx(0.01)


# The pace: 10 ms an item, so a window (0.5 s) answers 50 items, and PACE_TOLERANCE of it is 15.
ITEM_S = 0.01
BATCH = 64


def closed_loop(pace: Pace, start: float, seconds: float, clients: int, texts: int) -> float:
    """Clients that each send their next request the moment the last is answered: the time after."""
    t = start
    per_request = texts * ITEM_S
    while t < start + seconds:
        t += per_request
        pace.answered(texts, t)
        pace.offered(texts, t + 0.002)
        assert not pace.behind(t + 0.002, ITEM_S), f"behind at {t:.2f} s with {clients} closed-loop clients"
    return t


def test_a_closed_loop_keeps_up_however_long_its_standing_queue() -> None:
    pace = Pace()
    pace.offered(64 * 32, 0.0)  # 64 clients start at once: 20 s of work queued
    closed_loop(pace, 0.0, 30.0, clients=64, texts=32)


def test_clients_joining_a_closed_loop_are_a_step_not_a_rate() -> None:
    pace = Pace()
    pace.offered(4 * 32, 0.0)
    t = closed_loop(pace, 0.0, 5.0, clients=4, texts=32)
    pace.offered(60 * 32, t + 0.24)  # 60 more clients, straddling a window's end
    pace.offered(0, t + 0.26)
    closed_loop(pace, t + 0.26, 10.0, clients=64, texts=32)


def test_a_step_spread_over_two_windows_then_jitter_is_no_rate_and_even_rises_are() -> None:
    # Clients that all connected at once show their wait for a thread all at once,
    # when their next requests are read: a step across two windows, then jitter
    # just past the tolerance (15 items here). The rises fade; a rate's do not.
    step = Pace()
    step.offered(100, 0.0)
    step.offered(230, 0.75)  # mid-window: half the step in this window, half in the next
    step.offered(20, 1.5)  # then a rise of 20, past the tolerance, not a quarter of 115
    assert not step.behind(2.01, ITEM_S)
    rate = Pace()
    rate.offered(100, 0.0)
    for at in (0.5, 1.0, 1.5):
        rate.offered(20, at)  # the same 20 in every window
    assert rate.behind(2.01, ITEM_S)


def test_requests_waiting_for_a_thread_count_as_a_queue_a_step_when_clients_connect_at_once() -> None:
    # gthread counts the requests waiting for a thread when one gets its own: 56
    # clients beyond the threads fill that queue at once and keep it full, a step.
    pace = Pace()
    pace.request_items = 4.0  # the mean request, as its first requests taught it
    t = 0.0
    pace.offered(4, t, waiting=56)
    assert pace._level == pytest.approx(4 + 56 * 4.0)
    while t < 5.0:
        t += 4 * ITEM_S
        pace.answered(4, t)
        # The wait of the requests that follow grows over a pass of the queue (read
        # alone, 100 items a second: a rate); the count says the queue stands.
        pace.offered(4, t + 0.001, waited_s=min(t, 3.0), seconds_per_item=ITEM_S, waiting=56)
        assert not pace.behind(t + 0.001, ITEM_S)
    # A queue for the threads that grows every window is a rate.
    waiting = 56
    while t < 8.0:
        t += 4 * ITEM_S
        waiting += 1
        pace.answered(4, t)
        pace.offered(4, t + 0.001, waiting=waiting)
    assert pace.behind(t + 0.001, ITEM_S)


def test_arrivals_that_outrun_the_answers_put_the_service_behind_and_it_recovers() -> None:
    pace = Pace()
    t, verdicts = 0.0, []
    # Open loop at twice capacity: 2 items every 10 ms, 1 answered.
    while t < 3.0:
        t += ITEM_S
        pace.offered(2, t)
        pace.answered(1, t)
        verdicts.append((t, pace.behind(t, ITEM_S)))
    first = next(at for at, late in verdicts if late)
    assert 1.0 <= first <= 2.5  # within a few windows of the overload's start, not at once
    assert all(late for at, late in verdicts if at > first)
    # The overload ends: arrivals match the answers again, and once the windows it
    # looks back on (four of 0.5 s) are past the growth, it is not behind.
    while t < 5.1:
        t += ITEM_S
        pace.offered(1, t)
        pace.answered(1, t)
    assert not pace.behind(t, ITEM_S)


def test_refused_demand_keeps_an_overloaded_service_behind() -> None:
    # Once it sheds, the queue stops growing, but the refused requests count as demand unmet.
    pace = Pace()
    t = 0.0
    while t < 4.0:
        t += ITEM_S
        pace.offered(5, t)  # 5x capacity, four of every five refused
        pace.answered(1, t)
    assert pace.behind(t, ITEM_S)


def test_an_unmeasured_or_idle_service_is_not_behind() -> None:
    pace = Pace()
    pace.offered(10_000, 0.0)
    assert not pace.behind(5.0, None)  # no rate yet: nothing to compare with
    assert not pace.behind(100.0, ITEM_S)  # idle since: the backlog did not grow


def test_a_request_too_large_for_its_deadline_alone_says_how_many_items_fit() -> None:
    # 0.015 s an item: 2,048 items take about 31 s alone, past a 30 s deadline.
    why = alone_past_deadline(2048, 0.015, 30.0)
    assert why is not None
    assert "2048 items would take about 30.7 s" in why
    assert "67 items a second" in why
    assert "30 s deadline" in why
    assert "at most about 1666 items" in why  # 30 / (1.2 * 0.015)
    # What fits with the deadline margin to spare is no refusal, nor is anything while the rate is unknown.
    assert alone_past_deadline(1666, 0.015, 30.0) is None
    assert alone_past_deadline(1667, 0.015, 30.0) is not None
    assert alone_past_deadline(100_000, None, 30.0) is None


def test_the_quick_view_of_the_rate_is_known_after_one_batch_while_the_long_one_waits() -> None:
    meter = ServiceMeter(min_served=32)
    assert meter.recent_seconds_per_item is None
    meter.batch_ran(0.4, items=8)
    assert meter.recent_seconds_per_item == pytest.approx(0.05)
    assert meter.seconds_per_item is None  # too few served to admit on


@pytest.mark.parametrize("seed", range(5))
def test_the_pace_s_verdict_is_the_same_worked_out_once_or_at_every_ask(seed: int) -> None:
    # Load that rises, holds and falls, asked about as the door, admission and each batch do.
    rng = random.Random(seed)
    kept, fresh = Pace(), Pace()
    now, verdicts = 0.0, []
    for step in range(4000):
        now += rng.expovariate(400 if step % 1500 < 900 else 150)
        spi = 0.004 if step < 2000 else 0.003
        waited, answered = rng.random() * 0.01, rng.random() < 0.6
        for pace in (kept, fresh):
            pace.offered(1, now, waited, spi)
            if answered:
                pace.answered(1, now, spi)
        fresh._verdict_for = None  # as if never asked before
        verdicts.append((kept.behind(now, spi), fresh.behind(now, spi)))
        verdicts.append((kept.behind(now, spi), kept.behind(now + 1e-6, spi)))
    assert all(a == b for a, b in verdicts)
    assert any(a for a, _ in verdicts)  # it did fall behind

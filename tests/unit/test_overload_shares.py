"""The workers' shared verdict: behind when any worker's pace is, a dead worker's verdict going stale."""

from __future__ import annotations

from service.host.overload import FRESH_S, OverloadShares


def test_a_worker_is_behind_when_another_worker_said_so_lately() -> None:
    shares = OverloadShares(4)
    shares.publish(1, True, now=10.0)
    assert shares.others_behind(0, now=10.5)
    assert not shares.others_behind(1, now=10.5)  # its own entry is not another's
    assert not shares.others_behind(0, now=10.0 + FRESH_S + 0.1)  # stale: a worker that stopped


def test_a_worker_that_keeps_up_again_clears_its_entry_at_once() -> None:
    shares = OverloadShares(2)
    shares.publish(1, True, now=10.0)
    shares.publish(1, False, now=10.1)
    assert not shares.others_behind(0, now=10.2)


def test_each_worker_publishes_its_own_verdict_and_judges_by_all() -> None:
    now = [100.0]
    shares = OverloadShares(2)
    first, second = (shares.for_slot(slot, clock=lambda: now[0]) for slot in (0, 1))
    assert not first(False)
    assert second(True)
    assert first(False)  # the overload is the service's
    # Each published its own verdict only: once the second keeps up, neither is behind.
    assert not second(False)
    assert not first(False)


def test_a_slot_past_the_capacity_publishes_nothing_and_still_sees_the_others() -> None:
    shares = OverloadShares(2)
    extra = shares.for_slot(5, clock=lambda: 1.0)
    assert extra(True)
    assert not shares.others_behind(0, now=1.0)
    shares.publish(0, True, now=1.0)
    assert shares.for_slot(5, clock=lambda: 1.5)(False)

"""Connection balance between workers: the rule, the shared table, and one worker's part."""

from __future__ import annotations

import multiprocessing
import os
import select

import pytest

from service.host.balance import Balance, ConnectionShares, may_accept


@pytest.mark.parametrize(
    ("mine", "others", "slack", "accept"),
    [
        (0, [], 0, True),  # alone
        (3, [3], 0, True),  # level: either may take the next
        (4, [3], 0, False),  # ahead: leave it to the other
        (4, [3, 9], 0, False),  # the least-loaded counts, not the mean
        (4, [3], 1, True),
        (2, [5, 7], 0, True),  # the least-loaded always accepts
    ],
)
def test_a_worker_accepts_unless_it_is_ahead_of_the_least_loaded(
    mine: int, others: list[int], slack: int, accept: bool
) -> None:
    assert may_accept(mine, others, slack) is accept


def test_only_other_workers_seen_recently_count() -> None:
    shares = ConnectionShares(4)
    shares.publish(0, 5, now=100.0, pid=10)
    shares.publish(1, 2, now=99.0, pid=11)
    shares.publish(2, 7, now=90.0, pid=12)  # not refreshed for 10 s: dead or wedged
    assert shares.live(0, now=100.0) == [1]
    assert shares.live(1, now=100.0) == [0]
    assert [shares.count(slot) for slot in shares.live(3, now=100.0)] == [5, 2]


def test_a_slot_is_forgotten_only_for_the_worker_that_holds_it() -> None:
    shares = ConnectionShares(2)
    shares.publish(0, 5, now=100.0, pid=10)
    shares.forget(0, pid=99)  # an old worker of the same slot, exiting after a reload
    assert shares.live(1, now=100.0) == [0]
    shares.forget(0, pid=10)
    assert shares.live(1, now=100.0) == []
    shares.forget(7, pid=10)  # past the table: nothing to do


def test_forked_workers_see_each_others_counts() -> None:
    shares = ConnectionShares(2)
    child = multiprocessing.get_context("fork").Process(target=shares.publish, args=(1, 6, 50.0, 77))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert shares.live(0, now=50.0) == [1] and shares.count(1) == 6


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_a_refusing_worker_is_woken_when_another_accepts() -> None:
    clock = [100.0]
    shares = ConnectionShares(3)
    ahead, behind, level = (Balance(shares, slot, clock=lambda: clock[0]) for slot in range(3))
    assert level.may_accept(2)
    assert behind.may_accept(2)
    assert not ahead.may_accept(4)  # two connections ahead: it stops accepting
    assert not readable(ahead.wakeup_fd)

    behind.accepted(3)
    # Only the worker that refused is woken, so its event loop turns and looks again.
    assert readable(ahead.wakeup_fd) and not readable(level.wakeup_fd)
    ahead.woken()
    assert not readable(ahead.wakeup_fd)
    assert not ahead.may_accept(4)  # still ahead of 3 and 2
    level.accepted(3)
    behind.accepted(4)
    level.accepted(4)
    assert ahead.may_accept(4)  # level with the others now

    # Accepting again wakes nobody: no worker is refusing.
    ahead.woken()
    behind.accepted(5)
    assert not any(readable(b.wakeup_fd) for b in (ahead, level))


def test_the_wakeup_fds_close_with_the_table() -> None:
    shares = ConnectionShares(2)
    fds = list(shares.wakeup_fds)
    del shares
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_one_ask_after_an_accept_publishes_decides_and_wakes_the_refusing() -> None:
    # gevent's worker asks once per accept (service.host.gevent_accept): accepted(), then may_accept().
    clock = [100.0]
    shares = ConnectionShares(2)
    ahead, behind = (Balance(shares, slot, clock=lambda: clock[0]) for slot in range(2))
    assert behind.may_accept(1)
    assert not ahead.may_accept(3)  # refusing, and marked so
    assert behind.may_accept(2, accepted=True)
    assert shares.count(1) == 2  # published
    assert readable(ahead.wakeup_fd)  # woken to look again
    ahead.woken()
    assert behind.may_accept(2)  # without an accept, nobody is woken
    assert not readable(ahead.wakeup_fd)

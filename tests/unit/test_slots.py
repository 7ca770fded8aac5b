from __future__ import annotations

from service.host.slots import SlotTable


def test_workers_take_the_lowest_free_slot_and_a_replacement_takes_its_predecessors() -> None:
    table = SlotTable()
    assert [table.assign(age, live=range(1, age)) for age in (1, 2, 3)] == [0, 1, 2]
    assert table.release(2) == 1
    assert table.assign(4, live=[1, 3]) == 1
    assert table.holders() == {0: 1, 1: 4, 2: 3}


def test_releasing_an_unknown_worker_changes_nothing() -> None:
    table = SlotTable()
    table.assign(1)
    assert table.release(99) is None
    assert table.holders() == {0: 1}


def test_a_worker_that_vanished_without_a_release_loses_its_slot() -> None:
    table = SlotTable()
    table.assign(1)
    table.assign(2, live=[1])
    # worker 1 is gone but child_exit never ran for it
    assert table.assign(3, live=[2]) == 0
    assert table.holders() == {0: 3, 1: 2}

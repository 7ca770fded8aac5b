"""The open-file limit raised for a worker's connections (service.host.open_files)."""

from __future__ import annotations

import resource

from service.host.open_files import SPARE, needed, target

INFINITY = resource.RLIM_INFINITY


def test_a_worker_needs_a_descriptor_a_connection_and_some_to_spare() -> None:
    assert needed(4328) == 4328 + SPARE


def test_the_soft_limit_is_raised_to_what_is_needed_as_far_as_the_hard_limit_allows() -> None:
    assert target(1024, 1 << 20, 4584) == 4584
    assert target(1024, INFINITY, 4584) == 4584
    # Only root may raise the hard limit: the soft one stops there.
    assert target(1024, 2048, 4584) == 2048


def test_a_limit_already_high_enough_or_at_the_hard_limit_is_left_alone() -> None:
    assert target(1 << 20, 1 << 20, 4584) is None
    assert target(INFINITY, INFINITY, 4584) is None
    assert target(4584, 8192, 4584) is None
    assert target(2048, 2048, 4584) is None  # never lowered, nothing to raise

"""Sub-batch cuts and the cost model (service.batching.subbatch): pure functions, no model."""

from __future__ import annotations

import itertools
import random

import pytest

from service.batching.subbatch import Cost, CostModel, cut, oldest_first
from service.models.shapes import steps_for


def padded(sizes: list[int], ranges: list[tuple[int, int]]) -> int:
    return sum((end - start) * sizes[end - 1] for start, end in ranges)


def test_one_long_item_is_cut_off_from_the_short_ones() -> None:
    sizes = [2, 2, 2, 2, 100]
    # One call: 10 + 5 x 100 = 510; short ones apart: (10 + 8) + (10 + 100) = 128.
    assert cut(sizes, Cost(10, 1), max_tokens=10_000, max_rows=64) == [(0, 4), (4, 5)]


def test_equal_sizes_run_as_one_call_when_calls_cost_something() -> None:
    assert cut([12] * 64, Cost(0.002, 1e-5), max_tokens=10_000, max_rows=64) == [(0, 64)]


def test_ties_go_to_fewer_longer_sub_batches() -> None:
    # No overhead: one call or three cost the same padded tokens.
    assert cut([5, 5, 5], Cost(0, 1), max_tokens=100, max_rows=64) == [(0, 3)]


def test_every_sub_batch_keeps_within_the_token_budget_and_the_row_limit() -> None:
    sizes = sorted([3, 7, 7, 9, 12, 15, 15, 30, 31, 60, 61, 64] * 4)
    ranges = cut(sizes, Cost(1.0, 0.001), max_tokens=200, max_rows=5)
    assert [r for r in ranges if r[1] - r[0] > 5] == []
    assert all((end - start) * sizes[end - 1] <= 200 for start, end in ranges)
    # Consecutive and complete: every item in exactly one sub-batch, in order.
    assert ranges[0][0] == 0 and ranges[-1][1] == len(sizes)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_an_item_over_the_budget_runs_alone() -> None:
    assert cut([4, 4, 500], Cost(1, 0.01), max_tokens=100, max_rows=64) == [(0, 2), (2, 3)]


def test_the_cut_is_no_worse_than_any_fixed_chunk_size() -> None:
    sizes = sorted([8, 9, 11, 14, 17, 19, 22, 25, 28, 33, 41, 52, 67, 88, 120, 160] * 4)
    cost = Cost(0.003, 2e-5)
    best = cut(sizes, cost, max_tokens=1 << 20, max_rows=64)

    def total(ranges: list[tuple[int, int]]) -> float:
        return sum(cost.of(end - start, sizes[end - 1]) for start, end in ranges)

    for chunk in (1, 2, 4, 8, 16, 64):
        fixed = [(i, min(i + chunk, len(sizes))) for i in range(0, len(sizes), chunk)]
        assert total(best) <= total(fixed) + 1e-12
    assert padded(sizes, best) < padded(sizes, [(0, len(sizes))])


@pytest.mark.parametrize("seed", range(20))
def test_the_cut_is_the_cheapest_of_every_split_on_padded_shapes(seed: int) -> None:
    # Against an exhaustive search: each of the n - 1 gaps between items is a cut or not.
    rng = random.Random(seed)
    sizes = sorted(rng.randint(1, 140) for _ in range(rng.randint(1, 11)))
    steps = steps_for(8, 128)
    cost = Cost(rng.uniform(0, 0.01), rng.uniform(1e-6, 1e-4), shape=steps.shape)
    max_tokens, max_rows = rng.choice([(600, 8), (1 << 20, 8), (1 << 20, 3)])

    def allowed(start: int, end: int) -> bool:
        return end - start <= max_rows and (
            end - start == 1 or cost.tokens(end - start, sizes[end - 1]) <= max_tokens
        )

    def total(ranges: list[tuple[int, int]]) -> float:
        return sum(cost.of(end - start, sizes[end - 1]) for start, end in ranges)

    n = len(sizes)
    splits = []
    for gaps in itertools.product((False, True), repeat=n - 1):
        edges = [0] + [i + 1 for i, gap in enumerate(gaps) if gap] + [n]
        ranges = list(itertools.pairwise(edges))
        if all(allowed(*r) for r in ranges):
            splits.append(ranges)
    found = cut(sizes, cost, max_tokens=max_tokens, max_rows=max_rows)
    assert found in splits
    assert total(found) == pytest.approx(min(total(r) for r in splits), rel=1e-12)


def test_unsorted_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="sorted"):
        cut([3, 1], Cost(0, 1), max_tokens=10, max_rows=4)


def test_the_cost_model_recovers_a_line() -> None:
    model = CostModel()
    assert model.estimate() is None
    for tokens in (10, 40, 160, 640, 2560):
        model.observe(tokens, 0.002 + 1e-5 * tokens)
    estimate = model.estimate()
    assert estimate is not None
    assert estimate.overhead_s == pytest.approx(0.002, rel=1e-6)
    assert estimate.per_token_s == pytest.approx(1e-5, rel=1e-6)


def test_the_cost_model_follows_a_machine_that_slows_down() -> None:
    model = CostModel(decay=0.9)
    for _ in range(5):
        for tokens in (10, 100, 1000):
            model.observe(tokens, 0.001 + 1e-5 * tokens)
    for _ in range(30):
        for tokens in (10, 100, 1000):
            model.observe(tokens, 0.001 + 4e-5 * tokens)
    estimate = model.estimate()
    assert estimate is not None
    assert estimate.per_token_s == pytest.approx(4e-5, rel=0.05)


def test_one_size_only_gives_a_cost_per_token_and_no_overhead() -> None:
    model = CostModel()
    model.observe(100, 0.01)
    model.observe(100, 0.03)
    # The mean time per token, the older call weighing a little less.
    assert model.estimate() == Cost(0.0, pytest.approx(2e-4, rel=0.02))


def test_a_falling_line_keeps_a_positive_cost_per_token() -> None:
    model = CostModel()
    model.observe(10, 0.5)  # a preempted call
    model.observe(1000, 0.01)
    estimate = model.estimate()
    assert estimate is not None and estimate.per_token_s > 0 and estimate.overhead_s == 0


def test_the_floor_follows_every_observation_and_the_models_padding() -> None:
    model = CostModel(decay=1.0)
    model.observe(1, 0.2)
    first = model.floor()
    assert first is not None and first.of(1, 1) == pytest.approx(0.2)
    assert model.floor() == first  # nothing new: the same
    model.observe(1, 0.4)
    after = model.floor()
    assert after is not None and after.of(1, 1) == pytest.approx(0.3)
    model.shape = lambda rows, longest: (rows, 8 * longest)  # a model that pads (service.models.shapes)
    padded = model.floor()
    assert padded is not None and padded.shape is model.shape


def test_the_floor_is_the_estimate_never_drawn_past_the_largest_call_seen() -> None:
    model = CostModel(decay=1.0)
    assert model.floor() is None
    model.observe(1, 0.2)
    model.observe(1, 0.4)
    floor = model.floor()
    assert floor is not None
    # A refusal must not guess that eight items take eight times one item's time.
    assert floor.of(8, 1) == pytest.approx(0.3)
    assert model.estimate() == Cost(0.0, pytest.approx(0.3))
    # Two nearly flat sizes: the line (0.18 s + 0.02 s an item) stops at the larger.
    flat = CostModel(decay=1.0)
    flat.observe(1, 0.20)
    flat.observe(2, 0.22)
    floor = flat.floor()
    assert floor is not None and floor.of(1, 1) == pytest.approx(0.20)
    assert floor.of(32, 1) == pytest.approx(0.22)
    # Smaller calls than those seen cost less, not the mean of the large ones.
    large = CostModel(decay=1.0)
    large.observe(16, 0.32)
    floor = large.floor()
    assert floor is not None and floor.of(1, 1) == pytest.approx(0.02)


def test_sub_batches_that_waited_alike_run_shortest_first() -> None:
    ranges = [(0, 2), (2, 3), (3, 5)]
    # Within a few milliseconds of each other: a burst, or one gathering's requests.
    arrived = [10.003, 10.0, 10.001, 10.004, 10.002]
    assert oldest_first(ranges, arrived) == ranges


def test_the_sub_batch_whose_rows_waited_longest_on_average_runs_first() -> None:
    ranges = [(0, 2), (2, 3), (3, 5)]
    # (0, 2) holds the oldest row, but on average (3, 5) waited longest.
    arrived = [9.90, 10.10, 10.05, 9.95, 9.96]
    assert oldest_first(ranges, arrived) == [(3, 5), (0, 2), (2, 3)]
    assert oldest_first([(0, 5)], arrived) == [(0, 5)]

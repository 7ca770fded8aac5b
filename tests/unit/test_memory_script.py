"""scripts/bench/memory.py's verdict on its RSS samples: the two figures that say whether memory is flat."""

from __future__ import annotations

from scripts.bench.memory import verdict


def rows(*columns: list[int], every: int = 10) -> list[dict[str, object]]:
    return [{"t": every * (i + 1), "rss_mib": list(rss)} for i, rss in enumerate(zip(*columns, strict=True))]


def test_a_flat_worker_and_a_growing_one_are_told_apart() -> None:
    flat = [500, 540, 560, 570, 575, 575, 576, 575, 576, 577, 576, 576]
    growing = [500, 540, 580, 620, 660, 700, 740, 780, 820, 860, 900, 940]
    found = verdict(rows(flat, growing), pids=[11, 12], seconds=120)
    # Over the last half (60 s to 120 s), and the end against the one-minute mark.
    assert found["last_half_growth_pct"] == [0.2, 34.3]
    assert found["end_over_one_minute"] == [1.002, 1.343]
    assert found["pids"] == [11, 12]

"""scripts/bench/memory.py's verdict on its samples: the figures that say whether memory is flat."""

from __future__ import annotations

from scripts.bench.memory import verdict


def rows(
    *rss: list[int], pss: list[list[int]] | None = None, master: list[int] | None = None, every: int = 10
) -> list[dict[str, object]]:
    """Samples every ``every`` s; PSS follows RSS unless given; the master holds 200 MiB unless given."""
    per_worker = list(zip(*rss, strict=True))
    pss_rows = list(zip(*pss, strict=True)) if pss is not None else per_worker
    master_rows = master if master is not None else [200] * len(per_worker)
    return [
        {
            "t": every * (i + 1),
            "rss_mib": list(r),
            "pss_mib": list(p),
            "private_mib": [value // 2 for value in p],
            "master_pss_mib": m,
            "service_pss_mib": sum(p) + m,
        }
        for i, (r, p, m) in enumerate(zip(per_worker, pss_rows, master_rows, strict=True))
    ]


FLAT = [500, 540, 560, 570, 575, 575, 576, 575, 576, 577, 576, 576]
GROWING = [500, 540, 580, 620, 660, 700, 740, 780, 820, 860, 900, 940]


def test_a_flat_worker_and_a_growing_one_are_told_apart() -> None:
    found = verdict(rows(FLAT, GROWING), pids=[11, 12], seconds=120)
    # Over the last half (60 s to 120 s), and the end against the one-minute mark.
    assert found["last_half_growth_pct"] == [0.2, 34.3]
    assert found["end_over_one_minute"] == [1.002, 1.343]
    assert found["pss_last_half_growth_pct"] == [0.2, 34.3]
    assert found["pids"] == [11, 12]
    # The service: 575 + 700 + 200 at 60 s, 576 + 940 + 200 at the end.
    assert found["service_pss_last_half_growth_pct"] == 16.3
    assert found["service_pss_end_over_one_minute"] == 1.163
    assert found["flat"] is False


def test_flat_workers_and_a_flat_service_are_flat() -> None:
    found = verdict(rows(FLAT, FLAT), pids=[11, 12], seconds=120)
    assert found["last_half_growth_pct"] == [0.2, 0.2]
    assert found["service_pss_last_half_growth_pct"] == 0.1
    assert found["flat"] is True


def test_the_service_pss_is_judged_apart_from_each_worker_rss() -> None:
    """Each worker's RSS is flat, but the pages they share are copied one by one: the service grows."""
    shared_copied = [300 + 8 * i for i in range(12)]
    found = verdict(
        rows(FLAT, FLAT, pss=[shared_copied, shared_copied], master=[200] * 12), pids=[11, 12], seconds=120
    )
    assert found["last_half_growth_pct"] == [0.2, 0.2]
    # 2 x 340 + 200 at 60 s, 2 x 388 + 200 at the end.
    assert found["service_pss_last_half_growth_pct"] == 10.9
    assert found["flat"] is False

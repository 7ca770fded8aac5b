# design:
# - Measures what the model itself can do, with no HTTP: each of `workers`
#   processes (spawned, never forked: torch's OpenMP pool does not survive a
#   fork) loads the model with `torch_threads` intra-op threads, waits at a
#   barrier so that all start together, runs `predict` on full batches back to
#   back for a fixed time, and reports how many items it finished.
# - Results travel back through a multiprocessing queue; the parent only sums
#   them. Used by scripts/bench.py (the offline limit) and scripts/tune.py (the
#   batch-latency curve behind the recommended settings).

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from service.settings import Settings


@dataclass(frozen=True)
class Split:
    workers: int
    torch_threads: int

    def __str__(self) -> str:
        return f"{self.workers}x{self.torch_threads}"


@dataclass(frozen=True)
class Measurement:
    split: Split
    batch_size: int
    items_per_s: float
    batch_ms_median: float


def splits_for(cores: int) -> list[Split]:
    """Every workers x torch-threads split that uses all the cores without oversubscribing them."""
    return [Split(w, cores // w) for w in range(1, cores + 1) if cores % w == 0]


def measure(
    settings: Settings, split: Split, batch_sizes: list[int], item: Any, *, seconds: float, warmup: int = 3
) -> list[Measurement]:
    """Items/s of ``split.workers`` processes running full batches of ``item`` at once, per batch size."""
    context = mp.get_context("spawn")
    barrier = context.Barrier(split.workers)
    results: mp.Queue[list[tuple[float, list[float]]]] = context.Queue()
    processes = [
        context.Process(
            target=_run,
            args=(settings, split.torch_threads, batch_sizes, item, seconds, warmup, barrier, results),
        )
        for _ in range(split.workers)
    ]
    for process in processes:
        process.start()
    reports = [results.get(timeout=len(batch_sizes) * (seconds + 60) + 600) for _ in processes]
    for process in processes:
        process.join(60)
    measurements = []
    for index, batch_size in enumerate(batch_sizes):
        per_process = [report[index] for report in reports]
        durations = [d for _, batch_times in per_process for d in batch_times]
        measurements.append(
            Measurement(
                split=split,
                batch_size=batch_size,
                items_per_s=sum(rate for rate, _ in per_process),
                batch_ms_median=statistics.median(durations) * 1000 if durations else float("nan"),
            )
        )
    return measurements


def _run(  # noqa: PLR0917  (a process target takes positional arguments)
    settings: Settings,
    torch_threads: int,
    batch_sizes: list[int],
    item: Any,
    seconds: float,
    warmup: int,
    barrier: Any,
    results: Any,
) -> None:
    from service.models import load_model
    from service.runtime import configure_torch, select_device
    from service.topology import LIBRARY_ENV

    # As gunicorn_conf.py sets up a worker, so that the figures are a worker's.
    os.environ.update(LIBRARY_ENV)
    configure_torch(torch_threads)
    model = load_model(settings, select_device())
    prepared = model.prepare(item)
    report = []
    for batch_size in batch_sizes:
        batch = [prepared] * batch_size
        for _ in range(warmup):
            model.predict(batch)
        barrier.wait()  # every process starts each size together, so all cores are busy
        batch_times: list[float] = []
        begin = time.monotonic()
        end = begin + seconds
        while (started := time.monotonic()) < end:
            model.predict(batch)
            batch_times.append(time.monotonic() - started)
        # Whole batches over the time they took: a batch that overran the window counts in full.
        report.append((batch_size * len(batch_times) / (time.monotonic() - begin), batch_times))
    results.put(report)

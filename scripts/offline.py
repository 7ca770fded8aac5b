# design:
# - Measures what the model itself can do, with no HTTP: each of `workers`
#   processes (spawned, never forked: torch's OpenMP pool does not survive a
#   fork) loads the model with `torch_threads` intra-op threads, takes the
#   model's own sample item (service.models.base.sample_item), waits at a
#   barrier so that all start together, runs `predict` on full batches back to
#   back for a fixed time, and reports how many items it finished.
# - Each process sends one message back on its own pipe: its report, or the
#   error that stopped it. The parent blocks on the pipes and only sums the
#   reports. A pipe whose process died without a word reads as end-of-file, so
#   the parent never waits on a process that is gone.
# - Failure: a process that fails aborts the barrier, so the others stop
#   waiting for it, and sends its traceback; every barrier wait also has a
#   timeout, for a peer that hangs. The parent raises OfflineError on the first
#   failure and, whatever happens, terminates every process it started.
# - Used by scripts/bench.py (the offline limit) and scripts/tune.py (the
#   batch-latency curve behind the recommended settings).

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, cast

from service.settings import Settings

# A process that has not reached the barrier this long after its peers has hung
# (loading even the largest built-in model takes well under a minute).
BARRIER_TIMEOUT_S = 300.0
# How long a process gets to exit after SIGTERM before it is killed.
STOP_GRACE_S = 10.0


class OfflineError(RuntimeError):
    """A measuring process failed; the message holds its error."""


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
    settings: Settings, split: Split, batch_sizes: list[int], *, seconds: float, warmup: int = 3
) -> list[Measurement]:
    """Items/s of ``split.workers`` processes running full batches of the model's sample item at once.

    One measurement per batch size. Raises OfflineError, promptly, if any
    process fails to load the model, has no sample item, or fails to predict.
    """
    context = mp.get_context("spawn")
    barrier = context.Barrier(split.workers)
    pipes: dict[Connection, BaseProcess] = {}
    try:
        for _ in range(split.workers):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_run,
                args=(settings, split.torch_threads, batch_sizes, seconds, warmup, barrier, sender),
                daemon=True,  # never outlives the parent, even one killed before its finally
            )
            process.start()
            # Only the child may hold the sending end, so that its death reads as end-of-file here.
            sender.close()
            pipes[receiver] = process
        budget = BARRIER_TIMEOUT_S + len(batch_sizes) * (seconds + BARRIER_TIMEOUT_S)
        reports = _collect(pipes, settings.model, budget)
    finally:
        _stop(list(pipes.values()))
        for receiver in pipes:
            receiver.close()
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


def _collect(pipes: dict[Connection, BaseProcess], model: str, budget: float) -> list[Any]:
    """Every process's report; OfflineError at the first failure, a death or after ``budget`` s."""
    deadline = time.monotonic() + budget
    pending = dict(pipes)
    reports = []
    while pending:
        ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise OfflineError(
                f"offline measurement of SERVE_MODEL={model!r}: {len(pending)} process(es) sent "
                f"nothing within {budget:.0f} s"
            )
        errors = []
        for receiver in cast(list[Connection], ready):
            process = pending.pop(receiver)
            try:
                kind, payload = receiver.recv()
            except EOFError:
                process.join(STOP_GRACE_S)
                kind, payload = "error", f"the process exited with code {process.exitcode} and no report"
            if kind == "report":
                reports.append(payload)
            else:
                errors.append((kind, payload))
        if errors:
            # A peer's failure is sent before it breaks the barrier, so when a
            # process reports the broken barrier, the cause is among the same
            # messages (or came earlier): name the cause.
            errors.sort(key=lambda error: error[0] == "barrier")
            raise OfflineError(
                f"offline measurement of SERVE_MODEL={model!r} failed in a measuring process:\n{errors[0][1]}"
            )
    return reports


def _stop(processes: list[BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(STOP_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()


def _run(
    settings: Settings,
    torch_threads: int,
    batch_sizes: list[int],
    seconds: float,
    warmup: int,
    barrier: Any,
    sender: Connection,
) -> None:
    try:
        report = _measure_here(settings, torch_threads, batch_sizes, seconds, warmup, barrier)
    except threading.BrokenBarrierError:
        sender.send(
            (
                "barrier",
                f"another process failed, or did not reach the barrier within {BARRIER_TIMEOUT_S:.0f} s",
            )
        )
    except BaseException:
        # The error first, then the barrier: peers that see it broken report after this.
        sender.send(("error", traceback.format_exc()))
        barrier.abort()
    else:
        sender.send(("report", report))
    finally:
        sender.close()


def _measure_here(
    settings: Settings, torch_threads: int, batch_sizes: list[int], seconds: float, warmup: int, barrier: Any
) -> list[tuple[float, list[float]]]:
    from service.models import describe, load_model
    from service.models.base import sample_item
    from service.runtime import configure_torch, select_device
    from service.topology.plan import LIBRARY_ENV

    # As gunicorn_conf.py sets up a worker, so that the figures are a worker's.
    os.environ.update(LIBRARY_ENV)
    configure_torch(torch_threads)
    model = load_model(settings, select_device())
    prepared = model.prepare(sample_item(describe(model)))
    report = []
    for batch_size in batch_sizes:
        batch = [prepared] * batch_size
        for _ in range(warmup):
            model.predict(batch)
        # Every process starts each size together, so all cores are busy.
        barrier.wait(BARRIER_TIMEOUT_S)
        batch_times: list[float] = []
        begin = time.monotonic()
        end = begin + seconds
        while (started := time.monotonic()) < end:
            model.predict(batch)
            batch_times.append(time.monotonic() - started)
        # Whole batches over the time they took: a batch that overran the window counts in full.
        report.append((batch_size * len(batch_times) / (time.monotonic() - begin), batch_times))
    return report

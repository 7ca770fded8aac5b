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
# - With a corpus (texts, or [query, document] pairs for a rerank model: any
#   items the model's `prepare` takes), each process instead runs the corpus in
#   windows of `window` consecutive items, as a server gathers them, under one
#   Strategy each: padded as they come, sorted by size and run in chunks of a
#   fixed size, or sorted and cut by the batcher's own cost model
#   (service.batching.subbatch), so the offline limit on real text is measured
#   the ways a batcher could run it.
# - One more corpus strategy is not offline: the batcher without HTTP
#   (Strategy.clients). The worker's own Batcher (service.runtime.new_batcher)
#   runs on the model while that many threads each prepare a corpus item and
#   wait for its answer, as request threads do. Between it and the offline
#   limit lies what batching costs (hand-offs, the batches clients leave it);
#   between it and the service, what HTTP costs.
# - Used by scripts/bench/bench.py (the offline limit) and scripts/deploy/tune.py (the
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

from service.config.settings import Settings

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
class Strategy:
    """How a window of corpus items runs: padded as gathered, sorted in chunks, or cut by cost."""

    window: int
    chunk: int | None = None  # sorted by size, then chunks of this many; None with cost=False: padded
    cost: bool = False  # sorted and cut by the batcher's cost model under SERVE_MAX_BATCH_TOKENS
    max_tokens: int | None = None  # the cut's token budget; None: SERVE_MAX_BATCH_TOKENS
    clients: int | None = None  # instead: through the worker's batcher, from this many threads

    def __str__(self) -> str:
        if self.clients is not None:
            return f"batcher without HTTP, {self.clients} clients"
        if self.cost and self.max_tokens is not None:
            return f"{self.window} sorted, cut by cost within {self.max_tokens} tokens"
        if self.cost:
            return f"{self.window} sorted, cut by cost"
        if self.chunk is None:
            return f"{self.window} padded"
        return f"{self.window} sorted, chunks of {self.chunk}"


@dataclass(frozen=True)
class Measurement:
    split: Split
    batch_size: int
    items_per_s: float
    batch_ms_median: float
    strategy: str = ""


def splits_for(cores: int) -> list[Split]:
    """Every workers x torch-threads split that uses all the cores without oversubscribing them."""
    return [Split(w, cores // w) for w in range(1, cores + 1) if cores % w == 0]


def measure(
    settings: Settings,
    split: Split,
    batch_sizes: list[int],
    *,
    seconds: float,
    warmup: int = 3,
    corpus: list[Any] | None = None,
    strategies: list[Strategy] | None = None,
) -> list[Measurement]:
    """Items/s of ``split.workers`` processes running full batches of the model's sample item at once.

    One measurement per batch size; with ``corpus`` (items as a client sends
    them: texts, or [query, document] pairs), one per strategy instead
    (``batch_sizes`` is then ignored). Raises OfflineError, promptly, if any
    process fails to load the model, has no sample item, or fails to predict.
    """
    runs: list[Any] = list(strategies or []) if corpus is not None else list(batch_sizes)
    context = mp.get_context("spawn")
    barrier = context.Barrier(split.workers)
    pipes: dict[Connection, BaseProcess] = {}
    try:
        for _ in range(split.workers):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_run,
                args=(settings, split.torch_threads, runs, corpus, seconds, warmup, barrier, sender),
                daemon=True,  # never outlives the parent, even one killed before its finally
            )
            process.start()
            # Only the child may hold the sending end, so that its death reads as end-of-file here.
            sender.close()
            pipes[receiver] = process
        budget = BARRIER_TIMEOUT_S + len(runs) * (seconds + BARRIER_TIMEOUT_S)
        reports = _collect(pipes, settings.model, budget)
    finally:
        _stop(list(pipes.values()))
        for receiver in pipes:
            receiver.close()
    measurements = []
    for index, run in enumerate(runs):
        per_process = [report[index] for report in reports]
        durations = [d for _, batch_times in per_process for d in batch_times]
        measurements.append(
            Measurement(
                split=split,
                batch_size=run.window if isinstance(run, Strategy) else run,
                items_per_s=sum(rate for rate, _ in per_process),
                batch_ms_median=statistics.median(durations) * 1000 if durations else float("nan"),
                strategy=str(run) if isinstance(run, Strategy) else "",
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
    runs: list[Any],
    corpus: list[Any] | None,
    seconds: float,
    warmup: int,
    barrier: Any,
    sender: Connection,
) -> None:
    try:
        if corpus is None:
            report = _measure_here(settings, torch_threads, runs, seconds, warmup, barrier)
        else:
            report = _measure_corpus(settings, torch_threads, corpus, runs, seconds, barrier)
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
    from service.models.device import configure_torch, select_device
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


def _measure_corpus(
    settings: Settings,
    torch_threads: int,
    corpus: list[Any],
    strategies: list[Strategy],
    seconds: float,
    barrier: Any,
) -> list[tuple[float, list[float]]]:
    from service.batching.calibration import calibrate
    from service.batching.subbatch import cut
    from service.models import load_model
    from service.models.device import configure_torch, select_device
    from service.topology.plan import LIBRARY_ENV

    os.environ.update(LIBRARY_ENV)
    configure_torch(torch_threads)
    model = load_model(settings, select_device())
    items = [model.prepare(item) for item in corpus]
    size = getattr(model, "item_size", None)
    if size is None:
        raise ValueError(f"model {model.name} reports no item sizes; a corpus needs a model that does")
    cost = calibrate(model.predict, items[:16], size, max_rows=settings.max_batch_size)
    if cost.estimate() is None:
        raise ValueError("the cost calibration observed no model call")
    report = []
    for strategy in strategies:
        if strategy.clients is not None:
            report.append(_through_batcher(settings, model, corpus, strategy.clients, seconds, barrier))
            continue

        def calls(window: list[Any], strategy: Strategy = strategy) -> list[list[Any]]:
            if not (strategy.cost or strategy.chunk):
                return [window]
            ordered = sorted(window, key=size)
            if strategy.chunk:
                return [ordered[i : i + strategy.chunk] for i in range(0, len(ordered), strategy.chunk)]
            estimate = cost.estimate()
            if estimate is None:  # calibrated above, so never; as the batcher, one call
                return [ordered]
            ranges = cut(
                [size(item) for item in ordered],
                estimate,
                max_tokens=strategy.max_tokens or settings.max_batch_tokens,
                max_rows=settings.max_batch_size,
            )
            return [ordered[a:b] for a, b in ranges]

        windows = [
            [items[(start + k) % len(items)] for k in range(strategy.window)]
            for start in range(0, len(items), strategy.window)
        ]
        for batch in calls(windows[0]):
            model.predict(batch)  # warm-up
        barrier.wait(BARRIER_TIMEOUT_S)
        window_times: list[float] = []
        done = 0
        begin = time.monotonic()
        end = begin + seconds
        while (started := time.monotonic()) < end:
            window = windows[len(window_times) % len(windows)]
            for batch in calls(window):
                call_started = time.monotonic()
                model.predict(batch)
                if strategy.cost:
                    # As the batch thread does: every call it runs refines the cost model.
                    cost.observe(len(batch) * max(map(size, batch)), time.monotonic() - call_started)
            done += len(window)
            window_times.append(time.monotonic() - started)
        report.append((done / (time.monotonic() - begin), window_times))
    return report


# Time the batcher's threads run before the measured span: its first batches,
# its cost model's first live calls and the clients' first round trips.
BATCHER_WARM_UP_S = 1.0


def _through_batcher(
    settings: Settings, model: Any, corpus: list[Any], clients: int, seconds: float, barrier: Any
) -> tuple[float, list[float]]:
    """Items/s of ``clients`` threads sending corpus items through the worker's batcher, one at a time.

    Each thread prepares its item itself (a text model tokenizes it), submits
    it, and waits for the answer, as a request thread does; the batch thread
    gathers and cuts the batches as in a worker, without the door's latency
    budget (nothing here is late). Answers within the measured span count;
    the second value holds their round trips.
    """
    from service.runtime import new_batcher

    batcher = new_batcher(settings, model)
    batcher.start()
    barrier.wait(BARRIER_TIMEOUT_S)
    begin = time.monotonic() + BATCHER_WARM_UP_S
    end = begin + seconds
    answered: list[list[float]] = [[] for _ in range(clients)]
    failures: list[BaseException] = []

    def client(index: int) -> None:
        position = index * len(corpus) // clients
        try:
            while (sent := time.monotonic()) < end:
                item = model.prepare(corpus[position % len(corpus)])
                position += 1
                batcher.submit([item], deadline=sent + BARRIER_TIMEOUT_S).future.result(BARRIER_TIMEOUT_S)
                if begin <= (done := time.monotonic()) <= end:
                    answered[index].append(done - sent)
        except BaseException as exc:  # reported by the measuring process, below
            failures.append(exc)

    threads = [threading.Thread(target=client, args=(index,), daemon=True) for index in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    batcher.stop(BARRIER_TIMEOUT_S)
    if failures:
        raise failures[0]
    round_trips = [t for times in answered for t in times]
    return len(round_trips) / seconds, round_trips

# design:
# - What every CPU worker builds alike (torch and the libraries, the model's
#   weights and the modules around them, its tokenizer) is built once in the
#   gunicorn master, before the first fork, and the workers share its pages
#   copy-on-write: more workers no longer multiply the model's memory.
#   SERVE_SHARE_WEIGHTS=off builds everything in each worker, as before.
# - GPU workers keep their own copy: weights in GPU memory cannot pass through
#   a fork, and CUDA must not start in the master (docs/topology.md).
# - The master never runs the model. GNU OpenMP, which torch's wheels use,
#   hangs a forked child on its first parallel region if the parent ran one
#   (pytorch #49555), so the master sets one intra-op thread, builds without a
#   forward pass (MiniLM is traced in each worker, service.models.minilm), and
#   a precision check, which runs the model, runs in a child process of its own
#   (service.models.precision_cache); the master only applies its choice. Each
#   worker sets its own thread counts after the fork (service.runtime).
# - gevent patches each worker after the fork, as before; what the master built
#   keeps the native locks it made at import. The model is only ever run by the
#   batch thread or, on the naive route, by a request greenlet from start to end
#   without yielding, so no greenlet waits on such a lock held by another.
# - Pages stay shared while nothing writes them. The tensors' data is written
#   by nothing; the Python objects around it are, by reference counts (a few MiB
#   of module and parameter objects) and by the cyclic collector, which writes
#   to every object it tracks: gc.freeze() moves everything the master made
#   into the permanent generation, which collections in the workers never visit.
# - A worker that gunicorn replaces is forked from the same master and shares
#   like the first. On SIGHUP (gunicorn_conf.on_reload) the master builds the
#   models afresh, so a reload serves the files as they are now.
# - Several models (SERVE_MODEL lists them) are each built once, by entry.

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.config.model_list import ModelEntry
    from service.config.settings import Settings
    from service.models.base import Model
    from service.models.precision import Outcome

# The master's environment while it builds: one thread for every pool that
# reads one at load (torch's OpenMP and MKL, numpy's BLAS), no GPU, and no
# tokenizer pool. Each worker's own values are set after the fork (service.topology).
MASTER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "CUDA_VISIBLE_DEVICES": "",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass(frozen=True)
class Preloaded:
    """A model the master built, as every worker will find it after the fork."""

    spec: str
    model: Model
    precision: Outcome
    seconds: float
    # The name the model gives itself, before its entry's served name replaced it.
    own_name: str = ""


# What the master built, by SERVE_MODEL entry (each model of the list has its own).
_held: dict[ModelEntry, Preloaded] = {}


def wanted(settings: Settings, devices: Iterable[str]) -> bool:
    """Whether the master builds the models: sharing is on and every planned worker runs on a CPU."""
    return settings.share_weights and all(device == "cpu" for device in devices)


def build(settings: Settings, check_env: Mapping[str, str | None]) -> list[Preloaded]:
    """In the master, before the fork: each model SERVE_MODEL lists, on the CPU, in its precision, not run.

    ``check_env`` is the environment a precision check runs in (a worker's:
    its threads), should one be needed. Raises whatever loading raises, with
    the failing model's name in ``failed_model`` on the exception.
    """
    os.environ.update(MASTER_ENV)
    import torch

    from service.models import load_model
    from service.models.base import task_of
    from service.models.precision_cache import settle_before_fork

    torch.set_num_threads(1)
    # Inherited by every worker: it can be set once per process (a reload finds it set).
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    if _held:
        # A reload: the previous build is freed before the next is made (the
        # collector may visit it again; the old workers keep their own pages).
        _held.clear()
        gc.unfreeze()
        gc.collect()
    for entry in settings.models:
        started = time.monotonic()
        own = settings.for_model(entry)
        try:
            model = load_model(own, "cpu", may_run=False)
            own_name = model.name
            if entry.name is not None:
                model.name = entry.name
            precision = settle_before_fork(model, task_of(model), own, check_env)
        except Exception as exc:
            exc.failed_model = entry.name or entry.spec  # type: ignore[attr-defined]
            raise
        _held[entry] = Preloaded(entry.spec, model, precision, time.monotonic() - started, own_name)
    freeze()
    return list(_held.values())


def freeze() -> None:
    """Keep the collector off what the master holds, so that it stays shared (call before each fork)."""
    gc.collect()
    gc.freeze()


def take(settings: Settings, device: str, entry: ModelEntry | None = None) -> Preloaded | None:
    """In a worker: the model the master built for ``entry``, or None (not shared, another model, a GPU)."""
    held = _held.get(entry or settings.models[0])
    if held is None or device != "cpu" or held.spec != settings.model:
        return None
    return held

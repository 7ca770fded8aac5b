"""A process's torch: its thread pools, its device, and its share of a GPU.

Set once per process, before any model work: by each worker (service.runtime),
by a precision check's child (service.models.precision_cache), and by the
benchmarks that load a model outside the service.
"""

from __future__ import annotations

import contextlib
import logging

log = logging.getLogger(__name__)


def configure_torch(threads: int | None) -> None:
    """Fix torch's pools before any model work: intra-op as planned, inter-op 1."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    # One inter-op thread: requests are parallel across workers and batches,
    # and a second pool per worker only competes for the same cores. It can be
    # set once per process; tests build several apps in one.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)


def one_intra_op_thread() -> bool:
    """Whether torch runs each call on the calling thread alone (one intra-op thread).

    With more, every OS thread that calls a model starts an OpenMP pool of its
    own (GNU OpenMP keeps one per calling thread), so calls are kept to one thread.
    """
    import torch

    return bool(torch.get_num_threads() == 1)


def select_device(planned: str | None = None) -> str:
    """The torch device for the worker's planned one ("cpu", "cuda:N"; None: not planned).

    gunicorn_conf.py shows a GPU worker its one GPU alone, so "cuda:N" is "cuda"
    here. Without a plan (tests, a plain WSGI server) a visible GPU is used.
    """
    import torch

    if planned == "cpu":
        return "cpu"
    if planned is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"the plan gives this worker {planned}, but torch sees no CUDA device "
            f"(torch {torch.__version__}; is it built with CUDA?)"
        )
    return "cuda"


def limit_gpu_memory(fraction: float) -> None:
    """Cap torch's allocator at the worker's planned share of its GPU.

    Past it, an allocation raises torch.cuda.OutOfMemoryError in this worker
    (the batch fails with 503) instead of starving the workers that share the GPU.
    """
    import torch

    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    log.info("torch may allocate %.3f of the GPU's memory in this worker", fraction)

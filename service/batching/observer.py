"""The batcher's metrics hooks (BatchObserver), and notify(), which calls one so that it cannot do harm.

The telemetry implements the hooks (service.telemetry); the batcher and the
runtime call them through notify(), from the threads the class's docstring names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class BatchObserver:
    """Hooks for metrics. The base class ignores them.

    ``on_batch`` runs in the batch thread, ``on_queue_depth`` in whichever
    thread changed the depth, one call at a time (changes made during a call
    coalesce into the next; the last call gets the depth as it is),
    ``on_model_loaded`` in the runtime's loader
    thread. Each must be quick. One that raises is logged and ignored (see
    notify): a metrics fault must not lose a request or stop the batch thread.
    """

    def on_batch(self, items: int, requests: int, queue_waits: list[float], model_seconds: float) -> None:
        pass

    def on_queue_depth(self, depth: int) -> None:
        pass

    def on_sub_batches(self, real_tokens: int, padded_tokens: int, sub_batches: int) -> None:
        """One length-aware batch ran as ``sub_batches`` model calls (models that report sizes)."""

    def on_model_loaded(self, device: str, seconds: float) -> None:
        pass

    def on_model_info(self, name: str, task: str, precision: str = "float32", reason: str = "asked") -> None:
        """The loaded model's name, task (models.base.task_of), precision and why, from the loader thread."""

    def on_precision(self, exactness: dict[str, float]) -> None:
        """How far the precision in use is from float32 on the sample items (empty for float32)."""


def notify(hook: Callable[..., None], *args: Any) -> None:
    """Call an observer hook; one that raises is logged, never passed to the caller.

    The hooks run where a failure would do harm: inside submit() after the depth
    was counted, in the batch thread between taking a request and running it.
    """
    try:
        hook(*args)
    except Exception:
        log.exception("the batch observer's %s failed; ignored", getattr(hook, "__name__", hook))

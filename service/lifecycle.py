"""What gunicorn's worker hooks do (wired in gunicorn_conf.py).

A worker starts serving only once its model is loaded, leaves through gunicorn's
graceful path when its batch thread fails, and drains its batcher on the way out.
Importing this module is cheap and touches no torch: gunicorn may call
``worker_exit`` in the master too.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.runtime import ModelRuntime


def runtime_of(worker: Any) -> ModelRuntime | None:
    """The runtime of the app a gunicorn worker serves, if it is this service's."""
    if getattr(worker, "pid", None) != os.getpid():
        return None  # the master, reaping a worker it lost
    from service.runtime import EXTENSION

    extensions = getattr(getattr(worker, "wsgi", None), "extensions", None)
    runtime: ModelRuntime | None = extensions.get(EXTENSION) if isinstance(extensions, dict) else None
    return runtime


def serve_when_loaded(worker: Any) -> None:
    """``post_worker_init``: hold the worker back until its model is loaded.

    A worker that accepted connections while loading would answer them 503;
    held back, it leaves them in the listen backlog for its siblings (or for
    itself, a moment later). That is what makes a SIGHUP reload, or the
    replacement of a crashed worker, fail no request. The loop keeps beating
    gunicorn's heartbeat, so a slow load is not mistaken for a hung worker.
    """
    runtime = runtime_of(worker)
    if runtime is None:
        return
    # SIGTERM to itself takes gunicorn's graceful path: stop accepting, finish
    # what is in flight (the batcher's requests have had their 503), exit, and
    # the master starts a replacement.
    runtime.on_fault = lambda reason: os.kill(os.getpid(), signal.SIGTERM)
    while worker.alive and not runtime.wait_loaded(timeout=1.0):
        worker.notify()


def drain(worker: Any) -> None:
    """``worker_exit``: answer every request still queued, then end the batch thread.

    gunicorn calls it once the worker has stopped accepting and its in-flight
    requests have finished (or ``graceful_timeout`` ran out), so normally the
    queue is already empty.
    """
    runtime = runtime_of(worker)
    if runtime is None:
        return
    # gunicorn's own logger: its error log is where a worker's exit is reported.
    pid = os.getpid()
    if runtime.failure is not None:
        worker.log.warning("Exiting: %s (pid: %s)", runtime.failure, pid)
    if runtime.stop(timeout=worker.cfg.graceful_timeout):
        worker.log.info("Batcher drained (pid: %s)", pid)
    else:
        worker.log.warning("Batch thread did not end; exiting without it (pid: %s)", pid)

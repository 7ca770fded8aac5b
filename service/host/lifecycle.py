# design:
# - What gunicorn's worker hooks do (wired in gunicorn_conf.py). Each hook runs
#   in the worker's main thread: post_worker_init before the worker accepts any
#   connection, worker_exit once it has stopped accepting. gunicorn may call
#   worker_exit in the master too, for a lost child; runtime_of() tells them
#   apart, and importing this module is cheap and touches no torch.
# - The model loads in the runtime's loader thread (service.runtime). The main
#   thread waits for it in post_worker_init, one second at a time, beating
#   gunicorn's heartbeat in between, so a slow load is not taken for a hang and
#   no connection is accepted before the model can answer it.
# - A model that failed to load ends the worker with gunicorn's boot error code
#   (Arbiter.WORKER_BOOT_ERROR); the master then stops the whole service rather
#   than start workers that fail the same way forever.
# - A batch-thread fault is reported from the watchdog's thread; the hook sends
#   SIGTERM to its own process, so the worker leaves through gunicorn's graceful
#   path (stop accepting, finish what is in flight) and the master replaces it.
# - worker_exit drains the batcher: every queued request is answered before the
#   batch thread ends.

from __future__ import annotations

import os
import signal
import sys
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

    A model that fails to load exits the worker with gunicorn's boot error,
    which stops the master: a bad ``SERVE_MODEL`` stops the service, with the
    reason in the log, instead of leaving it up answering 503.
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
    # A worker told to stop while it loaded (the master is halting, e.g. because a
    # sibling failed to boot) just stops: a second boot error, reaped while the
    # master halts, would escape gunicorn's halt and turn its exit code 3 into 1.
    if runtime.load_error is not None and worker.alive:
        from gunicorn.arbiter import Arbiter

        worker.log.error(
            "Worker failed to boot: %s; stopping the service (pid: %s)", runtime.load_error, os.getpid()
        )
        sys.exit(Arbiter.WORKER_BOOT_ERROR)


def drain(worker: Any) -> None:
    """``worker_exit``: answer every request still queued, then end the batch thread.

    gunicorn calls it once the worker has stopped accepting and its in-flight
    requests have finished (or ``graceful_timeout`` ran out), so normally the
    queue is already empty.
    """
    runtime = runtime_of(worker)
    if runtime is None or runtime.batcher is None:
        return  # not this service's worker, or no model (serve_when_loaded said why)
    # gunicorn's own logger: its error log is where a worker's exit is reported.
    pid = os.getpid()
    if runtime.failure is not None:
        worker.log.warning("Exiting: %s (pid: %s)", runtime.failure, pid)
    if runtime.stop(timeout=worker.cfg.graceful_timeout):
        worker.log.info("Batcher drained (pid: %s)", pid)
    else:
        worker.log.warning("Batch thread did not end; exiting without it (pid: %s)", pid)

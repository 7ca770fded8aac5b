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
# - Only one worker reports that error. gunicorn's master halts on the first,
#   and reaps the other workers inside its stop(): a second boot error reaped
#   there escapes halt(), so the service exits 1 instead of 3 and the log loses
#   its "Reason:" line. Every worker fails alike, so the first to fail claims
#   the report (a flag in shared memory, made in the master before the fork);
#   the others wait for the halting master's SIGTERM and just stop.
# - A batch-thread fault is reported from the watchdog's thread; the hook sends
#   SIGTERM to its own process, so the worker leaves through gunicorn's graceful
#   path (stop accepting, finish what is in flight) and the master replaces it.
# - pre_request marks a request whose declared body is over the limit to close
#   its connection: the app refuses it unread (413), and gunicorn skips at most
#   64 KiB of an unread body, then closes a connection it announced as keep-alive.
# - worker_exit drains the batcher: every queued request is answered before the
#   batch thread ends.

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from service.telemetry.logs import ACCESS_LOGGER

if TYPE_CHECKING:
    from service.model_set import ModelSet


# Imported by gunicorn_conf.py in the master, so every worker forks with the same flag.
_boot_error_reported = multiprocessing.Value("b", 0)
_SIBLING_POLL_S = 0.1


def _claim_boot_error() -> bool:
    """True for the first worker of this master to fail to boot, False for the rest."""
    with _boot_error_reported.get_lock():
        first = not _boot_error_reported.value
        _boot_error_reported.value = 1
    return first


def runtime_of(worker: Any) -> ModelSet | None:
    """The models of the app a gunicorn worker serves, if it is this service's."""
    from service.runtime import EXTENSION

    runtime: ModelSet | None = _extension(worker, EXTENSION)
    return runtime


def door_of(worker: Any) -> Any:
    """The door of the app a gunicorn worker serves (service.http.door.Door), if it is this service's."""
    from service.http.door import EXTENSION

    return _extension(worker, EXTENSION)


def _extension(worker: Any, name: str) -> Any:
    """The app's Flask extension ``name`` in a gunicorn worker; None in the master or for another app."""
    if getattr(worker, "pid", None) != os.getpid():
        return None  # the master, reaping a worker it lost
    extensions = getattr(getattr(worker, "wsgi", None), "extensions", None)
    return extensions.get(name) if isinstance(extensions, dict) else None


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
    # sibling failed to boot) just stops.
    if runtime.load_error is None or not worker.alive:
        return
    if not _claim_boot_error():
        worker.log.error(
            "Worker failed to boot: %s; a sibling has reported it (pid: %s)", runtime.load_error, os.getpid()
        )
        _wait_for_halt(worker)
        if not worker.alive:
            return
    from gunicorn.arbiter import Arbiter

    worker.log.error(
        "Worker failed to boot: %s; stopping the service (pid: %s)", runtime.load_error, os.getpid()
    )
    sys.exit(Arbiter.WORKER_BOOT_ERROR)


def _wait_for_halt(worker: Any) -> None:
    """Beat the heartbeat until the halting master's SIGTERM, or its graceful timeout."""
    deadline = time.monotonic() + worker.cfg.graceful_timeout
    while worker.alive and time.monotonic() < deadline:
        worker.notify()
        time.sleep(_SIBLING_POLL_S)  # the SIGTERM handler clears worker.alive: nothing to block on


def close_after_oversized_body(req: Any, limit: int) -> None:
    """``pre_request``: answer a request whose Content-Length is over ``limit`` with ``Connection: close``.

    The app refuses such a body with 413 before reading it. Told the connection
    closes, the client sends its next request on a new one, rather than on one
    that gunicorn closes once it has given up skipping the body.
    """
    length = next((value for name, value in req.headers if name == "CONTENT-LENGTH"), "")
    if length.isdigit() and int(length) > limit:
        req.force_close()


def drain(worker: Any) -> None:
    """``worker_exit``: answer every request still queued, then end the batch thread.

    gunicorn calls it once the worker has stopped accepting and its in-flight
    requests have finished (or ``graceful_timeout`` ran out), so normally the
    queue is already empty.
    """
    try:
        _drain_batcher(worker)
    finally:
        # The access lines still queued for the writer thread (service.telemetry.logs.LineWriter),
        # and the metric updates not yet written (service.telemetry.tally): a dead worker's counters stay.
        for handler in logging.getLogger(ACCESS_LOGGER).handlers:
            handler.flush()
        _flush_metrics(worker)


def _flush_metrics(worker: Any) -> None:
    from service.telemetry.metrics import EXTENSION

    metrics = _extension(worker, EXTENSION)
    if metrics is not None:
        metrics.flush()


def _drain_batcher(worker: Any) -> None:
    runtime = runtime_of(worker)
    if runtime is None or runtime.load_error is not None:
        return  # not this service's worker, or no model (serve_when_loaded said why)
    # gunicorn's own logger: its error log is where a worker's exit is reported.
    pid = os.getpid()
    if runtime.failure is not None:
        worker.log.warning("Exiting: %s (pid: %s)", runtime.failure, pid)
    if runtime.stop(timeout=worker.cfg.graceful_timeout):
        worker.log.info("Batcher drained (pid: %s)", pid)
    else:
        worker.log.warning("Batch thread did not end; exiting without it (pid: %s)", pid)

"""The metrics directory gunicorn's workers share (prometheus_client's multiprocess mode).

Used by the launcher, gunicorn_conf.py, in the gunicorn master. It imports
prometheus_client only inside its functions: the master loads this module
before the directory exists, and prometheus_client fixes its mode when first
imported.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from service.host.pid import current_pid

# Directories this process created, removed by cleanup(). Kept here rather than
# in gunicorn_conf.py because gunicorn re-executes its config file on every
# reload (SIGHUP), which would forget them; this module is imported once.
_created: list[Path] = []


def prepare(path: str | None, prefix: str = "serve-metrics-") -> str:
    """The directory to use: ``path`` emptied of stale metrics, or a fresh temporary one.

    Files left by an earlier run would be summed into this run's counters, so
    a given directory is wiped of them (and created if missing).
    """
    if path is None:
        fresh = Path(tempfile.mkdtemp(prefix=prefix))
        _created.append(fresh)
        return str(fresh)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.db"):
        stale.unlink(missing_ok=True)
    return str(directory)


def import_client() -> None:
    """Import prometheus_client in multiprocess mode, its pid check made cheap; call once the variable is set.

    In the master, before any fork: workers inherit the module as it is, with
    the locks it made from ``threading`` before gevent could patch them.
    """
    from prometheus_client import values

    if not getattr(values.ValueClass, "_multiprocess", False):
        raise RuntimeError(
            "prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set, so the workers "
            "could not share their metrics; nothing in the gunicorn master may import it earlier"
        )
    # Each write first checks whether the process forked since (its file is the
    # pid's): with os.getpid, a system call a write (service.host.pid).
    values.ValueClass = values.MultiProcessValue(current_pid)  # type: ignore[no-untyped-call]


def mark_dead(path: str, pid: int) -> None:
    """Drop a dead worker's live gauges; its counters and histograms stay in the sums."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]


def cleanup() -> None:
    """Remove the directories :func:`prepare` created; a directory the user named stays."""
    while _created:
        shutil.rmtree(_created.pop(), ignore_errors=True)

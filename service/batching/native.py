# design:
# - OS threads, locks, queues and futures that stay native in a gevent-patched
#   worker. gevent's monkey-patching turns ``threading.Thread`` into a greenlet
#   and ``threading.Lock`` into a hub-bound lock; this module hands out the
#   originals whether or not the process was patched.
# - Who uses them: the batch thread, the watchdog and the model loader are OS
#   threads started here (a model call inside a greenlet would stall the
#   worker's event loop). The queue, the batcher's lock and each request's
#   future are shared between those threads and request threads or greenlets,
#   so they must be safe across OS threads: native, from here.
# - Futures: ``concurrent.futures.Future`` guards its state with a
#   ``threading.Condition``, whose lock is gevent's once patched. gevent can
#   pass such a lock between an OS thread and a greenlet only through a slow
#   hand-off via the owning hub, which its maintainers call delicate and advise
#   against. A request's future is touched by both sides, so its lock is a
#   native one. It is held only for a few attribute writes, so a greenlet that
#   waits for it stalls its hub for microseconds; nobody waits on the condition
#   itself under gevent (service.batching.waiting wakes greenlets through the hub).
# - Shutdown: threads started here are unknown to ``threading``, so the
#   interpreter does not wait for them at exit. Each owner ends its own
#   (Batcher.stop drains the batch thread; the watchdog returns once that
#   thread ends), and one still running when the process exits, such as a
#   stalled batch, ends with it instead of holding the worker up.

from __future__ import annotations

import importlib
import threading

# The C implementation: gevent patches ``queue.SimpleQueue`` but not ``_queue``.
from _queue import Empty, SimpleQueue
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["Empty", "SimpleQueue", "allocate_lock", "gevent_patched", "new_future", "start_thread"]


def gevent_patched() -> bool:
    try:
        from gevent import monkey
    except ImportError:
        return False
    return bool(monkey.is_module_patched("threading"))


def _original(module: str, name: str) -> Any:
    if gevent_patched():
        from gevent import monkey

        return monkey.get_original(module, name)
    return getattr(importlib.import_module(module), name)


def allocate_lock() -> Any:
    """A plain OS lock (``_thread.LockType``)."""
    return _original("_thread", "allocate_lock")()


def new_future() -> Future[Any]:
    """A ``concurrent.futures.Future`` whose internal lock is a native OS lock."""
    future: Future[Any] = Future()
    if gevent_patched():
        # Future keeps its state under ``_condition`` (CPython 3.2 onwards); a
        # Condition over a native RLock serves every Future method unchanged.
        future._condition = threading.Condition(_original("_thread", "RLock")())
    return future


def start_thread(target: Callable[[], None]) -> int:
    """Run ``target`` in a new OS thread; returns its ident."""
    return int(_original("_thread", "start_new_thread")(target, ()))

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
# - Replies: a request's reply (service.batching.reply) is touched by the batch
#   thread and by a request thread or greenlet, so its locks come from here.
# - Shutdown: threads started here are unknown to ``threading``, so the
#   interpreter does not wait for them at exit. Each owner ends its own
#   (Batcher.stop drains the batch thread; the watchdog returns once that
#   thread ends), and one still running when the process exits, such as a
#   stalled batch, ends with it instead of holding the worker up.

from __future__ import annotations

import importlib
import sys

# The C implementation: gevent patches ``queue.SimpleQueue`` but not ``_queue``.
from _queue import Empty, SimpleQueue
from collections.abc import Callable
from typing import Any

__all__ = ["Empty", "SimpleQueue", "allocate_lock", "get_ident", "gevent_patched", "sleep", "start_thread"]


def gevent_patched() -> bool:
    """Whether gevent has patched ``threading`` in this process.

    Asked for every batched request (service.batching.waiting): once patched, a process stays
    patched, so a yes is remembered; a no is asked again, since a gevent
    worker patches after this module may have been imported. Patching imports
    ``gevent.monkey``, so a process that has not imported it is not patched.
    """
    global _patched  # noqa: PLW0603
    if _patched:
        return True
    monkey = sys.modules.get("gevent.monkey")
    if monkey is None:
        return False
    _patched = bool(monkey.is_module_patched("threading"))
    return _patched


_patched = False


def _original(module: str, name: str) -> Any:
    if gevent_patched():
        from gevent import monkey

        return monkey.get_original(module, name)
    return getattr(importlib.import_module(module), name)


# Looked up once, at import: unpatched then, or patched and found through gevent.
# Either way the original; a lookup per lock cost each request two imports' worth.
_allocate_lock = _original("_thread", "allocate_lock")


def allocate_lock() -> Any:
    """A plain OS lock (``_thread.LockType``)."""
    return _allocate_lock()


_get_ident = _original("_thread", "get_ident")  # patched, it names the greenlet


def get_ident() -> int:
    """This OS thread's ident, never a greenlet's."""
    return int(_get_ident())


def start_thread(target: Callable[[], None]) -> int:
    """Run ``target`` in a new OS thread; returns its ident."""
    return int(_original("_thread", "start_new_thread")(target, ()))


_sleep = _original("time", "sleep")  # as _allocate_lock: the original, looked up once


def sleep(seconds: float) -> None:
    """Block this OS thread for ``seconds``: gevent's patched ``time.sleep`` would expect a hub."""
    _sleep(seconds)

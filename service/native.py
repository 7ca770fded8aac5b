"""OS threads, locks and queues that stay native in a gevent-patched worker.

gevent's monkey-patching turns ``threading.Thread`` into a greenlet and
``threading.Lock`` into a hub-bound lock. The batcher must be a real OS thread
(a model call inside a greenlet would stall the worker's event loop), and what
it shares with request greenlets must be safe across OS threads, so this module
hands out the originals whether or not the process was patched.
"""

from __future__ import annotations

import importlib

# The C implementation: gevent patches ``queue.SimpleQueue`` but not ``_queue``.
from _queue import Empty, SimpleQueue
from collections.abc import Callable
from typing import Any

__all__ = ["Empty", "SimpleQueue", "allocate_lock", "gevent_patched", "start_thread"]


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


def start_thread(target: Callable[[], None]) -> int:
    """Run ``target`` in a new OS thread; returns its ident."""
    return int(_original("_thread", "start_new_thread")(target, ()))

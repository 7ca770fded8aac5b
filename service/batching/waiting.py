# design:
# - A batched request waits for its Future, which the batch thread (a native OS
#   thread, service.batching.native) completes. Request threads (gthread, sync) block in
#   Future.result(timeout).
# - Under gevent a request is a greenlet on the worker's one hub. Blocking in
#   Future.result() would wait on a lock that gevent can only hand between an
#   OS thread and a greenlet through its delicate cross-thread path. Instead
#   the greenlet waits on a gevent Event with its timeout, and a done-callback,
#   which runs in the batch thread, asks the hub to set that Event with
#   loop.run_callback_threadsafe: the one hub call made for other threads. The
#   hub keeps serving other greenlets (/healthz) while the batch runs.
# - A timed-out caller cancels its future (a no-op once the batch has started)
#   and drops its reference; the batch thread's result then goes nowhere, and
#   the callback sets an Event nobody waits on. No map of pending requests
#   exists, so nothing is left behind.
# - The other way: the batch thread, woken by the first request a greenlet
#   queues, waits for the hub to end its turn before it gathers a batch
#   (end_of_hub_turn). The hub's loop is recorded by the first greenlet that
#   waits here; a callback asked of it runs once the greenlets its turn woke
#   have run, and each has queued its request by then.
"""Waiting for a batched request's Future from a request thread or greenlet, and for the hub's turn."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from typing import Any

from service.batching import native
from service.batching.reply import Reply
from service.errors import ClientClosed, DeadlineExceeded
from service.models.base import Outputs

# How often a waiting request looks whether its client is still there (``gone``).
GONE_CHECK_S = 0.5


def wait_result(future: Reply, timeout_s: float, gone: Callable[[], bool] | None = None) -> Outputs:
    """The request's outputs, or its error; DeadlineExceeded once ``timeout_s`` passes.

    ``gone()``: whether the client hung up, asked every GONE_CHECK_S while the
    request waits longer. A request whose client is gone is taken back
    (cancelled while queued, failed between the parts of a large one), so the
    model computes nothing more for it, and ClientClosed is raised.
    """
    if future.done():
        # Answered within submit() (Batcher._run_here): under gevent, a waiter
        # would still ask the hub, from this very greenlet, to wake it.
        return future.result(timeout=0)
    until = time.monotonic() + max(0.0, timeout_s)
    wait = _greenlet_waiter(future) if native.gevent_patched() else _thread_waiter(future)
    while True:
        left = max(0.0, until - time.monotonic())
        step = left if gone is None else min(left, GONE_CHECK_S)
        if wait(step):
            return future.result(timeout=0)
        if left <= step:
            return _after_deadline(future)
        if gone is not None and gone():
            _take_back(future)


def _thread_waiter(future: Reply) -> Callable[[float], bool]:
    """``wait(timeout_s)``: block this thread on the future for at most that long; whether it is done."""

    def wait(timeout_s: float) -> bool:
        try:
            future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            # TimeoutError is also what DeadlineExceeded from the batch thread is;
            # a finished future re-raises its own outcome.
            return future.done()
        except Exception:
            return True  # finished with an error, which result() raises again
        return True

    return wait


def _take_back(future: Reply) -> None:
    """Cancel a request whose client is gone, or fail it if a batch has taken it; raises ClientClosed."""
    error = ClientClosed("the client closed the connection while its request waited", reason="client_closed")
    if not future.cancel():
        # Already taken into a batch: failed now, the batch thread skips its later
        # parts. If it was answered meanwhile, the answer stands (the caller's
        # next look at the future returns it) and its write finds the client gone.
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            future.set_exception(error)
            raise error
        return
    raise error


# Longest the batch thread waits for the hub's turn: the interpreter's switch
# interval, after which the hub would have had to give up the GIL anyway.
HUB_TURN_WAIT_S = 0.005
_hub_loop: Any = None  # the gevent hub's loop of this worker, once a greenlet has waited
_hub_thread: int | None = None  # the OS thread that hub runs on
_spawn_raw: Any = None  # gevent.spawn_raw, once imported (spawn_on_hub)
_event: Any = None  # gevent.event.Event, once a greenlet has waited


def end_of_hub_turn() -> None:
    """From the batch thread: return once the hub has run what its turn woke, or after HUB_TURN_WAIT_S.

    Under gevent every socket call the hub makes releases the GIL, and a batch
    thread woken by the first request queued took it at the next one: each
    request was a batch of its own (1.2 a batch at 64 clients on a model that
    costs nothing, against 4.7 under gthread), and a round trip of the GIL
    between the hub and the batch thread, four thread switches a request.
    Waiting for the turn lets one batch take every request the turn parsed.
    A no-op outside gevent, and before any greenlet has waited.
    """
    loop = _hub_loop
    if loop is None:
        return
    turned = native.allocate_lock()
    turned.acquire()
    try:
        loop.run_callback_threadsafe(turned.release)
    except Exception:  # a hub already torn down (the worker exiting): gather as it stands
        return
    turned.acquire(timeout=HUB_TURN_WAIT_S)


def on_hub_thread() -> bool:
    """Whether this is the OS thread of the worker's gevent hub (False before any greenlet waited)."""
    return _hub_thread is not None and native.get_ident() == _hub_thread


def spawn_on_hub(run: Callable[[], None]) -> None:
    """Run ``run`` in a greenlet of its own; called on the hub's thread (on_hub_thread).

    A greenlet spawned so starts in the hub's callbacks, after the I/O of its
    turn: every request the turn parsed has been queued by then.
    """
    global _spawn_raw  # noqa: PLW0603
    if _spawn_raw is None:
        from gevent import spawn_raw

        _spawn_raw = spawn_raw
    _spawn_raw(run)


def _greenlet_waiter(future: Reply) -> Callable[[float], bool]:
    """``wait(timeout_s)``: yield to the hub until the future is done or that long passes; whether it is done.

    One Event and one done-callback per request, however many times it waits.
    """
    global _hub_loop, _hub_thread, _event
    if _hub_loop is None:
        # Once: every request greenlet runs on the worker's one hub. Looked up
        # here, not imported at the top: outside gevent this module must not load it.
        from gevent import get_hub
        from gevent.event import Event

        hub = get_hub()
        _hub_loop, _hub_thread, _event = hub.loop, hub.thread_ident, Event
    loop, thread = _hub_loop, _hub_thread
    woken = _event()

    def wake(_: Reply) -> None:
        # In the batch thread, through the hub's thread-safe queue; on the hub's
        # own thread (a batch run there, Batcher._on_hub) at once, no wake-up to ask for.
        if native.get_ident() == thread:
            woken.set()
        else:
            loop.run_callback_threadsafe(woken.set)

    future.add_done_callback(wake)

    def wait(timeout_s: float) -> bool:
        if not future.done():
            woken.wait(timeout_s)
        return future.done()

    return wait


def _after_deadline(future: Reply) -> Outputs:
    # cancel() succeeds only while the request is still queued, and fails once
    # the batch has taken it; if the batch finished in the meantime, its
    # outcome is still the answer.
    if future.cancel():
        raise DeadlineExceeded("the request's deadline passed while it was queued", reason="expired_in_queue")
    if not future.done():
        raise DeadlineExceeded(
            "the request's deadline passed before its batch finished", reason="expired_in_batch"
        )
    return future.result(timeout=0)

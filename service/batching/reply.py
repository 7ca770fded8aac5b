# design:
# - One per batched request: the request thread (or greenlet) waits on it, the
#   batch thread, the watchdog or the caller's own cancel completes it, once.
# - It keeps the part of ``concurrent.futures.Future``'s interface the batcher
#   uses, with its semantics (pending -> running -> finished; cancel only while
#   pending; set_* on a finished or cancelled reply raises InvalidStateError;
#   callbacks run once, in the thread that completes it). It exists because
#   Future costs too much on this path: its Condition builds an RLock and a
#   waiter lock per wait and runs notify() in Python, which measured as a fifth
#   of a worker's Python time on a model that costs nothing
#   (docs/bench-request-path.md). Here waiting is one native lock, held from
#   creation and released once when the answer is in; state changes take one more
#   native lock for a few attribute writes, never across a callback.
# - Both locks are native (service.batching.native), so the batch thread may
#   complete a reply that a greenlet waits for under gevent; greenlets never
#   block on them (service.batching.waiting wakes them through the hub).
# - claim, fail and deliver complete a reply once, by whichever side reaches it
#   first (batch thread, watchdog, gate), so a stalled batch thread that wakes
#   up after the watchdog failed its requests cannot answer them twice.
"""A batched request's answer, handed from the batch thread to the request's thread."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import CancelledError, InvalidStateError

from service.batching import native
from service.models.base import Outputs

log = logging.getLogger(__name__)

_PENDING, _RUNNING, _CANCELLED, _FINISHED = range(4)


class Reply:
    """A one-shot result: ``set_result`` or ``set_exception`` once, ``result(timeout)`` to wait for it."""

    __slots__ = ("_callbacks", "_error", "_guard", "_ready", "_state", "_value")

    def __init__(self) -> None:
        self._guard = native.allocate_lock()
        # Held until the reply is complete: a waiter blocks on it and passes it on.
        self._ready = native.allocate_lock()
        self._ready.acquire()
        self._state = _PENDING
        self._value: Outputs | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Reply], object]] = []

    def done(self) -> bool:
        return self._state >= _CANCELLED

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def cancel(self) -> bool:
        """Cancel it if nobody has started on it; True if it is (now) cancelled."""
        with self._guard:
            if self._state == _CANCELLED:
                return True
            if self._state != _PENDING:
                return False
            self._state = _CANCELLED
        self._complete()
        return True

    def set_running_or_notify_cancel(self) -> bool:
        """Mark it running; False if it was cancelled. Raises RuntimeError if it is finished."""
        with self._guard:
            if self._state == _CANCELLED:
                return False
            if self._state != _PENDING:
                raise RuntimeError("the reply is already running or finished")
            self._state = _RUNNING
            return True

    def set_result(self, value: Outputs) -> None:
        self._finish(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._finish(None, error)

    def result(self, timeout: float | None = None) -> Outputs:
        """The outputs; raises what the batch raised, CancelledError, or TimeoutError after ``timeout`` s."""
        self._wait(timeout)
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]  # set with the state

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._error

    def add_done_callback(self, callback: Callable[[Reply], object]) -> None:
        """Call ``callback(reply)`` once it is done: at once, here, if it already is."""
        with self._guard:
            if self._state < _CANCELLED:
                self._callbacks.append(callback)
                return
        _call(callback, self)

    def _finish(self, value: Outputs | None, error: BaseException | None) -> None:
        with self._guard:
            if self._state >= _CANCELLED:
                raise InvalidStateError("the reply is already finished or cancelled")
            self._value, self._error = value, error
            self._state = _FINISHED
        self._complete()

    def _complete(self) -> None:
        # Only the one call that moved the state to done gets here.
        self._ready.release()
        for callback in self._callbacks:
            _call(callback, self)
        self._callbacks.clear()

    def _wait(self, timeout: float | None) -> None:
        if self._state < _CANCELLED:
            waited = self._ready.acquire(timeout=-1 if timeout is None else max(0.0, timeout))
            if waited:
                self._ready.release()  # for any other waiter
        state = self._state
        if state == _CANCELLED:
            raise CancelledError()
        if state != _FINISHED:
            raise TimeoutError()


def _call(callback: Callable[[Reply], object], reply: Reply) -> None:
    try:
        callback(reply)
    except Exception:
        log.exception("a reply's done-callback %r raised; ignored", callback)


def claim(reply: Reply) -> bool:
    """Mark a queued request's reply as running; False if it needs no answer.

    That is when its caller cancelled it, or when the watchdog already failed
    it (a stalled thread waking up after Batcher.abandon()).
    """
    try:
        return reply.set_running_or_notify_cancel()
    except RuntimeError:  # already finished
        return False


def fail(reply: Reply, error: BaseException) -> bool:
    """Fail a reply unless another thread already completed it; True if this call did."""
    try:
        reply.set_exception(error)
    except InvalidStateError:
        return False
    return True


def deliver(reply: Reply, result: Outputs) -> None:
    with contextlib.suppress(InvalidStateError):  # the watchdog already failed it
        reply.set_result(result)


def error_of(reply: Reply) -> BaseException | None:
    """The exception a finished reply holds; None if it was answered or cancelled."""
    if reply.cancelled():
        return None
    try:
        return reply.exception(timeout=0)
    except Exception:  # not finished: cannot happen in a done-callback
        return None

"""Reply: the one-shot answer the batch thread hands a request, with Future's rules."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, InvalidStateError

import pytest

from service.batching.reply import Reply


def test_a_result_set_in_another_thread_wakes_every_waiter() -> None:
    reply = Reply()
    got: list[object] = []
    waiters = [threading.Thread(target=lambda: got.append(reply.result(timeout=10))) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.05)  # let them block
    assert not reply.done() and not got
    threading.Thread(target=reply.set_result, args=(["out"],)).start()
    for waiter in waiters:
        waiter.join(10)
    assert got == [["out"]] * 3
    assert reply.done() and not reply.cancelled() and reply.exception(timeout=0) is None


def test_an_exception_is_raised_to_the_waiter() -> None:
    reply = Reply()
    reply.set_exception(ValueError("bad item"))
    with pytest.raises(ValueError, match="bad item"):
        reply.result(timeout=0)
    assert isinstance(reply.exception(timeout=0), ValueError)


def test_waiting_past_the_timeout_raises_timeout_error() -> None:
    reply = Reply()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        reply.result(timeout=0.05)
    assert time.monotonic() - started >= 0.04
    with pytest.raises(TimeoutError):
        reply.result(timeout=0)


def test_it_completes_once() -> None:
    reply = Reply()
    reply.set_result([1])
    with pytest.raises(InvalidStateError):
        reply.set_result([2])
    with pytest.raises(InvalidStateError):
        reply.set_exception(RuntimeError())
    assert reply.result(timeout=0) == [1]
    assert not reply.cancel()


def test_cancel_only_while_pending() -> None:
    queued = Reply()
    assert queued.cancel() and queued.cancel() and queued.cancelled()
    assert not queued.set_running_or_notify_cancel()  # the batch thread skips it
    with pytest.raises(CancelledError):
        queued.result(timeout=0)
    with pytest.raises(InvalidStateError):
        queued.set_result([1])

    running = Reply()
    assert running.set_running_or_notify_cancel()
    assert not running.cancel() and not running.done()
    running.set_result([1])
    with pytest.raises(RuntimeError):
        running.set_running_or_notify_cancel()


def test_callbacks_run_once_when_done_or_at_once_after() -> None:
    reply = Reply()
    calls: list[str] = []
    reply.add_done_callback(lambda r: calls.append("before"))
    reply.add_done_callback(lambda r: 1 / 0)  # logged, and the others still run
    reply.add_done_callback(lambda r: calls.append("before, second"))
    assert calls == []
    reply.set_result([1])
    reply.add_done_callback(lambda r: calls.append(f"after: {r.result(timeout=0)}"))
    assert calls == ["before", "before, second", "after: [1]"]

    cancelled = Reply()
    cancelled.add_done_callback(lambda r: calls.append("cancelled"))
    cancelled.cancel()
    assert calls[-1] == "cancelled"

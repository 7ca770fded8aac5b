"""Waiting for a batched request's Future from a request thread.

A timed-out caller cancels its future (a no-op once the batch has started) and
drops its reference; the batch thread's result then goes nowhere. No map of
pending requests exists, so nothing is left behind.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future

from service.errors import DeadlineExceeded
from service.models.base import Outputs


def wait_result(future: Future[Outputs], timeout_s: float) -> Outputs:
    try:
        return future.result(timeout=max(0.0, timeout_s))
    except concurrent.futures.TimeoutError:
        # TimeoutError is also what DeadlineExceeded from the batch thread is;
        # a finished future re-raises its own outcome.
        if future.done():
            return future.result(timeout=0)
        future.cancel()
        raise DeadlineExceeded("the request's deadline passed before its batch finished") from None

# design:
# - One watchdog OS thread per worker (service.batching.native, so it stays a real thread
#   under gevent), started right after the batch thread. It blocks on the batch
#   thread's exit for one check interval at a time: a thread that dies is seen at
#   once, one that stalls within an interval of the stall limit.
# - diagnose() is the rule, pure: the thread is dead if it ended without stop(),
#   stalled if one batch has run longer than the stall limit.
# - On a fault it calls on_fault(reason) once and ends; the runtime then marks
#   itself not ready, fails every request the batcher holds (Batcher.abandon)
#   and asks its host to replace the worker (service.host.lifecycle). A clean exit
#   after stop() is not a fault: the watchdog just ends with the thread.

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from service.batching import native
from service.batching.batcher import Batcher

log = logging.getLogger(__name__)


def diagnose(
    *, exited: bool, stopping: bool, crash: str | None, busy_since: float | None, now: float, limit_s: float
) -> str | None:
    """Why the batch thread can no longer serve, or None while it can."""
    if exited and (crash is not None or not stopping):
        return f"died ({crash or 'exited'})"
    if not exited and busy_since is not None and now - busy_since > limit_s:
        return f"is stuck: one batch has run for {now - busy_since:.1f} s (limit {limit_s:g} s)"
    return None


def check_interval(limit_s: float) -> float:
    """How often a stall is looked for: a quarter of the limit, at most a second."""
    return min(1.0, limit_s / 4)


class Watchdog:
    def __init__(self, batcher: Batcher, *, limit_s: float, on_fault: Callable[[str], None]) -> None:
        self._batcher = batcher
        self._limit_s = limit_s
        self._on_fault = on_fault

    def start(self) -> None:
        native.start_thread(self._run)

    def _run(self) -> None:
        batcher = self._batcher
        interval = check_interval(self._limit_s)
        while True:
            exited = batcher.wait_exit(interval)
            reason = diagnose(
                exited=exited,
                stopping=batcher.stopping,
                crash=batcher.crash,
                busy_since=batcher.busy_since,
                now=time.monotonic(),
                limit_s=self._limit_s,
            )
            if reason is not None:
                log.critical("the batch thread %s", reason)
                self._on_fault(reason)
                return
            if exited:
                return

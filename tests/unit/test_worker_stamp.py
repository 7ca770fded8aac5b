"""The gthread worker's stamp: each request's arrival reaches the environ; the app stays reachable."""

from __future__ import annotations

import threading
from typing import Any

from service.host.worker import StampedApp, arrivals_local
from service.http.arrival import ARRIVAL_ENVIRON_KEY, WAITING_ENVIRON_KEY


class _App:
    def __init__(self) -> None:
        self.extensions = {"serve": "the runtime"}
        self.environ: dict[str, Any] = {}

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        self.environ = environ
        return [b"ok"]


def test_the_stamp_of_the_thread_reaches_the_environ() -> None:
    app, arrivals = _App(), arrivals_local(threading.local)
    stamped = StampedApp(app, arrivals)
    arrivals.at = 123.5
    assert stamped({}, lambda *a: None) == [b"ok"]
    assert app.environ[ARRIVAL_ENVIRON_KEY] == 123.5
    arrivals.at = None
    stamped({}, lambda *a: None)
    assert ARRIVAL_ENVIRON_KEY not in app.environ


def test_the_requests_waiting_for_a_thread_reach_the_environ_where_the_worker_counts_them() -> None:
    app, arrivals = _App(), arrivals_local(threading.local)
    stamped = StampedApp(app, arrivals)
    stamped({}, lambda *a: None)
    assert WAITING_ENVIRON_KEY not in app.environ  # gevent counts none: the pace uses the wait
    arrivals.waiting = 56
    stamped({}, lambda *a: None)
    assert app.environ[WAITING_ENVIRON_KEY] == 56


def test_the_hooks_still_find_the_apps_extensions() -> None:
    # service.host.lifecycle reaches the runtime through worker.wsgi.extensions.
    assert StampedApp(_App(), arrivals_local(threading.local)).extensions == {"serve": "the runtime"}


def test_requests_in_transit_are_those_let_in_and_not_yet_picked_up() -> None:
    from service.host.worker import InTransit

    transit = InTransit(ttl_s=1.0)
    for _ in range(3):
        transit.sent(10.0)
    assert transit.count(10.0) == 3
    picked = [threading.Thread(target=transit.landed) for _ in range(2)]
    for thread in picked:
        thread.start()
    for thread in picked:
        thread.join()
    assert transit.count(10.1) == 1
    # One whose client hung up before a thread took it stops counting after the ttl.
    transit.sent(10.5)
    assert transit.count(10.9) == 2
    assert transit.count(11.2) == 1
    transit.landed()
    assert transit.count(11.2) == 0

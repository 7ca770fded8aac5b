"""End to end against real gunicorn: overload, deadlines, shutdown, reloads and worker faults.

The model is tests.support.models:scripted, whose items are commands ("sleep:S",
"wedge", "die") and queries ("busy", "seen:X", "pid"), so each test sets up the
exact situation it needs. Every client call has a timeout: a hang fails the test.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from scripts.common.procs import rss_bytes
from tests.support.metrics import Scrape
from tests.support.procs import established_connections
from tests.support.server import Server, gunicorn

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

# The latency budget off: the scripted model's seconds-long "sleep" batches
# would teach the worker a service time that refuses the quick requests behind
# them as over budget, and these tests are about the queue bound, deadlines and
# faults (tests/e2e/test_overload.py covers the budget).
SCRIPTED = {
    "SERVE_MODEL": "tests.support.models:scripted",
    "SERVE_THREADS": "48",
    "SERVE_LATENCY_BUDGET_MS": "0",
}
CLIENT_TIMEOUT = 30  # far beyond any answer these tests expect; reaching it means a hang


def batched(server: Server, *items: str, timeout_ms: int | None = None) -> requests.Response:
    headers = {"X-Request-Timeout-Ms": str(timeout_ms)} if timeout_ms is not None else {}
    return requests.post(
        server.url + "/predict/batched", json={"inputs": list(items)}, headers=headers, timeout=CLIENT_TIMEOUT
    )


def ask(server: Server, query: str) -> float:
    """A query to the scripted model on the naive route, which never queues behind a batch."""
    response = requests.post(server.url + "/predict/naive", json={"inputs": [query]}, timeout=CLIENT_TIMEOUT)
    response.raise_for_status()
    return float(response.json()["outputs"][0][0])


def eventually(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    """Wait for another process to reach a state; it offers no event to block on."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.02)


def queue_depth(server: Server) -> int:
    return int(server.get("/info").json()["batching"]["queue_depth"])


class Load:
    """Client threads sending batched requests on fresh connections until stopped.

    Outcomes: the status code, or "connection error", or "hang" (no answer in time).
    """

    def __init__(self, server: Server, clients: int, item: str) -> None:
        self.outcomes: Counter[int | str] = Counter()
        self._server, self._item = server, item
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _client(self) -> None:
        while not self._stop.is_set():
            outcome: int | str
            try:
                outcome = batched(self._server, self._item).status_code
            except requests.Timeout:
                outcome = "hang"
            except requests.ConnectionError:
                outcome = "connection error"
            with self._lock:
                self.outcomes[outcome] += 1

    def completed(self) -> int:
        with self._lock:
            return sum(self.outcomes.values())

    def wait_for(self, more: int) -> None:
        target = self.completed() + more
        eventually(lambda: self.completed() >= target, f"{more} more requests completed")

    def stop(self) -> Counter[int | str]:
        self._stop.set()
        for thread in self._threads:
            thread.join(CLIENT_TIMEOUT + 10)
        return self.outcomes


@pytest.fixture(scope="module")
def one_slot() -> Iterator[Server]:
    """One worker running one request at a time, with room for two more in its queue."""
    env = {**SCRIPTED, "SERVE_WORKERS": "1", "SERVE_MAX_BATCH_SIZE": "1", "SERVE_MAX_QUEUE": "2"}
    with gunicorn(env) as server:
        yield server


def test_a_full_queue_answers_503_with_retry_after_at_once(one_slot: Server) -> None:
    with ThreadPoolExecutor(3) as pool:
        running = pool.submit(batched, one_slot, "sleep:3")
        eventually(lambda: ask(one_slot, "busy") == 1, "the model is busy")
        queued = [pool.submit(batched, one_slot, name) for name in ("q1", "q2")]
        eventually(lambda: queue_depth(one_slot) == 2, "two requests are queued")
        started = time.monotonic()
        refused = batched(one_slot, "one too many")
        elapsed = time.monotonic() - started
        assert refused.status_code == 503
        assert int(refused.headers["Retry-After"]) >= 1
        assert "queue is full" in refused.json()["error"]
        assert elapsed < 2.5, "a full queue must refuse at once, not after the running batch"
        assert [f.result().status_code for f in (running, *queued)] == [200, 200, 200]


def test_an_expired_deadline_gets_504_and_never_reaches_the_model(one_slot: Server) -> None:
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(batched, one_slot, "sleep:2")
        eventually(lambda: ask(one_slot, "busy") == 1, "the model is busy")
        expired = batched(one_slot, "victim", timeout_ms=200)
        assert expired.status_code == 504
        assert "deadline" in expired.json()["error"]
        assert running.result().status_code == 200
    overrun = batched(one_slot, "sleep:1", timeout_ms=200)  # times out while its batch runs
    assert overrun.status_code == 504
    assert ask(one_slot, "seen:victim") == 0.0
    assert ask(one_slot, "seen:sleep:1") == 1.0
    eventually(lambda: ask(one_slot, "busy") == 0, "the overrunning batch ended")
    assert batched(one_slot, "after").json()["outputs"] == [[5.0]]


def test_a_request_whose_client_hung_up_is_never_computed(one_slot: Server) -> None:
    def scrape() -> Scrape:
        return Scrape.parse(requests.get(one_slot.url + "/metrics", timeout=CLIENT_TIMEOUT).text)

    rejected = scrape().total("serve_rejected_requests_total")  # other tests share this server
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(batched, one_slot, "sleep:2")
        eventually(lambda: ask(one_slot, "busy") == 1, "the model is busy")
        # A raw client sends its request behind the running batch, then hangs up.
        body = b'{"inputs": ["abandoned"]}'
        with socket.create_connection(("127.0.0.1", one_slot.port), timeout=CLIENT_TIMEOUT) as sock:
            sock.sendall(
                b"POST /predict/batched HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            eventually(lambda: queue_depth(one_slot) == 1, "the request is queued")
        assert running.result().status_code == 200
    eventually(lambda: queue_depth(one_slot) == 0, "the queue is empty")
    assert batched(one_slot, "after").json()["outputs"] == [[5.0]]
    assert ask(one_slot, "seen:abandoned") == 0.0
    metrics = scrape()
    assert metrics.total("serve_http_requests_total", code="499", route="/predict/batched") == 1
    # A series of their own, by model; the 503s' series keeps its meaning.
    assert metrics.total("serve_abandoned_requests_total") == 1
    assert metrics.total("serve_rejected_requests_total") == rejected


def test_a_burst_of_timeouts_leaves_nothing_behind() -> None:
    with gunicorn({**SCRIPTED, "SERVE_WORKERS": "1"}) as server:
        pid = int(ask(server, "pid"))
        rss: list[int] = []
        for _ in range(4):
            # The burst must arrive while the sleeper runs, or the model, idle again, answers
            # part of it in time: a thread for each request at once (the sleeper, 40, then 4;
            # with fewer, the last of the burst waits for a thread), and a sleeper long enough
            # for a loaded machine to see it busy and send the burst.
            with ThreadPoolExecutor(45) as pool:
                sleeper = pool.submit(batched, server, "sleep:1.0")
                eventually(lambda: ask(server, "busy") == 1, "the model is busy")
                burst = list(pool.map(lambda i: batched(server, f"t{i}", timeout_ms=50), range(40)))
                overruns = [pool.submit(batched, server, "sleep:0.3", timeout_ms=100) for _ in range(4)]
                assert sleeper.result().status_code == 200
                assert {r.status_code for r in burst} | {f.result().status_code for f in overruns} == {504}
            eventually(lambda: queue_depth(server) == 0 and ask(server, "busy") == 0, "the queue is empty")
            rss.append(rss_bytes(pid) or 0)
        assert ask(server, "seen:t0") == 0.0  # every timed-out request was dropped unseen
        assert rss[-1] - rss[1] < 16 << 20, f"worker RSS grew from {rss[1]} to {rss[-1]} bytes"
        assert batched(server, "ok").status_code == 200


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_sigterm_finishes_every_queued_and_running_request(worker_class: str) -> None:
    env = {
        **SCRIPTED,
        "SERVE_WORKER_CLASS": worker_class,
        "SERVE_WORKERS": "1",
        "SERVE_MAX_BATCH_SIZE": "1",
        "SERVE_MAX_QUEUE": "16",
    }
    with gunicorn(env) as server, ThreadPoolExecutor(8) as pool:
        accepted = [pool.submit(batched, server, "sleep:2")]
        eventually(lambda: ask(server, "busy") == 1, "the model is busy")
        accepted += [pool.submit(batched, server, "sleep:0.2") for _ in range(7)]
        eventually(lambda: queue_depth(server) == 7, "one request runs and seven are queued")
        server.signal(signal.SIGTERM)
        assert [f.result().status_code for f in accepted] == [200] * 8
        # The clients keep their connections alive. gthread lets a stopping worker's idle
        # kept-alive connections linger 2 s at most; gevent keeps them open until
        # `keepalive` runs out, so the master kills that worker at graceful_timeout, once
        # it has answered everything (see docs/reliability.md, "Graceful shutdown").
        if worker_class == "gthread":
            assert server.process.wait(30) == 0
            assert "Batcher drained" in server.log()
        else:
            assert server.process.wait(60) == 0


def test_sighup_replaces_workers_without_a_failed_request() -> None:
    # Workers that take 2 s to load: a reload must not route requests to them meanwhile.
    # Built in each worker (not once in the master), so that each new worker does take them.
    env = {
        **SCRIPTED,
        "SERVE_MODEL": "tests.support.models:scripted_slow_start",
        "SERVE_WORKERS": "2",
        "SERVE_SHARE_WEIGHTS": "off",
    }
    with gunicorn(env) as server:
        old = set(server.workers())
        load = Load(server, clients=4, item="sleep:0.05")
        load.wait_for(20)
        server.signal(signal.SIGHUP)
        eventually(
            lambda: len(set(server.workers()) - old) == 2 and not old & set(server.workers()),
            "two new workers replaced the old ones",
        )
        eventually(lambda: server.get("/readyz").status_code == 200, "the new workers are ready")
        load.wait_for(20)
        outcomes = load.stop()
        assert set(outcomes) == {200}, outcomes


def test_workers_replaced_after_max_requests_fail_no_request() -> None:
    # SERVE_MAX_REQUESTS=30, a tenth of jitter: each worker is replaced after 30 to 33
    # requests, and its replacement takes 2 s to load its model.
    env = {
        **SCRIPTED,
        "SERVE_MODEL": "tests.support.models:scripted_slow_start",
        "SERVE_WORKERS": "2",
        "SERVE_MAX_REQUESTS": "30",
        "SERVE_SHARE_WEIGHTS": "off",  # each replacement loads for itself
    }
    with gunicorn(env) as server:
        first = set(server.workers())
        load = Load(server, clients=4, item="sleep:0.02")
        eventually(lambda: not first & set(server.workers()), "both first workers were replaced")
        load.wait_for(20)  # served by the replacements
        outcomes = load.stop()
        assert set(outcomes) == {200}, outcomes
        assert server.log().count("Autorestarting worker after current request.") >= 2


def test_sigkill_of_a_worker_fails_only_the_requests_it_held() -> None:
    with gunicorn({**SCRIPTED, "SERVE_WORKERS": "2"}) as server:
        load = Load(server, clients=8, item="sleep:0.2")
        load.wait_for(10)
        victim = server.workers()[0]
        os.kill(victim, signal.SIGSTOP)  # freeze it so it accepts nothing more while we count
        held = established_connections(victim, server.port)
        os.kill(victim, signal.SIGKILL)
        eventually(lambda: len(server.workers()) == 2 and victim not in server.workers(), "a replacement")
        load.wait_for(20)  # the other worker, then the replacement too, keep serving
        outcomes = load.stop()
        assert set(outcomes) <= {200, "connection error"}, outcomes
        assert outcomes["connection error"] <= held, (outcomes, held)
        assert "hang" not in outcomes


@pytest.mark.parametrize("fault", ["die", "wedge"])
def test_a_batcher_fault_turns_readyz_503_and_the_worker_is_replaced(fault: str) -> None:
    env = {
        **SCRIPTED,
        "SERVE_WORKERS": "1",
        "SERVE_REQUEST_TIMEOUT_MS": "500",
        "SERVE_STALL_TIMEOUT_MS": "1000",
    }
    with gunicorn(env) as server:
        first = ask(server, "pid")
        # A kept-alive connection still reaches the faulty worker while it winds down.
        probe = requests.Session()
        assert probe.get(server.url + "/readyz", timeout=CLIENT_TIMEOUT).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            faulty = pool.submit(batched, server, fault)
            seen: list[tuple[int, str]] = []

            def replaced() -> bool:
                try:
                    ready = probe.get(server.url + "/readyz", timeout=CLIENT_TIMEOUT)
                except requests.ConnectionError:
                    return False
                seen.append((ready.status_code, ready.json().get("error", "")))
                # Only the probe's kept-alive connection reaches the failing worker once it
                # stops accepting, so nothing else is asked until it has answered 503.
                if ready.status_code != 200 or 503 not in [status for status, _ in seen]:
                    return False
                return ask(server, "pid") != first

            eventually(replaced, "/readyz turned 503, then a new worker was ready")
            assert faulty.result().status_code == (500 if fault == "die" else 504)
        not_ready = [error for status, error in seen if status == 503]
        assert not_ready, f"/readyz never answered 503: {seen}"
        assert "batch thread" in not_ready[0]
        assert batched(server, "ok").status_code == 200
        assert ("died (SystemExit)" if fault == "die" else "is stuck") in server.log()

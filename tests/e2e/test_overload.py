"""Open-loop overload against real gunicorn: the service sheds with 503s and keeps its latency budget.

Requests arrive on a Poisson schedule at several times the measured capacity,
whatever the service does (scripts/load/openloop.py), and each latency is timed from
the request's scheduled send. The model is tests.support.models:sleepy: each
batch of up to 8 items takes 0.1 s and leaves the CPU free, as a model on a GPU
does, so capacity is about 80 requests a second whatever else the shared
machine runs, and what is measured is the shedding. (The soak test,
tests/e2e/test_soak.py, overloads a CPU-bound MLP.) One worker, to leave the
other core to the generator.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import statistics
import threading
import time
from typing import NamedTuple

import pytest
import requests

from scripts.load import openloop
from tests.support.metrics import Scrape
from tests.support.nginx import NGINX, SKIP_REASON, nginx
from tests.support.raw_http import read_response
from tests.support.server import Server, gunicorn

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(120)]

BUDGET_MS = 1000
OVERLOAD = {
    "SERVE_MODEL": "tests.support.models:sleepy",
    "SERVE_MAX_BATCH_SIZE": "8",
    "SERVE_WORKERS": "1",
    "SERVE_LATENCY_BUDGET_MS": str(BUDGET_MS),
}
BODY = json.dumps({"inputs": [0.1]}).encode()


def bodies() -> list[openloop.Request]:
    return [openloop.Request(BODY, "/predict/batched"), openloop.Request(BODY, "/predict")]


def rejected_over_budget(server: Server) -> float:
    metrics = Scrape.parse(server.get("/metrics").text)
    assert any(s["reason"] == "over_budget" for s in metrics.series("serve_rejected_requests_total"))
    return metrics.total("serve_rejected_requests_total", reason="over_budget")


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_open_loop_overload_is_shed_with_503s_and_accepted_requests_keep_the_budget(
    worker_class: str,
) -> None:
    with gunicorn({**OVERLOAD, "SERVE_WORKER_CLASS": worker_class}) as server:
        url = server.url + "/predict/batched"
        capacity = openloop.closed_loop(url, bodies(), clients=32, seconds=4)
        assert capacity > 0
        result = openloop.run(url, bodies(), 4 * capacity, seconds=8, timeout_s=30)
        summary = result.summary()
        statuses = summary["by_status"]

        # Every request got an answer, and only these two: no other 5xx, no
        # connection error, nothing timed out.
        assert set(statuses) == {"200", "503"}, summary
        assert summary["refused_with_retry_after"] == statuses["503"], "a 503 without Retry-After"
        assert rejected_over_budget(server) > 0
        # Not a collapse: most of what the service can do still gets done.
        assert summary["goodput_rps"] >= 0.6 * capacity, summary
        # Bounded by the budget, not by the offered load (unshed, the backlog
        # would grow for the whole run: 8 s x 3 capacities of excess). The
        # budget counts from arrival at the worker, the client's clock from the
        # scheduled send, and the prediction is an average: some slack at p99.
        assert summary["accepted_ms"]["p50"] <= BUDGET_MS, summary
        assert summary["accepted_ms"]["p99"] <= 2.5 * BUDGET_MS, summary
        # The backlog is gone within 2 s of the last send.
        assert summary["drain_s"] <= 2.0, summary

        # Afterwards the service is ready and a lone request is served at once.
        assert server.get("/readyz").status_code == 200
        lone = requests.post(
            url, data=bodies()[0].body, headers={"Content-Type": "application/json"}, timeout=30
        )
        assert lone.status_code == 200
        assert lone.elapsed.total_seconds() < BUDGET_MS / 1000


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_a_refused_request_with_a_large_body_leaves_its_connection_usable(worker_class: str) -> None:
    # The door refuses before reading the body. A body larger than what gunicorn
    # skips on its own (64 KiB) used to leave a connection announced as
    # keep-alive, then closed: the client's next request on it failed.
    body = b'{"inputs": [' + b"0.1, " * (100 << 10) + b"0.1]}"  # 500 KiB, under SERVE_MAX_BODY_BYTES
    with (
        gunicorn({**OVERLOAD, "SERVE_WORKER_CLASS": worker_class}) as server,
        socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock,
    ):
        for _ in range(2):
            # nginx's X-Request-Start saying it waited 60 s: past the 30 s deadline whatever the
            # stamp's rounding (at 30 s, one in four runs read 29.9997 s and was let in: a 413).
            sock.sendall(
                b"POST /predict/batched HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                b"X-Request-Start: t=%.3f\r\nContent-Length: %d\r\n\r\n"
                % (time.time() - 60, len(body))
                + body
            )
            head, _ = read_response(sock)
            assert head.startswith(b"HTTP/1.1 503"), head
            assert b"connection: keep-alive" in head.lower(), head
        sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: test\r\n\r\n")
        head, _ = read_response(sock)
        assert head.startswith(b"HTTP/1.1 200"), "the connection did not carry the next request"


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_a_kept_alive_request_refused_while_the_door_refuses_gets_the_doors_answer(worker_class: str) -> None:
    # Once the door has refused, gthread's event loop checks kept-alive requests
    # itself and answers refusals without a request thread (service.host.worker);
    # gevent checks a request that arrives during a hold before gunicorn parses it,
    # and its door answers the others in their greenlets. Either way the answer is the
    # door's: the route's error shape, Retry-After, the client's request id, the
    # connection kept, held, and then serving the client's next request.
    stale = b"X-Request-Start: t=%.3f\r\n" % (time.time() - 60)  # past the 30 s deadline
    openai_body = b'{"input": "a sentence", "model": "sleepy"}'

    def post(sock: socket.socket, path: bytes, body: bytes, headers: bytes = b"") -> tuple[bytes, bytes]:
        sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\n\r\n%s" % (path, headers, len(body), body)
        )
        return read_response(sock)

    with (
        gunicorn({**OVERLOAD, "SERVE_WORKER_CLASS": worker_class}) as server,
        socket.create_connection(("127.0.0.1", server.port), timeout=30) as first,
        socket.create_connection(("127.0.0.1", server.port), timeout=30) as kept,
    ):
        kept.sendall(b"GET /readyz HTTP/1.1\r\nHost: test\r\n\r\n")
        assert read_response(kept)[0].startswith(b"HTTP/1.1 200")
        first_head, _ = post(first, b"/predict/batched", BODY, stale)
        assert first_head.startswith(b"HTTP/1.1 503"), first_head

        # A new connection's first request, while the door refuses (gthread's loop
        # checks it when it arrives, without a thread): the same answer, the
        # connection held, then serving its client's next request.
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as fresh:
            fresh_head, _ = post(fresh, b"/predict/batched", BODY, stale)
            assert fresh_head.startswith(b"HTTP/1.1 503"), fresh_head
            assert {line.partition(b":")[0] for line in fresh_head.split(b"\r\n")[1:]} == {
                line.partition(b":")[0] for line in first_head.split(b"\r\n")[1:]
            }
            assert post(fresh, b"/predict/batched", BODY)[0].startswith(b"HTTP/1.1 200")

        head, body = post(kept, b"/v1/embeddings", openai_body, stale + b"X-Request-ID: e2e-kept-42\r\n")
        assert head.startswith(b"HTTP/1.1 503"), head
        fields = dict(
            (name.strip().lower(), value.strip())
            for name, _, value in (line.partition(b":") for line in head.split(b"\r\n")[1:])
        )
        first_fields = {line.partition(b":")[0].strip().lower() for line in first_head.split(b"\r\n")[1:]}
        assert set(fields) == first_fields, (head, first_head)
        assert fields[b"connection"] == b"keep-alive"
        assert fields[b"x-request-id"] == b"e2e-kept-42"
        assert int(fields[b"retry-after"]) >= 1
        error = json.loads(body)["error"]  # OpenAI's shape, as that route's refusals always are
        assert error["type"] and "overloaded" in error["message"], error

        # Sent again during its hold, still stale: refused again, with the same answer
        # (gevent checks it at the door before gunicorn parses it), and held again.
        again, again_body = post(
            kept, b"/v1/embeddings", openai_body, stale + b"X-Request-ID: e2e-kept-43\r\n"
        )
        assert again.startswith(b"HTTP/1.1 503"), again
        assert b"X-Request-ID: e2e-kept-43" in again
        assert json.loads(again_body)["error"]["type"] == error["type"]
        refused_at = time.monotonic()

        # Held for its hold (half the 1 s budget at most), then the connection serves the next request.
        head, body = post(kept, b"/predict/batched", BODY)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert json.loads(body)["outputs"]
        assert time.monotonic() - refused_at < 2.0
        assert rejected_over_budget(server) == 4


class Storm(NamedTuple):
    served: list[int]  # each client's 200s
    refused: int  # 503s
    after_refusal: list[float]  # for each 200 answering a resend, the seconds from the 503 before it
    first_try: list[float]  # for each 200 answering a request not refused before, its latency
    late: int = 0  # 504s: admitted, and its deadline passed before its answer


def storm(port: int, clients: int, seconds: float) -> Storm:
    """Closed-loop clients that resend the moment they are answered, 503 included, each on its own
    kept-alive connection, as wrk or a hand-written loop does."""
    lock = threading.Lock()
    tally = {"refused": 0, "late": 0}
    served = [0] * clients
    after_refusal: list[float] = []
    first_try: list[float] = []
    end = time.monotonic() + seconds

    def client(index: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        refused_at = None
        while time.monotonic() < end:
            sent = time.monotonic()
            conn.request("POST", "/predict/batched", BODY, {"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            now = time.monotonic()
            with lock:
                if response.status == 200:
                    served[index] += 1
                    if refused_at is not None:
                        after_refusal.append(now - refused_at)
                    else:
                        first_try.append(now - sent)
                elif response.status == 504:
                    tally["late"] += 1
                else:
                    tally["refused"] += 1
            assert response.status in (200, 503, 504), response.status
            refused_at = now if response.status == 503 else None
        conn.close()

    threads = [threading.Thread(target=client, args=(index,)) for index in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds + 60)
    return Storm(served, int(tally["refused"]), after_refusal, first_try, int(tally["late"]))


# Clients that resend at once are refused only when their requests cannot be
# answered in time: with the deadline at the budget, a closed loop longer than
# the budget is one. (With the default deadline they are all answered:
# test_closed_loop_clients_past_the_budget_are_all_answered_by_their_deadline.)
SHORT_DEADLINE = {**OVERLOAD, "SERVE_REQUEST_TIMEOUT_MS": str(BUDGET_MS)}


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_closed_loop_clients_past_the_budget_are_all_answered_by_their_deadline(worker_class: str) -> None:
    # 128 clients keep a queue of 1.6 s, past the 1 s budget; they send no faster
    # than they are answered, so the service keeps up and refuses none.
    with gunicorn({**OVERLOAD, "SERVE_WORKER_CLASS": worker_class}) as server:
        capacity = openloop.closed_loop(server.url + "/predict/batched", bodies(), clients=16, seconds=4)
        served, refused, _, first_try, late = storm(server.port, 128, 6.0)
    assert refused == 0 and late == 0
    assert statistics.median(first_try) > BUDGET_MS / 1000, (
        "128 clients fit the budget: the test no longer tests"
    )
    assert served.count(0) == 0, served
    assert sum(served) / 6.0 >= 0.8 * capacity, (sum(served) / 6.0, capacity)


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_clients_that_resend_at_once_get_the_capacity_not_a_storm_of_refusals(worker_class: str) -> None:
    # 128 clients hold three times the requests the deadline admits. Each refusal
    # holds its connection for its Retry-After (1 s), at most half the
    # budget (0.5 s here), before the worker reads the resend, unless the batcher
    # has room for it sooner; so the refusals stay under two a second a client:
    # without the hold they ran to thousands a second and took the CPU from the model.
    hold_s = BUDGET_MS / 2000
    clients, seconds = 128, 6.0
    # A queue the budget fills before its limit, as the defaults' is (4 batches of 64).
    env = {**SHORT_DEADLINE, "SERVE_WORKER_CLASS": worker_class, "SERVE_MAX_QUEUE": "256"}
    with gunicorn(env) as server:
        capacity = openloop.closed_loop(server.url + "/predict/batched", bodies(), clients=16, seconds=4)
        served, refused, after_refusal, _, late = storm(server.port, clients, seconds)
    assert refused > 0, "128 clients fit the budget: the test no longer overloads"
    # Admitted on a prediction within a 1 s deadline, a few can miss it (504); not many.
    assert late <= 0.05 * sum(served), (late, sum(served))
    most = clients * (seconds / hold_s + 1)
    assert refused <= most, f"{refused} refusals in {seconds} s from {clients} clients"
    # A held resend's wait counts from when it was sent, the moment its 503 came back.
    assert max(after_refusal) <= BUDGET_MS / 1000 + 0.5, max(after_refusal)
    # Held clients are let in longest held first, so clients take turns rather
    # than the first served keeping every place.
    assert served.count(0) <= clients // 2, f"{served.count(0)} of {clients} clients were never served"
    # Not the collapse the storm was; the benchmark (scripts/load/resenders.py) measures how close.
    assert sum(served) / seconds >= 0.6 * capacity, (sum(served) / seconds, capacity)


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_a_held_resend_is_let_in_as_soon_as_the_batcher_has_room(worker_class: str) -> None:
    # 80 clients, threads for each, and about 66 requests' room within the
    # deadline's margin: a few are refused at a time. Each answer makes room, and
    # the longest held resend takes it before the client just answered resends.
    hold_s = BUDGET_MS / 2000
    env = {
        **SHORT_DEADLINE,
        "SERVE_WORKER_CLASS": worker_class,
        "SERVE_MAX_QUEUE": "256",
        "SERVE_THREADS": "96",
    }
    with gunicorn(env) as server:
        # 16 clients first, for the worker to learn its rate.
        openloop.closed_loop(server.url + "/predict/batched", bodies(), clients=16, seconds=3)
        served, refused, after_refusal, first_try, late = storm(server.port, 80, 6.0)
    assert late <= 0.05 * sum(served), (late, sum(served))
    assert refused > 0 and after_refusal, "80 clients fit the deadline: the test no longer overloads"
    # A resend waits for the work queued ahead of it, as any request does, and
    # for its turn among the held, less than its hold: it is let in early.
    queued = statistics.median(first_try)
    assert statistics.median(after_refusal) < queued + 0.9 * hold_s, (queued, sorted(after_refusal))
    assert max(after_refusal) <= BUDGET_MS / 1000 + 0.5, max(after_refusal)
    assert served.count(0) == 0, served


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_a_resend_that_finds_room_is_let_in_as_it_arrives_not_when_its_hold_ends(worker_class: str) -> None:
    # Room comes from answers, and each answer lets the held in; here no answer
    # follows the resend. The service is idle when it arrives, and nothing but
    # its own arrival can let it in before its hold ends.
    env = {**OVERLOAD, "SERVE_WORKER_CLASS": worker_class, "SERVE_LATENCY_BUDGET_MS": "4000"}
    fresh = b"POST /predict/batched HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    with (
        gunicorn(env) as server,
        socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock,
    ):
        # nginx's X-Request-Start saying it waited 60 s: past the 30 s deadline, refused and held.
        sock.sendall(
            fresh
            + b"X-Request-Start: t=%.3f\r\nContent-Length: %d\r\n\r\n%s" % (time.time() - 60, len(BODY), BODY)
        )
        head, _ = read_response(sock)
        refused_at = time.monotonic()
        assert head.startswith(b"HTTP/1.1 503"), head
        retry_after = float(re.search(rb"(?im)^retry-after: *(\d+)", head).group(1))  # type: ignore[union-attr]
        hold_s = min(retry_after, 2.0)  # half the 4 s budget caps it at 2
        time.sleep(0.1)  # the worker is waiting out the hold by now
        sock.sendall(fresh + b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
        head, _ = read_response(sock)
        waited = time.monotonic() - refused_at
    assert head.startswith(b"HTTP/1.1 200"), head
    # 0.1 s before the resend and 0.1 s for its batch; the hold is 1 s or more.
    assert waited < 0.6 * hold_s, (waited, hold_s)


@pytest.mark.skipif(NGINX is None, reason=SKIP_REASON)
def test_clients_that_resend_at_once_through_nginx_are_held_too() -> None:
    # nginx's kept-alive connections to the service carry every client's
    # requests. Left unheld, each resend came straight back through them, and the
    # storm was what it was without holds (64 such clients: 0.17x of capacity in
    # scripts/load/resenders.py --behind-nginx). Held, the next request on each waits
    # until the batcher has room for it, whoever sent it.
    hold_s = BUDGET_MS / 2000
    clients, seconds = 64, 6.0
    env = {**SHORT_DEADLINE, "SERVE_MAX_QUEUE": "256"}
    with gunicorn(env) as server, nginx([server.url.removeprefix("http://")], env) as proxy:
        capacity = openloop.closed_loop(proxy.url + "/predict/batched", bodies(), clients=16, seconds=4)
        served, refused, after_refusal, _, late = storm(int(proxy.url.rsplit(":", 1)[1]), clients, seconds)
    assert late <= 0.05 * sum(served), (late, sum(served))
    assert refused > 0, "64 clients fit the budget: the test no longer overloads"
    assert refused <= clients * (seconds / hold_s + 1), f"{refused} refusals in {seconds} s"
    # Through nginx few refused clients are served again within the 6 s (0 to 7 of
    # some 290 refusals in repeated runs): nginx sends each resend on whichever
    # connection it picks, so the held get no turns of their own. Those that are
    # served waited no longer than the budget allows.
    assert all(wait <= BUDGET_MS / 1000 + 0.5 for wait in after_refusal), sorted(after_refusal)
    assert sum(served) / seconds >= 0.6 * capacity, (sum(served) / seconds, capacity)


def test_a_request_too_large_for_its_deadline_gets_413_after_its_first_call_not_a_503_at_its_end() -> None:
    # 64 items of 0.1 s in batches of 8: 0.8 s of model time, past a 500 ms deadline
    # even with nothing ahead. A retry could not succeed, so it is the client's to
    # cut, not a 503 to send again; and a fresh worker, whose rate is not trusted
    # yet, knows it from the request's first call.
    body = json.dumps({"inputs": [0.1] * 64})
    headers = {"Content-Type": "application/json", "X-Request-Timeout-Ms": "500"}
    with gunicorn(OVERLOAD) as server:
        refused = requests.post(server.url + "/predict/batched", data=body, headers=headers, timeout=30)
        assert refused.status_code == 413, refused.text
        message = refused.json()["error"]
        assert "too large for its deadline: its 64 items would take about" in message
        assert re.search(r"send at most about \d+ items a request", message), message
        # With the default deadline (the request timeout) the same request is answered.
        plain = {"Content-Type": "application/json"}
        answered = requests.post(server.url + "/predict/batched", data=body, headers=plain, timeout=30)
        assert answered.status_code == 200, answered.text
        assert len(answered.json()["outputs"]) == 64


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_a_request_that_waited_in_the_accept_queue_counts_that_wait(worker_class: str) -> None:
    # The worker is stopped, so the connection waits unaccepted in the listen socket's
    # queue, where no stamp of the worker's sees it; the kernel says when its bytes
    # arrived (service.host.tcp_info). Past its 500 ms deadline by then, it is refused
    # at the door as soon as the worker reads it, not served late.
    env = {**OVERLOAD, "SERVE_WORKER_CLASS": worker_class}
    env.update(SERVE_REQUEST_TIMEOUT_MS="500", SERVE_LATENCY_BUDGET_MS="500")
    with gunicorn(env) as server:
        assert server.post("/predict/batched", json={"inputs": [0.1]}).status_code == 200
        [worker] = server.workers()
        request = (
            b"POST /predict/batched HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY
        )
        os.kill(worker, signal.SIGSTOP)
        try:
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sock.sendall(request)
            time.sleep(1.0)
        finally:
            os.kill(worker, signal.SIGCONT)
        with sock:
            head, body = read_response(sock)
        assert head.startswith(b"HTTP/1.1 503 "), head + body
        assert b"\r\nRetry-After: 1\r\n" in head
        assert "past the 500 ms it may wait" in json.loads(body)["error"]
        # A request sent now is fresh: served.
        assert server.post("/predict/batched", json={"inputs": [0.1]}).status_code == 200

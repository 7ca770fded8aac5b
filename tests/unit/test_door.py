"""Admission at the door, in process: a request that cannot be answered in time gets a cheap 503.

A request that waited past its deadline is refused whatever the pace; one that
waited only past its latency budget is served while the service keeps up
(service.batching.admission.Pace). These tests make a request old with a stale
arrival stamp, so the refusing ones shorten the deadline to the budget.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from flask.testing import FlaskClient

from service.config.settings import Settings
from service.http.arrival import ARRIVAL_ENVIRON_KEY, HOLD_ENVIRON_KEY, WAITING_ENVIRON_KEY
from service.http.door import EXTENSION
from tests.conftest import SMALL_MLP
from tests.support.metrics import Scrape

BODY = {"inputs": [[0.0] * 16]}


def test_a_request_that_waited_past_its_budget_gets_503_with_retry_after(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(SMALL_MLP.replace(latency_budget_ms=1000, request_timeout_ms=1000))
    stale = f"t={time.time() - 2:.3f}"  # as nginx stamps it: it waited 2 s before reaching the worker
    for path in ("/predict", "/predict/batched", "/predict/naive"):
        response = client.post(path, json=BODY, headers={"X-Request-Start": stale, "X-Request-ID": "abc-1"})
        assert response.status_code == 503, response.text
        assert response.headers["Retry-After"] == "1"
        assert response.headers["X-Request-ID"] == "abc-1"
        assert "past the 1000 ms it may wait" in response.json["error"]
    metrics = Scrape.parse(client.get("/metrics").text)
    assert metrics.total("serve_rejected_requests_total", reason="over_budget") == 3
    assert metrics.total("serve_http_requests_total", code="503", route="/predict/batched") == 1
    assert metrics.total("serve_http_wait_before_handler_seconds_count") == 3


def test_refused_before_the_body_is_even_parsed(make_client: Callable[[Settings], FlaskClient]) -> None:
    client = make_client(SMALL_MLP.replace(latency_budget_ms=1000, request_timeout_ms=1000))
    response = client.post(
        "/predict/batched",
        data=b"{not json",
        headers={"Content-Type": "application/json", "X-Request-Start": f"t={time.time() - 5:.3f}"},
    )
    assert response.status_code == 503


def test_while_the_service_keeps_up_a_request_past_its_budget_is_served_by_its_deadline(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    # Closed-loop clients that outnumber the request threads wait before the handler: no overload.
    client = make_client(SMALL_MLP.replace(latency_budget_ms=1000))
    stale = f"t={time.time() - 2:.3f}"
    for path in ("/predict", "/predict/batched", "/predict/naive"):
        response = client.post(path, json=BODY, headers={"X-Request-Start": stale})
        assert response.status_code == 200, response.text
    # Its client's own deadline (X-Request-Timeout-Ms) rules at the door too.
    response = client.post(
        "/predict/batched", json=BODY, headers={"X-Request-Start": stale, "X-Request-Timeout-Ms": "1500"}
    )
    assert response.status_code == 503
    assert "past the 1500 ms it may wait" in response.json["error"]


def test_a_fresh_request_and_a_forged_future_stamp_are_served(client: FlaskClient) -> None:
    for stamp in (f"t={time.time():.3f}", f"t={time.time() + 3600:.3f}", "t=garbage"):
        response = client.post("/predict/batched", json=BODY, headers={"X-Request-Start": stamp})
        assert response.status_code == 200, response.text


def test_other_paths_pass_the_door_untouched(make_client: Callable[[Settings], FlaskClient]) -> None:
    client = make_client(SMALL_MLP.replace(latency_budget_ms=1000, request_timeout_ms=1000))
    stale = {"X-Request-Start": f"t={time.time() - 5:.3f}"}
    assert client.get("/readyz", headers=stale).status_code == 200
    assert client.get("/predict/batched", headers=stale).status_code == 405
    assert client.get("/info").json["limits"]["latency_budget_ms"] == 1000


def spied(client: FlaskClient) -> list[dict[str, Any]]:
    """Each request's environ as the worker sees it once the app returns (the test client's is a copy)."""
    environs: list[dict[str, Any]] = []
    door = client.application.wsgi_app

    def seen(environ: dict[str, Any], start_response: Any) -> Any:
        environs.append(environ)
        return door(environ, start_response)

    client.application.wsgi_app = seen  # type: ignore[method-assign]
    return environs


def test_a_refused_connection_is_held_for_its_retry_after_through_a_proxy_too(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(SMALL_MLP.replace(latency_budget_ms=1000, request_timeout_ms=1000))
    environs = spied(client)
    # As the gthread worker stamps it: the connection was readable 5 s ago.
    straight = client.post(
        "/predict", json=BODY, environ_overrides={ARRIVAL_ENVIRON_KEY: time.monotonic() - 5}
    )
    assert straight.status_code == 503
    assert straight.headers["Retry-After"] == "1"
    # Held for its Retry-After, but never past half the budget: the hold counts toward it.
    assert environs[-1][HOLD_ENVIRON_KEY] == 0.5
    # Through nginx too: the next request on that connection is let in as soon as there is room.
    for header in ("X-Request-Start", "X-Forwarded-For"):
        value = f"t={time.time() - 5:.3f}" if header == "X-Request-Start" else "203.0.113.7"
        proxied = client.post(
            "/predict",
            json=BODY,
            headers={header: value},
            environ_overrides={ARRIVAL_ENVIRON_KEY: time.monotonic() - 5},
        )
        assert proxied.status_code == 503
        assert environs[-1][HOLD_ENVIRON_KEY] == 0.5
    served = client.post("/predict", json=BODY)
    assert served.status_code == 200
    assert HOLD_ENVIRON_KEY not in environs[-1]


def test_with_holds_off_a_refused_connection_is_read_again_at_once(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(
        SMALL_MLP.replace(latency_budget_ms=1000, request_timeout_ms=1000, hold_refused=False)
    )
    environs = spied(client)
    refused = client.post(
        "/predict", json=BODY, environ_overrides={ARRIVAL_ENVIRON_KEY: time.monotonic() - 5}
    )
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert HOLD_ENVIRON_KEY not in environs[-1]


STALE_ROUTES = {
    # route: its error shape (a check on the body)
    "/v1/embeddings": lambda body: "past" in body["error"]["message"],
    "/v1/rerank": lambda body: set(body) == {"message"},
    "/v2/rerank": lambda body: set(body) == {"message"},
    "/rerank/batched": lambda body: set(body) == {"error"},
    "/rerank/naive": lambda body: set(body) == {"error"},
    "/embed": lambda body: body["error_type"] == "Overloaded",
    "/rerank": lambda body: body["error_type"] == "Overloaded",
    "/": lambda body: body["error_type"] == "Overloaded",
    "/v2/models/mlp/infer": lambda body: set(body) == {"error"},
    "/v2/models/mlp/versions/1/infer": lambda body: set(body) == {"error"},
}


def test_every_prediction_route_refuses_at_the_door_in_its_own_error_shape(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    # Refused before the body is read, so the body (and whether this model serves the
    # route at all) does not matter: the wait alone refuses it.
    client = make_client(SMALL_MLP.replace(latency_budget_ms=1000, request_timeout_ms=1000))
    stale = {"X-Request-Start": f"t={time.time() - 2:.3f}"}
    for path, shaped in STALE_ROUTES.items():
        response = client.post(path, data=b"{not read", headers={**stale, "Content-Type": "application/json"})
        assert response.status_code == 503, (path, response.text)
        assert response.headers["Retry-After"] == "1", path
        assert shaped(response.json), (path, response.json)
    assert client.post("/tokenize", json={"inputs": "x"}, headers=stale).status_code != 503  # no model call
    metrics = Scrape.parse(client.get("/metrics").text)
    assert metrics.total("serve_rejected_requests_total", reason="over_budget") == len(STALE_ROUTES)
    # Counted under Flask's rule, not under a path with the model's name in it.
    assert metrics.total("serve_http_requests_total", code="503", route="/v2/models/<name>/infer") == 1
    assert metrics.total("serve_http_requests_total", code="503", route="/v2/models/mlp/infer") == 0


def test_with_several_models_the_door_refuses_for_the_model_the_url_names(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    two = SMALL_MLP.replace(model="a=mlp,b=mlp", latency_budget_ms=1000, request_timeout_ms=1000)
    client = make_client(two)
    stale = {"X-Request-Start": f"t={time.time() - 2:.3f}", "Content-Type": "application/json"}
    assert client.post("/v2/models/b/infer", data=b"{", headers=stale).status_code == 503
    assert client.post("/embed?model=b", data=b"{", headers=stale).status_code == 503
    # A body that names its model is unread: refused by the wait alone, under no model.
    assert client.post("/predict", data=b"{", headers=stale).status_code == 503
    # A name the service does not serve is the route's to answer: 404, naming those it serves.
    unknown = client.post("/v2/models/zzz/infer", data=b"{", headers=stale)
    assert unknown.status_code == 404, unknown.text
    metrics = Scrape.parse(client.get("/metrics").text)
    assert metrics.total("serve_rejected_requests_total", reason="over_budget", model="b") == 2
    assert metrics.total("serve_rejected_requests_total", reason="over_budget", model="a") == 0
    assert metrics.total("serve_rejected_requests_total", reason="over_budget") == 3


def test_the_event_loops_check_counts_only_what_it_refuses(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    # The gthread worker's event loop asks the door about a kept-alive request before
    # it waits for a thread (service.host.worker). A request it would let in is the
    # door's to count in its thread; a refusal is counted here, as in a thread.
    client = make_client(SMALL_MLP.replace(latency_budget_ms=1000, request_timeout_ms=1000))
    door = client.application.extensions[EXTENSION]
    assert not door.refusing(time.monotonic())
    plain = {"REQUEST_METHOD": "POST", "PATH_INFO": "/predict/batched", "CONTENT_LENGTH": "30"}
    assert door.check({**plain, ARRIVAL_ENVIRON_KEY: time.monotonic()}, ahead_of_thread=True) is None
    metrics = Scrape.parse(client.get("/metrics").text)
    assert metrics.total("serve_http_wait_before_handler_seconds_count") == 0

    stale = {**plain, "HTTP_X_REQUEST_START": f"t={time.time() - 2:.3f}", "HTTP_X_REQUEST_ID": "abc-2"}
    refusal = door.check(stale, ahead_of_thread=True)
    assert refusal is not None
    assert refusal.status == "503 Service Unavailable"
    assert dict(refusal.headers)["Retry-After"] == "1" and dict(refusal.headers)["X-Request-ID"] == "abc-2"
    assert "past the 1000 ms it may wait" in json.loads(refusal.body)["error"]
    assert refusal.hold_s == 0.5  # its Retry-After, at most half the budget
    assert door.refusing(time.monotonic())
    metrics = Scrape.parse(client.get("/metrics").text)
    assert metrics.total("serve_rejected_requests_total", reason="over_budget") == 1
    assert metrics.total("serve_http_requests_total", code="503", route="/predict/batched") == 1
    assert metrics.total("serve_http_wait_before_handler_seconds_count") == 1


def test_the_event_loop_refuses_what_would_wait_too_long_for_a_thread(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    # A request the loop lets in waits for a thread behind those waiting already,
    # as long as the batcher takes to answer that many; the door in its thread
    # would refuse it for that wait, so the loop refuses it now, where it is cheap.
    client = make_client(SMALL_MLP.replace(latency_budget_ms=1000, request_timeout_ms=1000))
    for _ in range(40):  # the service rate is trusted once 32 requests are served
        assert client.post("/predict/batched", json=BODY).status_code == 200
    door = client.application.extensions[EXTENSION]
    fresh = {"REQUEST_METHOD": "POST", "PATH_INFO": "/predict/batched", "CONTENT_LENGTH": "30"}
    crowd = {WAITING_ENVIRON_KEY: 10**9}  # more than a second's answers ahead of it

    def ahead(environ: dict[str, Any]) -> Any:
        return door.check({**environ, ARRIVAL_ENVIRON_KEY: time.monotonic()}, ahead_of_thread=True)

    # While the service keeps up, a queue for threads is a closed loop's, answered by its deadline.
    assert ahead(fresh) is None and ahead({**fresh, **crowd}) is None
    # Once arrivals outrun the answers (the pace's verdict, stood in for here):
    gate = door._runtime.batcher.gate
    outlook = gate.door_outlook
    gate.door_outlook = lambda items: (outlook(items)[0], True)
    assert ahead(fresh) is None
    refusal = ahead({**fresh, **crowd})
    assert refusal is not None
    assert "more for a thread" in json.loads(refusal.body)["error"]
    # In its thread, its wait is behind it and counted as it was.
    assert door.check({**fresh, **crowd, ARRIVAL_ENVIRON_KEY: time.monotonic()}) is None


def test_a_deadline_header_of_thousands_of_digits_is_the_routes_400_not_an_error(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(SMALL_MLP.replace(latency_budget_ms=1000))
    response = client.post("/predict/batched", json=BODY, headers={"X-Request-Timeout-Ms": "9" * 5000})
    assert response.status_code == 400, response.text
    assert "X-Request-Timeout-Ms must be a positive integer" in response.json["error"]

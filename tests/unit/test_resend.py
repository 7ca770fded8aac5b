"""A resend told from a new request on a held connection (service.http.resend), and what carries the digest.

A refused request that is held leaves its body's digest on its connection;
the request read after the hold is a resend only if its body has that
digest. The pace counts a new one as demand, a resend not again.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable
from typing import Any

from flask.testing import FlaskClient

from service.config.settings import Settings
from service.host.worker import StampedApp, arrivals_local, take_refused_digest
from service.http.arrival import HELD_OUT, HOLD_ENVIRON_KEY, LET_IN, RETURNING_ENVIRON_KEY, ask_to_hold
from service.http.linger import Linger, discard_body
from service.http.resend import (
    BODY_ENVIRON_KEY,
    HELD_DIGEST_ENVIRON_KEY,
    REFUSED_DIGEST_ENVIRON_KEY,
    digest,
    digester,
    is_resend,
)
from service.runtime import EXTENSION
from tests.conftest import SMALL_MLP

MiB = 1 << 20
REFUSED = json.dumps({"inputs": [[0.0] * 16]}).encode()
NEW = json.dumps({"inputs": [[1.0] * 16]}).encode()


def test_a_resend_has_the_refused_bodys_digest_and_a_new_request_does_not() -> None:
    held = digest(REFUSED)
    assert is_resend(held, REFUSED)
    assert not is_resend(held, NEW)
    # Unknown (a body not drained to its end): taken for a resend, as every one was before.
    assert is_resend(None, NEW)


def test_the_digest_of_a_body_read_in_chunks_is_that_of_the_whole() -> None:
    whole = digester()
    for chunk in (REFUSED[:5], REFUSED[5:9], REFUSED[9:]):
        whole.update(chunk)
    assert whole.digest() == digest(REFUSED)


def test_a_held_refusal_of_a_body_already_read_leaves_its_digest() -> None:
    environ: dict[str, object] = {BODY_ENVIRON_KEY: REFUSED}
    ask_to_hold(environ, 1, 2.0)
    assert environ[REFUSED_DIGEST_ENVIRON_KEY] == digest(REFUSED)
    # Refused at the door, before its body was read: the drain leaves it (below).
    unread: dict[str, object] = {}
    ask_to_hold(unread, 1, 2.0)
    assert REFUSED_DIGEST_ENVIRON_KEY not in unread


def refusing(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    start_response("503 Service Unavailable", [("Content-Type", "application/json")])
    environ[HOLD_ENVIRON_KEY] = 1.0
    return [b'{"error": "overloaded"}']


def drained(app: Any, body: bytes, max_bytes: int = 1 * MiB) -> dict[str, Any]:
    environ = {"CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body)}
    answer = app(environ, lambda *args: None)
    b"".join(answer)
    getattr(answer, "close", lambda: None)()  # as the server calls it, when there is one
    return environ


def test_a_held_refusal_whose_body_was_unread_leaves_the_digest_of_what_was_drained() -> None:
    body = b"y" * 300_000  # drained in several chunks
    assert drained(Linger(refusing, 1 * MiB, 5), body)[REFUSED_DIGEST_ENVIRON_KEY] == digest(body)
    # Not drained to its end (declared past the bound, or read only in part): unknown.
    assert REFUSED_DIGEST_ENVIRON_KEY not in drained(Linger(refusing, 100_000, 5), body)
    environ = {"HTTP_TRANSFER_ENCODING": "chunked", "wsgi.input": io.BytesIO(body), HOLD_ENVIRON_KEY: 1.0}
    assert not discard_body(environ, 100_000, 5)
    assert REFUSED_DIGEST_ENVIRON_KEY not in environ

    def not_held(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("413 Request Entity Too Large", [])
        return [b"{}"]

    assert REFUSED_DIGEST_ENVIRON_KEY not in drained(Linger(not_held, 1 * MiB, 5), body)


def test_the_worker_carries_a_refusals_digest_to_the_request_read_after_its_hold() -> None:
    seen: list[dict[str, Any]] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        seen.append(environ)
        if environ.get("PATH_INFO") == "/refuse":
            environ[HOLD_ENVIRON_KEY] = 1.0
            environ[REFUSED_DIGEST_ENVIRON_KEY] = digest(REFUSED)
        return [b"{}"]

    arrivals = arrivals_local(threading.local)
    stamped = StampedApp(app, arrivals)
    stamped({"PATH_INFO": "/refuse"}, lambda *args: None)
    # What the worker keeps on the connection once the answer is closed.
    kept = take_refused_digest(arrivals)
    assert kept == digest(REFUSED)
    assert arrivals.environ is None  # the environ is not kept past its request
    # The request read after the hold gets it; any other request does not.
    arrivals.returning, arrivals.held_digest = LET_IN, kept
    stamped({}, lambda *args: None)
    assert seen[-1][HELD_DIGEST_ENVIRON_KEY] == kept
    assert take_refused_digest(arrivals) is None  # served, not held
    arrivals.returning = None
    stamped({}, lambda *args: None)
    assert HELD_DIGEST_ENVIRON_KEY not in seen[-1]


def test_a_new_request_read_after_a_hold_is_submitted_as_demand(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(SMALL_MLP)
    batcher = client.application.extensions[EXTENSION].default.batcher
    resends: list[bool] = []
    submit = batcher.submit

    def spy(*args: Any, **kwargs: Any) -> Any:
        resends.append(kwargs["resend"])
        return submit(*args, **kwargs)

    batcher.submit = spy
    cases = [
        (REFUSED, digest(REFUSED), True),  # the refused request again
        (NEW, digest(REFUSED), False),  # an open-loop client's next, another client's through a proxy
        (NEW, None, True),  # the refused body's digest unknown: as before, a resend
    ]
    for how in (HELD_OUT, LET_IN):
        for body, held, _ in cases:
            answer = client.post(
                "/predict",
                data=body,
                content_type="application/json",
                environ_overrides={RETURNING_ENVIRON_KEY: how, HELD_DIGEST_ENVIRON_KEY: held},
            )
            assert answer.status_code == 200, answer.get_json()
    # Not read after a hold: new, whatever its body.
    assert client.post("/predict", data=REFUSED, content_type="application/json").status_code == 200
    assert resends == [resend for _ in (HELD_OUT, LET_IN) for _, _, resend in cases] + [False]

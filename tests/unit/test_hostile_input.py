"""Hostile input, in process: never a 5xx, always a JSON error, and no memory growth."""

from __future__ import annotations

import gc
import io
import tracemalloc
from collections.abc import Iterator

import orjson
import pytest
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings

from service import create_app
from service.config.settings import Settings
from service.runtime import EXTENSION
from tests.conftest import wait_until_ready
from tests.support import hostile

ROUTES = ("/predict/naive", "/predict/batched")
SETTINGS = Settings(
    model="mlp", mlp_width=hostile.WIDTH, mlp_depth=1, max_items_per_request=8, torch_threads=1
)


@pytest.fixture(scope="module")
def app_client() -> Iterator[FlaskClient]:
    # One app for the whole module: hypothesis runs hundreds of examples against it.
    app = create_app(SETTINGS)
    runtime = wait_until_ready(app)
    yield app.test_client()
    runtime.stop(timeout=10)


def check(response_status: int, body: bytes, is_json: bool, valid: bool) -> None:
    assert response_status < 500, body[:300]
    assert is_json, body[:300]
    document = orjson.loads(body)
    if response_status >= 400:
        assert isinstance(document["error"], str) and document["error"]
        assert "Traceback" not in document["error"]
        assert not valid, f"a valid request was refused: {document['error']}"
    else:
        assert response_status == 200
        assert len(document["outputs"]) >= 1


@pytest.mark.parametrize("route", ROUTES)
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=hostile.requests)
def test_hostile_requests_get_a_4xx_json_error_never_a_5xx(
    app_client: FlaskClient, route: str, request: tuple[bytes, str | None, str | None]
) -> None:
    body, content_type, timeout = request
    response = app_client.post(route, data=body, headers=hostile.headers(content_type, timeout))
    valid = hostile.is_valid(body, content_type, timeout, SETTINGS.max_items_per_request)
    check(response.status_code, response.get_data(), response.is_json, valid)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH"])
def test_other_methods_get_a_json_405(app_client: FlaskClient, route: str, method: str) -> None:
    response = app_client.open(route, method=method, data=b"{}")
    assert response.status_code == 405 and response.is_json


def _corpus() -> list[tuple[bytes, str | None]]:
    big = b'{"inputs": [[' + b"1.5," * (SETTINGS.max_body_bytes // 4 - 20) + b"1]]}"  # just under the limit
    return [
        (big, "application/json"),
        (big + b" " * 100, "application/json"),  # just over it: refused before parsing
        (b"[" * 100_000, "application/json"),
        (b'{"inputs": ' + b"[" * 1000 + b"]" * 1000 + b"}", "application/json"),
        (orjson.dumps({"inputs": ["\u202e\u0000\uffff" * 1000] * 8}), "application/json"),
        (orjson.dumps({"inputs": [[1e38] * 16] * 9}), "application/json"),
        (b"\xff\xfe" * 1000, "application/json"),
        (b"x" * 10_000, "text/plain"),
        (b"", None),
    ]


def test_hostile_requests_leave_memory_where_it_was(app_client: FlaskClient) -> None:
    corpus = _corpus()

    def one_round() -> None:
        for body, content_type in corpus:
            for route in ROUTES:
                headers = {"Content-Type": content_type} if content_type else {}
                status = app_client.post(route, data=body, headers=headers).status_code
                assert 400 <= status < 500

    for _ in range(3):
        one_round()  # warm caches and pools first
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(15):
            one_round()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 256 << 10, f"{grown} bytes still allocated after 15 rounds of hostile requests"
    assert app_client.application.extensions[EXTENSION].batcher.depth == 0


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_the_body_limit_is_exact_with_or_without_content_length(
    app_client: FlaskClient, chunked: bool
) -> None:
    limit = SETTINGS.max_body_bytes

    def post(size: int) -> int:
        body = b'{"inputs": [' + b" " * (size - 14) + b"]}"
        if not chunked:
            return app_client.post("/predict", data=body, content_type="application/json").status_code
        # As gunicorn passes a chunked body: a stream it ends itself, of no declared length.
        return app_client.post(
            "/predict",
            input_stream=io.BytesIO(body),
            content_type="application/json",
            headers={"Transfer-Encoding": "chunked"},
            environ_overrides={"wsgi.input_terminated": True},
        ).status_code

    assert post(limit) == 422  # parsed: at the limit is allowed
    assert post(limit + 1) == 413
    assert post(4 * limit) == 413


class BrokenFraming(io.BytesIO):
    """A body stream whose server-side decoding fails, as gunicorn's does on a bad chunk size."""

    def read(self, size: int | None = -1) -> bytes:
        raise RuntimeError("Invalid chunk size")

    def readinto(self, buffer: object) -> int:
        raise RuntimeError("Invalid chunk size")


@pytest.mark.parametrize("route", ROUTES)
def test_a_body_the_server_cannot_decode_is_a_400(app_client: FlaskClient, route: str) -> None:
    response = app_client.post(
        route,
        input_stream=BrokenFraming(),
        content_type="application/json",
        headers={"Transfer-Encoding": "chunked"},
        environ_overrides={"wsgi.input_terminated": True},
    )
    assert response.status_code == 400
    assert response.json == {"error": "the request body could not be read (RuntimeError)"}


class ShortBody(io.BytesIO):
    """A body stream that hands over a few bytes a read, then ends early: a client gone mid-body."""

    def read(self, size: int | None = -1) -> bytes:
        return super().read(min(3, size if size is not None and size >= 0 else 3))


@pytest.mark.parametrize("route", ROUTES)
def test_a_declared_length_is_read_in_full_or_refused(app_client: FlaskClient, route: str) -> None:
    body = b'{"inputs": [[' + b"0.5, " * (hostile.WIDTH - 1) + b"0.5]]}"

    def post(declared: int) -> tuple[int, object]:
        # The stream hands over 3 bytes a read, so the body comes in many reads.
        response = app_client.post(
            route,
            input_stream=ShortBody(body),
            content_type="application/json",
            environ_overrides={"CONTENT_LENGTH": str(declared)},  # not the stream's length
        )
        return response.status_code, response.json

    assert post(len(body))[0] == 200  # read to its end, a few bytes at a time
    status, document = post(len(body) + 10)  # the client is gone before its last 10 bytes
    assert status == 400 and isinstance(document, dict) and "error" in document
    status, document = post(SETTINGS.max_body_bytes + 1)  # refused on its declared length, unread
    assert status == 413
    assert document == {
        "error": f"the request body is over {SETTINGS.max_body_bytes} bytes (SERVE_MAX_BODY_BYTES)"
    }

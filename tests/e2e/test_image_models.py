"""End to end: real gunicorn serving an image model directory, under gthread and gevent.

Every way to send an image (a raw body as curl sends it, multipart, base64 in
JSON, tritonclient's BYTES tensors, binary and JSON) must give what the same
preprocessing and program give when run directly, on both routes; hostile
files must get a 4xx naming the problem, from the same worker, whose memory
stays where it was.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.http as triton

from scripts.common.procs import rss_bytes
from tests.support import images
from tests.support.server import Server, gunicorn

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings(images.JIT_DEPRECATED)]

MODEL = "shelf-cnn"
FILES = [
    images.photo(11, (640, 480)),
    images.photo(12, (300, 400), "PNG"),
    images.photo(13, (64, 48)),
    images.photo(14, (120, 90), "PNG"),
    images.photo(15, (200, 200), "WEBP"),
    images.photo(16, (48, 64), "PNG", mode="RGBA"),
    images.photo(17, (500, 375), "JPEG", mode="L"),
    images.photo(18, (33, 77)),
]
TYPES = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}


def media_type(data: bytes) -> str:
    from service.models.imaging import sniff

    return TYPES[sniff(data) or ""]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return images.image_model_dir(tmp_path_factory.mktemp("image-e2e"), MODEL)


@pytest.fixture(scope="module")
def want(model_dir: Path) -> list[list[dict[str, Any]]]:
    return images.top_k(images.reference(model_dir, FILES), 3)


@pytest.fixture(scope="module", params=["gthread", "gevent"])
def server(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[Server]:
    env = {
        "SERVE_MODEL": str(model_dir),
        "SERVE_WORKERS": "1",
        "SERVE_WORKER_CLASS": str(request.param),
        "SERVE_MAX_ITEMS_PER_REQUEST": "16",
    }
    with gunicorn(env) as started:
        yield started


def assert_close(got: list[list[dict[str, Any]]], want: list[list[dict[str, Any]]]) -> None:
    assert [[e["label"] for e in row] for row in got] == [[e["label"] for e in row] for row in want]
    difference = np.abs(
        np.array([[e["score"] for e in row] for row in got])
        - np.array([[e["score"] for e in row] for row in want])
    )
    assert difference.max() <= 1e-5, difference.max()


def post_raw(server: Server, route: str, data: bytes) -> requests.Response:
    # What `curl --data-binary @photo.jpg -H 'Content-Type: image/jpeg'` sends.
    return server.post(route, data=data, headers={"Content-Type": media_type(data)})


def test_raw_uploads_equal_the_direct_model_on_both_routes(
    server: Server, want: list[list[dict[str, Any]]]
) -> None:
    naive = [post_raw(server, "/predict/naive", data) for data in FILES]
    with ThreadPoolExecutor(len(FILES)) as pool:
        batched = list(pool.map(lambda data: post_raw(server, "/predict", data), FILES))
    for response in naive + batched:
        assert response.status_code == 200, response.text
        assert response.json()["model"] == MODEL
    assert_close([r.json()["outputs"][0] for r in naive], want)
    assert_close([r.json()["outputs"][0] for r in batched], want)


def test_multipart_and_base64_json_give_the_same_outputs(
    server: Server, want: list[list[dict[str, Any]]]
) -> None:
    files = [("image", (f"{i}.img", data, media_type(data))) for i, data in enumerate(FILES)]
    inputs = [base64.b64encode(data).decode() for data in FILES]
    inputs[1] = "data:image/png;base64," + inputs[1]
    for route in ("/predict/naive", "/predict/batched"):
        multipart = server.post(route, files=files)
        as_json = server.post(route, json={"inputs": inputs})
        for response in (multipart, as_json):
            assert response.status_code == 200, response.text
            assert response.headers["X-Batch-Size"] == str(len(FILES))
            assert_close(response.json()["outputs"], want)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json-base64"])
def test_tritonclient_bytes_give_the_same_outputs(
    server: Server, want: list[list[dict[str, Any]]], binary: bool
) -> None:
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        assert client.get_model_metadata(MODEL)["inputs"] == [
            {"name": "input", "datatype": "BYTES", "shape": [-1]}
        ]
        tensor = triton.InferInput("input", [len(FILES)], "BYTES")
        # JSON carries BYTES elements as strings: the files go as base64 there.
        elements = FILES if binary else [base64.b64encode(data) for data in FILES]
        tensor.set_data_from_numpy(np.array(elements, dtype=np.object_), binary_data=binary)
        output = triton.InferRequestedOutput("output", binary_data=binary)
        result = client.infer(MODEL, [tensor], outputs=[output], request_id="photo-1")
    finally:
        client.close()
    got = [json.loads(element) for element in result.as_numpy("output")]
    assert_close(got, want)
    assert result.get_response()["id"] == "photo-1"


def test_hostile_images_get_only_4xx_from_a_worker_that_stays_up_and_small(server: Server) -> None:
    (pid,) = server.workers()
    corpus = images.hostile_images()
    rss = []
    for _ in range(12):
        for name, (data, content_type, status) in corpus.items():
            for route in ("/predict/naive", "/predict/batched"):
                response = server.post(route, data=data, headers={"Content-Type": content_type})
                assert response.status_code == status, (name, response.text)
                assert response.headers["Content-Type"] == "application/json"
                assert response.json()["error"]
        rss.append(rss_bytes(pid) or 0)
    assert server.workers() == [pid]
    assert post_raw(server, "/predict", FILES[0]).status_code == 200
    # Decoding leaves the allocator's arenas a little larger in the first rounds;
    # a leak of the decoded images (megabytes each) would climb every round.
    warm = rss[3]
    assert rss[-1] - warm < 16 << 20, f"worker RSS went from {warm} to {rss[-1]} bytes: {rss}"

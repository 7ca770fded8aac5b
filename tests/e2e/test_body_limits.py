"""Body limits on real gunicorn: a phone's photo fits an image model, and every client reads a refusal.

With SERVE_MODEL alone, an image model directory takes a 12-megapixel JPEG and
a WebP of more than 8 MiB on both routes, and a HEIC file gets a 415 that names
the formats served. A body refused while it is still arriving (413 over the
limit, 401 before it is read) is read to its end before the connection closes,
so urllib, which sends the whole body before it reads, sees the status and the
JSON error as requests does: under gthread and gevent, and behind nginx.
"""

from __future__ import annotations

import io
import json
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import requests
from PIL import Image

from service.config.settings import DEFAULT_BODY_BYTES, image_body_bytes
from tests.support import images
from tests.support.nginx import NGINX, SKIP_REASON, nginx
from tests.support.server import Server, gunicorn

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), pytest.mark.filterwarnings(images.JIT_DEPRECATED)]

TOKEN = "sesame"
JSON = {"Content-Type": "application/json"}
# A body of texts just over the text models' default limit (8 MiB), as JSON.
OVER = b'{"inputs": ["' + b"x" * DEFAULT_BODY_BYTES + b'"]}'


def camera_photo(size: tuple[int, int], fmt: str, noise: float, **options: object) -> bytes:
    """A photo-like file of ``size``: smooth light and shade plus sensor noise, as a phone's camera saves."""
    width, height = size
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    light = [127 + 100 * np.sin(x / (300 + 50 * c)) * np.cos(y / (200 + 30 * c)) for c in range(3)]
    noisy = np.stack(light, axis=-1) + np.random.default_rng(0).normal(0, noise, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB").save(buffer, fmt, **options)
    return buffer.getvalue()


def heic_header() -> bytes:
    """The first bytes of an iPhone's HEIC photo: an ftyp box of brand heic, then its meta box."""
    brands = b"heic" + b"\0\0\0\0" + b"mif1heic"
    return struct.pack(">I", 8 + len(brands)) + b"ftyp" + brands + b"\0\0\0\x28meta" + bytes(4096)


# -- an image model with SERVE_MODEL alone -------------------------------------------------


@pytest.fixture(scope="module")
def photo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = images.image_model_dir(tmp_path_factory.mktemp("photos"))
    with gunicorn({"SERVE_MODEL": str(directory)}) as started:
        yield started


@pytest.fixture(scope="module")
def phone_files() -> dict[str, bytes]:
    files = {
        "image/jpeg": camera_photo((4000, 3000), "JPEG", 6, quality=95),
        "image/webp": camera_photo((4000, 3000), "WEBP", 16, quality=100),
    }
    assert 3_000_000 < len(files["image/jpeg"]) < 6_000_000, len(files["image/jpeg"])
    # Over the text models' limit, which an image model's limit must not be.
    assert len(files["image/webp"]) > DEFAULT_BODY_BYTES, len(files["image/webp"])
    return files


def test_the_body_limit_of_an_image_model_follows_its_pixel_limit(photo_server: Server) -> None:
    limits = photo_server.get("/info").json()["limits"]
    assert limits["max_body_bytes"] == image_body_bytes(4096 * 4096) == 22 << 20


@pytest.mark.parametrize("route", ["/predict", "/predict/naive"])
def test_a_12_megapixel_jpeg_and_an_8_mb_webp_get_200(
    photo_server: Server, phone_files: dict[str, bytes], route: str
) -> None:
    for media_type, data in phone_files.items():
        # What `curl --data-binary @photo.jpg -H 'Content-Type: image/jpeg'` sends.
        raw = photo_server.post(route, data=data, headers={"Content-Type": media_type})
        assert raw.status_code == 200, raw.text
        assert len(raw.json()["outputs"]) == 1
    # The WebP as a form upload too (`curl -F image=@photo.webp`).
    form = photo_server.post(
        route, files=[("image", ("photo.webp", phone_files["image/webp"], "image/webp"))]
    )
    assert form.status_code == 200, form.text


def test_a_heic_photo_gets_a_415_naming_the_formats_served(photo_server: Server) -> None:
    heic = heic_header()
    answers = [
        # A client that labels every photo image/jpeg, a form upload, and an honest label.
        photo_server.post("/predict", data=heic, headers={"Content-Type": "image/jpeg"}),
        photo_server.post("/predict/naive", files=[("image", ("IMG_0001.HEIC", heic, "image/heic"))]),
        photo_server.post("/predict", data=heic, headers={"Content-Type": "image/heic"}),
    ]
    for response in answers:
        assert response.status_code == 415, response.text
        assert response.headers["Content-Type"] == "application/json"
        error = response.json()["error"]
        assert "image/jpeg" in error and "image/png" in error and "image/webp" in error, error
    assert "the image is HEIC" in answers[0].json()["error"]


# -- a refusal every client reads ------------------------------------------------------


def urllib_post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, object]]:
    """The status and JSON body urllib reads: it sends the whole body before it reads a byte."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def requests_post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, object]]:
    response = requests.post(url, data=body, headers=headers, timeout=60)
    return response.status_code, response.json()


CLIENTS = {"urllib": urllib_post, "requests": requests_post}


@pytest.fixture(scope="module", params=["gthread", "gevent"])
def text_server(request: pytest.FixtureRequest) -> Iterator[Server]:
    env = {
        "SERVE_MODEL": "minilm",
        "SERVE_WORKERS": "1",
        "SERVE_WORKER_CLASS": str(request.param),
        "SERVE_API_TOKEN": TOKEN,
    }
    with gunicorn(env) as started:
        yield started


@pytest.mark.parametrize("client", CLIENTS)
# OpenAI's route answers 400 for what others answer 413: its SDK has no class for 413.
@pytest.mark.parametrize(("route", "refused"), [("/predict", 413), ("/v1/embeddings", 400)])
def test_a_body_over_the_limit_gets_its_413_whatever_the_client(
    text_server: Server, client: str, route: str, refused: int
) -> None:
    headers = {**JSON, "Authorization": f"Bearer {TOKEN}"}
    status, document = CLIENTS[client](text_server.url + route, OVER, headers)
    assert status == refused
    assert "SERVE_MAX_BODY_BYTES" in json.dumps(document)
    # The worker goes on serving.
    status, document = CLIENTS[client](text_server.url + "/predict", b'{"inputs": ["a"]}', headers)
    assert status == 200, document


@pytest.mark.parametrize("client", CLIENTS)
def test_a_401_before_the_body_is_read_reaches_the_client(text_server: Server, client: str) -> None:
    # Under the limit, and far larger than the sockets' buffers: refused before a byte is read.
    body = OVER[: DEFAULT_BODY_BYTES - 1024] + b'"]}'
    status, document = CLIENTS[client](text_server.url + "/predict", body, JSON)
    assert status == 401
    assert "Bearer" in str(document["error"])


@pytest.fixture(scope="module")
def proxy(text_server: Server) -> Iterator[str]:
    if NGINX is None:
        pytest.skip(SKIP_REASON)
    with nginx([text_server.url.removeprefix("http://")], {"SERVE_MODEL": "minilm"}) as started:
        yield started.url


@pytest.mark.parametrize("client", CLIENTS)
def test_behind_nginx_every_client_reads_the_413(proxy: str, client: str) -> None:
    status, document = CLIENTS[client](proxy + "/predict", OVER, JSON)
    assert status == 413
    assert "SERVE_MAX_BODY_BYTES" in json.dumps(document)
    # The service's own refusal, passed on by nginx, reaches the client as well.
    status, document = CLIENTS[client](proxy + "/predict", OVER[: DEFAULT_BODY_BYTES - 1024] + b'"]}', JSON)
    assert status == 401, document

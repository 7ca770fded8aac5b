"""Body limits that follow the model, the bounds on what a worker holds, and reading a refused body's rest."""

from __future__ import annotations

import io
import json
import socket
import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from scripts.deploy.render_nginx import TEMPLATE, Options, gunicorn_keepalive, render
from service.config.budget import Budget, body_budget_bytes
from service.config.image_spec import ImageSpec
from service.config.settings import DEFAULT_BODY_BYTES, Settings, image_body_bytes
from service.errors import Overloaded, UnsupportedMediaType
from service.http.inference import SMALL_BODY_BYTES, take_body_room
from service.http.linger import Linger, discard_body
from service.models.imaging import ImagePreprocessor, sniff

MiB = 1 << 20


@pytest.fixture
def image_dir(tmp_path: Path) -> Path:
    # Only the declaration is looked at to pick the limit.
    (tmp_path / "preprocess.json").write_text(json.dumps({"resize": 256, "center_crop": 224}))
    return tmp_path


# -- the default limit -------------------------------------------------------------------------


def test_an_image_model_takes_one_photo_of_its_pixel_limit_as_base64() -> None:
    # 4096 x 4096 at a byte a pixel, as base64, rounded up to a whole MiB.
    assert image_body_bytes(4096 * 4096) == 22 * MiB
    assert image_body_bytes(12_000_000) == 16 * MiB
    # Never below the text default, never above the setting's maximum.
    assert image_body_bytes(1000) == DEFAULT_BODY_BYTES
    assert image_body_bytes(89_478_485) == 114 * MiB


def test_a_phones_photo_fits_whatever_way_it_is_sent() -> None:
    # A 12 MP phone photo is 1 to 6 MB as JPEG; an 8 MB WebP is a large one. As
    # base64 in JSON it grows by a third, and still fits at 12 MP.
    limit = image_body_bytes(12_000_000)
    assert limit > 8_000_000 * 4 // 3 + 1000


def test_the_default_limit_follows_the_model(image_dir: Path) -> None:
    assert Settings.from_env({}).max_body_bytes == DEFAULT_BODY_BYTES
    assert Settings.from_env({"SERVE_MODEL": "mlp"}).max_body_bytes == DEFAULT_BODY_BYTES
    assert Settings.from_env({"SERVE_MODEL": str(image_dir)}).max_body_bytes == 22 * MiB
    fewer = Settings.from_env({"SERVE_MODEL": str(image_dir), "SERVE_MAX_IMAGE_PIXELS": "12000000"})
    assert fewer.max_body_bytes == 16 * MiB


def test_an_explicit_limit_wins(image_dir: Path) -> None:
    env = {"SERVE_MODEL": str(image_dir), "SERVE_MAX_BODY_BYTES": "2000000"}
    assert Settings.from_env(env).max_body_bytes == 2_000_000
    assert Settings.from_env({"SERVE_MAX_BODY_BYTES": "30000000"}).max_body_bytes == 30_000_000


def test_nginx_takes_the_limit_the_model_gets(image_dir: Path) -> None:
    settings = Settings.from_env({"SERVE_MODEL": str(image_dir)})
    text = render(TEMPLATE.read_text(), Options(prefix="/srv/nginx"), settings, gunicorn_keepalive())
    assert f"client_max_body_size {22 * MiB};" in text


def test_a_refused_body_is_read_up_to_16_mib_or_twice_the_limit() -> None:
    assert Settings().linger_bytes == 16 * MiB >= 8_000_000
    assert Settings(max_body_bytes=22 * MiB).linger_bytes == 44 * MiB
    assert Settings.from_env({"SERVE_LINGER_MS": "0"}).linger_ms == 0


# -- what a worker holds at once -----------------------------------------------------------------


def test_a_budget_waits_for_room_and_gives_up_at_its_timeout() -> None:
    budget = Budget(10)
    assert budget.take(7) == 7
    assert budget.take(4, timeout=0.05) is None  # 7 + 4 > 10
    got: list[int | None] = []
    waiter = threading.Thread(target=lambda: got.append(budget.take(4, timeout=10)))
    waiter.start()
    budget.give_back(7)
    waiter.join(10)
    assert got == [4]
    assert budget.held == 4
    # More than the whole budget is taken as all of it, once the rest is back.
    budget.give_back(4)
    assert budget.take(50) == 10
    budget.give_back(10)
    with budget.hold(3):
        assert budget.held == 3
    assert budget.held == 0


def test_a_worker_holds_four_bodies_at_the_limit_or_64_mib() -> None:
    assert body_budget_bytes(DEFAULT_BODY_BYTES) == 64 * MiB
    assert body_budget_bytes(22 * MiB) == 88 * MiB


def runtime(limit: int, capacity: int) -> Any:
    return SimpleNamespace(settings=Settings(max_body_bytes=limit), bodies=Budget(capacity))


def test_small_bodies_take_no_room_and_large_ones_wait_until_their_budget() -> None:
    rt = runtime(8 * MiB, 10 * MiB)
    now = time.monotonic()
    assert take_body_room(rt, {"CONTENT_LENGTH": str(SMALL_BODY_BYTES)}, now) == 0
    assert take_body_room(rt, {}, now) == 0
    taken = take_body_room(rt, {"CONTENT_LENGTH": str(6 * MiB)}, now + 1)
    assert taken == 6 * MiB
    # A chunked body weighs the limit: 6 + 8 MiB is over the 10 MiB bound.
    started = time.monotonic()
    with pytest.raises(Overloaded, match="request bodies") as refused:
        take_body_room(rt, {"HTTP_TRANSFER_ENCODING": "chunked"}, started + 0.1)
    assert refused.value.status == 503 and refused.value.reason == "queue_full"
    assert time.monotonic() - started >= 0.09
    rt.bodies.give_back(taken)
    assert take_body_room(rt, {"HTTP_TRANSFER_ENCODING": "chunked"}, time.monotonic()) == 8 * MiB


def test_a_worker_decodes_two_images_of_the_pixel_limit_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    preprocess = ImagePreprocessor(ImageSpec(resize=(8, 8)), max_pixels=64 * 48)
    seen: list[int] = []
    real = preprocess.transform
    monkeypatch.setattr(
        preprocess, "transform", lambda image: seen.append(preprocess._decoding.held) or real(image)
    )
    buffer = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (64, 48)).save(buffer, "PNG")
    assert preprocess(buffer.getvalue()).shape == (3, 8, 8)
    assert seen == [64 * 48]  # held while it was transformed
    assert preprocess._decoding.capacity == 2 * 64 * 48
    assert preprocess._decoding.held == 0


# -- formats a phone sends ------------------------------------------------------------------------


def iso_media(major: bytes, *compatible: bytes) -> bytes:
    box = major + b"\0\0\0\0" + b"".join(compatible)
    return struct.pack(">I", 8 + len(box)) + b"ftyp" + box + bytes(64)


@pytest.mark.parametrize(
    ("data", "found"),
    [
        (iso_media(b"heic", b"mif1", b"heic"), "HEIC"),
        (iso_media(b"mif1", b"mif1", b"heic"), "HEIC"),
        (iso_media(b"mif1", b"mif1"), "HEIF"),
        (iso_media(b"avif", b"avif", b"mif1", b"miaf"), "AVIF"),
        (iso_media(b"isom", b"mp41"), None),  # a video: not an image at all
    ],
)
def test_heic_and_avif_are_refused_with_the_formats_served(data: bytes, found: str | None) -> None:
    assert sniff(data) == found
    if found is None:
        return
    with pytest.raises(UnsupportedMediaType) as refused:
        ImagePreprocessor(ImageSpec(resize=(8, 8)))(data)
    assert refused.value.status == 415
    assert f"the image is {found}" in refused.value.message
    assert "JPEG, PNG or WebP (image/jpeg, image/png, image/webp)" in refused.value.message


# -- reading the rest of a refused body -------------------------------------------------------------


def refusing(status: str) -> Any:
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response(status, [("Content-Type", "application/json")])
        return [b'{"error": "no"}']

    return app


def call(app: Any, environ: dict[str, Any]) -> bytes:
    answer = app(environ, lambda status, headers, exc_info=None: None)
    try:
        return b"".join(answer)
    finally:
        getattr(answer, "close", lambda: None)()


def body_environ(body: bytes, **extra: str) -> dict[str, Any]:
    return {"CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body), **extra}


def test_a_refused_body_is_read_to_its_end_after_the_answer() -> None:
    for status in ("413 Request Entity Too Large", "401 Unauthorized", "503 Service Unavailable"):
        environ = body_environ(b"x" * 300_000)
        assert call(Linger(refusing(status), 1 * MiB, 5), environ) == b'{"error": "no"}'
        assert environ["wsgi.input"].tell() == 300_000, status


def test_a_body_is_left_alone_after_a_success_or_past_the_bound_or_when_off() -> None:
    cases = [
        (Linger(refusing("200 OK"), 1 * MiB, 5), 0),
        (Linger(refusing("413 Request Entity Too Large"), 100_000, 5), 0),  # declared past the bound
        (Linger(refusing("413 Request Entity Too Large"), 1 * MiB, 0), 0),  # SERVE_LINGER_MS=0
    ]
    for app, read in cases:
        environ = body_environ(b"x" * 300_000)
        call(app, environ)
        assert environ["wsgi.input"].tell() == read


def test_a_chunked_body_is_read_up_to_the_bound() -> None:
    environ = {"HTTP_TRANSFER_ENCODING": "chunked", "wsgi.input": io.BytesIO(b"x" * 300_000)}
    assert not discard_body(environ, 100_000, 5)
    assert environ["wsgi.input"].tell() <= 100_001
    environ = {"HTTP_TRANSFER_ENCODING": "chunked", "wsgi.input": io.BytesIO(b"x" * 300_000)}
    assert discard_body(environ, 1 * MiB, 5)


def test_a_slow_sender_is_read_no_longer_than_the_time_bound() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"x" * 1000)  # and then nothing more
        ours.settimeout(None)
        environ = {"wsgi.input": ours.makefile("rb"), "gunicorn.socket": ours}
        started = time.monotonic()
        assert not discard_body(environ, 1 * MiB, 0.2)
        assert 0.15 < time.monotonic() - started < 2
        assert ours.gettimeout() is None  # put back as it was

"""Image models in process: the directory, its declaration, preprocessing, and every way to send an image."""

from __future__ import annotations

import base64
import io
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flask.testing import FlaskClient
from PIL import Image
from werkzeug.datastructures import FileStorage, MultiDict
from werkzeug.test import encode_multipart

from service.config.image_spec import ImageSpec
from service.config.model_spec import check_spec, default_onednn_cache, directory_task
from service.config.settings import PILLOW_MAX_IMAGE_PIXELS, Settings
from service.errors import PayloadTooLarge, SettingsError
from service.models.imaging import ImagePreprocessor, crop_box, resized
from tests.support import images

pytestmark = pytest.mark.filterwarnings(images.JIT_DEPRECATED)

ROUTES = ("/predict/naive", "/predict/batched")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return images.image_model_dir(tmp_path_factory.mktemp("image-models"))


@pytest.fixture
def image_client(make_client: Callable[[Settings], FlaskClient], model_dir: Path) -> FlaskClient:
    return make_client(Settings(model=str(model_dir), max_items_per_request=8, torch_threads=1))


FILES = [images.photo(1), images.photo(2, (50, 70), "PNG"), images.photo(3, (33, 33), "WEBP")]


# werkzeug's test client draws a multipart boundary from the clock and a random
# number, 68 to 71 characters: now and then past RFC 2046's 70, which the
# service refuses (400). These bodies use a fixed one.
BOUNDARY = "test-boundary-7f3a"


def multipart(fields: dict[str, Any]) -> dict[str, Any]:
    """post()'s data and content_type for ``fields``: a str, (stream, filename[, type]), or a list of those.

    Parts follow the fields' order.
    """
    values: MultiDict[str, Any] = MultiDict()
    for name, value in fields.items():
        for one in value if isinstance(value, list) else [value]:
            if isinstance(one, tuple):
                stream, filename, *kind = one
                values.add(name, FileStorage(stream, filename, content_type=kind[0] if kind else None))
            else:
                values.add(name, one)
    boundary, body = encode_multipart(values, boundary=BOUNDARY)
    return {"data": body, "content_type": f"multipart/form-data; boundary={boundary}"}


def expected(model_dir: Path, files: list[bytes]) -> list[list[dict[str, Any]]]:
    return images.top_k(images.reference(model_dir, files), 3)


def assert_close(got: list[list[dict[str, Any]]], want: list[list[dict[str, Any]]]) -> None:
    assert [[entry["label"] for entry in row] for row in got] == [[e["label"] for e in row] for row in want]
    scores = np.array([[entry["score"] for entry in row] for row in got])
    assert np.abs(scores - np.array([[e["score"] for e in row] for row in want])).max() <= 1e-5


# -- the directory and its declaration --------------------------------------------------


def test_an_image_directory_is_recognised_without_torch(model_dir: Path) -> None:
    assert directory_task(model_dir) == "image"
    assert check_spec(str(model_dir)) == "directory"


AMX = frozenset({"avx512_bf16", "amx_bf16"})
NO_BFLOAT16 = frozenset({"avx512f", "avx512_vnni"})


def test_an_image_model_keeps_onednns_cache_and_a_float32_text_model_keeps_none(model_dir: Path) -> None:
    # One input size: its convolutions' primitives are found again (0 cost 7% of its speed).
    for flags in (AMX, NO_BFLOAT16):
        assert default_onednn_cache(str(model_dir), "auto", flags) == 1024
    # New shapes at nearly every call: a cache only grows the worker in float32.
    assert default_onednn_cache("minilm", "auto", NO_BFLOAT16) == 0
    assert default_onednn_cache("minilm", "float32", AMX) == 0
    assert default_onednn_cache("minilm", "int8", AMX) == 0


def test_a_text_model_in_bfloat16_keeps_onednns_cache(model_dir: Path) -> None:
    # bfloat16's kernels are oneDNN primitives: with no cache each call builds them again.
    assert default_onednn_cache("minilm", "auto", AMX) == 1024
    assert default_onednn_cache("minilm", "bfloat16", AMX) == 1024
    # avx512_bf16 alone: bfloat16 if it measures faster, which it cannot without the cache.
    assert default_onednn_cache("minilm", "auto", frozenset({"avx512_bf16"})) == 1024
    # A factory's model is unknown before a worker loads it.
    assert default_onednn_cache("tests.support.models:sized_echo", "auto", AMX) == 0


@pytest.mark.parametrize(
    ("declared", "says"),
    [
        ({"resize": 256}, "images must come out of one size"),
        ({"center_crop": 224, "mean": [0.5, 0.5]}, "mean must be a finite number or a list of 3"),
        ({"center_crop": 224, "std": 0}, "std must be a finite positive number"),
        ({"center_crop": 224, "mean": [0.5, float("nan"), 0.5]}, "mean must be a finite number"),
        ({"center_crop": 224, "std": float("inf")}, "std must be a finite positive number"),
        ({"center_crop": 0}, "center_crop must be a whole number or [height, width]"),
        ({"center_crop": 224, "channels": "RGBA"}, "channels must be one of RGB, BGR, L"),
        ({"center_crop": 224, "resample": "bilinear"}, "unknown key 'resample'"),
        ({"center_crop": 224, "outputs": "top_k"}, "needs labels.txt"),
        ([224, 224], "must be a JSON object"),
    ],
)
def test_a_bad_declaration_stops_the_service_naming_the_key(tmp_path: Path, declared: Any, says: str) -> None:
    (tmp_path / "model.pt").write_bytes(b"not read here")
    (tmp_path / "preprocess.json").write_text(json.dumps(declared))
    with pytest.raises(SettingsError, match=r"preprocess\.json") as caught:
        check_spec(str(tmp_path))
    assert says in str(caught.value)


def test_a_declaration_without_a_program_is_refused(tmp_path: Path) -> None:
    (tmp_path / "preprocess.json").write_text(json.dumps({"center_crop": 224}))
    with pytest.raises(SettingsError, match=r"no program; save the model beside it as model.pt"):
        check_spec(str(tmp_path))


def test_labels_that_do_not_match_the_outputs_stop_the_worker(
    tmp_path: Path, make_client: Callable[[Settings], FlaskClient]
) -> None:
    directory = images.image_model_dir(tmp_path)
    (directory / "labels.txt").write_text("cat\ndog\n")
    from service.models import load_model

    with pytest.raises(SettingsError, match=r"returns 10 scores per image, labels.txt has 2 labels"):
        load_model(Settings(model=str(directory)), "cpu")


def test_the_pixel_limit_is_a_setting_below_pillows_guard() -> None:
    assert PILLOW_MAX_IMAGE_PIXELS == Image.MAX_IMAGE_PIXELS
    assert Settings.from_env({"SERVE_MAX_IMAGE_PIXELS": "1000000"}).max_image_pixels == 1_000_000
    with pytest.raises(SettingsError, match=r"SERVE_MAX_IMAGE_PIXELS must be an integer from 1 to 89478485"):
        Settings.from_env({"SERVE_MAX_IMAGE_PIXELS": "100000000"})


# -- preprocessing -----------------------------------------------------------------------


def test_resize_and_crop_follow_torchvisions_arithmetic() -> None:
    assert resized((64, 48), 40) == (53, 40)  # the shorter side to 40, int() of the longer
    assert resized((48, 64), 40) == (40, 53)
    assert resized((64, 48), (20, 30)) == (30, 20)  # [height, width]
    assert crop_box((53, 40), (32, 32)) == (10, 4, 42, 36)
    assert crop_box((20, 40), (32, 32)) == (-6, 4, 26, 36)  # padded with black where it is too small


def test_preprocessing_matches_the_same_steps_written_out_with_numpy() -> None:
    spec = ImageSpec(resize=(20, 24), channels="BGR", mean=(0.1, 0.2, 0.3), std=(0.5, 0.25, 0.125))
    data = images.photo(7, (40, 30), "PNG")
    got = ImagePreprocessor(spec)(data)
    image = Image.open(io.BytesIO(data)).convert("RGB").resize((24, 20), Image.Resampling.BILINEAR)
    pixels = np.asarray(image, dtype=np.float32)[:, :, ::-1] / 255
    want = ((pixels - np.float32([0.1, 0.2, 0.3])) / np.float32([0.5, 0.25, 0.125])).transpose(2, 0, 1)
    assert got.shape == (3, 20, 24) and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-6


def test_grayscale_models_get_one_channel() -> None:
    got = ImagePreprocessor(ImageSpec(center_crop=(8, 8), channels="L"))(images.photo(8))
    assert got.shape == (1, 8, 8)


# -- every way to send an image ------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("index", "media_type"), [(0, "image/jpeg"), (1, "image/png"), (2, "image/webp")])
def test_a_raw_body_is_one_image(
    image_client: FlaskClient, model_dir: Path, route: str, index: int, media_type: str
) -> None:
    response = image_client.post(route, data=FILES[index], headers={"Content-Type": media_type})
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.json is not None
    assert response.json["model"] == "shelf-cnn"
    assert_close(response.json["outputs"], expected(model_dir, [FILES[index]]))


@pytest.mark.parametrize("route", ROUTES)
def test_base64_and_data_uris_in_json(image_client: FlaskClient, model_dir: Path, route: str) -> None:
    inputs = [
        base64.b64encode(FILES[0]).decode(),
        "data:image/png;base64," + base64.b64encode(FILES[1]).decode(),
        base64.encodebytes(FILES[2]).decode(),  # wrapped at 76 characters, as mail encoders do
    ]
    response = image_client.post(route, json={"inputs": inputs})
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.json is not None
    assert_close(response.json["outputs"], expected(model_dir, FILES))


@pytest.mark.parametrize("route", ROUTES)
def test_multipart_carries_several_images_in_order(
    image_client: FlaskClient, model_dir: Path, route: str
) -> None:
    data = {
        "image": [
            (io.BytesIO(FILES[2]), "c.webp", "image/webp"),
            (io.BytesIO(FILES[0]), "a.jpg", "image/jpeg"),
        ],
        "other": (io.BytesIO(FILES[1]), "b.png", "application/octet-stream"),
    }
    response = image_client.post(route, **multipart(data))
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.json is not None
    assert_close(response.json["outputs"], expected(model_dir, [FILES[2], FILES[0], FILES[1]]))


def test_multipart_refuses_text_parts_too_many_parts_and_no_boundary(image_client: FlaskClient) -> None:
    # A plain field declares no Content-Type, so it is read as an image, and is not one.
    fields = {"note": "hello", "image": (io.BytesIO(FILES[0]), "a.jpg")}
    text = image_client.post("/predict", **multipart(fields))
    assert text.status_code == 422
    # The field is part 0.
    assert text.json is not None and text.json["error"].startswith("inputs[0]: the data is not a JPEG")
    nine = [(io.BytesIO(FILES[0]), f"{i}.jpg", "image/jpeg") for i in range(9)]
    many = image_client.post("/predict", **multipart({"image": nine}))
    assert many.status_code == 413
    assert "SERVE_MAX_ITEMS_PER_REQUEST" in many.json["error"]  # type: ignore[index]
    typed = image_client.post(
        "/predict",
        data=b'--b\r\nContent-Disposition: form-data; name="x"\r\nContent-Type: text/plain\r\n\r\n'
        b"hi\r\n--b--\r\n",
        content_type="multipart/form-data; boundary=b",
    )
    assert typed.status_code == 415 and "part 0 ('x') is text/plain" in typed.json["error"]  # type: ignore[index]
    bare = image_client.post("/predict", data=b"--x\r\n", content_type="multipart/form-data")
    assert bare.status_code == 400 and "boundary" in bare.json["error"]  # type: ignore[index]


def test_the_info_and_oip_metadata_describe_an_image_model(image_client: FlaskClient) -> None:
    info = image_client.get("/info").json
    assert info is not None
    assert info["model"]["item_kind"] == "image" and info["model"]["item_shape"] == [3, 32, 32]
    assert info["model"]["task"] == "classification"
    metadata = image_client.get("/v2/models/shelf-cnn").json
    assert metadata is not None
    assert metadata["inputs"] == [{"name": "input", "datatype": "BYTES", "shape": [-1]}]
    assert metadata["outputs"] == [{"name": "output", "datatype": "BYTES", "shape": [-1]}]


def test_oip_v2_bytes_as_binary_data_and_as_base64_json(image_client: FlaskClient, model_dir: Path) -> None:
    raw = b"".join(struct.pack("<I", len(data)) + data for data in FILES)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "BYTES",
                    "shape": [3],
                    "parameters": {"binary_data_size": len(raw)},
                }
            ]
        }
    ).encode()
    binary = image_client.post(
        "/v2/models/shelf-cnn/infer",
        data=header + raw,
        headers={
            "Inference-Header-Content-Length": str(len(header)),
            "Content-Type": "application/octet-stream",
        },
    )
    as_json = image_client.post(
        "/v2/models/shelf-cnn/infer",
        json={
            "inputs": [
                {
                    "name": "input",
                    "datatype": "BYTES",
                    "shape": [3],
                    "data": [base64.b64encode(data).decode() for data in FILES],
                }
            ]
        },
    )
    want = expected(model_dir, FILES)
    for response in (binary, as_json):
        assert response.status_code == 200, response.get_data(as_text=True)
        assert response.json is not None
        (output,) = response.json["outputs"]
        assert output["datatype"] == "BYTES" and output["shape"] == [3]
        assert_close([json.loads(text) for text in output["data"]], want)


def test_a_raw_output_model_answers_its_tensor(
    tmp_path: Path, make_client: Callable[[Settings], FlaskClient]
) -> None:
    directory = images.image_model_dir(tmp_path, "raw-cnn", labels=False, program="model.pt2")
    client = make_client(Settings(model=str(directory), torch_threads=1))
    response = client.post("/predict/batched", data=FILES[0], headers={"Content-Type": "image/jpeg"})
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.json is not None
    got = np.array(response.json["outputs"])
    assert np.abs(got - images.reference(directory, [FILES[0]])).max() <= 1e-5
    metadata = client.get("/v2/models/raw-cnn").json
    assert metadata is not None
    assert metadata["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}]


# -- hostile images --------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", sorted(images.hostile_images()))
def test_hostile_images_get_the_4xx_that_names_the_problem(
    image_client: FlaskClient, route: str, name: str
) -> None:
    data, media_type, status = images.hostile_images()[name]
    response = image_client.post(route, data=data, headers={"Content-Type": media_type})
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.json is not None and "Traceback" not in response.json["error"]
    if media_type not in ("image/jpeg", "image/png", "image/webp"):
        return  # refused for its Content-Type alone; in base64 it is judged by its bytes
    good = base64.b64encode(FILES[0]).decode()
    as_base64 = image_client.post(route, json={"inputs": [good, base64.b64encode(data).decode()]})
    assert as_base64.status_code == status, as_base64.get_data(as_text=True)
    assert as_base64.json is not None and as_base64.json["error"].startswith("inputs[1]: ")


def test_hostile_json_items_name_their_index(image_client: FlaskClient) -> None:
    cases = {
        "not base64 !": (422, "inputs[1]: the image is not valid base64"),
        "data:text/plain;base64,aGk=": (415, "inputs[1]: the data: URI's type is text/plain"),
        "data:image/png,raw": (422, "inputs[1]: a data: URI must be"),
        42: (422, "inputs[1]: expected an image"),
    }
    good = base64.b64encode(FILES[0]).decode()
    for item, (status, says) in cases.items():
        response = image_client.post("/predict", json={"inputs": [good, item]})
        assert response.status_code == status, response.get_data(as_text=True)
        assert response.json is not None and response.json["error"].startswith(says)


def test_the_pixel_limit_refuses_before_decoding(
    make_client: Callable[[Settings], FlaskClient], model_dir: Path
) -> None:
    client = make_client(Settings(model=str(model_dir), max_image_pixels=64 * 48 - 1, torch_threads=1))
    response = client.post("/predict", data=images.photo(1, (64, 48)), headers={"Content-Type": "image/jpeg"})
    assert response.status_code == 413
    assert response.json is not None
    assert response.json["error"] == (
        "inputs[0]: the image is 64x48 pixels; "
        "the limit is 3071 pixels (width x height, SERVE_MAX_IMAGE_PIXELS)"
    )
    fits = client.post("/predict", data=images.photo(1, (60, 48)), headers={"Content-Type": "image/jpeg"})
    assert fits.status_code == 200


def test_a_text_model_still_refuses_image_bodies(client: FlaskClient) -> None:
    response = client.post("/predict", data=FILES[0], headers={"Content-Type": "image/jpeg"})
    assert response.status_code == 415
    assert response.json == {"error": "Content-Type must be application/json, got image/jpeg"}


def test_sample_items_for_an_image_model_are_jpegs_it_takes(image_client: FlaskClient) -> None:
    import random

    from service.models.base import sample_item

    info = image_client.get("/info").json
    assert info is not None
    fixed, varied = sample_item(info["model"]), sample_item(info["model"], random.Random(1))
    assert fixed.startswith("data:image/jpeg;base64,") and fixed != varied
    response = image_client.post("/predict", json={"inputs": [fixed, varied]})
    assert response.status_code == 200, response.get_data(as_text=True)


def test_a_long_thin_image_is_refused_before_its_resize_makes_more_pixels_than_the_limit() -> None:
    # 2x5000 is 10,000 pixels, within the limit; its short side scaled to 256 would be
    # 256x640,000, 16,384 times more.
    thin = io.BytesIO()
    Image.new("RGB", (2, 5000), (90, 120, 150)).save(thin, "PNG")
    preprocess = ImagePreprocessor(ImageSpec(resize=256, center_crop=(224, 224)), max_pixels=10_000)
    with pytest.raises(PayloadTooLarge, match=r"2x5000 pixels; resized for the model it would be 256x640000"):
        preprocess(thin.getvalue())

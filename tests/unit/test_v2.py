"""In-process tests of the Open Inference Protocol v2 routes: the spec's shapes and error bodies."""

from __future__ import annotations

import struct
import tomllib
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

import service
from service.config.settings import Settings
from tests.support.metrics import Scrape
from tests.support.server import ROOT

VECTOR = [0.1 * i for i in range(16)]
ECHO = Settings(model="tests.support.models:echo", max_items_per_request=8)
HEADER = "Inference-Header-Content-Length"


def fp32(rows: list[list[float]], **extra: Any) -> dict[str, Any]:
    shape = [len(rows), len(rows[0])]
    return {"inputs": [{"name": "input", "datatype": "FP32", "shape": shape, "data": rows}], **extra}


def texts(values: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "inputs": [{"name": "input", "datatype": "BYTES", "shape": [len(values)], "data": values}],
        **extra,
    }


def binary_request(header: dict[str, Any], raw: bytes) -> tuple[bytes, dict[str, str]]:
    encoded = orjson.dumps(header)
    return encoded + raw, {HEADER: str(len(encoded))}


def length_prefixed(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def split_binary(response: TestResponse) -> tuple[dict[str, Any], bytes]:
    body = response.get_data()
    length = int(response.headers[HEADER])
    return orjson.loads(body[:length]), body[length:]


@pytest.fixture
def echo(make_client: Callable[[Settings], FlaskClient]) -> FlaskClient:
    return make_client(ECHO)


def test_server_metadata_and_health(client: FlaskClient) -> None:
    assert client.get("/v2").json == {
        "name": "torch-serve-batched",
        "version": service.__version__,
        "extensions": ["binary_tensor_data"],
    }
    # tritonclient reads the status alone; KServe's client reads "live" and "ready".
    assert client.get("/v2/health/live").json == {"live": True}
    assert client.get("/v2/health/ready").json == {"ready": True}


def test_the_version_is_the_projects() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert service.__version__ == project["version"]


def test_model_metadata_comes_from_the_served_model(client: FlaskClient, echo: FlaskClient) -> None:
    vector = {
        "name": "mlp",
        "versions": ["1"],
        "platform": "pytorch",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, -1]}],
    }
    assert client.get("/v2/models/mlp").json == vector
    assert client.get("/v2/models/mlp/versions/1").json == vector
    assert client.get("/v2/models/mlp/ready").json == {"name": "mlp", "ready": True}
    assert client.get("/v2/models/mlp/versions/1/ready").status_code == 200
    text = echo.get("/v2/models/echo").json
    assert text["inputs"] == [{"name": "input", "datatype": "BYTES", "shape": [-1]}]  # type: ignore[index]


def test_a_text_models_outputs_are_described_by_its_item_shape(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(Settings(model="tests.support.models:vectors"))
    outputs = client.get("/v2/models/vectors").json["outputs"]  # type: ignore[index]
    assert outputs == [{"name": "output", "datatype": "FP32", "shape": [-1, 3]}]


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/other",
        "/v2/models/mlp/versions/2",
        "/v2/models/other/ready",
        "/v2/models/mlp/versions/0/ready",
    ],
)
def test_an_unknown_model_or_version_is_a_404(client: FlaskClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404
    assert "mlp" in response.json["error"]  # type: ignore[index]


def test_infer_with_json_tensors_matches_predict(client: FlaskClient) -> None:
    rows = [VECTOR, VECTOR[::-1]]
    response = client.post("/v2/models/mlp/infer", json=fp32(rows, id="req-7"))
    assert response.status_code == 200, response.json
    assert response.content_type == "application/json"
    assert HEADER not in response.headers
    document = response.json
    assert document["model_name"] == "mlp" and document["model_version"] == "1"  # type: ignore[index]
    assert document["id"] == "req-7"  # type: ignore[index]
    [output] = document["outputs"]  # type: ignore[index]
    assert (output["name"], output["datatype"], output["shape"]) == ("output", "FP32", [2, 16])
    expected = client.post("/predict", json={"inputs": rows}).json["outputs"]  # type: ignore[index]
    np.testing.assert_allclose(np.reshape(output["data"], (2, 16)), expected, rtol=1e-5, atol=1e-6)
    assert response.headers["X-Batch-Size"] == "2"


def test_nested_json_data_is_read_in_row_major_order(client: FlaskClient) -> None:
    flat = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 16], "data": VECTOR + VECTOR}]}
    nested = fp32([VECTOR, VECTOR])
    a = client.post("/v2/models/mlp/versions/1/infer", json=flat).json
    b = client.post("/v2/models/mlp/infer", json=nested).json
    assert a["outputs"][0]["data"] == b["outputs"][0]["data"]  # type: ignore[index]
    assert "id" not in a  # type: ignore[operator]


def test_infer_with_binary_tensors_in_and_out(client: FlaskClient) -> None:
    rows = np.array([VECTOR, VECTOR[::-1]], dtype="<f4")
    header = {
        "inputs": [
            {"name": "input", "datatype": "FP32", "shape": [2, 16], "parameters": {"binary_data_size": 128}}
        ],
        "parameters": {"binary_data_output": True},
    }
    body, headers = binary_request(header, rows.tobytes())
    response = client.post("/v2/models/mlp/infer", data=body, headers=headers)
    assert response.status_code == 200, response.get_data()
    assert response.content_type == "application/octet-stream"
    document, raw = split_binary(response)
    [output] = document["outputs"]
    assert output["parameters"] == {"binary_data_size": 128} and "data" not in output
    expected = client.post("/predict", json={"inputs": rows.tolist()}).json["outputs"]  # type: ignore[index]
    np.testing.assert_allclose(np.frombuffer(raw, "<f4").reshape(2, 16), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("asked", "binary"), [(None, False), ({"binary_data": True}, True), ({}, True)])
def test_requested_outputs_are_honoured(
    client: FlaskClient, asked: dict[str, Any] | None, binary: bool
) -> None:
    # A per-output binary_data wins over the request's binary_data_output.
    output: dict[str, Any] = {"name": "output"}
    if asked is not None:
        output["parameters"] = asked
    request = fp32([VECTOR], outputs=[output], parameters={"binary_data_output": asked == {}})
    response = client.post("/v2/models/mlp/infer", json=request)
    assert response.status_code == 200
    assert (HEADER in response.headers) is binary


def test_binary_text_in_and_out(echo: FlaskClient) -> None:
    words = ["hello", "grüße", ""]
    raw = length_prefixed([w.encode() for w in words])
    header = {
        "inputs": [
            {"name": "input", "datatype": "BYTES", "shape": [3], "parameters": {"binary_data_size": len(raw)}}
        ]
    }
    body, headers = binary_request(header, raw)
    response = echo.post("/v2/models/echo/infer", data=body, headers=headers)
    assert response.status_code == 200, response.get_data()
    # The echo model returns each text's length in characters.
    assert response.json["outputs"][0]["data"] == [5.0, 5.0, 0.0]  # type: ignore[index]
    assert response.json["outputs"][0]["shape"] == [3, 1]  # type: ignore[index]


def test_string_outputs_go_back_as_bytes(make_client: Callable[[Settings], FlaskClient]) -> None:
    client = make_client(Settings(model="tests.support.models:labels"))
    response = client.post("/v2/models/labels/infer", json=texts(["ab", "abc"]))
    assert response.json["outputs"][0] == {
        "name": "output",
        "datatype": "BYTES",
        "shape": [2],
        "data": ["2", "3"],
    }  # type: ignore[index]
    response = client.post(
        "/v2/models/labels/infer", json=texts(["ab"], parameters={"binary_data_output": True})
    )
    _, raw = split_binary(response)
    assert raw == length_prefixed([b"2"])


def test_a_model_whose_outputs_are_no_tensor_gets_a_json_500(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(Settings(model="tests.support.models:records"))
    response = client.post("/v2/models/records/infer", json=texts(["x"]))
    assert response.status_code == 500
    assert "/predict" in response.json["error"]  # type: ignore[index]
    assert client.post("/predict", json={"inputs": ["x"]}).status_code == 200


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (texts(["x"]), "datatype must be FP32"),
        (fp32([VECTOR[:15]]), "shape must be [-1, 16]"),
        (
            {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16], "data": VECTOR[:15]}]},
            "data 15",
        ),
        (
            {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16], "data": ["1"] * 16}]},
            "numbers",
        ),
        (
            {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16], "data": [1e39] * 16}]},
            "float32",
        ),
        ({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16]}]}, "neither"),
        ({"inputs": [{"name": "input", "datatype": "FP32", "shape": "1x16", "data": VECTOR}]}, "shape"),
        ({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 16], "data": VECTOR}]}, "'pixels'"),
        ({"inputs": []}, "takes one"),
        ({"inputs": "x"}, "takes one"),
        ({"id": 7, **fp32([VECTOR])}, '"id"'),
        (fp32([VECTOR], outputs=[{"name": "logits"}]), "unknown output 'logits'"),
        (fp32([VECTOR], parameters=[]), "parameters"),
        ([], "JSON object"),
    ],
)
def test_a_bad_tensor_is_a_400_naming_the_problem(client: FlaskClient, body: Any, fragment: str) -> None:
    response = client.post("/v2/models/mlp/infer", json=body)
    assert response.status_code == 400, response.json
    assert fragment in response.json["error"], response.json  # type: ignore[index]


@pytest.mark.parametrize(
    ("header_length", "raw", "fragment"),
    [
        ("abc", b"", HEADER),
        ("-1", b"", HEADER),
        ("99999", b"", HEADER),
        (None, b"\x00" * 64, f"needs the {HEADER} header"),
        ("ok", b"\x00" * 60, "binary_data_size is 64"),
        ("ok", b"\x00" * 68, "binary_data_size is 64"),
    ],
)
def test_malformed_binary_data_is_a_400(
    client: FlaskClient, header_length: str | None, raw: bytes, fragment: str
) -> None:
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [1, 16],
                    "parameters": {"binary_data_size": 64},
                }
            ]
        }
    )
    headers = (
        {}
        if header_length is None
        else {HEADER: str(len(header)) if header_length == "ok" else header_length}
    )
    response = client.post("/v2/models/mlp/infer", data=header + raw, headers=headers)
    assert response.status_code == 400, response.get_data()
    assert fragment in response.json["error"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (struct.pack("<I", 5) + b"abc", "runs past"),
        (length_prefixed([b"ab"]) + b"\x01\x00", "4-byte length"),
        (length_prefixed([b"a", b"b", b"c"]), "holds 2 elements"),
        (length_prefixed([b"\xff", b"ok"]), "UTF-8"),
    ],
)
def test_malformed_binary_text_is_a_400(echo: FlaskClient, raw: bytes, fragment: str) -> None:
    header = {
        "inputs": [
            {"name": "input", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": len(raw)}}
        ]
    }
    body, headers = binary_request(header, raw)
    response = echo.post("/v2/models/echo/infer", data=body, headers=headers)
    assert response.status_code == 400, response.get_data()
    assert fragment in response.json["error"]  # type: ignore[index]


def test_the_limits_of_predict_apply(client: FlaskClient) -> None:
    # max_items_per_request is 8 in the shared test settings.
    response = client.post("/v2/models/mlp/infer", json=fp32([VECTOR] * 9))
    assert response.status_code == 413
    assert "limit is 8" in response.json["error"]  # type: ignore[index]
    big = b"[" + b" " * (9 << 20) + b"]"
    assert client.post("/v2/models/mlp/infer", data=big).status_code == 413
    slow = client.post("/v2/models/mlp/infer", json=fp32([VECTOR]), headers={"X-Request-Timeout-Ms": "soon"})
    assert slow.status_code == 400


def test_unknown_model_on_infer_is_a_404(client: FlaskClient) -> None:
    response = client.post("/v2/models/resnet/infer", json=fp32([VECTOR]))
    assert response.status_code == 404
    assert response.json == {"error": "unknown model 'resnet'; this service serves 'mlp'"}
    assert client.post("/v2/models/mlp/versions/3/infer", json=fp32([VECTOR])).status_code == 404


def test_a_model_of_other_items_is_not_served(make_client: Callable[[Settings], FlaskClient]) -> None:
    client = make_client(Settings(model="tests.support.models:sleepy"))
    response = client.get("/v2/models/sleepy")
    assert response.status_code == 404
    assert "POST /predict" in response.json["error"]  # type: ignore[index]


def test_the_token_guards_infer_but_not_health_or_metadata(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(Settings(model="mlp", mlp_width=16, mlp_depth=1, api_token="s3cret"))
    refused = client.post("/v2/models/mlp/infer", json=fp32([VECTOR]))
    assert refused.status_code == 401
    assert "error" in refused.json  # type: ignore[operator]
    token = {"Authorization": "Bearer s3cret"}
    assert client.post("/v2/models/mlp/infer", json=fp32([VECTOR]), headers=token).status_code == 200
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/mlp", "/v2/models/mlp/ready"):
        assert client.get(path).status_code == 200


def test_metrics_and_the_access_line_label_the_v2_routes(client: FlaskClient) -> None:
    assert client.post("/v2/models/mlp/infer", json=fp32([VECTOR])).status_code == 200
    assert client.post("/v2/models/mlp/versions/1/infer", json=texts(["x"])).status_code == 400
    scrape = Scrape.parse(client.get("/metrics").get_data())
    requests = "serve_http_requests_total"
    assert scrape.total(requests, route="/v2/models/<name>/infer", code="200") == 1
    assert scrape.total(requests, route="/v2/models/<name>/versions/<version>/infer", code="400") == 1
    assert scrape.total("serve_inferred_items_total") == 1

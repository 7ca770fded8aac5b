"""Hostile v2 and OpenAI bodies, in process: never a 5xx, always the protocol's JSON error.

Bodies range from random bytes to near-valid requests with one field wrong,
binary tensor data whose header length, sizes and length prefixes disagree,
and the shared hostile JSON of tests.support.hostile.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from flask import Flask
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service import create_app
from service.config.settings import Settings
from tests.conftest import wait_until_ready
from tests.support import hostile

MAX_ITEMS = 8
HEADER = "Inference-Header-Content-Length"


def app_for(model: str) -> Flask:
    return create_app(
        Settings(
            model=model,
            mlp_width=hostile.WIDTH,
            mlp_depth=1,
            max_items_per_request=MAX_ITEMS,
            torch_threads=1,
        )
    )


@pytest.fixture(scope="module")
def clients() -> Iterator[dict[str, FlaskClient]]:
    # One app per model for the whole module: hypothesis runs hundreds of examples.
    apps = {"mlp": app_for("mlp"), "vectors": app_for("tests.support.models:vectors")}
    runtimes = [wait_until_ready(app) for app in apps.values()]
    yield {name: app.test_client() for name, app in apps.items()}
    for runtime in runtimes:
        runtime.stop(timeout=10)


datatypes = st.sampled_from(["FP32", "BYTES", "FP64", "INT8", "fp32", ""]) | hostile.leaves
shapes = st.lists(st.integers(-2, 20), max_size=4) | hostile.json_values
numbers = st.lists(
    st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(10**40), 10**40), max_size=40
)
strings = st.lists(st.text(st.characters(exclude_categories=()), max_size=8), max_size=10)


@st.composite
def v2_tensor(draw: st.DrawFn) -> dict[str, Any]:
    tensor: dict[str, Any] = {
        "name": draw(st.sampled_from(["input", "input", "output", ""]) | hostile.leaves),
        "datatype": draw(datatypes),
        "shape": draw(shapes),
    }
    if draw(st.booleans()):
        tensor["data"] = draw(numbers | strings | hostile.json_values)
    if draw(st.booleans()):
        tensor["parameters"] = draw(
            st.fixed_dictionaries({"binary_data_size": st.integers(-4, 200) | hostile.leaves})
            | hostile.json_values
        )
    return tensor


@st.composite
def v2_document(draw: st.DrawFn) -> dict[str, Any]:
    document: dict[str, Any] = {"inputs": draw(st.lists(v2_tensor(), max_size=3) | hostile.json_values)}
    if draw(st.booleans()):
        document["id"] = draw(hostile.leaves)
    if draw(st.booleans()):
        document["outputs"] = draw(
            st.lists(
                st.fixed_dictionaries({"name": st.sampled_from(["output", "x"]) | hostile.leaves}), max_size=2
            )
            | hostile.json_values
        )
    if draw(st.booleans()):
        document["parameters"] = draw(
            st.fixed_dictionaries({"binary_data_output": hostile.leaves}) | hostile.leaves
        )
    return document


def dumps(document: Any) -> bytes:
    # NaN, Infinity and integers of any size, which a strict parser must refuse.
    return json.dumps(document, allow_nan=True).encode()


def length_prefixed(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


binary_tails = st.one_of(
    st.binary(max_size=200),
    st.lists(st.binary(max_size=12), max_size=6).map(length_prefixed),
    st.builds(lambda n, tail: struct.pack("<I", n) + tail, st.integers(0, 2**32 - 1), st.binary(max_size=8)),
)
header_lengths = st.one_of(
    st.none(),
    st.just("exact"),
    st.integers(-5, 10**6).map(str),
    st.text(hostile.LATIN1, max_size=12),
)


@st.composite
def v2_request(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    header = dumps(draw(v2_document())) if draw(st.integers(0, 4)) else draw(hostile.bodies)
    tail = draw(binary_tails) if draw(st.booleans()) else b""
    length = draw(header_lengths)
    headers = {}
    if length is not None:
        headers[HEADER] = str(len(header)) if length == "exact" else length
    return header + tail, headers


def check(response: Any, openai: bool) -> None:
    assert response.status_code < 500, response.get_data()[:300]
    document = orjson.loads(response.get_data() if HEADER not in response.headers else b"{}")
    if response.status_code >= 400:
        error = document["error"]
        message = error["message"] if openai else error
        assert isinstance(message, str) and message and "Traceback" not in message
        if openai:
            assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("model", ["mlp", "vectors"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=v2_request())
def test_v2_infer_never_answers_5xx(
    clients: dict[str, FlaskClient], model: str, request: tuple[bytes, dict[str, str]]
) -> None:
    body, headers = request
    check(clients[model].post(f"/v2/models/{model}/infer", data=body, headers=headers), openai=False)


openai_inputs = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=30),
    st.lists(st.text(max_size=10), max_size=MAX_ITEMS + 2),
    st.lists(st.integers(-5, 2**40), max_size=5),
    hostile.json_values,
)


@st.composite
def openai_body(draw: st.DrawFn) -> bytes:
    if not draw(st.integers(0, 4)):
        return draw(hostile.bodies)
    document: dict[str, Any] = {}
    if draw(st.integers(0, 5)):
        document["model"] = draw(
            st.sampled_from(["vectors", "vectors", "text-embedding-3-small"]) | hostile.leaves
        )
    if draw(st.integers(0, 5)):
        document["input"] = draw(openai_inputs)
    for field, values in (
        ("encoding_format", st.sampled_from(["float", "base64", "int8"]) | hostile.leaves),
        ("dimensions", st.integers(-1, 4096) | hostile.leaves),
        ("user", hostile.leaves),
    ):
        if draw(st.booleans()):
            document[field] = draw(values)
    return dumps(document)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=openai_body(), content_type=hostile.content_types)
def test_openai_embeddings_never_answers_5xx(
    clients: dict[str, FlaskClient], body: bytes, content_type: str | None
) -> None:
    headers = {"Content-Type": content_type} if content_type is not None else {}
    response = clients["vectors"].post("/v1/embeddings", data=body, headers=headers)
    check(response, openai=True)
    if response.status_code == 200:
        data = response.json["data"]  # type: ignore[index]
        assert [d["index"] for d in data] == list(range(len(data)))

"""End to end: tritonclient and the openai SDK, with their default settings, against real gunicorn."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import openai
import pytest
import requests
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.support.server import Server, gunicorn

pytestmark = pytest.mark.e2e

MODEL = "all-MiniLM-L6-v2"
SENTENCES = ["A man is eating food.", "A man is riding a horse.", "The sky is blue."]


@pytest.fixture(scope="module")
def minilm() -> Iterator[Server]:
    # Each client's answers are compared with /predict's at 1e-5. In bfloat16 (auto's
    # choice on a CPU with AMX) how the batcher cuts a batch moves the rounding
    # (docs/protocols.md); these tests are about the protocols, so float32.
    with gunicorn({"SERVE_WORKERS": "1", "SERVE_PRECISION": "float32"}) as server:
        yield server


@pytest.fixture(scope="module")
def reference(minilm: Server) -> np.ndarray:
    """The embeddings /predict gives for SENTENCES."""
    return np.array(minilm.post("/predict", json={"inputs": SENTENCES}).json()["outputs"], dtype=np.float32)


@pytest.fixture
def triton_client(minilm: Server) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(minilm.url.removeprefix("http://"))
    yield client
    client.close()


@pytest.fixture
def openai_client(minilm: Server) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=minilm.url + "/v1", api_key="unused")
    yield client
    client.close()


def text_input(texts: list[str], *, binary: bool = True) -> triton.InferInput:
    tensor = triton.InferInput("input", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_), binary_data=binary)
    return tensor


def test_tritonclient_health_and_metadata(triton_client: triton.InferenceServerClient) -> None:
    assert triton_client.is_server_live()
    assert triton_client.is_server_ready()
    assert triton_client.is_model_ready(MODEL)
    assert triton_client.is_model_ready(MODEL, "1")
    assert not triton_client.is_model_ready("resnet50")
    server = triton_client.get_server_metadata()
    assert server["name"] == "torch-serve-batched"
    assert "binary_tensor_data" in server["extensions"]
    model = triton_client.get_model_metadata(MODEL)
    assert model["inputs"] == [{"name": "input", "datatype": "BYTES", "shape": [-1]}]
    assert model["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 384]}]


def test_tritonclient_infer_with_binary_data_by_default(
    triton_client: triton.InferenceServerClient, reference: np.ndarray
) -> None:
    # Binary input, and no outputs named: tritonclient asks for binary outputs too.
    result = triton_client.infer(MODEL, [text_input(SENTENCES)], request_id="triton-1")
    embeddings = result.as_numpy("output")
    assert embeddings.dtype == np.float32 and embeddings.shape == (3, 384)
    np.testing.assert_allclose(embeddings, reference, atol=1e-5)
    assert result.get_response()["id"] == "triton-1"


def test_tritonclient_infer_with_json_tensors(
    triton_client: triton.InferenceServerClient, reference: np.ndarray
) -> None:
    output = triton.InferRequestedOutput("output", binary_data=False)
    result = triton_client.infer(
        MODEL, [text_input(SENTENCES, binary=False)], outputs=[output], model_version="1"
    )
    assert "data" in result.get_output("output")
    np.testing.assert_allclose(result.as_numpy("output"), reference, atol=1e-5)


def test_tritonclient_wrong_datatype_and_unknown_model(triton_client: triton.InferenceServerClient) -> None:
    numbers = triton.InferInput("input", [1, 384], "FP32")
    numbers.set_data_from_numpy(np.zeros((1, 384), dtype=np.float32))
    with pytest.raises(InferenceServerException, match="datatype must be BYTES") as bad:
        triton_client.infer(MODEL, [numbers])
    assert bad.value.status() == "400"
    with pytest.raises(InferenceServerException, match="unknown model 'resnet50'") as unknown:
        triton_client.infer("resnet50", [text_input(["x"])])
    assert unknown.value.status() == "404"
    with pytest.raises(InferenceServerException, match="unknown model"):
        triton_client.get_model_metadata("resnet50")


def test_openai_sdk_default_base64(openai_client: openai.OpenAI, reference: np.ndarray) -> None:
    # The SDK asks for base64 unless told otherwise, and decodes it to floats.
    response = openai_client.embeddings.create(model=MODEL, input=SENTENCES)
    assert response.model == MODEL
    assert [d.index for d in response.data] == [0, 1, 2]
    np.testing.assert_allclose([d.embedding for d in response.data], reference, atol=1e-5)
    # Real counts from the tokenizer: "A man is eating food." is [CLS], 5 words, "." and [SEP].
    assert response.usage.prompt_tokens == response.usage.total_tokens == 8 + 9 + 7


def test_openai_sdk_float_and_a_single_string(openai_client: openai.OpenAI, reference: np.ndarray) -> None:
    response = openai_client.embeddings.create(model=MODEL, input=SENTENCES[0], encoding_format="float")
    [only] = response.data
    assert len(only.embedding) == 384
    np.testing.assert_allclose(only.embedding, reference[0], atol=1e-5)
    assert response.usage.prompt_tokens == 8


def test_openai_sdk_dimensions(openai_client: openai.OpenAI, reference: np.ndarray) -> None:
    # text-embedding-3's option: the first components, back to unit length.
    response = openai_client.embeddings.create(model=MODEL, input=SENTENCES, dimensions=128)
    cut = np.array([d.embedding for d in response.data])
    expected = reference[:, :128] / np.linalg.norm(reference[:, :128], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, rtol=1e-5)


def test_openai_sdk_errors(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as empty:
        openai_client.embeddings.create(model=MODEL, input=[])
    assert empty.value.param == "input"
    with pytest.raises(openai.BadRequestError):
        openai_client.embeddings.create(model=MODEL, input="")
    with pytest.raises(openai.NotFoundError) as unknown:
        openai_client.embeddings.create(model="text-embedding-3-small", input="x")
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="from 1 to 384") as too_wide:
        openai_client.embeddings.create(model=MODEL, input="x", dimensions=385)
    assert too_wide.value.param == "dimensions"
    # What LangChain's OpenAIEmbeddings sends by default: tiktoken's token ids.
    with pytest.raises(openai.BadRequestError, match="check_embedding_ctx_length=False"):
        openai_client.embeddings.create(model=MODEL, input=[[32, 893, 374, 12459, 3691, 13]])
    with pytest.raises(openai.BadRequestError, match="20000"):
        openai_client.embeddings.create(model=MODEL, input="x" * 20_001)


def test_openai_sdk_lists_the_model(openai_client: openai.OpenAI) -> None:
    assert [m.id for m in openai_client.models.list()] == [MODEL]
    assert openai_client.models.retrieve(MODEL).owned_by == "torch-serve-batched"


@pytest.fixture(scope="module")
def slow_echo() -> Iterator[Server]:
    # One worker whose batches take 200 ms, so that concurrent requests queue behind each other.
    with gunicorn({"SERVE_MODEL": "tests.support.models:slow_echo", "SERVE_WORKERS": "1"}) as server:
        yield server


def test_v2_openai_and_predict_requests_are_batched_together(slow_echo: Server) -> None:
    address = slow_echo.url.removeprefix("http://")
    start = threading.Barrier(12)

    def v2(text: str) -> tuple[float, int]:
        client = triton.InferenceServerClient(address)
        try:
            start.wait(30)
            result = client.infer("slow-echo", [text_input([text])])
            return float(result.as_numpy("output")[0, 0]), 0
        finally:
            client.close()

    def embeddings(text: str) -> tuple[float, int]:
        with openai.OpenAI(base_url=slow_echo.url + "/v1", api_key="unused") as client:
            start.wait(30)
            raw = client.embeddings.with_raw_response.create(model="slow-echo", input=text)
            return raw.parse().data[0].embedding[0], int(raw.headers["X-Batch-Size"])

    def predict(text: str) -> tuple[float, int]:
        start.wait(30)
        response = requests.post(slow_echo.url + "/predict", json={"inputs": [text]}, timeout=60)
        return response.json()["outputs"][0][0], int(response.headers["X-Batch-Size"])

    calls: list[tuple[Any, str]] = [
        (call, "x" * (i + 1)) for i, call in enumerate([v2, embeddings, predict] * 4)
    ]
    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(lambda c: c[0](c[1]), calls))
    # Each request got its own output: the echo model answers each text's length.
    assert [value for value, _ in results] == [float(len(text)) for _, text in calls]
    # While one 200 ms batch runs, the others queue and go in together, whatever their protocol.
    assert max(size for _, size in results) > 1
    routes = {"route=/v2/models/<name>/infer", "route=/v1/embeddings", "route=/predict"}

    def access_lines() -> list[str]:
        return [line for line in slow_echo.log().splitlines() if any(r in line for r in routes)]

    # A worker writes its access lines from a thread of its own, just after the answers.
    deadline = time.monotonic() + 10
    while len(batched := access_lines()) < len(calls) and time.monotonic() < deadline:
        time.sleep(0.05)  # the log file offers nothing to wait on
    assert len(batched) == len(calls)
    sizes = [int(line.split("batch_size=")[1].split()[0]) for line in batched]
    assert any(size > 1 for size, line in zip(sizes, batched, strict=True) if "/v2/" in line)


@pytest.fixture(scope="module")
def gevent_vectors() -> Iterator[Server]:
    env = {
        "SERVE_MODEL": "tests.support.models:vectors",
        "SERVE_WORKERS": "1",
        "SERVE_WORKER_CLASS": "gevent",
    }
    with gunicorn(env) as server:
        yield server


def test_both_clients_under_a_gevent_worker(gevent_vectors: Server) -> None:
    # Request greenlets wait on the native batch thread for every protocol alike.
    client = triton.InferenceServerClient(gevent_vectors.url.removeprefix("http://"))
    try:
        result = client.infer("vectors", [text_input(["a b", "abc"])])
    finally:
        client.close()
    np.testing.assert_array_equal(result.as_numpy("output"), [[3, 1, 1], [3, 0, 1]])
    with openai.OpenAI(base_url=gevent_vectors.url + "/v1", api_key="unused") as sdk:
        response = sdk.embeddings.create(model="vectors", input=["a b c"])
    assert response.data[0].embedding == [5.0, 2.0, 1.0]

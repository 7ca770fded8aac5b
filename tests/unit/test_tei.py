"""In-process tests of Text Embeddings Inference's routes: TEI's shapes, its errors and /info's keys.

The real clients (huggingface_hub, LlamaIndex, Haystack) run against real
gunicorn in tests/e2e/test_tei.py; these hold the contract field by field.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service import create_app
from service.config.settings import Settings
from service.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelError,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    ServeError,
    UnsupportedMediaType,
)
from service.http.arrival import ARRIVAL_ENVIRON_KEY
from service.http.payload import prepare_items
from service.http.tei_codec import Empty, NotServed, error_document
from service.model_set import UnknownModel
from service.models.base import truncating
from service.models.hf import Encoder, load_tokenizer
from tests.conftest import wait_until_ready
from tests.support import hostile
from tests.support.hf_dirs import minilm_path
from tests.support.models import VectorsModel

VECTORS = Settings(model="tests.support.models:vectors", max_items_per_request=8)
# What the vectors model returns for a text: its length, its spaces and 1.
RAW = {"a b c": [5.0, 2.0, 1.0], "ab": [2.0, 0.0, 1.0], "a b c d": [7.0, 3.0, 1.0]}


def unit(vector: list[float]) -> list[float]:
    array = np.asarray(vector, dtype=np.float64)
    return (array / np.linalg.norm(array)).tolist()  # type: ignore[no-any-return]


@pytest.fixture
def vectors(make_client: Callable[[Settings], FlaskClient]) -> FlaskClient:
    return make_client(VECTORS)


@pytest.fixture(scope="module")
def several(model_dirs: dict[str, Path]) -> Iterator[FlaskClient]:
    """A reranker (the default), a classifier, a fill-mask model and the vectors model in one service."""
    spec = (
        f"rerank={model_dirs['rerank']},classify={model_dirs['classification']},"
        f"mask={model_dirs['fill-mask']},vectors=tests.support.models:vectors"
    )
    app = create_app(Settings(model=spec, torch_threads=1, precision="float32", max_items_per_request=8))
    models = wait_until_ready(app, timeout=120)
    yield app.test_client()
    models.stop(timeout=10)


def error_of(response: Any, status: int, error_type: str = "Validation") -> str:
    assert response.status_code == status, response.get_data()
    document = response.json
    assert set(document) == {"error", "error_type"}
    assert document["error_type"] == error_type
    assert document["error"] and "Traceback" not in document["error"]
    return document["error"]  # type: ignore[no-any-return]


# -- /embed -----------------------------------------------------------------------


def test_embed_answers_bare_vectors_normalised_by_default(vectors: FlaskClient) -> None:
    one = vectors.post("/embed", json={"inputs": "a b c"})
    assert one.status_code == 200, one.json
    np.testing.assert_allclose(one.json, [unit(RAW["a b c"])], rtol=1e-6)
    assert one.headers["X-Batch-Size"] == "1"
    many = vectors.post("/embed", json={"inputs": ["ab", "a b c d"], "normalize": False, "truncate": True})
    assert many.json == [RAW["ab"], RAW["a b c d"]]


def test_dimensions_cut_and_renormalise(vectors: FlaskClient) -> None:
    cut = vectors.post("/embed", json={"inputs": ["a b c", "ab"], "dimensions": 2}).json
    np.testing.assert_allclose(cut, [unit(RAW["a b c"][:2]), unit(RAW["ab"][:2])], rtol=1e-6)
    # As TEI: without normalize, the first components as they are.
    assert vectors.post("/embed", json={"inputs": "a b c", "dimensions": 1, "normalize": False}).json == [
        [5.0]
    ]
    whole = vectors.post("/embed", json={"inputs": "a b c", "dimensions": 3}).json
    np.testing.assert_allclose(whole, [unit(RAW["a b c"])], rtol=1e-6)


def test_the_root_embeds_for_an_embedder(vectors: FlaskClient) -> None:
    # huggingface_hub's feature_extraction: the options at the body's top level.
    response = vectors.post("/", json={"inputs": ["ab"], "normalize": True, "truncation_direction": "right"})
    np.testing.assert_allclose(response.json, [unit(RAW["ab"])], rtol=1e-6)


def test_a_model_that_cannot_cut_on_the_left_refuses_to(vectors: FlaskClient, several: FlaskClient) -> None:
    # The vectors model tokenizes, if at all, in its own code, which no request can ask to cut elsewhere.
    for path in ("/", "/embed"):
        body = {"inputs": ["ab"], "truncation_direction": "left"}  # huggingface_hub's lower case
        message = error_of(vectors.post(path, json=body), 422)
        assert message.startswith(
            '"truncation_direction" "Left": model \'vectors\' cannot cut texts on the left'
        )
    # A directory's tokenizer can.
    rerank = several.post("/rerank", json={"query": "q", "texts": ["a"], "truncation_direction": "Left"})
    assert rerank.status_code == 200, rerank.json
    classify = several.post("/?model=classify", json={"inputs": "a", "truncation_direction": "Left"})
    assert classify.status_code == 200, classify.json


def test_a_model_of_no_declared_size_is_held_to_the_size_it_returns(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    echo = make_client(Settings(model="tests.support.models:echo"))  # one number per text, undeclared
    assert echo.post("/embed", json={"inputs": "abc", "dimensions": 1}).json == [[1.0]]
    message = error_of(echo.post("/embed", json={"inputs": "abc", "dimensions": 2}), 422)
    assert message == (
        '"dimensions" must be a whole number from 1 to 1, the size of the model\'s embeddings, got 2'
    )
    openai = echo.post("/v1/embeddings", json={"model": "echo", "input": "abc", "dimensions": 2})
    assert openai.status_code == 400 and openai.json["error"]["param"] == "dimensions"


@pytest.mark.parametrize(
    ("body", "status", "error_type", "fragment"),
    [
        ({}, 422, "Validation", '"inputs" is missing'),
        ({"inputs": []}, 400, "Empty", "empty"),
        ({"inputs": 5}, 422, "Validation", "a string or a list of strings"),
        ({"inputs": [1, 2, 3]}, 422, "Validation", "token ids are not supported"),
        ({"inputs": [[101, 2054]]}, 422, "Validation", "token ids are not supported"),
        ({"inputs": [["a"]]}, 422, "Validation", "inputs[0] must be a string, got array"),
        ({"inputs": ["ok", None]}, 422, "Validation", "inputs[1]"),
        ({"inputs": "x", "normalize": "yes"}, 422, "Validation", '"normalize" must be true or false'),
        ({"inputs": "x", "truncate": 1}, 422, "Validation", '"truncate"'),
        ({"inputs": "x", "truncation_direction": "Up"}, 422, "Validation", '"Right" or "Left"'),
        ({"inputs": "x", "dimensions": 4}, 422, "Validation", "from 1 to 3"),
        ({"inputs": "x", "dimensions": 0}, 422, "Validation", "from 1 to 3"),
        ({"inputs": "x", "dimensions": 1.5}, 422, "Validation", "got number"),
        ({"inputs": "x", "dimensions": True}, 422, "Validation", "got boolean"),
        ({"inputs": "x", "prompt_name": "query"}, 422, "Validation", "has no prompts"),
        ({"inputs": ["x"] * 9}, 413, "Validation", "the limit is 8"),
    ],
)
def test_bad_embed_requests_get_tei_errors(
    vectors: FlaskClient, body: dict[str, Any], status: int, error_type: str, fragment: str
) -> None:
    assert fragment in error_of(vectors.post("/embed", json=body), status, error_type)


@pytest.mark.parametrize("entry", [["a"], True, [True], [], 1.5])
def test_only_token_ids_are_told_to_send_text(vectors: FlaskClient, entry: Any) -> None:
    message = error_of(vectors.post("/embed", json={"inputs": ["ok", entry]}), 422)
    assert message.startswith("inputs[1] must be a string") and "token ids" not in message


@pytest.mark.parametrize(
    ("error", "status", "error_type"),
    [
        (InvalidInput, 422, "Validation"),
        (PayloadTooLarge, 413, "Validation"),
        (UnsupportedMediaType, 415, "Validation"),
        (Empty, 400, "Empty"),
        (NotServed, 404, "Backend"),
        (ModelError, 500, "Backend"),
    ],
)
def test_an_items_refusal_keeps_its_class_so_its_status_and_tei_type(
    error: type[ServeError], status: int, error_type: str
) -> None:
    class Refusing(VectorsModel):
        def prepare(self, item: Any) -> str:
            raise error("not this one")

    # prepare_items names the item in an error of the same class.
    with pytest.raises(error) as refused:
        prepare_items(["x"], Refusing(), 8)
    exc = refused.value
    document = {"error": "inputs[0]: not this one", "error_type": error_type}
    assert error_document(exc.status, exc.message, exc) == (status, document)


def test_the_services_other_errors_take_tei_types() -> None:
    assert error_document(503, "m", NotReady("m"))[1]["error_type"] == "Unhealthy"
    assert error_document(503, "m", Overloaded("m"))[1]["error_type"] == "Overloaded"
    assert error_document(504, "m", DeadlineExceeded("m"))[1]["error_type"] == "Backend"
    assert error_document(404, "m", UnknownModel("m", "nope", "served: x"))[1]["error_type"] == "Validation"
    assert error_document(413, "m", None) == (413, {"error": "m", "error_type": "Validation"})


def test_bodies_that_are_not_a_json_object(vectors: FlaskClient) -> None:
    assert "not valid JSON" in error_of(
        vectors.post("/embed", data=b"{", content_type="application/json"), 400
    )
    assert "Content-Type" in error_of(vectors.post("/embed", data=b"x", content_type="text/plain"), 415)
    assert "JSON object" in error_of(vectors.post("/embed", json=["x"]), 422)


def test_routes_a_model_does_not_serve_say_which_does(vectors: FlaskClient) -> None:
    body = {"query": "q", "texts": ["a"]}
    assert "not rerank" in error_of(vectors.post("/rerank", json=body), 404, "Backend")
    assert "no tokenizer" in error_of(vectors.post("/tokenize", json={"inputs": "x"}), 404, "Backend")
    assert "unknown model 'nope'" in error_of(vectors.post("/embed?model=nope", json={"inputs": "x"}), 404)


def test_the_token_guards_the_tei_routes(make_client: Callable[[Settings], FlaskClient]) -> None:
    client = make_client(VECTORS.replace(api_token="s3cret"))
    for path in ("/", "/embed", "/rerank", "/tokenize"):
        error_of(client.post(path, json={"inputs": "x"}), 401)
    ok = client.post("/embed", json={"inputs": "ab"}, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200


# -- /info --------------------------------------------------------------------------


def test_info_has_tei_s_keys_beside_its_own(vectors: FlaskClient) -> None:
    info = vectors.get("/info").json
    assert {"model", "models", "batching", "limits", "precision", "ready"} <= set(info)
    assert info["model_id"] == "vectors"
    assert info["model_type"] == {"embedding": {"pooling": None}}
    assert (info["max_client_batch_size"], info["max_batch_tokens"]) == (8, 8192)
    assert info["auto_truncate"] is True and isinstance(info["version"], str)
    assert info["model_dtype"] == "float32"


def test_info_describes_the_model_asked_for(several: FlaskClient) -> None:
    rerank = several.get("/info").json
    assert rerank["model_id"] == "rerank"
    assert rerank["model_type"] == {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
    assert rerank["max_input_length"] == 512
    classify = several.get("/info?model=classify").json
    labels = {"0": "negative", "1": "neutral", "2": "positive"}
    assert classify["model_type"]["classifier"]["id2label"] == labels
    assert classify["model"]["name"] == "rerank"  # the service's own keys stay the default's
    assert several.get("/info?model=mask").json["model_type"] is None


# -- /rerank, classify, /tokenize on model directories -------------------------------


def test_rerank_answers_best_first(several: FlaskClient) -> None:
    texts = ["a cat purrs", "stocks fell", "dogs bark", "cats sleep"]
    ranks = several.post("/rerank", json={"query": "cats", "texts": texts, "return_text": True}).json
    scores = several.post("/v1/rerank", json={"query": "cats", "documents": texts}).json["results"]
    assert [r["index"] for r in ranks] == [r["index"] for r in scores]
    assert [r["score"] for r in ranks] == [r["relevance_score"] for r in scores]
    assert all(set(r) == {"index", "text", "score"} and r["text"] == texts[r["index"]] for r in ranks)
    bare = several.post("/", json={"query": "cats", "texts": texts}).json  # the default is the reranker
    assert [set(r) for r in bare] == [{"index", "score"}] * 4


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"texts": ["a"]}, 422, '"query" must be a string'),
        ({"query": "q", "texts": []}, 400, "empty"),
        ({"query": "q", "texts": "a"}, 200, ""),
        ({"query": "q", "texts": ["a"], "raw_scores": True}, 422, "raw_scores"),
        ({"query": "q", "texts": ["a"], "return_text": "yes"}, 422, "return_text"),
        ({"query": "q", "texts": ["a"] * 9}, 413, "SERVE_MAX_DOCUMENTS_PER_REQUEST"),
    ],
)
def test_bad_rerank_requests(several: FlaskClient, body: dict[str, Any], status: int, fragment: str) -> None:
    response = several.post("/rerank", json=body)
    if status == 200:  # one text, bare: ranked as a list of one
        assert response.status_code == 200, response.json
        cohere = several.post("/v1/rerank", json={"query": "q", "documents": ["a"]}).json
        assert response.json == [{"index": 0, "score": cohere["results"][0]["relevance_score"]}]
        return
    assert fragment in error_of(response, status, "Empty" if status == 400 else "Validation")


def test_the_root_classifies_for_a_classifier(several: FlaskClient) -> None:
    one = several.post("/?model=classify", json={"inputs": "what a day", "parameters": {}})
    labels = several.post("/predict", json={"model": "classify", "inputs": ["what a day"]}).json["outputs"]
    assert one.json == labels  # a list per text, even for one (what huggingface_hub reads)
    batch = several.post(
        "/?model=classify", json={"inputs": [["what a day"], ["bad"]], "parameters": {"top_k": 1}}
    )
    assert [len(labels) for labels in batch.json] == [1, 1]
    assert batch.json[0] == labels[0][:1]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"inputs": ["what a day", "bad"]}, "pair of texts"),
        ({"inputs": [["what a day", "bad"]]}, "inputs[0]"),
        ({"inputs": "x", "raw_scores": True}, "raw_scores"),
        ({"inputs": "x", "parameters": {"function_to_apply": "sigmoid"}}, "function_to_apply"),
        ({"inputs": "x", "parameters": {"top_k": 0}}, "top_k"),
        ({"inputs": "x", "parameters": []}, "parameters"),
    ],
)
def test_bad_classify_requests(several: FlaskClient, body: dict[str, Any], fragment: str) -> None:
    assert fragment in error_of(several.post("/?model=classify", json=body), 422)


def test_the_root_refuses_a_model_tei_has_no_route_for(several: FlaskClient) -> None:
    message = error_of(several.post("/?model=mask", json={"inputs": "a [MASK]"}), 404, "Backend")
    assert "POST /predict serves this one" in message


def test_tokenize_lists_tokens_with_byte_offsets(several: FlaskClient) -> None:
    [tokens] = several.post("/tokenize?model=classify", json={"inputs": "Hi wörld"}).json
    assert [t["text"] for t in tokens] == ["[CLS]", "Hi", "wörld", "[SEP]"]
    assert tokens[0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert tokens[-1]["special"] and tokens[-1]["text"] == "[SEP]"
    words = [t for t in tokens if not t["special"]]
    # "ö" is two bytes: offsets count bytes, as TEI's do.
    assert words[0] == {"id": words[0]["id"], "text": "Hi", "special": False, "start": 0, "stop": 2}
    assert (words[-1]["text"], words[-1]["stop"]) == ("wörld", 9)
    plain = several.post(
        "/tokenize?model=classify", json={"inputs": ["Hi", "x"], "add_special_tokens": False}
    )
    assert [[t["text"] for t in tokens] for tokens in plain.json] == [["Hi"], ["x"]]
    assert "inputs[0]" in error_of(
        several.post("/tokenize?model=classify", json={"inputs": "x" * 20_001}), 422
    )


def test_tokenize_reads_its_body_and_keeps_its_deadline_as_the_batched_routes_do(
    make_client: Callable[[Settings], FlaskClient], model_dirs: dict[str, Path]
) -> None:
    settings = Settings(model=str(model_dirs["classification"]), torch_threads=1, max_body_bytes=1024)
    client = make_client(settings)
    big = {"inputs": ["word " * 300]}
    assert "SERVE_MAX_BODY_BYTES" in error_of(client.post("/tokenize", json=big), 413)
    bad = client.post("/tokenize", json={"inputs": "ok"}, headers={"X-Request-Timeout-Ms": "0"})
    assert "X-Request-Timeout-Ms" in error_of(bad, 400)
    # Arrived an hour ago (as a worker stamps a request that waited): past its deadline before any text.
    late = client.post(
        "/tokenize", json={"inputs": "ok"}, environ_overrides={ARRIVAL_ENVIRON_KEY: time.monotonic() - 3600}
    )
    assert "deadline passed after 0 of its 1 texts" in error_of(late, 504, "Backend")
    assert client.post("/tokenize", json={"inputs": "ok"}).status_code == 200


# -- truncation on the side asked for ------------------------------------------------


def test_a_request_can_cut_its_texts_on_the_left() -> None:
    encoder = Encoder(load_tokenizer(minilm_path()), max_length=6)
    text = "one two three four five six seven"
    right = encoder(text).ids
    with truncating("left"):
        left = encoder(text).ids
        assert [t["text"] for t in encoder.pieces(text)] == ["[CLS]", "four", "five", "six", "seven", "[SEP]"]
    assert encoder(text).ids == right  # only within the block
    assert len(left) == len(right) == 6
    assert left[0] == right[0] and left[-1] == right[-1]  # [CLS] ... [SEP] either way
    whole = encoder.pieces(text)
    assert [t["text"] for t in whole][1:-1] == ["one", "two", "three", "four"]


def test_each_request_cuts_on_its_own_side_while_another_cuts_on_the_other() -> None:
    tokenizer = load_tokenizer(minilm_path())
    text = "one two three four five six seven"
    expected = {}
    for side in ("left", "right"):
        with truncating(side):
            expected[side] = Encoder(tokenizer, max_length=6)(text).ids
    assert expected["left"] != expected["right"]
    # A fresh encoder: both threads also meet at its first cut on the left, which makes that core.
    encoder = Encoder(tokenizer, max_length=6)
    start = threading.Barrier(2)
    got: dict[str, set[tuple[int, ...]]] = {}

    def tokenize(side: str) -> None:
        with truncating(side):  # this thread's context only
            start.wait(timeout=30)
            got[side] = {tuple(encoder(text).ids) for _ in range(2000)}

    threads = [threading.Thread(target=tokenize, args=(side,)) for side in ("left", "right")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert got == {side: {tuple(ids)} for side, ids in expected.items()}


# -- hostile bodies -----------------------------------------------------------------


@st.composite
def tei_body(draw: st.DrawFn) -> bytes:
    if not draw(st.integers(0, 4)):
        return draw(hostile.bodies)
    document: dict[str, Any] = {}
    if draw(st.integers(0, 5)):
        document["inputs"] = draw(
            st.text(max_size=20) | st.lists(st.text(max_size=8), max_size=10) | hostile.json_values
        )
    for field, values in (
        ("normalize", st.booleans() | hostile.leaves),
        ("truncate", st.booleans() | hostile.leaves),
        ("truncation_direction", st.sampled_from(["Left", "right", "up"]) | hostile.leaves),
        ("dimensions", st.integers(-1, 2**70) | hostile.leaves),
        ("prompt_name", hostile.leaves),
        ("parameters", hostile.json_values),
    ):
        if draw(st.booleans()):
            document[field] = draw(values)
    return json.dumps(document).encode()  # json: orjson refuses integers past 64 bits


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[FlaskClient]:
    # One app for every example: hypothesis runs hundreds.
    app = create_app(VECTORS)
    models = wait_until_ready(app)
    yield app.test_client()
    models.stop(timeout=10)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=tei_body(), content_type=hostile.content_types, path=st.sampled_from(["/embed", "/"]))
def test_hostile_bodies_never_get_a_5xx(
    fuzzed: FlaskClient, body: bytes, content_type: str | None, path: str
) -> None:
    headers = {"Content-Type": content_type} if content_type is not None else {}
    response = fuzzed.post(path, data=body, headers=headers)
    assert response.status_code < 500, response.get_data()[:300]
    if response.status_code >= 400:
        assert set(response.json) == {"error", "error_type"}

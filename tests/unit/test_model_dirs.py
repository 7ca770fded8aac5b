"""Model directories: recognised by their files, served on both routes, equal to the libraries run alone."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flask.testing import FlaskClient

from service.config.model_spec import check_spec, directory_task
from service.config.settings import Settings
from service.errors import SettingsError

ROUTES = ["/predict/naive", "/predict/batched"]
TEXTS = ["I loved this film.", "The service was slow, the food cold and the bill wrong.", "ok"]
MASKED = ["Paris is the [MASK] of France.", "A [MASK] sat on the [MASK]."]
PAIRS = [
    ["how do cats sleep", "Cats sleep for up to sixteen hours a day, mostly in short naps."],
    ["how do cats sleep", "The stock market fell sharply on Tuesday."],
    ["how do cats sleep", "cats"],
]


def serve(make_client: Callable[[Settings], FlaskClient], path: Path) -> FlaskClient:
    return make_client(Settings(model=str(path), torch_threads=1, max_items_per_request=16))


@pytest.mark.parametrize("task", ["embeddings", "rerank", "classification", "fill-mask"])
def test_each_directory_is_recognised_by_its_files(model_dirs: dict[str, Path], task: str) -> None:
    assert check_spec(str(model_dirs[task])) == "directory"
    assert directory_task(model_dirs[task]) == task


def test_an_unsupported_directory_is_refused_naming_what_was_found_and_what_is_served(
    model_dirs: dict[str, Path],
) -> None:
    with pytest.raises(SettingsError) as refused:
        check_spec(str(model_dirs["plain"]))
    message = str(refused.value)
    assert "config.json names BertModel" in message
    for supported in ("modules.json", "ForSequenceClassification", "ForMaskedLM"):
        assert supported in message


def test_a_directory_without_a_tokenizer_is_refused(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    shutil.copy(model_dirs["rerank"] / "config.json", bare / "config.json")
    with pytest.raises(SettingsError, match="has no tokenizer"):
        check_spec(str(bare))


def test_a_sentence_transformers_cross_encoder_is_read_from_its_config(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # sentence-transformers saves a CrossEncoder with its own files beside config.json.
    saved = tmp_path / "st-cross-encoder"
    shutil.copytree(model_dirs["rerank"], saved)
    (saved / "modules.json").write_text("[]")
    (saved / "config_sentence_transformers.json").write_text(json.dumps({"model_type": "CrossEncoder"}))
    assert directory_task(saved) == "rerank"


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("route", ROUTES)
def test_embeddings_equal_sentence_transformers(
    make_client: Callable[[Settings], FlaskClient], model_dirs: dict[str, Path], route: str
) -> None:
    from sentence_transformers import SentenceTransformer

    client = serve(make_client, model_dirs["embeddings"])
    response = client.post(route, json={"inputs": TEXTS})
    assert response.status_code == 200, response.json
    got = np.array(response.json["outputs"])  # type: ignore[index]
    reference = SentenceTransformer(str(model_dirs["embeddings"]), local_files_only=True).encode(TEXTS)
    assert got.shape == reference.shape == (3, 384)
    assert cosines(got, reference).min() >= 0.999
    info = client.get("/info").json["model"]  # type: ignore[index]
    assert info["name"] == "minilm-embeddings" and info["task"] == "embeddings"


@pytest.mark.parametrize("route", ROUTES)
def test_rerank_scores_equal_cross_encoder(
    make_client: Callable[[Settings], FlaskClient], model_dirs: dict[str, Path], route: str
) -> None:
    from sentence_transformers import CrossEncoder

    client = serve(make_client, model_dirs["rerank"])
    response = client.post(route, json={"inputs": PAIRS})
    assert response.status_code == 200, response.json
    reference = CrossEncoder(str(model_dirs["rerank"]), local_files_only=True).predict(PAIRS)
    np.testing.assert_allclose(response.json["outputs"], reference, atol=1e-4)  # type: ignore[index]
    assert len(set(np.round(reference, 4))) == len(PAIRS), "the scores must differ for the test to rank"


@pytest.mark.parametrize("route", ROUTES)
def test_classification_equals_the_pipeline(
    make_client: Callable[[Settings], FlaskClient], model_dirs: dict[str, Path], route: str
) -> None:
    from transformers import pipeline

    client = serve(make_client, model_dirs["classification"])
    response = client.post(route, json={"inputs": TEXTS})
    assert response.status_code == 200, response.json
    reference = pipeline("text-classification", model=str(model_dirs["classification"]), top_k=None)(TEXTS)
    for got, want in zip(response.json["outputs"], reference, strict=True):  # type: ignore[index]
        assert [entry["label"] for entry in got] == [entry["label"] for entry in want]
        np.testing.assert_allclose([e["score"] for e in got], [e["score"] for e in want], atol=1e-4)


def _fills(output: Any) -> list[list[dict[str, Any]]]:
    """The pipeline's output for one text as one list of fills per mask."""
    return [output] if isinstance(output[0], dict) else output


@pytest.mark.parametrize("route", ROUTES)
def test_fill_mask_equals_the_pipeline(
    make_client: Callable[[Settings], FlaskClient], model_dirs: dict[str, Path], route: str
) -> None:
    from transformers import pipeline

    client = serve(make_client, model_dirs["fill-mask"])
    response = client.post(route, json={"inputs": MASKED})
    assert response.status_code == 200, response.json
    reference = pipeline("fill-mask", model=str(model_dirs["fill-mask"]))(MASKED)
    for got, want in zip(response.json["outputs"], reference, strict=True):  # type: ignore[index]
        # The pipeline's shape: a list of fills for one mask, a list of lists for several.
        assert isinstance(got[0], dict) == isinstance(want[0], dict)
        for got_mask, want_mask in zip(_fills(got), _fills(want), strict=True):
            assert [(f["token"], f["token_str"], f["sequence"]) for f in got_mask] == [
                (f["token"], f["token_str"], f["sequence"]) for f in want_mask
            ]
            scores = [f["score"] for f in got_mask], [f["score"] for f in want_mask]
            np.testing.assert_allclose(*scores, atol=1e-4)


@pytest.mark.parametrize(
    ("task", "inputs", "fragment"),
    [
        ("fill-mask", ["Paris is the capital of France."], "inputs[0]: the text has no [MASK]"),
        ("fill-mask", ["[MASK] " + "word " * 600], "inputs[0]: the text is 60"),
        ("fill-mask", ["[MASK] " * 17], "inputs[0]: the text has 17 [MASK] tokens; the limit is 16"),
        ("rerank", [["query", 7]], "inputs[0]: the document must be a string, got number"),
        ("rerank", ["just one text"], "inputs[0]: expected a [query, document] pair"),
        ("classification", [["not", "a text"]], "inputs[0]: expected a string, got array"),
        ("embeddings", ["x" * 20_001], "inputs[0]: text is 20001 characters; the limit is 20000"),
    ],
)
def test_bad_items_are_refused_naming_the_item(
    make_client: Callable[[Settings], FlaskClient],
    model_dirs: dict[str, Path],
    task: str,
    inputs: list[Any],
    fragment: str,
) -> None:
    client = serve(make_client, model_dirs[task])
    for route in ROUTES:
        response = client.post(route, json={"inputs": inputs})
        assert response.status_code == 422
        assert fragment in response.json["error"]  # type: ignore[index]

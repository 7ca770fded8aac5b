"""Weights saved in float16 or bfloat16, as hub checkpoints often are, are served in float32.

Each half directory is a tiny float32 one with its weights converted by
scripts/bench/gpu_pack.py's ``convert_weights`` (config.json's dtype too), and
its float32 twin holds the same rounded weights written back in float32: the
two must answer alike, and the original within the rounding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flask.testing import FlaskClient

from scripts.bench.gpu_pack import convert_weights
from scripts.fixtures.make_bert_base import Shape, write
from service.config.settings import Settings
from service.models import load_model
from service.models import precision as p
from service.runtime import EXTENSION

TINY = Shape(layers=2, hidden=32, heads=2, intermediate=64)
LENIENT = p.Floor(min_cosine=-1, median_cosine=-1, top1_agreement=0, max_score_diff=1e9)
TEXTS = ["A man is eating food.", "The bill was wrong and the soup cold.", "ok"]


@pytest.fixture(scope="module")
def float32_dirs(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, Path]) -> dict[str, Path]:
    """An embeddings directory with a Dense module after its pooling, and the tiny classifier."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense

    root = tmp_path_factory.mktemp("half-weights")
    bert = write(root / "bert", seed=0, shape=TINY)
    embedder = SentenceTransformer(str(bert), device="cpu", local_files_only=True)
    torch.manual_seed(0)
    embedder.append(Dense(TINY.hidden, 8))  # saved in its own folder, in the same dtype as the rest
    embedder.save(str(root / "embeddings"))
    return {"embeddings": root / "embeddings", "classification": model_dirs["classification"]}


CASES = [("embeddings", "float16"), ("classification", "bfloat16")]


def saved_in(float32_dirs: dict[str, Path], tmp_path: Path, task: str, dtype: str) -> tuple[Path, Path]:
    """The directory saved in ``dtype``, and its twin: the same rounded weights saved in float32."""
    half = convert_weights(float32_dirs[task], tmp_path / f"{task}-{dtype}", dtype)
    return half, convert_weights(half, tmp_path / f"{task}-rounded", "float32")


def outputs(model: Any) -> np.ndarray:
    answers = model.predict([model.prepare(text) for text in TEXTS])
    if model.task == "classification":  # each label's score, in the labels' order
        return np.array([[e["score"] for e in sorted(row, key=lambda e: e["label"])] for row in answers])
    return np.asarray(answers)


def floating_dtypes(module: Any) -> set[torch.dtype]:
    return {t.dtype for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()}


@pytest.mark.parametrize(("task", "dtype"), CASES)
def test_half_weights_load_in_float32_and_answer_as_the_same_weights_saved_in_float32(
    float32_dirs: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture, task: str, dtype: str
) -> None:
    half, twin = saved_in(float32_dirs, tmp_path, task, dtype)
    with caplog.at_level(logging.INFO, logger="service.models.hf"):
        model = load_model(Settings(model=str(half)), "cpu")
    said = [r.getMessage() for r in caplog.records if r.name == "service.models.hf"]
    assert said == [
        f"model {task}-{dtype}: weights stored in {dtype} are run in float32; "
        "SERVE_PRECISION chooses the precision"
    ]
    assert floating_dtypes(model.network()) == {torch.float32}  # type: ignore[attr-defined]

    served = outputs(model)
    # Every weight is the twin's exactly (float16 and bfloat16 widen to float32 without loss),
    # and so is the arithmetic: the same answers. The Dense module, converted too, runs at all.
    np.testing.assert_allclose(served, outputs(load_model(Settings(model=str(twin)), "cpu")), atol=1e-6)
    # Against the original, the weights' rounding alone: 1.2e-4 here in float16, 4.8e-3 in bfloat16.
    original = outputs(load_model(Settings(model=str(float32_dirs[task])), "cpu"))
    np.testing.assert_allclose(served, original, atol=0.02 if dtype == "bfloat16" else 0.002)


def test_float32_weights_are_left_as_they_are_and_nothing_is_logged(
    float32_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="service.models.hf"):
        model = load_model(Settings(model=str(float32_dirs["classification"])), "cpu")
    assert not [r for r in caplog.records if r.name == "service.models.hf"]
    assert floating_dtypes(model.network()) == {torch.float32}  # type: ignore[attr-defined]


# The weights' dtype, and the precision asked of the check: int8 is what a CPU would ask.
CHECKS = [("embeddings", "float16", "int8"), ("classification", "bfloat16", "bfloat16")]


@pytest.mark.parametrize(("task", "dtype", "asked"), CHECKS)
def test_the_precision_check_measures_against_float32(
    float32_dirs: dict[str, Path], tmp_path: Path, task: str, dtype: str, asked: str
) -> None:
    """Its reference ran in the weights' own dtype before: a float16 "float32"."""
    half, _ = saved_in(float32_dirs, tmp_path, task, dtype)
    model = load_model(Settings(model=str(half)), "cpu")
    ran_in: list[torch.dtype] = []

    def run(items: list[Any]) -> Any:
        ran_in.append(next(model.network().parameters()).dtype)  # type: ignore[attr-defined]
        return p.in_chunks(model, items)

    choice = p.check(model, task, asked, LENIENT, run=run)
    assert choice.precision == asked, choice.fallback
    assert ran_in[0] == torch.float32  # the reference
    if asked != "int8":  # (int8 leaves the parameters it does not quantize in float32)
        assert ran_in[1] == getattr(torch, asked)


def test_serve_precision_float32_serves_a_float16_directory_in_float32(
    make_client: Callable[[Settings], FlaskClient], float32_dirs: dict[str, Path], tmp_path: Path
) -> None:
    half, _ = saved_in(float32_dirs, tmp_path, "embeddings", "float16")
    client = make_client(Settings(model=str(half), precision="float32", torch_threads=1))
    info = client.get("/info").json
    assert info is not None and info["precision"] == {"requested": "float32", "in_use": "float32"}
    served = client.application.extensions[EXTENSION].model  # and float32 is what runs
    assert floating_dtypes(served.network()) == {torch.float32}
    response = client.post("/predict/batched", json={"inputs": TEXTS})
    assert response.status_code == 200, response.json


def test_float16_runs_a_directory_with_a_dense_module(float32_dirs: dict[str, Path]) -> None:
    """The body in float16, its pooling and Dense module in float32: as on a GPU, run here on the CPU.

    sentence-transformers calls its transformer's forward itself, so a forward hook
    never cast the body's output: the Dense module, in float32, refused float16.
    Speed is not measured here; the check runs the GPU path's code.
    """
    model = load_model(Settings(model=str(float32_dirs["embeddings"])), "cpu")
    reference = outputs(model)
    choice = p.check(model, "embeddings", "float16", p.Floor(min_cosine=0.5, median_cosine=0.5))
    assert choice.precision == "float16", choice.fallback
    reduced = outputs(model)
    assert reduced.dtype == np.float32 and reduced.shape == reference.shape == (len(TEXTS), 8)
    cosines = (
        (reduced * reference).sum(1) / np.linalg.norm(reduced, axis=1) / np.linalg.norm(reference, axis=1)
    )
    assert cosines.min() > 0.99

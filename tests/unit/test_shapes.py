"""Bounded call shapes (service.models.shapes): the steps, the batcher's cuts on them, and the outputs.

Where the worker's oneDNN cache is on, a text model pads each call's rows to a
few steps and its length to a multiple of 16 tokens up to 64, then two steps a
doubling. Padding must never show
in the answers: every kind's outputs for the batch's own rows are float32's
without it, to float rounding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.batching.subbatch import Cost, CostModel, cut
from service.config.settings import Settings
from service.models import load_model
from service.models.precision import sample_items
from service.models.shapes import ShapeSteps, padded_length, steps_for
from service.runtime import bound_shapes


def test_rows_step_by_powers_of_two_up_to_the_largest_batch() -> None:
    assert steps_for(64, 256).rows == (1, 2, 4, 8, 16, 32, 64)
    assert steps_for(48, None).rows == (1, 2, 4, 8, 16, 32, 48)
    assert steps_for(1, None).rows == (1,)


def test_lengths_step_by_16_to_64_then_twice_a_doubling() -> None:
    lengths = sorted({padded_length(longest) for longest in range(1, 513)})
    assert lengths == [16, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert padded_length(65) == 96 and padded_length(97) == 128 and padded_length(129) == 192
    # Never more than a third of a padded call's tokens past 64 (and never a step of less than 16).
    assert all(longest / padded_length(longest) > 2 / 3 for longest in range(65, 513))


def test_a_call_is_padded_to_the_next_step_never_past_the_models_limit() -> None:
    steps = steps_for(64, 256)
    assert steps.shape(1, 7) == (1, 16)
    assert steps.shape(3, 16) == (4, 16)
    assert steps.shape(33, 17) == (64, 32)
    assert steps.shape(2, 70) == (2, 96)
    assert steps.shape(64, 250) == (64, 256)
    assert steps_for(64, 250).shape(2, 245) == (2, 250)  # a limit that is not on a step
    assert steps_for(64, 250).shape(2, 130) == (2, 192)
    assert steps.shape(100, 20) == (100, 32)  # past the largest step (never cut so): its own rows
    assert steps.tokens(33, 17) == 64 * 32


def test_the_number_of_shapes_is_bounded() -> None:
    steps = steps_for(64, 256)
    shapes = {steps.shape(rows, longest) for rows in range(1, 65) for longest in range(1, 257)}
    assert len(shapes) == 7 * 8
    # Within MiniLM's 8,192-token budget (64 x 192 and 64 x 256 are never cut so).
    assert len({shape for shape in shapes if shape[0] * shape[1] <= 8192}) == 54


def test_the_cost_counts_padded_tokens_as_the_model_pads() -> None:
    steps = steps_for(64, 256)
    cost = Cost(0.001, 1e-5, shape=steps.shape)
    assert cost.tokens(3, 10) == 4 * 16 and cost.of(3, 10) == pytest.approx(0.001 + 64e-5)
    model = CostModel(shape=steps.shape)
    assert model.tokens(5, 20) == 8 * 32
    model.observe(100, 0.01)
    model.observe(1000, 0.02)
    estimate = model.estimate()
    assert estimate is not None and estimate.shape == steps.shape
    floor = model.floor()
    assert floor is not None and floor.shape == steps.shape


def test_cuts_fall_on_the_steps_and_within_the_padded_budget() -> None:
    steps = steps_for(64, 256)
    cost = Cost(0.0001, 1e-6, shape=steps.shape)
    # 33 short items: a cut of 33 rows would run as 64; 32 and 1 run as 32 and 1.
    cuts = cut([10] * 33, cost, max_tokens=8192, max_rows=64)
    assert [end - start for start, end in cuts] in ([32, 1], [1, 32])
    # 17 rows of 250 tokens pad to 32 x 256 = 8192: within the budget; 8 rows more would not be.
    long = cut([250] * 40, cost, max_tokens=8192, max_rows=64)
    assert all(cost.tokens(end - start, 250) <= 8192 for start, end in long)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    raw, _ = sample_items("embeddings")
    return raw[:11]


@pytest.mark.parametrize("task", ["minilm", "embeddings", "rerank", "classification", "fill-mask"])
def test_padded_calls_answer_as_unpadded_ones(model_dirs: dict[str, Path], task: str) -> None:
    spec = "minilm" if task == "minilm" else str(model_dirs[task])
    model = load_model(Settings(model=spec), "cpu")
    kind = "embeddings" if task == "minilm" else task
    raw, _ = sample_items(kind)
    items = [model.prepare(item) for item in raw[:11]]  # 11 rows: padded to 16
    plain = model.predict(items)
    model.bound_shapes(64)  # type: ignore[attr-defined]
    padded = model.predict(items)
    assert len(padded) == len(items)
    if isinstance(plain, np.ndarray):
        assert np.abs(np.asarray(padded) - plain).max() <= 1e-5
    elif task == "classification":
        for want, got in zip(plain, padded, strict=True):
            assert [e["label"] for e in want] == [e["label"] for e in got]
            assert max(abs(a["score"] - b["score"]) for a, b in zip(want, got, strict=True)) <= 1e-5
    else:
        for want, got in zip(plain, padded, strict=True):
            assert [e["token_str"] for e in want] == [e["token_str"] for e in got]


def test_shapes_are_bounded_only_where_the_oneDNN_cache_is_on(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(model=str(model_dirs["rerank"]), max_batch_size=32)
    model = load_model(settings, "cpu")
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")
    bound_shapes(model, settings, "cpu")
    assert model.shapes is None  # type: ignore[attr-defined]
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    bound_shapes(model, settings, "cuda")
    assert model.shapes is None  # type: ignore[attr-defined]
    bound_shapes(model, settings, "cpu")
    assert model.shapes == ShapeSteps((1, 2, 4, 8, 16, 32), limit=512)  # type: ignore[attr-defined]

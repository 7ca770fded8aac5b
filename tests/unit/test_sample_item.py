"""The sample items benchmarks, the soak test and load tests send: one function for every model kind."""

from __future__ import annotations

import random

import numpy as np
import pytest

from service.models.base import SAMPLE_SENTENCE, sample_item


def info(kind: str, shape: list[int] | None, name: str = "m") -> dict[str, object]:
    return {"name": name, "item_kind": kind, "item_shape": shape, "device": "cpu"}


def test_text_models_get_the_sample_sentence_and_random_words_from_it() -> None:
    assert sample_item(info("text", [384])) == SAMPLE_SENTENCE
    varied = sample_item(info("text", None), random.Random(1))
    assert isinstance(varied, str)
    assert set(varied.split()) <= set(SAMPLE_SENTENCE.rstrip(".").split())


@pytest.mark.parametrize(("kind", "shape"), [("vector", [16]), ("tensor", [2, 3]), ("tensor", [1, 2, 2])])
def test_vector_and_tensor_models_get_numbers_of_their_shape(kind: str, shape: list[int]) -> None:
    fixed = np.asarray(sample_item(info(kind, shape)))
    assert fixed.shape == tuple(shape) and (fixed == 0.5).all()
    varied = np.asarray(sample_item(info(kind, shape), random.Random(2)))
    assert varied.shape == tuple(shape) and (np.abs(varied) <= 1).all()
    assert len(np.unique(varied)) > 1


def test_the_same_rng_seed_gives_the_same_items() -> None:
    vector = info("vector", [8])
    assert sample_item(vector, random.Random(3)) == sample_item(vector, random.Random(3))


@pytest.mark.parametrize(
    ("kind", "shape", "message"),
    [
        ("tensor", None, "set SERVE_ITEM_SHAPE"),
        ("seconds", [2], "its items are 'seconds'"),
        ("json", None, "sample items exist for 'text'"),
    ],
)
def test_a_model_it_cannot_make_items_for_is_named_in_a_value_error(
    kind: str, shape: list[int] | None, message: str
) -> None:
    with pytest.raises(ValueError, match="no sample item for model 'mine'") as raised:
        sample_item(info(kind, shape, name="mine"))
    assert message in str(raised.value)

"""Checks on what a model returned or raised, shared by both routes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from service.errors import InvalidInput, ModelError, Overloaded
from service.outputs import check_count, check_outputs, client_error, first_non_finite
from tests.support.models import OutOfMemoryError

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("outputs", "bad"),
    [
        (np.array([[1.0, 2.0], [3.0, NAN]], dtype=np.float32), 1),
        (np.array([INF, 1.0]), 0),
        ([[1.0, 2.0], [[3.0], [NAN]]], 1),  # nested lists
        ([np.float32(1.0), np.float32(INF)], 1),  # numpy scalars
        ([np.float64(-INF)], 0),
        ([1.0, NAN], 1),  # plain floats
        ([(1.0, 2.0), (NAN, 2.0)], 1),  # tuples
        ([{"score": 0.5}, {"score": NAN}], 1),  # dicts
        ([["cat", 0.9], ["dog", NAN]], 1),  # a label beside a score
        ([[1.0, [2.0, 3.0]], [1.0, [2.0, NAN]]], 1),  # ragged
        ([np.array([1.0]), np.array([NAN])], 1),  # a list of arrays
        (np.array([[1.0], [NAN]], dtype=object), 1),  # an object array
        (np.array([1 + 1j, complex(1, NAN)]), 1),  # complex
        (np.array([[3e38, 3e38], [1.0, INF]], dtype=np.float32), 1),  # the sum overflows, then the search
        (np.array([[1e308, 1e308], [1.0, NAN]]), 1),  # float64: likewise
        (np.array([[1.0, 2.0], [INF, 1.0]], dtype=np.float16), 1),
    ],
)
def test_non_finite_values_are_found_in_every_kind_of_output(outputs: Any, bad: int) -> None:
    assert first_non_finite(outputs) == bad
    with pytest.raises(ModelError, match=rf"non-finite value \(NaN or infinity\) for input {bad}$"):
        check_outputs(outputs, len(outputs))


@pytest.mark.parametrize(
    "outputs",
    [
        np.zeros((2, 3), dtype=np.float32),
        np.array([1, 2], dtype=np.int64),
        np.zeros((0, 4)),
        [[1.0, 2.0], [3.0]],
        ["nan", "inf"],  # strings are not numbers, whatever they spell
        [["label", "nan"], {"text": "Infinity"}],
        [None, True, 10**30, 2**70],
        [np.float32(1.5), np.int8(3)],
        [[]],
        np.array([1 + 2j, 3 - 4j]),
        np.full((2, 4), 3e38, dtype=np.float32),  # finite rows whose sum overflows
        np.full((2, 4), 1e308),  # float64 too
        np.full((2, 4), 6e4, dtype=np.float16),
    ],
)
def test_finite_outputs_pass(outputs: Any) -> None:
    assert first_non_finite(outputs) is None
    check_outputs(outputs, len(outputs))


def test_a_count_mismatch_names_both_numbers() -> None:
    with pytest.raises(ModelError, match=r"^model returned 3 outputs for 4 inputs$"):
        check_count([1, 2, 3], 4)


def test_a_gpu_out_of_memory_is_a_503_to_retry() -> None:
    # OutOfMemoryError is a mock of torch.cuda.OutOfMemoryError: a real one needs a GPU.
    error = client_error(OutOfMemoryError("CUDA out of memory"), 32)
    assert isinstance(error, Overloaded)
    assert error.status == 503 and error.reason == "gpu_out_of_memory"
    assert "batch of 32 items" in error.message


def test_other_model_exceptions_are_a_500_naming_only_the_class() -> None:
    error = client_error(ValueError("secret detail /srv/x"), 2)
    assert isinstance(error, ModelError) and error.status == 500
    assert error.message == "the model failed on this request's inputs (ValueError)"


def test_service_errors_pass_unchanged() -> None:
    original = InvalidInput("inputs[0]: too long")
    assert client_error(original, 1) is original

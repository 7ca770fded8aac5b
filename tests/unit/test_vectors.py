"""Embeddings cut to fewer dimensions and normalised, as /embed and /v1/embeddings return them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from service.http.vectors import check_dimensions, shorten

VECTORS = np.array([[3.0, 4.0, 12.0], [0.0, 0.0, 0.0], [-2.0, 0.0, 1.0]], dtype="<f4")


def test_cut_to_the_first_components_and_back_to_unit_length() -> None:
    cut = shorten(VECTORS, 2, normalize=True)
    assert cut.dtype == np.dtype("<f4") and cut.shape == (3, 2)
    np.testing.assert_allclose(cut, [[0.6, 0.8], [0.0, 0.0], [-1.0, 0.0]], rtol=1e-6)


def test_a_zero_vector_stays_zero() -> None:
    for dimensions in (None, 1, 3):
        out = shorten(VECTORS, dimensions, normalize=True)
        assert not np.isnan(out).any()
        assert (out[1] == 0).all()
    # A row zero only once cut: still zero, not NaN.
    np.testing.assert_array_equal(shorten(np.array([[0.0, 5.0]], dtype="<f4"), 1, normalize=True), [[0.0]])


def test_one_dimension_is_the_first_components_sign() -> None:
    np.testing.assert_array_equal(shorten(VECTORS, 1, normalize=True), [[1.0], [0.0], [-1.0]])


def test_without_normalize_the_first_components_are_as_they_were() -> None:
    out = shorten(VECTORS, 2, normalize=False)
    np.testing.assert_array_equal(out, VECTORS[:, :2])
    np.testing.assert_array_equal(shorten(VECTORS, None, normalize=False), VECTORS)


def test_all_dimensions_only_normalise() -> None:
    whole = shorten(VECTORS, 3, normalize=True)
    np.testing.assert_allclose(whole[0], VECTORS[0] / 13, rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(whole[[0, 2]], axis=1), 1.0, rtol=1e-6)


def test_more_dimensions_than_the_vectors_hold_is_refused_naming_their_size() -> None:
    # What a model that declares no size is held to, once its vectors are seen.
    with pytest.raises(ValueError, match=r"from 1 to 3, the size of the model's embeddings, got 4"):
        shorten(VECTORS, 4, normalize=True)


@pytest.mark.parametrize(("value", "size"), [(None, 3), (1, 3), (3, 3), (1, None), (10_000, None)])
def test_dimensions_allowed(value: Any, size: int | None) -> None:
    assert check_dimensions(value, size, "m") == value


@pytest.mark.parametrize(
    ("value", "size", "message"),
    [
        (0, 3, "from 1 to 3, the size of the embeddings of model 'm', got 0"),
        (4, 3, "from 1 to 3, the size of the embeddings of model 'm', got 4"),
        (0, None, "of at least 1, got 0"),
        (-1, None, "of at least 1, got -1"),
        (True, 3, "got boolean"),
        (1.0, 3, "got number"),
        ("2", 3, "got string"),
        ([2], None, "got array"),
    ],
)
def test_dimensions_refused(value: Any, size: int | None, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        check_dimensions(value, size, "m")
    assert str(refused.value).startswith('"dimensions" must be a whole number ')
    assert str(refused.value).endswith(message)

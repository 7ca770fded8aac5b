"""Embeddings as the protocols return them: checked to be vectors, cut to fewer dimensions, normalised.

Pure (numpy only), shared by OpenAI's ``/v1/embeddings`` and TEI's ``/embed``.
``dimensions`` keeps a vector's first components and scales them back to unit
length, as OpenAI's ``text-embedding-3`` models and TEI do: what a
Matryoshka-trained model (nomic v1.5, mxbai, gte-modernbert...) is trained to
allow. Any other model's cut vectors lose quality, which the service cannot
see: it cuts what it is asked to.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.errors import ModelError, json_type
from service.http import v2_codec
from service.models.base import EMBEDDINGS, GENERIC, Model, task_of


def as_vectors(model: Model, outputs: Any) -> np.ndarray:
    """The model's outputs as a float32 matrix, one row a text; ModelError if they are not vectors."""
    try:
        array = np.asarray(outputs, dtype="<f4")
    except (TypeError, ValueError) as exc:
        raise ModelError(f"model {model.name!r} returned outputs that are not vectors of numbers") from exc
    if array.ndim != 2:
        raise ModelError(f"model {model.name!r} returned outputs of shape {list(array.shape)}, not vectors")
    return array


def embeds_text(model: Model) -> bool:
    """Whether the model embeds text: a sentence-transformers directory, or a model of text items whose
    outputs are (or may be) vectors. What the embeddings routes serve."""
    if task_of(model) not in (EMBEDDINGS, GENERIC) or model.item_kind != "text":
        return False
    shape = v2_codec.output_spec(model).shape
    return shape is None or len(shape) == 2


def embedding_size(model: Model) -> int | None:
    """How many numbers the model's vectors hold, where it declares it (minilm: 384)."""
    shape = v2_codec.output_spec(model).shape
    return shape[1] if shape is not None and len(shape) == 2 and shape[1] > 0 else None


def check_dimensions(value: Any, size: int | None, name: str) -> int | None:
    """The ``dimensions`` a request asks for (None: all of them); ValueError says what is allowed.

    ``size`` is the model's vector size where it is known before the model runs
    (``embedding_size``); ``shorten`` checks it again against the vectors.
    """
    if value is None:
        return None
    whole = isinstance(value, int) and not isinstance(value, bool)  # JSON's true is no number
    if not whole or value < 1 or (size is not None and value > size):
        allowed = (
            f"from 1 to {size}, the size of the embeddings of model {name!r}" if size else "of at least 1"
        )
        raise ValueError(
            f'"dimensions" must be a whole number {allowed}, got {value if whole else json_type(value)}'
        )
    return int(value)


def shorten(vectors: np.ndarray, dimensions: int | None, *, normalize: bool) -> np.ndarray:
    """``vectors`` cut to their first ``dimensions`` components, then scaled to unit length if ``normalize``.

    A zero vector stays zero. ValueError when ``dimensions`` is more than the vectors hold.
    """
    if dimensions is not None:
        if dimensions > vectors.shape[1]:
            raise ValueError(
                f'"dimensions" must be a whole number from 1 to {vectors.shape[1]}, the size of the model\'s '
                f"embeddings, got {dimensions}"
            )
        vectors = vectors[:, :dimensions]
    if not normalize:
        return vectors
    norms = np.linalg.norm(vectors.astype(np.float64), axis=1, keepdims=True)
    scaled: np.ndarray = (vectors / np.where(norms > 0, norms, 1.0)).astype("<f4")
    return scaled

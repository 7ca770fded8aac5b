"""Conversions between JSON numbers and float32 arrays, shared by tensor models."""

from __future__ import annotations

from typing import Any

import numpy as np

from service.errors import json_type

# numpy dtype kinds a JSON list can produce that are not numbers.
_KINDS = {"U": "strings", "b": "booleans"}


def as_float_array(item: Any, shape: tuple[int, ...] | None) -> np.ndarray:
    """A client item as a finite float32 array of ``shape`` (any shape if None).

    numpy does the walk in C, which matters for items of thousands of numbers;
    ragged lists, strings, objects and overflowing numbers all end as ValueError.
    """
    if not isinstance(item, list):
        raise ValueError(f"expected a list of numbers, got {json_type(item)}")
    try:
        # No dtype here: converting straight to float32 would parse strings such
        # as "1.5" and turn null into NaN, accepting the wrong types.
        array = np.asarray(item)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError("expected a rectangular list of numbers") from exc
    if array.dtype.kind not in "iuf":
        found = _KINDS.get(array.dtype.kind)
        raise ValueError("expected a rectangular list of numbers" + (f", got {found}" if found else ""))
    if shape is not None and array.shape != shape:
        raise ValueError(f"expected shape {list(shape)}, got {list(array.shape)}")
    # Overflow to inf is caught by the finiteness check below, not warned about.
    with np.errstate(over="ignore", invalid="ignore"):
        array = array.astype(np.float32, copy=False)
    if not np.isfinite(array).all():
        raise ValueError("numbers must be finite and fit in float32")
    return array

"""Checks on what a model returned, shared by the naive and batched paths."""

from __future__ import annotations

import math

import numpy as np

from service.errors import ModelError
from service.models.base import Outputs


def check_outputs(outputs: Outputs, inputs: int) -> None:
    """Refuse outputs that break the model contract or cannot become JSON.

    JSON has no NaN or infinity and encoders differ on what they emit for them,
    so the documented rule is that a request whose outputs hold one fails with a
    500 naming the input, rather than being left to the encoder.
    """
    if len(outputs) != inputs:
        raise ModelError(f"model returned {len(outputs)} outputs for {inputs} inputs")
    bad = first_non_finite(outputs)
    if bad is not None:
        raise ModelError(f"model returned a non-finite value (NaN or infinity) for input {bad}")


def first_non_finite(outputs: Outputs) -> int | None:
    """Index of the first output holding NaN or infinity; None if all are finite."""
    if isinstance(outputs, np.ndarray):
        if outputs.dtype.kind != "f" or len(outputs) == 0:
            return None
        finite = np.isfinite(outputs.reshape(len(outputs), -1)).all(axis=1)
        return None if finite.all() else int(np.argmin(finite))
    for index, output in enumerate(outputs):
        if isinstance(output, float) and not math.isfinite(output):
            return index
        if isinstance(output, np.ndarray) and output.dtype.kind == "f" and not np.isfinite(output).all():
            return index
    return None

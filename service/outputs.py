"""What a model returned or raised, turned into what its callers are told.

Shared by the naive route (service.runtime) and the batch thread
(service.batching.batcher), so that both routes answer the same model behaviour with the
same status and message.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from service.errors import ModelError, Overloaded, ServeError
from service.models.base import Outputs

log = logging.getLogger(__name__)


def check_outputs(outputs: Outputs, inputs: int) -> None:
    """Refuse outputs that break the model contract or cannot become JSON."""
    check_count(outputs, inputs)
    check_finite(outputs)


def check_count(outputs: Outputs, inputs: int) -> None:
    if len(outputs) != inputs:
        raise ModelError(f"model returned {len(outputs)} outputs for {inputs} inputs")


def check_finite(outputs: Outputs) -> None:
    """Refuse outputs holding NaN or infinity, naming the first input they came from.

    JSON has no NaN or infinity and encoders differ on what they emit for them
    (orjson writes null), so the documented rule is that such a request fails
    with a 500 rather than being left to the encoder.
    """
    bad = first_non_finite(outputs)
    if bad is not None:
        raise ModelError(f"model returned a non-finite value (NaN or infinity) for input {bad}")


def first_non_finite(outputs: Outputs) -> int | None:
    """Index of the first output holding NaN or infinity; None if all are finite."""
    if isinstance(outputs, np.ndarray) and outputs.dtype.kind != "O":
        if outputs.dtype.kind not in "fc" or len(outputs) == 0:
            return None
        # One reduction answers the common case: a NaN or infinity anywhere makes
        # the sum non-finite. A finite sum proves all are finite; a sum that only
        # overflowed falls through to the exact search below.
        if outputs.dtype.kind == "f" and outputs.dtype.itemsize <= 4:
            # float16 and float32 summed in float64 cannot overflow: no error
            # state to set up, which costs as much as the sum itself.
            if math.isfinite(outputs.sum(dtype=np.float64)):
                return None
        else:
            with np.errstate(over="ignore"):  # an overflowing sum is expected here, and checked below
                total = outputs.sum()
            if np.isfinite(total):  # numpy's, not math's: the sum of a complex array is complex
                return None
        finite = np.isfinite(outputs.reshape(len(outputs), -1)).all(axis=1)
        return None if finite.all() else int(np.argmin(finite))
    for index, output in enumerate(outputs):
        if _holds_non_finite(output):
            return index
    return None


def _holds_non_finite(value: Any) -> bool:
    """Whether one output, of whatever kind a factory model returns, holds NaN or infinity."""
    if isinstance(value, float):  # numpy's float64 too
        return not math.isfinite(value)
    if value is None or isinstance(value, (str, bytes, int)):  # bool is an int
        return False
    if isinstance(value, dict):
        return any(_holds_non_finite(v) for v in value.values())
    array = _numeric_array(value)
    if array is not None:
        return not bool(np.isfinite(array).all())
    # Mixed or ragged containers (a label beside a score): look at each element.
    if isinstance(value, (list, tuple, np.ndarray)):
        elements = value.ravel() if isinstance(value, np.ndarray) else value
        return any(_holds_non_finite(v) for v in elements)
    return False


def _numeric_array(value: Any) -> np.ndarray | None:
    """``value`` as one array of numbers (numpy scalars, nested lists, tensors), or None.

    No dtype is forced, so that a string such as "nan" stays a string rather
    than becoming a float; a list mixing strings and numbers is not numeric.
    """
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, OverflowError):  # ragged lists, among others
        return None
    return array if array.dtype.kind in "biufc" else None


def client_error(exc: BaseException, items: int) -> ServeError:
    """What the callers of a failed model call are told; the details go to the log."""
    if isinstance(exc, ServeError):
        return exc
    if type(exc).__name__ == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError, without importing torch
        log.warning("the GPU ran out of memory on %d items: %s", items, exc)
        _release_cached_gpu_memory()
        return Overloaded(
            f"the GPU ran out of memory for a batch of {items} items; retry, or send fewer items",
            reason="gpu_out_of_memory",
        )
    log.error("model failed on %d items", items, exc_info=exc)
    return ModelError(f"the model failed on this request's inputs ({type(exc).__name__})")


def _release_cached_gpu_memory() -> None:
    # What the failed call left in torch's cache would otherwise starve the next one.
    import torch

    torch.cuda.empty_cache()

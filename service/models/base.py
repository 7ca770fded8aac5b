"""The one small interface every served model implements.

A model is loaded once per worker process. ``prepare`` checks and converts one
client item (raising ``ValueError`` with a message for the client) so that a
bad item is refused with 422 before it can reach a batch; ``predict`` maps a
list of prepared items to a sequence of outputs of the same length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

import numpy as np

# A model's outputs: a list, or an array whose first axis runs over the inputs.
Outputs: TypeAlias = Sequence[Any] | np.ndarray


@runtime_checkable
class Model(Protocol):
    name: str
    item_kind: str
    item_shape: tuple[int, ...] | None
    device: str

    def prepare(self, item: Any) -> Any: ...

    def predict(self, batch: list[Any]) -> Outputs: ...


def describe(model: Model) -> dict[str, Any]:
    """What ``GET /info`` says about the model."""
    return {
        "name": model.name,
        "item_kind": model.item_kind,
        "item_shape": list(model.item_shape) if model.item_shape is not None else None,
        "device": model.device,
    }


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    names: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)

"""User models: ``package.module:factory`` or a TorchScript / torch.export file.

A factory is any callable returning an object with ``predict(batch)``; it may
also offer ``prepare(item)`` (else items pass as parsed JSON), ``item_size(item)``
(then its batches are cut into length-aware sub-batches, as the built-in text
models' are), ``name``, ``task``, ``item_kind``, ``item_shape`` and
``output_shape``: the interface of service.models.base, shown in
docs/model-interface.md.
A file is loaded with ``torch.jit.load``, or ``torch.export.load`` for ``.pt2``;
its items are tensors given as nested lists.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.errors import SettingsError
from service.models.base import GENERIC, TASKS, Outputs
from service.models.tensors import as_float_array


class FactoryModel:
    """Adapts whatever a user factory returns to the :class:`Model` interface."""

    def __init__(self, spec: str, device: str) -> None:
        module_name, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise SettingsError(
                f"SERVE_MODEL={spec!r}: cannot import {attr!r} from {module_name!r}: {exc}"
            ) from exc
        self._inner = factory()
        if not callable(getattr(self._inner, "predict", None)):
            raise SettingsError(
                f"SERVE_MODEL={spec!r}: the factory returned an object without predict(batch)"
            )
        self.name = str(getattr(self._inner, "name", spec))
        self.item_kind = str(getattr(self._inner, "item_kind", "json"))
        shape = getattr(self._inner, "item_shape", None)
        self.item_shape = tuple(shape) if shape is not None else None
        self.device = str(getattr(self._inner, "device", device))
        self.task = str(getattr(self._inner, "task", GENERIC))
        if self.task not in TASKS:
            raise SettingsError(
                f"SERVE_MODEL={spec!r}: the model's task is {self.task!r}; "
                f"a task is one of {', '.join(TASKS)}"
            )
        output_shape = getattr(self._inner, "output_shape", None)
        if output_shape is not None:
            self.output_shape = tuple(output_shape)
        # Offered only when the inner model has it: the runtime checks for the
        # method (SizedModel) to decide whether to cut sub-batches.
        if callable(getattr(self._inner, "item_size", None)):
            self.item_size = self._inner.item_size

    def prepare(self, item: Any) -> Any:
        prepare = getattr(self._inner, "prepare", None)
        return prepare(item) if prepare is not None else item

    def predict(self, batch: list[Any]) -> Outputs:
        outputs = self._inner.predict(batch)
        if isinstance(outputs, torch.Tensor):
            array: np.ndarray = outputs.detach().float().cpu().numpy()
            return array
        if not isinstance(outputs, (Sequence, np.ndarray)):
            raise TypeError(f"predict returned {type(outputs).__name__}, not a sequence")
        return outputs


def load_program(path: Path, device: str) -> Any:
    """A TorchScript file, or a torch.export program (``.pt2``), on ``device``, ready to run."""
    if path.suffix == ".pt2":
        return torch.export.load(str(path)).module().to(device)
    return torch.jit.load(str(path), map_location=device).eval()  # type: ignore[no-untyped-call]


class TorchFileModel:
    task = GENERIC
    item_kind = "tensor"

    def __init__(self, path: Path, item_shape: tuple[int, ...] | None, device: str) -> None:
        if not path.is_file():
            raise SettingsError(f"SERVE_MODEL={str(path)!r}: no such file")
        self.name = path.name
        self.item_shape = item_shape
        self.device = device
        self._program = load_program(path, device)

    def prepare(self, item: Any) -> np.ndarray:
        return as_float_array(item, self.item_shape)

    def predict(self, batch: list[Any]) -> np.ndarray:
        with torch.inference_mode():
            out = self._program(torch.from_numpy(np.stack(batch)).to(self.device))
        array: np.ndarray = out.detach().float().cpu().numpy()
        return array

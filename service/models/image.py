"""Image models: a TorchScript or torch.export program, its declared preprocessing, and its labels.

The directory (recognised by service.config.model_spec) holds ``model.pt`` (or
``model.pt2``, ``model.ts``), ``preprocess.json`` (service.config.image_spec) and,
for labelled outputs, ``labels.txt``: one label a line, in the order of the
model's outputs. ``prepare`` decodes and preprocesses one image in the request
thread (service.models.imaging); ``predict`` only stacks the arrays and runs
the program, then gives each image the top-k labels with their scores, best
first, or its output tensor as it is.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.config.image_spec import LABELS_FILE, program_file, read_image_spec
from service.errors import SettingsError
from service.models.base import CLASSIFICATION, GENERIC
from service.models.hf import directory_name
from service.models.imaging import ImagePreprocessor
from service.models.layout import AUTO, CHANNELS_LAST, CONTIGUOUS, SAMPLE_BATCH, Layout, measure
from service.models.user import load_program


class ImageModel:
    item_kind = "image"

    def __init__(self, path: Path, device: str, max_pixels: int, layout: str = AUTO) -> None:
        spec = read_image_spec(path)
        program = program_file(path)
        if program is None:  # model_spec checked it; the directory may have changed since
            raise SettingsError(f"SERVE_MODEL={str(path)!r}: the image model's program is gone")
        self.name = directory_name(path)
        self.device = device
        self.spec = spec
        self.preprocess = ImagePreprocessor(spec, max_pixels)
        self.item_shape: tuple[int, ...] | None = spec.input_shape
        self.task = CLASSIFICATION if spec.outputs == "top_k" else GENERIC
        self._program = load_program(program, device)
        self._channels_last = False  # the batch's layout (service.models.layout)
        self.labels = _read_labels(path / LABELS_FILE) if (path / LABELS_FILE).is_file() else None
        # One run on a black image at load: a program that does not take the
        # declared input, or labels that do not match its outputs, stop the
        # worker with a message rather than fail every request.
        try:
            out = self._run(np.zeros((1, *spec.input_shape), dtype=np.float32))
        except Exception as exc:
            raise SettingsError(
                f"SERVE_MODEL={str(path)!r}: the program fails on one image of the declared shape "
                f"{list(spec.input_shape)} (preprocess.json): {exc}"
            ) from exc
        self.output_shape = tuple(out.shape[1:])
        if self.task == CLASSIFICATION:
            if out.ndim != 2:
                raise SettingsError(
                    f"SERVE_MODEL={str(path)!r}: top_k outputs need one score per label, but the program "
                    f"returns shape {list(out.shape[1:])} per image"
                )
            if self.labels is not None and len(self.labels) != out.shape[1]:
                raise SettingsError(
                    f"SERVE_MODEL={str(path)!r}: the program returns {out.shape[1]} scores per image, "
                    f"{LABELS_FILE} has {len(self.labels)} labels"
                )
        self.layout = self._settle_layout(layout)

    def _settle_layout(self, requested: str) -> Layout:
        """The layout the program runs in: contiguous, or channels_last where it measures faster on a CPU."""
        if requested == CONTIGUOUS:
            return Layout(requested, CONTIGUOUS, reason="as asked")
        if self.device.startswith("cuda"):
            return Layout(requested, CONTIGUOUS, reason="on a GPU the library picks its own layout")
        # Random pixels, not black ones: the outputs of the two layouts are compared.
        sample = np.random.default_rng(0).standard_normal(
            (SAMPLE_BATCH, *self.spec.input_shape), dtype=np.float32
        )

        def run(channels_last: bool) -> torch.Tensor:
            self._channels_last = channels_last
            return self._run(sample)

        def switch(channels_last: bool) -> None:
            self._program.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)

        try:
            chosen = measure(requested, run, switch)
        except Exception as exc:  # a program that cannot change its layout keeps the one it has
            self._channels_last = False
            with contextlib.suppress(Exception):
                switch(False)
            return Layout(requested, CONTIGUOUS, reason=f"channels_last failed: {type(exc).__name__}: {exc}")
        self._channels_last = chosen.in_use == CHANNELS_LAST  # measure's last run was channels_last
        return chosen

    def prepare(self, item: Any) -> np.ndarray:
        return self.preprocess(item)

    def predict(self, batch: list[np.ndarray]) -> Any:
        out = self._run(np.stack(batch))
        if self.task != CLASSIFICATION:
            array: np.ndarray = out.numpy()
            return array
        scores = torch.softmax(out, dim=1) if self.spec.softmax else out
        values, indices = scores.topk(min(self.spec.top_k, scores.shape[1]), dim=1)
        labels = self.labels or []
        return [
            [{"label": labels[i], "score": v} for v, i in zip(row_values, row_indices, strict=True)]
            for row_values, row_indices in zip(values.tolist(), indices.tolist(), strict=True)
        ]

    def _run(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array).to(self.device)
        if self._channels_last:
            tensor = tensor.contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            out = self._program(tensor)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the program returned {type(out).__name__}, not one tensor")
        return out.detach().float().cpu()


def _read_labels(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{path} cannot be read as UTF-8 text: {exc}") from None
    # A trailing blank line is an editor's habit, not a label.
    while lines and not lines[-1].strip():
        lines.pop()
    return [line.strip() for line in lines]

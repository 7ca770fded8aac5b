"""What an image model declares about its inputs and outputs, read from ``preprocess.json``.

Free of Pillow, torch and numpy, like service.config.model_spec, which uses it: the
gunicorn master checks the declaration before it forks, so a typo in it stops
the service at once rather than in every worker. service.models.imaging runs
the declaration (in the request threads); service.models.image serves a model
directory that holds one.

The steps are torchvision's classic ones, on Pillow images: convert to the
channel order, resize (the shorter side to ``resize``, or to ``[height,
width]``), crop the centre to ``center_crop``, scale to [0, 1], subtract
``mean`` and divide by ``std`` per channel, lay out as channels x height x width.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.errors import SettingsError

PREPROCESS_FILE = "preprocess.json"
LABELS_FILE = "labels.txt"
# The program file of an image model directory, in the order they are looked for.
PROGRAM_FILES = ("model.pt", "model.pt2", "model.ts")

CHANNELS = {"RGB": 3, "BGR": 3, "L": 1}
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos")
OUTPUTS = ("top_k", "raw")
# SERVE_IMAGE_LAYOUT: the memory layout an image program runs in on a CPU (service.models.layout).
LAYOUTS = ("auto", "contiguous", "channels_last")
# Largest side a declaration may ask for: far above any vision model's input.
MAX_SIDE = 8192
KEYS = ("resize", "center_crop", "interpolation", "mean", "std", "channels", "outputs", "top_k", "softmax")


@dataclass(frozen=True)
class ImageSpec:
    """An image model's declared preprocessing, and how its outputs are given."""

    # The shorter side's length, (height, width), or None: leave the size as it is.
    resize: int | tuple[int, int] | None = None
    center_crop: tuple[int, int] | None = None
    interpolation: str = "bilinear"
    channels: str = "RGB"
    # Per channel, in the model's channel order; one value applies to every channel.
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    # "top_k": the labels with the best scores; "raw": the output tensor as it is.
    outputs: str = "raw"
    top_k: int = 5
    # Whether top-k scores are the softmax of the outputs (logits) or the outputs themselves.
    softmax: bool = True

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of every preprocessed image."""
        if self.center_crop is not None:
            height, width = self.center_crop
        elif isinstance(self.resize, tuple):
            height, width = self.resize
        else:  # from_json refuses a declaration without a fixed size
            raise ValueError("the declaration gives no fixed input size")
        return CHANNELS[self.channels], height, width

    @classmethod
    def from_json(cls, document: Any, where: str, *, has_labels: bool = False) -> ImageSpec:
        """The declaration in a parsed ``preprocess.json``; SettingsError naming ``where`` and the key.

        ``outputs`` defaults to "top_k" beside a labels file, else to "raw".
        """
        if not isinstance(document, dict):
            raise SettingsError(f"{where}: must be a JSON object with keys among {', '.join(KEYS)}")
        unknown = sorted(set(document) - set(KEYS))
        if unknown:
            raise SettingsError(f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(KEYS)}")
        channels = _choice(document, "channels", tuple(CHANNELS), "RGB", where)
        spec = cls(
            resize=_size(document.get("resize"), "resize", where, allow_int=True),
            center_crop=_pair(_size(document.get("center_crop"), "center_crop", where, allow_int=False)),
            interpolation=_choice(document, "interpolation", INTERPOLATIONS, "bilinear", where),
            channels=channels,
            mean=_per_channel(document.get("mean", 0.0), "mean", CHANNELS[channels], where, positive=False),
            std=_per_channel(document.get("std", 1.0), "std", CHANNELS[channels], where, positive=True),
            outputs=_choice(document, "outputs", OUTPUTS, "top_k" if has_labels else "raw", where),
            top_k=_whole(document.get("top_k", 5), "top_k", where),
            softmax=_flag(document.get("softmax", True), "softmax", where),
        )
        if spec.center_crop is None and not isinstance(spec.resize, tuple):
            raise SettingsError(
                f"{where}: images must come out of one size to be batched: give center_crop, "
                'or resize as [height, width] (e.g. "resize": 256, "center_crop": 224)'
            )
        return spec


def read_image_spec(directory: Path) -> ImageSpec:
    """The declaration in ``directory/preprocess.json``, with the labels' file checked for ``top_k``."""
    where = f"SERVE_MODEL={str(directory)!r}: {PREPROCESS_FILE}"
    try:
        document = json.loads((directory / PREPROCESS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SettingsError(f"{where} cannot be read as JSON: {exc}") from None
    has_labels = (directory / LABELS_FILE).is_file()
    spec = ImageSpec.from_json(document, where, has_labels=has_labels)
    if spec.outputs == "top_k" and not has_labels:
        raise SettingsError(
            f'{where} asks for "outputs": "top_k", which needs {LABELS_FILE} beside it (one label a line, '
            'in the order of the outputs); add it, or declare "outputs": "raw"'
        )
    return spec


def program_file(directory: Path) -> Path | None:
    """The image model directory's program (TorchScript or torch.export), if it has one."""
    return next((directory / name for name in PROGRAM_FILES if (directory / name).is_file()), None)


def _size(value: Any, key: str, where: str, *, allow_int: bool) -> int | tuple[int, int] | None:
    if value is None:
        return None
    if _is_side(value):
        return int(value)
    if isinstance(value, list) and len(value) == 2 and all(map(_is_side, value)):
        return int(value[0]), int(value[1])
    shorter = "a whole number (the shorter side) or " if allow_int else "a whole number or "
    raise SettingsError(
        f"{where}: {key} must be {shorter}[height, width], from 1 to {MAX_SIDE}, got {value!r}"
    )


def _pair(size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    return (size, size) if isinstance(size, int) else size


def _is_side(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_SIDE


def _choice(document: dict[str, Any], key: str, allowed: tuple[str, ...], default: str, where: str) -> str:
    value = document.get(key, default)
    if value not in allowed:
        raise SettingsError(f"{where}: {key} must be one of {', '.join(allowed)}, got {value!r}")
    return str(value)


def _per_channel(value: Any, key: str, count: int, where: str, *, positive: bool) -> tuple[float, ...]:
    values = value if isinstance(value, list) else [value]
    # Python's JSON reader takes NaN and Infinity, which would make every output NaN.
    numbers = all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
    )
    if not numbers or len(values) not in (1, count) or (positive and not all(v > 0 for v in values)):
        sign = "positive " if positive else ""
        raise SettingsError(
            f"{where}: {key} must be a finite {sign}number or a list of {count} ({count} channels), "
            f"got {value!r}"
        )
    return tuple(float(v) for v in values)


def _whole(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SettingsError(f"{where}: {key} must be a whole number of at least 1, got {value!r}")
    return value


def _flag(value: Any, key: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise SettingsError(f"{where}: {key} must be true or false, got {value!r}")
    return value

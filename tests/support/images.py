"""Image models and files for the tests, all made here: a seeded CNN, JPEG/PNG/WebP files, hostile files.

``image_model_dir`` writes a model directory as a user would: the CNN as
TorchScript (random weights from a fixed seed), preprocess.json, labels.txt.
``reference`` runs the same preprocessing and program directly, without the
service, for the tests to compare with.
"""

from __future__ import annotations

import io
import json
import struct
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from service.config.image_spec import ImageSpec
from service.models.imaging import ImagePreprocessor

LABELS = [f"product-{i}" for i in range(10)]
PREPROCESS: dict[str, Any] = {
    "resize": 40,
    "center_crop": 32,
    "interpolation": "bilinear",
    "mean": [0.485, 0.456, 0.406],
    "std": [0.229, 0.224, 0.225],
    "channels": "RGB",
    "top_k": 3,
}


class SmallCNN(torch.nn.Module):
    """Two convolutions and a linear head: 3 x 32 x 32 in, 10 logits out."""

    def __init__(self, classes: int = len(LABELS)) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
        )
        self.head = torch.nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


# torch 2.13 deprecates TorchScript (jit.trace, jit.load) in favour of torch.export,
# but serves it still, and model files in the field are TorchScript: the tests that
# load one say so with this mark, and the helpers below silence the warning when saving.
JIT_DEPRECATED = "ignore:`torch.jit.(load|trace)` is deprecated:DeprecationWarning"


def small_cnn(seed: int = 0) -> SmallCNN:
    torch.manual_seed(seed)
    return SmallCNN().eval()


def save_program(module: torch.nn.Module, path: Path, shape: tuple[int, ...] = (3, 32, 32)) -> None:
    """``module`` as TorchScript (``.pt``) or as a torch.export program (``.pt2``) taking any batch size."""
    example = torch.zeros(2, *shape)
    if path.suffix == ".pt2":
        batch = torch.export.Dim("batch", min=1, max=4096)
        torch.export.save(torch.export.export(module, (example,), dynamic_shapes=({0: batch},)), str(path))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(module, example)
    traced.save(str(path))


def image_model_dir(
    root: Path, name: str = "shelf-cnn", *, labels: bool = True, program: str = "model.pt", **preprocess: Any
) -> Path:
    """A model directory for the seeded CNN; ``preprocess`` overrides keys of PREPROCESS."""
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    save_program(small_cnn(), directory / program)
    declared = {**PREPROCESS, **preprocess}
    if not labels:
        declared.pop("top_k", None)
    (directory / "preprocess.json").write_text(json.dumps(declared))
    if labels:
        (directory / "labels.txt").write_text("\n".join(LABELS) + "\n")
    return directory


def reference(directory: Path, files: list[bytes]) -> np.ndarray:
    """The program's outputs for ``files``, preprocessed the declared way, with no service around them."""
    declared = json.loads((directory / "preprocess.json").read_text())
    preprocess = ImagePreprocessor(ImageSpec.from_json(declared, "test", has_labels=False))
    program = small_cnn()  # the same seeded weights the directory's program holds
    with torch.inference_mode():
        out = program(torch.from_numpy(np.stack([preprocess(data) for data in files])))
    return np.asarray(out.numpy())


def top_k(logits: np.ndarray, k: int) -> list[list[dict[str, Any]]]:
    """What a top-k image model answers for these logits: labels and softmax scores, best first."""
    scores = torch.softmax(torch.from_numpy(logits), dim=1)
    values, indices = scores.topk(k, dim=1)
    return [
        [{"label": LABELS[i], "score": v} for v, i in zip(row_v, row_i, strict=True)]
        for row_v, row_i in zip(values.tolist(), indices.tolist(), strict=True)
    ]


def photo(seed: int, size: tuple[int, int] = (64, 48), fmt: str = "JPEG", mode: str = "RGB") -> bytes:
    """A random image file of ``size`` (width, height): smooth shapes and noise, as a photo has."""
    rng = np.random.default_rng(seed)
    width, height = size
    y, x = np.mgrid[0:height, 0:width]
    channels = [
        127 + 100 * np.sin(x / rng.uniform(3, 12) + rng.uniform(0, 6)) * np.cos(y / rng.uniform(3, 12))
        for _ in range(3)
    ]
    pixels = np.stack(channels, axis=-1) + rng.normal(0, 10, size=(height, width, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    if mode != "RGB":
        image = image.convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def animated(fmt: str, frames: int = 3) -> bytes:
    """An animated GIF, PNG (APNG) or WebP of ``frames`` frames."""
    images = [Image.new("RGB", (16, 16), (40 * i, 80, 160)) for i in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, fmt, save_all=True, append_images=images[1:], duration=100, loop=0)
    return buffer.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(width: int, height: int, pixels: bytes = b"") -> bytes:
    """A PNG that claims ``width`` x ``height``, with ``pixels`` as its (compressed) data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", zlib.compress(pixels))
        + _png_chunk(b"IEND", b"")
    )


def bomb() -> bytes:
    """A decompression bomb: a 40000 x 40000 PNG (1.6 gigapixels) of a few hundred bytes."""
    return png_header(40_000, 40_000, b"\x00" * 4096)


def hostile_images() -> dict[str, tuple[bytes, str, int]]:
    """Named hostile files: (bytes, the Content-Type to send them under, the status they must get)."""
    jpeg, png = photo(1), photo(2, fmt="PNG")
    corrupt = bytearray(jpeg)
    corrupt[20:400] = bytes(range(256)) + bytes(124)  # the tables and scan start overwritten
    return {
        "truncated-jpeg": (jpeg[: len(jpeg) // 2], "image/jpeg", 422),
        "truncated-png": (png[: len(png) // 2], "image/png", 422),
        "corrupt-jpeg": (bytes(corrupt), "image/jpeg", 422),
        "garbage": (b"\x00\x01not an image at all" * 20, "image/png", 422),
        "empty": (b"", "image/jpeg", 422),
        "header-only-jpeg": (b"\xff\xd8\xff\xe0", "image/jpeg", 422),
        "bomb-png": (bomb(), "image/png", 413),
        "zero-width-png": (png_header(0, 16), "image/png", 422),
        "zero-height-png": (png_header(16, 0), "image/png", 422),
        "animated-gif": (animated("GIF"), "image/gif", 415),
        "animated-gif-as-png": (animated("GIF"), "image/png", 415),
        "animated-png": (animated("PNG"), "image/png", 422),
        "animated-webp": (animated("WEBP"), "image/webp", 422),
        "jpeg-as-text": (jpeg, "text/plain", 415),
        "bmp": (photo(3, fmt="BMP"), "image/png", 415),
    }

"""``mlp``: a synthetic deep MLP with seeded weights.

A stand-in for a "big dummy model": its cost is set by width and depth, it
loads in milliseconds, and its outputs are deterministic, which suits fast tests
and benchmarks where the model is not the point.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from service.models.base import GENERIC
from service.models.tensors import as_float_array


class MLPModel:
    task = GENERIC
    item_kind = "vector"

    def __init__(self, width: int, depth: int, seed: int, device: str) -> None:
        self.name = "mlp"
        self.item_shape: tuple[int, ...] | None = (width,)
        self.device = device
        generator = torch.Generator().manual_seed(seed)
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            linear = torch.nn.Linear(width, width)
            with torch.no_grad():
                # Scaled so activations neither vanish nor explode over many layers.
                linear.weight.copy_(torch.randn(width, width, generator=generator) * (2.0 / width) ** 0.5)
                linear.bias.zero_()
            layers += [linear, torch.nn.ReLU()]
        self._net = torch.nn.Sequential(*layers[:-1]).eval().to(device)

    def prepare(self, item: Any) -> np.ndarray:
        return as_float_array(item, self.item_shape)

    def predict(self, batch: list[Any]) -> np.ndarray:
        with torch.inference_mode():
            x = torch.from_numpy(np.stack(batch)).to(self.device)
            out: np.ndarray = self._net(x).float().cpu().numpy()
        return out

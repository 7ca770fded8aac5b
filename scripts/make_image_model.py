#!/usr/bin/env python3
"""Write an image model directory for benchmarks and load tests: a ResNet-18-shaped CNN with RANDOM weights.

    .venv/bin/python scripts/make_image_model.py /tmp/resnet18-random
    SERVE_MODEL=/tmp/resnet18-random bash scripts/serve
    .venv/bin/python scripts/bench.py --model /tmp/resnet18-random --concurrency 1,8,32

The network has ResNet-18's layers and shapes (11.7 M parameters, 1.8 GFLOPs for
one 224 x 224 image), written in plain torch since torchvision does not install
beside the pinned torch here, with weights drawn from a fixed seed: its cost is a
ResNet-18's, its labels mean nothing. The directory holds model.pt (TorchScript),
preprocess.json (ImageNet's: shorter side to 256, centre crop 224, ImageNet mean and
std) and labels.txt (1000 made-up labels).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
from torch import nn

PREPROCESS = {
    "resize": 256,
    "center_crop": 224,
    "interpolation": "bilinear",
    "mean": [0.485, 0.456, 0.406],
    "std": [0.229, 0.224, 0.225],
    "channels": "RGB",
    "top_k": 5,
}


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18Shaped(nn.Module):
    """ResNet-18's layout: a 7x7 stem, four stages of two basic blocks, global pooling, 1000 logits."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        stages, width = [], 64
        for outputs, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages += [BasicBlock(width, outputs, stride), BasicBlock(outputs, outputs, 1)]
            width = outputs
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(self.stages(self.stem(x)), 1), 1))


def write(directory: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = ResNet18Shaped().eval()
    directory.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        # torch 2.13 calls TorchScript deprecated; the service loads it still, as it does .pt2.
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(model, torch.zeros(2, 3, 224, 224))
    traced.save(str(directory / "model.pt"))
    (directory / "preprocess.json").write_text(json.dumps(PREPROCESS, indent=2) + "\n")
    (directory / "labels.txt").write_text("".join(f"class-{i}\n" for i in range(1000)))
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write(args.directory, args.seed))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""An image program in the contiguous layout against channels_last on this CPU, and what the service picks.

    .venv/bin/python scripts/bench/layout.py [--model DIR] [--batches 1,8,32] [--threads 1,2]

Without --model it writes the ResNet-18-shaped directory (random weights,
scripts/fixtures/make_image_model.py) for the run. For each thread count and
batch size, one process holds the program twice, once in each layout, and runs
the same random batch in each in turn, --rounds times after a warm-up; the
table gives each layout's median ms a batch and channels_last's speed over
contiguous. Then it loads the directory as a worker does with
SERVE_IMAGE_LAYOUT=auto, --choices times, and prints the layout each load
chose with its measured speedup (service.models.layout). No HTTP; bounded by
the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def run(model_dir: Path, batches: list[int], threads: list[int], rounds: int, choices: int) -> None:
    import numpy as np
    import torch

    from service.models.image import ImageModel

    print(f"`{' '.join(sys.argv)}`, {os.cpu_count()} cores\n")
    print("| threads | batch | contiguous ms | channels_last ms | channels_last speed |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for count in threads:
        torch.set_num_threads(count)
        models = {
            layout: ImageModel(model_dir, "cpu", 4096 * 4096, layout)
            for layout in ("contiguous", "channels_last")
        }
        shape = models["contiguous"].spec.input_shape
        for batch in batches:
            items = list(np.random.default_rng(batch).standard_normal((batch, *shape), dtype=np.float32))
            times: dict[str, list[float]] = {layout: [] for layout in models}
            for model in models.values():
                model.predict(items)  # warm-up
            for _ in range(rounds):
                for layout, model in models.items():
                    began = time.perf_counter()
                    model.predict(items)
                    times[layout].append(time.perf_counter() - began)
            contiguous, channels_last = (statistics.median(times[layout]) for layout in models)
            print(
                f"| {count} | {batch} | {contiguous * 1000:.1f} | {channels_last * 1000:.1f} "
                f"| {contiguous / channels_last:.2f}x |"
            )
    print(f"\nSERVE_IMAGE_LAYOUT=auto, {choices} loads at {threads[0]} thread(s):")
    torch.set_num_threads(threads[0])
    for _ in range(choices):
        layout = ImageModel(model_dir, "cpu", 4096 * 4096, "auto").layout
        print(f"- {layout.summary()}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="an image model directory (default: ResNet-18-shaped)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--threads", default=f"1,{os.cpu_count() or 1}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--choices", type=int, default=3)
    args = parser.parse_args()
    batches = [int(part) for part in args.batches.split(",")]
    threads = [int(part) for part in args.threads.split(",")]
    if args.model is not None:
        run(args.model, batches, threads, args.rounds, args.choices)
        return
    from scripts.fixtures.make_image_model import write

    with tempfile.TemporaryDirectory() as scratch:
        run(write(Path(scratch) / "resnet18-random"), batches, threads, args.rounds, args.choices)


if __name__ == "__main__":
    main()

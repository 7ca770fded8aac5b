"""The memory layout an image program runs in on a CPU: channels_last where it measures faster.

A CPU's convolutions (oneDNN) work on channels-last (NHWC) tensors natively,
and a network whose weights and input are in that layout skips a reorder at
each convolution. Whether that pays depends on the network, the batch and the
processor: a ResNet-18-shaped program at batch 8 on this project's 2-core
machine measured 1.00x to 1.16x, and a network with few convolutions, or a
frozen TorchScript program whose weights are constants of its graph (which
``.to(memory_format=...)`` does not reach), can lose. So the layout is measured
once a worker has loaded its program, not assumed: the program runs a sample
batch in each layout, in turns, and channels_last is kept only when its median
is at least MIN_GAIN faster and its outputs match the contiguous ones. Only
programs that take one image batch, (batch, channels, height, width), are
measured; GPUs keep the contiguous layout (cuDNN picks its own).

``decide`` is pure: it takes the timings, so the tests need no clock.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.config.image_spec import LAYOUTS

AUTO, CONTIGUOUS, CHANNELS_LAST = LAYOUTS

# channels_last is kept only when its median run is at least this much faster:
# less is within the noise of a few runs on a shared machine, and the
# contiguous layout is the one every program was written for.
MIN_GAIN = 1.05
# Runs of each layout, taken in turns after one unmeasured warm-up run each
# (the first run of a TorchScript program profiles and optimises its graph).
ROUNDS = 3
# Images in the sample batch: a batch the batcher makes under load, kept small
# because measuring is paid at every load: with it the ResNet-18-shaped
# program's load took 2.7 s rather than 0.2 to 0.5 s at one thread (a
# ResNet-50, with about twice the work, would take twice that).
SAMPLE_BATCH = 4
# channels_last's outputs must match the contiguous ones this closely (a
# reordered sum differs in its last bits, a wrong one by far more).
TOLERANCE = 1e-3


@dataclass(frozen=True)
class Layout:
    """The layout an image program runs in, what was asked, and why: /info's "layout", the start log."""

    requested: str
    in_use: str
    # channels_last's speed over contiguous on the sample batch (median of ROUNDS); None when not measured.
    speedup: float | None = None
    reason: str = ""

    def describe(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "in_use": self.in_use,
            "speedup": self.speedup,
            "reason": self.reason,
        }

    def summary(self) -> str:
        measured = f", channels_last measured {self.speedup:.2f}x" if self.speedup is not None else ""
        return f"layout {self.in_use} (asked: {self.requested}{measured}): {self.reason}"


def decide(
    requested: str, contiguous_s: list[float], channels_last_s: list[float], outputs_match: bool
) -> Layout:
    """The layout for ``requested`` given each layout's run times on the sample batch."""
    speedup = statistics.median(contiguous_s) / statistics.median(channels_last_s)
    if not outputs_match:
        return Layout(
            requested, CONTIGUOUS, speedup, "channels_last's outputs differ from the contiguous layout's"
        )
    if requested == CHANNELS_LAST:
        return Layout(requested, CHANNELS_LAST, speedup, "as asked")
    if speedup >= MIN_GAIN:
        return Layout(requested, CHANNELS_LAST, speedup, f"faster by at least {MIN_GAIN:.2f}x")
    return Layout(requested, CONTIGUOUS, speedup, f"channels_last not faster by {MIN_GAIN:.2f}x")


def measure(
    requested: str,
    run: Callable[[bool], Any],
    switch: Callable[[bool], None],
    clock: Callable[[], float] = time.perf_counter,
) -> Layout:
    """Time ``run(channels_last)`` in both layouts and leave the program in the chosen one.

    ``switch(channels_last)`` puts the program's weights in that layout;
    ``run(channels_last)`` runs the sample batch in it and returns the output.
    """
    import torch

    times: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, Any] = {}
    for layout in (False, True):  # warm-up runs, unmeasured, which also give the outputs to compare
        switch(layout)
        outputs[layout] = run(layout)
    for _ in range(ROUNDS):
        for layout in (False, True):
            switch(layout)
            began = clock()
            run(layout)
            times[layout].append(clock() - began)
    match = bool(torch.allclose(outputs[False], outputs[True], rtol=TOLERANCE, atol=TOLERANCE))
    chosen = decide(requested, times[False], times[True], match)
    switch(chosen.in_use == CHANNELS_LAST)
    return chosen

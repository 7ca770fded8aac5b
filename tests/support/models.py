"""Test models, loadable through ``SERVE_MODEL=tests.support.models:<factory>``.

They stand in for a real model where the model is not the point: each records
the batches it saw and can be told to fail on a marked item.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np

from service.batching import native

POISON = "boom"
HOLD = "hold"


class EchoModel:
    """Outputs each text's length; raises on a batch that holds POISON."""

    name = "echo"
    item_kind = "text"
    item_shape = None

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def prepare(self, item: Any) -> str:
        if not isinstance(item, str):
            raise ValueError("expected a string")
        return item

    def predict(self, batch: list[str]) -> list[list[float]]:
        self.batches.append(list(batch))
        self.entered.set()
        self.gate.wait(timeout=30)
        if POISON in batch:
            raise ValueError("poisoned item")
        return [[float(len(text))] for text in batch]


def echo() -> EchoModel:
    return EchoModel()


class SlowEchoModel(EchoModel):
    """Each batch takes 200 ms, long enough for concurrent requests to queue behind it."""

    name = "slow-echo"

    def predict(self, batch: list[str]) -> list[list[float]]:
        threading.Event().wait(0.2)  # stands in for model time; not a poll
        return super().predict(batch)


def slow_echo() -> SlowEchoModel:
    return SlowEchoModel()


def _pause(seconds: float) -> None:
    """Block this OS thread alone, as a model call does: a native lock, so neither the
    GIL nor a gevent hub is held (``time.sleep`` would be gevent's in a patched worker)."""
    lock = native.allocate_lock()
    lock.acquire()
    lock.acquire(timeout=seconds)


class SleepyModel:
    """Each item is a number of seconds; a batch takes as long as its largest item.

    Outputs ``[seconds, 2 * seconds]``, so that a test can check each request got
    its own outputs. A stand-in for a long model call that leaves the rest of the
    worker free, as torch does.
    """

    name = "sleepy"
    item_kind = "seconds"
    item_shape = (2,)

    def prepare(self, item: Any) -> float:
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not 0 <= item <= 10:
            raise ValueError("expected a number of seconds from 0 to 10")
        return float(item)

    def predict(self, batch: list[float]) -> list[list[float]]:
        _pause(max(batch))
        return [[seconds, 2 * seconds] for seconds in batch]


def sleepy() -> SleepyModel:
    return SleepyModel()


class GpuAllocModel:
    """Each item is a number of MiB to allocate on the worker's GPU (needs CUDA).

    Outputs ``[MiB, the allocator's memory fraction, pid]``, so that a test sees
    the limit torch itself enforces and which worker answered.
    """

    name = "gpu-alloc"
    item_kind = "MiB"
    item_shape = (3,)
    device = "cuda"

    def prepare(self, item: Any) -> int:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ValueError("expected a whole number of MiB")
        return item

    def predict(self, batch: list[int]) -> list[list[float]]:
        import torch

        held = [torch.empty(mib << 20, dtype=torch.uint8, device="cuda") for mib in batch]
        fraction = torch.cuda.get_per_process_memory_fraction()
        del held
        return [[float(mib), fraction, float(os.getpid())] for mib in batch]


def gpu_alloc() -> GpuAllocModel:
    return GpuAllocModel()


class HoldingModel(EchoModel):
    """Holds a batch that contains HOLD for up to a minute, for tests across processes.

    Before it holds, it creates ``$TEST_HOLD_DIR/held-<pid>`` so that an
    end-to-end test learns which worker holds the batch (and can kill it).
    """

    name = "holding"

    def predict(self, batch: list[str]) -> list[list[float]]:
        if HOLD in batch:
            Path(os.environ["TEST_HOLD_DIR"], f"held-{os.getpid()}").touch()
            _pause(60)  # held until the test kills this worker
        return super().predict(batch)


def holding() -> HoldingModel:
    return HoldingModel()


class ScriptedModel:
    """A text model whose items are commands, for fault tests against real gunicorn.

    On either route: ``"sleep:S"`` holds its batch S seconds; ``"wedge"`` holds
    it forever, like a hung kernel; ``"die"`` ends the calling thread with
    SystemExit (send it to the batched route only: it kills the batch thread).
    Queries, best sent to the naive route so they do not queue: ``"busy"``
    answers how many predict calls are in progress, ``"seen:X"`` 1.0 if an item
    X ever reached predict, ``"pid"`` the worker's pid. Any other text answers
    its length.
    """

    name = "scripted"
    item_kind = "text"
    item_shape = None

    def __init__(self) -> None:
        # Native locks: the batch thread and request greenlets share them under gevent.
        self._lock = native.allocate_lock()
        self._seen: set[str] = set()
        self._busy = 0
        self._wedge = native.allocate_lock()
        self._wedge.acquire()  # held until unwedge(), which only an in-process test calls

    def prepare(self, item: Any) -> str:
        if not isinstance(item, str):
            raise ValueError("expected a string")
        return item

    def predict(self, batch: list[str]) -> list[list[float]]:
        with self._lock:
            self._seen.update(batch)
            self._busy += 1
        try:
            if "die" in batch:
                raise SystemExit("injected batch-thread death")
            if "wedge" in batch:
                self._wedge.acquire()
                self._wedge.release()
            _pause(max((float(item[6:]) for item in batch if item.startswith("sleep:")), default=0.0))
            return [[self._answer(item)] for item in batch]
        finally:
            with self._lock:
                self._busy -= 1

    def _answer(self, item: str) -> float:
        with self._lock:
            if item == "busy":
                return float(self._busy - 1)  # not counting this call
            if item.startswith("seen:"):
                return float(item[5:] in self._seen)
        if item == "pid":
            return float(os.getpid())
        return float(len(item))

    def unwedge(self) -> None:
        self._wedge.release()


def scripted() -> ScriptedModel:
    return ScriptedModel()


def scripted_slow_start() -> ScriptedModel:
    """A ScriptedModel that takes 2 s to load, like a model reading large weights."""
    _pause(2.0)
    return ScriptedModel()


class OutOfMemoryError(RuntimeError):
    """Stands in for ``torch.cuda.OutOfMemoryError``, which needs a GPU to happen.

    The service recognises that error by its class name, without importing
    torch, so this mock takes the same path.
    """


class QuirkyModel:
    """Each item names an output kind a factory model may return, or a fault.

    ``"nested-nan"`` gives a nested list holding NaN, ``"scalar-inf"`` a numpy
    float32 infinity, ``"labelled-nan"`` a label beside a NaN score, ``"nan-text"``
    the string "nan" (finite: a string is not a number), ``"oom"`` raises
    OutOfMemoryError; any other text answers its length.
    """

    name = "quirky"
    item_kind = "text"
    item_shape = None

    def prepare(self, item: Any) -> str:
        if not isinstance(item, str):
            raise ValueError("expected a string")
        return item

    def predict(self, batch: list[str]) -> list[Any]:
        if "oom" in batch:
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (mock)")
        kinds: dict[str, Any] = {
            "nested-nan": [[1.0, float("nan")], [2.0, 3.0]],
            "scalar-inf": np.float32("inf"),
            "labelled-nan": ["cat", float("nan")],
            "nan-text": "nan",
        }
        return [kinds.get(item, [float(len(item))]) for item in batch]


def quirky() -> QuirkyModel:
    return QuirkyModel()


# Where unloadable() pretends its weights are: a path that must stay out of client answers.
SECRET_PATH = "/srv/private/weights-7f3a.bin"


def spawning() -> EchoModel:
    """A factory that starts a process while it loads, as ctypes.util.find_library does."""
    subprocess.run(["true"], check=True)
    return EchoModel()


def unloadable() -> EchoModel:
    """A factory that fails as a model with unreadable weights does."""
    raise FileNotFoundError(f"cannot read the weights at {SECRET_PATH}")


def broken_load() -> EchoModel:
    """A factory that fails, like a model whose weights are missing."""
    raise RuntimeError("injected load failure")


class BrokenPredictModel(EchoModel):
    """Loads, then raises on every batch."""

    name = "broken-predict"

    def predict(self, batch: list[str]) -> list[list[float]]:
        raise RuntimeError("injected predict failure")


def broken_predict() -> BrokenPredictModel:
    return BrokenPredictModel()


def fails_in_one_process() -> EchoModel:
    """Fails to load in the first process that calls it, and loads in every other.

    The processes agree through ``$TEST_FAIL_DIR/failed``, created exclusively:
    the others then wait for the one that failed, as they would in production.
    """
    try:
        Path(os.environ["TEST_FAIL_DIR"], "failed").touch(exist_ok=False)
    except FileExistsError:
        return EchoModel()
    raise RuntimeError("injected load failure in one process")


class VectorsModel(EchoModel):
    """A text model that declares its outputs, as minilm does: 3 numbers per text."""

    name = "vectors"
    item_shape = (3,)

    def predict(self, batch: list[str]) -> list[list[float]]:
        return [[float(len(text)), float(text.count(" ")), 1.0] for text in batch]


def vectors() -> VectorsModel:
    return VectorsModel()


class LabelsModel(EchoModel):
    """A text model that answers a string per text: its length, written out."""

    name = "labels"

    def predict(self, batch: list[str]) -> list[str]:  # type: ignore[override]
        return [str(len(text)) for text in batch]


def labels() -> LabelsModel:
    return LabelsModel()


class RecordsModel(EchoModel):
    """A text model that answers a JSON object per text, which no tensor can hold."""

    name = "records"

    def predict(self, batch: list[str]) -> list[dict[str, int]]:  # type: ignore[override]
        return [{"length": len(text)} for text in batch]


def records() -> RecordsModel:
    return RecordsModel()


class SizedEchoModel(EchoModel):
    """An echo model whose items report their size in words, as a factory may."""

    name = "sized-echo"
    task = "generic"

    def item_size(self, item: str) -> int:
        return len(item.split())


def sized_echo() -> SizedEchoModel:
    return SizedEchoModel()


class BadTaskModel(EchoModel):
    task = "translation"


def bad_task() -> BadTaskModel:
    return BadTaskModel()

"""Test models, loadable through ``SERVE_MODEL=tests.support.models:<factory>``.

They stand in for a real model where the model is not the point: each records
the batches it saw and can be told to fail on a marked item.
"""

from __future__ import annotations

import threading
from typing import Any

POISON = "boom"


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

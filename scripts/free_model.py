"""A model that costs nothing: each text in, the same 384 floats out.

    SERVE_MODEL=scripts.free_model:create bash scripts/serve

With the model's time taken away, what a request costs is what the request
path costs: the HTTP server, routing, parsing, admission, the hand-off to the
batch thread and back, metrics, logging and the encoding of the outputs.
scripts/overhead.py measures that against a bare Flask handler
(scripts/bare_flask.py) that returns the same floats.
"""

from __future__ import annotations

import numpy as np

DIMENSIONS = 384
# Not constant zeros: the encoder writes each float in full, as it would a real embedding's.
VECTOR = np.linspace(-1.0, 1.0, DIMENSIONS, dtype=np.float32) / 3
_ROWS = np.tile(VECTOR, (1024, 1))


class FreeModel:
    name = "free"
    task = "embeddings"
    item_kind = "text"
    output_shape = (DIMENSIONS,)

    def prepare(self, item: object) -> str:
        if not isinstance(item, str):
            raise ValueError(f"expected a string, got {type(item).__name__}")
        return item

    def predict(self, batch: list[str]) -> np.ndarray:
        # A view of rows made once: the model's own cost stays near nothing.
        if len(batch) <= len(_ROWS):
            return _ROWS[: len(batch)]
        return np.tile(VECTOR, (len(batch), 1))


def create() -> FreeModel:
    return FreeModel()

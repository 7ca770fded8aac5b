"""Embeddings from a sentence-transformers directory (``modules.json``).

The directory's own modules do the work, as ``SentenceTransformer.encode``
runs them: its transformer, its pooling (mean, CLS, max...), its Dense and
Normalize modules if it has them, and its ``max_seq_length``. What this
module adds is the split the batcher needs: texts are tokenized in the
request thread and the batch thread only pads them and runs the modules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.models.base import EMBEDDINGS
from service.models.hf import (
    BoundedShapes,
    Encoder,
    Tokens,
    check_text,
    directory_name,
    in_float32,
    pad,
    position_limit,
    quiet_transformers,
)


class SentenceEmbeddingModel(BoundedShapes):
    task = EMBEDDINGS
    item_kind = "text"

    def __init__(self, path: Path, device: str) -> None:
        from sentence_transformers import SentenceTransformer

        quiet_transformers()
        self.name = directory_name(path)
        self.device = device
        loaded = SentenceTransformer(str(path), device=device, local_files_only=True).eval()
        self._model = in_float32(loaded, self.name)
        self._tokenizer = self._model.tokenizer
        # The directory's sentence_bert_config.json; without one, the tokenizer's limit.
        self._max_length = self._model.max_seq_length or position_limit(self._tokenizer, None)
        self._encode = Encoder(self._tokenizer, max_length=self._max_length)
        self._pad_id = self._tokenizer.pad_token_id or 0
        # Whether SERVE_PRECISION can swap its network (service.models.precision):
        # a first module that holds no transformer (static embeddings) cannot.
        self.reducible = isinstance(getattr(self._model[0], "model", None), torch.nn.Module) or isinstance(
            getattr(self._model[0], "auto_model", None), torch.nn.Module
        )
        dimension = self._model.get_embedding_dimension()
        # A text model's item_shape is what it returns for one item (service.http.v2_codec).
        self.item_shape: tuple[int, ...] | None = (dimension,) if dimension else None

    def network(self) -> Any:
        """The directory's transformer, what SERVE_PRECISION reduces: pooling and the rest stay float32."""
        return getattr(self._model[0], self._network_attribute())

    def use_network(self, module: Any) -> None:
        setattr(self._model[0], self._network_attribute(), module)

    def _network_attribute(self) -> str:
        # Newer sentence-transformers hold it as ``model`` (``auto_model`` only reads
        # it, and setting it would add an unused module); older ones, as ``auto_model``.
        held = getattr(self._model[0], "model", None)
        return "model" if isinstance(held, torch.nn.Module) else "auto_model"

    def prepare(self, item: Any) -> Tokens:
        """Check and tokenize one text in the request thread, truncated to the directory's max_seq_length."""
        return self._encode(check_text(item))

    def item_size(self, item: Tokens) -> int:
        return len(item.ids)

    def predict(self, batch: list[Tokens]) -> np.ndarray:
        features = pad(batch, self._pad_id, self.device, self.shapes)
        with torch.inference_mode():
            embeddings = self._model(features)["sentence_embedding"][: len(batch)]
        out: np.ndarray = embeddings.float().cpu().numpy()
        return out

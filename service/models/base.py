"""The one small interface every served model implements.

A model is loaded once per worker process. ``prepare`` checks and converts one
client item (raising ``ValueError`` with a message for the client) so that a
bad item is refused with 422 before it can reach a batch; ``predict`` maps a
list of prepared items to a sequence of outputs of the same length. ``task``
says which routes fit the model (see TASKS); the HTTP tier reads it through
``task_of`` and never imports a model kind. docs/model-interface.md shows the
interface with worked examples.
"""

from __future__ import annotations

import base64
import contextlib
import io
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, Protocol, TypeAlias, runtime_checkable

import numpy as np

from service.config.prompt_spec import Prompts

# A model's outputs: a list, or an array whose first axis runs over the inputs.
Outputs: TypeAlias = Sequence[Any] | np.ndarray

# What a model does, and so which routes fit it. "generic": outputs of any kind,
# served as they are on /predict (and on OIP v2 when they are one tensor).
EMBEDDINGS, RERANK, CLASSIFICATION, FILL_MASK, GENERIC = (
    "embeddings",
    "rerank",
    "classification",
    "fill-mask",
    "generic",
)
TASKS = (EMBEDDINGS, RERANK, CLASSIFICATION, FILL_MASK, GENERIC)
# Longest text (in characters) a text model's prepare accepts: a bound on the
# request thread's tokenizing, far above any model's token limit.
MAX_TEXT_CHARS = 20_000


@runtime_checkable
class Model(Protocol):
    name: str
    item_kind: str
    item_shape: tuple[int, ...] | None
    device: str

    def prepare(self, item: Any) -> Any: ...

    def predict(self, batch: list[Any]) -> Outputs: ...


@runtime_checkable
class SizedModel(Model, Protocol):
    """A model whose prepared items report their size, in the units its cost grows with.

    A text model's size is the item's token count after truncation: a padded
    batch costs rows times its longest item, in time and in activation memory.
    The batcher then sorts each batch by size and runs it as sub-batches
    (service.batching.subbatch). A model without ``item_size`` batches as is.
    """

    def item_size(self, item: Any) -> int: ...


def item_sizer(model: Model) -> Callable[[Any], int] | None:
    """The model's ``item_size`` if it reports sizes (a SizedModel), else None.

    What ``isinstance(model, SizedModel)`` answers, for the request path: a
    check against a runtime-checkable Protocol walks the Protocol's members on
    every call, microseconds each on Python 3.11.
    """
    size = getattr(model, "item_size", None)
    return size if callable(size) else None


# Which end of a text past its model's token limit is cut: None for the tokenizer's
# own side (the right, for nearly every model), or the side a request asks for
# (TEI's truncation_direction). A context variable rather than an argument of
# ``prepare``, so that the model interface keeps one argument and every kind that
# tokenizes with service.models.hf.Encoder honours it: the request thread sets it
# around its items' ``prepare`` (``truncating``), and the Encoder reads it there.
# A route asks ``cuts_on`` first, and refuses a side the model would not honour.
TRUNCATION_SIDE: ContextVar[str | None] = ContextVar("truncation_side", default=None)


@contextlib.contextmanager
def truncating(side: str | None) -> Iterator[None]:
    """Within the block, texts are cut on ``side`` ("left" or "right"; None: each tokenizer's own)."""
    token = TRUNCATION_SIDE.set(side)
    try:
        yield
    finally:
        TRUNCATION_SIDE.reset(token)


def cuts_on(model: Model, side: str) -> bool:
    """Whether ``model`` cuts a text past its limit on ``side`` ("left", "right") when a request asks.

    A kind that tokenizes with service.models.hf.Encoder says (``cuts_on``; a
    slow tokenizer cuts on its own side only). Any other model tokenizes, if
    it does, in its own code, which reads no TRUNCATION_SIDE: it is taken to
    cut on the right, as nearly every tokenizer does, and never on the left.
    """
    cuts = getattr(model, "cuts_on", None)
    return bool(cuts(side)) if callable(cuts) else side == "right"


def token_pieces(model: Model) -> Callable[[Any, bool, str], list[dict[str, Any]]] | None:
    """The model's ``token_pieces(text, add_special_tokens, prompt)``: its tokenizer's tokens of
    ``prompt + text`` (service.models.hf.Tokenized)."""
    pieces = getattr(model, "token_pieces", None)
    return pieces if callable(pieces) else None


def task_of(model: Model) -> str:
    """The model's task; a model that names none (an older factory) is "generic"."""
    task = getattr(model, "task", GENERIC)
    return task if task in TASKS else GENERIC


def describe(model: Model) -> dict[str, Any]:
    """What ``GET /info`` says about the model."""
    described = {
        "name": model.name,
        "task": task_of(model),
        "item_kind": model.item_kind,
        "item_shape": list(model.item_shape) if model.item_shape is not None else None,
        "device": model.device,
    }
    layout = getattr(model, "layout", None)  # an image program's memory layout (service.models.layout)
    if layout is not None:
        described["layout"] = layout.describe()
    prompts = getattr(model, "prompts", None)  # a sentence-transformers directory's
    if isinstance(prompts, Prompts):
        described.update(prompts.describe())
    return described


SAMPLE_SENTENCE = "The quick brown fox jumps over the lazy dog near the quiet river bank."


def sample_item(model_info: Mapping[str, Any], rng: random.Random | None = None) -> Any:
    """An item the model that ``model_info`` describes accepts (``describe``'s dict, /info's "model").

    Benchmarks, the soak test and load tests all send these (an image model's:
    a base64 JPEG, as JSON carries it). Without ``rng`` it
    is always the same item; with one, a random item of the same kind and shape,
    for traffic that varies. Raises ``ValueError`` for a model whose items it
    cannot make up.
    """
    kind, shape = model_info["item_kind"], model_info["item_shape"]
    task = model_info.get("task", GENERIC)
    if kind == "text-pair":
        return [_text(rng, 2, 6), _text(rng, 3, 16)]  # a short query, a longer document
    if kind == "text":
        text = _text(rng, 3, 16)
        if task == FILL_MASK:
            # Its mask token; text models of this project use BERT's.
            words = text.split()
            words[len(words) // 2] = "[MASK]"
            return " ".join(words)
        return text
    if kind in ("vector", "tensor") and shape:
        return _numbers(tuple(shape), rng)
    if kind == "image":
        return "data:image/jpeg;base64," + base64.b64encode(sample_jpeg(rng)).decode()
    hint = " (for a model file, set SERVE_ITEM_SHAPE)" if kind == "tensor" else ""
    raise ValueError(
        f"no sample item for model {model_info.get('name')!r}: its items are {kind!r} of shape "
        f"{shape}; sample items exist for 'text' and for 'vector' or 'tensor' of a known shape{hint}"
    )


# A camera's frame, scaled down: every image model resizes it, as it would a photo.
SAMPLE_IMAGE_SIZE = (320, 240)


def sample_jpeg(rng: random.Random | None = None, size: tuple[int, int] = SAMPLE_IMAGE_SIZE) -> bytes:
    """A JPEG of ``size`` (width, height): a colour gradient; with ``rng``, random colours and noise."""
    from PIL import Image  # only the benchmarks and load tests make images

    width, height = size
    seed = rng.randrange(2**32) if rng is not None else 0
    generator = np.random.default_rng(seed)
    corners = (
        generator.uniform(0, 255, size=(2, 2, 3))
        if rng is not None
        else np.array([[[255, 0, 0], [0, 255, 0]], [[0, 0, 255], [255, 255, 0]]], dtype=np.float64)
    )
    y = np.linspace(0, 1, height)[:, None, None]
    x = np.linspace(0, 1, width)[None, :, None]
    top = corners[0, 0] * (1 - x) + corners[0, 1] * x
    bottom = corners[1, 0] * (1 - x) + corners[1, 1] * x
    pixels = top * (1 - y) + bottom * y
    if rng is not None:
        pixels = pixels + generator.normal(0, 12, size=pixels.shape)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB").save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _text(rng: random.Random | None, shortest: int, longest: int) -> str:
    """SAMPLE_SENTENCE, or with ``rng`` a random run of its words."""
    if rng is None:
        return SAMPLE_SENTENCE if shortest > 2 else " ".join(SAMPLE_SENTENCE.split()[:shortest])
    words = SAMPLE_SENTENCE.rstrip(".").split()
    return " ".join(rng.choice(words) for _ in range(rng.randint(shortest, longest)))


def _numbers(shape: tuple[int, ...], rng: random.Random | None) -> Any:
    """Nested lists of ``shape``: all 0.5, or random numbers in [-1, 1] with ``rng``."""
    if not shape:
        return 0.5 if rng is None else round(rng.uniform(-1, 1), 4)
    return [_numbers(shape[1:], rng) for _ in range(shape[0])]

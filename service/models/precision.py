"""The arithmetic a model's network runs in, and what it costs in exactness against float32.

``SERVE_PRECISION`` asks for one; ``resolve`` (pure) settles what this device
and this model allow, or refuses with the reason. Only the network's body runs
reduced: every kind casts its network's output to float32 before pooling,
normalising, softmax or sigmoid, so the scores are computed in float32 whatever
the precision.

A reduced network is never trusted blindly. ``settle`` runs the fixed sample
items this module ships (service/models/exactness_texts.txt) through float32
and through the reduced network, measures how far apart they are (``compare``,
pure) and keeps the reduced network only above the floor (``shortfall``,
pure); below it, or on a non-finite output, the model stays in float32 and the
log says why. For int8 it also chooses which Linear layers to quantize: the
choice moves MiniLM's embeddings from a median cosine of 0.94 to 0.99, so the
layers whose quantization alone moves the outputs most stay in float32, as few
as the floor allows (docs/precision.md).

``auto`` picks bfloat16 on a CPU with AMX (service.config.precision_spec.auto_choice)
and holds it to a stricter floor than an explicit request (AUTO_FLOOR): a
precision nobody asked for keeps every clear top answer. On a CPU with
avx512_bf16 and no AMX it must also measure faster than float32 on the samples.

int8 is torch's own dynamic quantization (``quantize_dynamic``, one scale per
output channel, fbgemm's x86 kernels). torchao's int8 runs about five times
slower than float32 on a CPU unless the model is compiled (docs/bench-precision.md).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from service.config.precision_spec import (  # the rules the master checks too
    AMX_FLAG,
    AUTO,
    BFLOAT16,
    BFLOAT16_FLAGS,
    FLOAT16,
    FLOAT32,
    INT8,
    PRECISIONS,
    TEXT_TASKS,
    AutoChoice,
    auto_choice,
    check_device,
    cpu_flags,
    onednn_cache_capacity,
    resolve,
)
from service.models.base import CLASSIFICATION, EMBEDDINGS, FILL_MASK, RERANK

# What the workers use of the rules, from here as from service.config.precision_spec.
__all__ = [
    "AMX_FLAG",
    "AUTO",
    "BFLOAT16",
    "BFLOAT16_FLAGS",
    "FLOAT16",
    "FLOAT32",
    "INT8",
    "PRECISIONS",
    "TEXT_TASKS",
    "AutoChoice",
    "auto_choice",
    "check_device",
    "cpu_flags",
    "onednn_cache_capacity",
    "resolve",
]


@runtime_checkable
class Reducible(Protocol):
    """A model whose network can run in another precision: its module, and a way to swap it.

    ``use_network`` installs a module in place of the network (a reduced copy,
    or the float32 original back) and must leave the model answering with it.
    """

    def network(self) -> Any: ...

    def use_network(self, module: Any) -> None: ...


@dataclass(frozen=True)
class Floor:
    """How close a reduced network must stay to float32 to be kept (docs/settings.md)."""

    min_cosine: float = 0.95
    median_cosine: float = 0.98
    top1_agreement: float = 0.95
    max_score_diff: float = 0.1
    # Rerank: the share of sample queries whose top document leads by more than
    # twice the largest score move (see compare); below it the samples cannot
    # tell rounding from a tie, and the reduced network is not kept.
    clear_share: float = 0.5
    # Rerank: the share of those queries that must keep their top document
    # (SERVE_PRECISION_MIN_TOP1; a rerank's top1_agreement is not held to it).
    top1_where_clear: float = 0.95

    def stricter(self, other: Floor) -> Floor:
        """The stricter of the two floors, field by field."""
        return Floor(
            min_cosine=max(self.min_cosine, other.min_cosine),
            median_cosine=max(self.median_cosine, other.median_cosine),
            top1_agreement=max(self.top1_agreement, other.top1_agreement),
            max_score_diff=min(self.max_score_diff, other.max_score_diff),
            clear_share=max(self.clear_share, other.clear_share),
            top1_where_clear=max(self.top1_where_clear, other.top1_where_clear),
        )


# What ``auto`` holds a reduced network to, above an explicit request's floor:
# a precision nobody asked for must not be seen in the answers. bfloat16 on
# MiniLM measures a min cosine of 0.99994 on the samples and 0.9999 on the
# corpus (docs/bench-precision.md); a top label, token or clear top document must
# not move.
AUTO_FLOOR = Floor(
    min_cosine=0.999,
    median_cosine=0.999,
    top1_agreement=0.99,
    clear_share=0.5,
    top1_where_clear=1.0,
)


@dataclass(frozen=True)
class Outcome:
    """The precision a model runs in, and how it came to: /info's "precision" and the start log."""

    requested: str
    precision: str
    # How far the precision in use is from float32 on the sample items; empty for float32 itself.
    exactness: dict[str, float] = field(default_factory=dict)
    # int8: the Linear layers quantized, and those left in float32 to stay above the floor.
    quantized: tuple[str, ...] = ()
    kept_float32: tuple[str, ...] = ()
    # Why a reduced precision was asked for (or chosen) and float32 is in use instead.
    fallback: str | None = None
    # Why ``auto`` aimed where it did (precision_spec.auto_choice); None when asked for by name.
    reason: str | None = None
    # The reduced network's speed over float32's on the sample items, where it was measured.
    speedup: float | None = None
    # Why in a word, for the metrics: "asked" (by name), auto's code (AutoChoice),
    # or what made the check keep float32 ("exactness", "slower", "check_failed").
    code: str = "asked"

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"requested": self.requested, "in_use": self.precision}
        if self.reason is not None:
            out["reason"] = self.reason
        if self.speedup is not None:
            out["speedup_vs_float32"] = round(self.speedup, 3)
        if self.exactness:
            out["exactness"] = {name: round(value, 6) for name, value in self.exactness.items()}
        if self.quantized:
            out["quantized_layers"] = len(self.quantized)
            out["float32_layers"] = list(self.kept_float32)
        if self.fallback is not None:
            out["fallback"] = self.fallback
        return out

    def summary(self) -> str:
        """One line for the start log."""
        figures = ", ".join(f"{name} {value:.4f}" for name, value in self.exactness.items())
        line = f"precision {self.precision} (asked: {self.requested})"
        if self.reason is not None:
            line += f"; {self.reason}"
        if self.speedup is not None:
            line += f"; measured {self.speedup:.2f}x float32's speed on the sample items"
        if figures:
            line += f"; against float32 on the sample items: {figures}"
        if self.quantized:
            kept = ", ".join(self.kept_float32) or "none"
            line += f"; {len(self.quantized)} Linear layers in int8, left in float32: {kept}"
        if self.fallback is not None:
            line += f"; {self.fallback}"
        return line


# -- exactness: pure -----------------------------------------------------------------


def compare(task: str, reference: Any, reduced: Any, group: int = 1) -> dict[str, float]:
    """How far ``reduced`` outputs are from float32's ``reference``, in the task's own terms.

    Embeddings: the smallest and median cosine. Rerank: the largest score
    difference, how often the top document of each query (``group``
    consecutive pairs) is the same, the share of queries whose top document
    leads clearly (by more than twice the largest move: no two moves that
    large, one down and one up, could reorder it), and how often those keep
    it. A query without such a lead cannot tell rounding from a tie, so it
    is not counted there. Classification: the largest difference in
    a label's score and how often the top label is the same. Fill-mask: how
    often the top proposition is the same token string.
    """
    if task == EMBEDDINGS:
        ref, red = np.asarray(reference, dtype=np.float64), np.asarray(reduced, dtype=np.float64)
        norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(red, axis=1)
        cosines = (ref * red).sum(axis=1) / np.maximum(norms, 1e-12)
        return {"min_cosine": float(cosines.min()), "median_cosine": float(np.median(cosines))}
    if task == RERANK:
        ref, red = np.asarray(reference, dtype=np.float64), np.asarray(reduced, dtype=np.float64)
        moved = float(np.abs(ref - red).max())
        agree, clear = [], []
        for q in range(len(ref) // group):
            scores, reduced_scores = ref[q * group : (q + 1) * group], red[q * group : (q + 1) * group]
            same = bool(np.argmax(scores) == np.argmax(reduced_scores))
            agree.append(same)
            if _lead(scores) > 2 * moved:
                clear.append(same)
        return {
            "max_score_diff": moved,
            "top1_agreement": statistics.fmean(agree),
            "clear_share": len(clear) / max(1, len(agree)),
            # Vacuous without clear queries: clear_share's floor speaks for them.
            "top1_where_clear": statistics.fmean(clear) if clear else 1.0,
        }
    if task == CLASSIFICATION:
        diffs: list[float] = []
        tops: list[bool] = []
        for ref_labels, red_labels in zip(reference, reduced, strict=True):
            red_scores = {entry["label"]: entry["score"] for entry in red_labels}
            diffs.extend(abs(entry["score"] - red_scores[entry["label"]]) for entry in ref_labels)
            tops.append(ref_labels[0]["label"] == red_labels[0]["label"])
        return {"max_score_diff": max(diffs), "top1_agreement": statistics.fmean(tops)}
    if task == FILL_MASK:
        tops = [_first_fill(ref) == _first_fill(red) for ref, red in zip(reference, reduced, strict=True)]
        return {"top1_agreement": statistics.fmean(tops)}
    raise ValueError(f"no exactness measure for task {task!r}")


def _lead(scores: np.ndarray) -> float:
    """How far the top score is ahead of the next (infinite for a single document)."""
    if len(scores) < 2:
        return math.inf
    top, second = np.sort(scores)[-2:][::-1]
    return float(top - second)


def _first_fill(output: Any) -> Any:
    """The top proposition's token (of the first mask, for an item with several)."""
    first = output[0]
    return (first[0] if isinstance(first, list) else first)["token_str"]


# The sample texts are a hundred sentences; over a corpus of thousands the
# smallest cosine reaches further into the tail (all-MiniLM-L6-v2 in int8, over
# seven choices of layers: 0.007 to 0.031 lower on 1,583 sentences than on the
# samples). So the samples' smallest cosine must keep this share of the floor's
# distance from 1 in reserve: 0.98 for a floor of 0.95.
TAIL_RESERVE = 0.6
# Likewise the largest score move of a rerank or a classification, with a wider
# reserve: its tail is longer. A MiniLM cross-encoder trained on the corpus
# (scripts/fixtures/train_rerank_model.py), in int8, 16 documents to a query:
# over the corpus's 1,584 pairs the largest move was 7 to 16 times the 96
# sample pairs' (every layer in int8: 0.056 on the samples, 0.50 on the corpus;
# 29 layers: 0.027 and 0.18; 13 layers: 0.006 and 0.094), the moves being
# largest for scores near 0.5, where a sigmoid is steepest. With samples held
# to a fifth of the floor, 0.02 for 0.1, the corpus stayed within 0.1.
SCORE_TAIL_RESERVE = 0.8


def on_samples(floor: Floor) -> Floor:
    """The floor the sample items must meet for the model to meet ``floor`` on what clients send."""
    return dataclasses.replace(
        floor,
        min_cosine=1 - (1 - floor.min_cosine) * (1 - TAIL_RESERVE),
        max_score_diff=floor.max_score_diff * (1 - SCORE_TAIL_RESERVE),
    )


def shortfall(
    figures: dict[str, float], floor: Floor, asked: Floor | None = None, configured: Floor | None = None
) -> str | None:
    """Why ``figures`` fall below ``floor`` (naming the setting), or None if they do not.

    ``asked`` is the floor as set, where ``floor`` is what the samples must meet
    (``on_samples``); ``configured`` is the settings' floor, where ``auto``
    asked for a stricter one (AUTO_FLOOR).
    """
    asked = asked or floor
    configured = configured or asked
    # (figure, its setting, whether the figure must be at least the floor's field of the same name)
    limits = (
        ("min_cosine", "SERVE_PRECISION_MIN_COSINE", True),
        ("median_cosine", "SERVE_PRECISION_MEDIAN_COSINE", True),
        ("top1_agreement", "SERVE_PRECISION_MIN_TOP1", True),
        # Too few clear queries cannot vouch for the others (see compare).
        ("clear_share", None, True),
        ("top1_where_clear", "SERVE_PRECISION_MIN_TOP1", True),
        ("max_score_diff", "SERVE_PRECISION_MAX_SCORE_DIFF", False),
    )
    for name, setting, at_least in limits:
        value = figures.get(name)
        # A rerank query without a clear lead cannot tell rounding from a tie: its top is not counted.
        if value is None or (name == "top1_agreement" and "top1_where_clear" in figures):
            continue
        if not math.isfinite(value):
            return f"{name} is {value}: the reduced network's outputs are not finite"
        limit = getattr(floor, name)
        if (value < limit) if at_least else (value > limit):
            relation = "under" if at_least else "over"
            if setting is None:  # clear_share: not a setting, the same for every request
                return (
                    f"{name} {value:.4f} is {relation} {limit:g} on the samples: too few sample queries' top "
                    "documents lead by more than twice the largest score move to tell rounding from a tie"
                )
            set_to = getattr(asked, name)
            source = (
                f"auto's floor {set_to:g}" if set_to != getattr(configured, name) else f"{setting}={set_to:g}"
            )
            source += ", with a reserve for the tail" if set_to != limit else ""
            return f"{name} {value:.4f} is {relation} {limit:g} on the samples ({source})"
    return None


def finite(outputs: Any) -> bool:
    """Whether every number in ``outputs`` (an array, or lists of dicts of scores) is finite."""
    if isinstance(outputs, np.ndarray):
        return bool(np.isfinite(outputs).all())
    if isinstance(outputs, dict):
        return all(finite(value) for value in outputs.values())
    if isinstance(outputs, (list, tuple)):
        return all(finite(value) for value in outputs)
    if isinstance(outputs, (float, np.floating)):
        return math.isfinite(outputs)
    return True


# -- the samples -----------------------------------------------------------------------

SAMPLE_TEXTS_FILE = Path(__file__).with_name("exactness_texts.txt")
# Documents per rerank query in the samples: one that the query was cut from, and others.
RERANK_GROUP = 8


def sample_items(task: str, mask: str = "[MASK]") -> tuple[list[Any], int]:
    """The items the check runs for ``task``, and the group size ``compare`` reads them by.

    Real sentences of mixed length (22 to 700 characters). A rerank query is
    the opening words of one sentence, against it and seven others; a fill-mask
    item masks a word in the middle of a sentence.
    """
    texts = [line for line in SAMPLE_TEXTS_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    if task == RERANK:
        pairs: list[list[str]] = []
        for q in range(len(texts) // RERANK_GROUP):
            query = " ".join(texts[q * RERANK_GROUP].split()[:6])
            documents = texts[q * RERANK_GROUP : (q + 1) * RERANK_GROUP]
            # The matching document first for half the queries, last for the others.
            documents = documents if q % 2 == 0 else documents[1:] + documents[:1]
            pairs.extend([query, document] for document in documents)
        return pairs, RERANK_GROUP
    if task == FILL_MASK:
        masked = []
        for text in texts:
            words = text.split()
            words[len(words) // 2] = mask
            masked.append(" ".join(words))
        return masked, 1
    return texts, 1


# -- reducing a network: torch ---------------------------------------------------------------


def reduced(network: Any, precision: str, layers: Sequence[str] = (), *, in_place: bool = False) -> Any:
    """A copy of ``network`` in ``precision`` (int8: ``layers``, by name, quantized).

    ``in_place`` reduces ``network`` itself, for a caller that drops the float32 one.
    """
    import torch

    module = network if in_place else copy.deepcopy(network)
    if precision in (FLOAT16, BFLOAT16):
        module.to(getattr(torch, precision))
        # The body runs reduced; what comes out of it, float32 (see the module's docstring).
        module.__class__ = _answering_in_float32(type(module))
        return module
    if precision == INT8:
        return quantize(module, layers)
    raise ValueError(f"no reduced network for precision {precision!r}")


def quantize(module: Any, layers: Sequence[str]) -> Any:
    """``module`` with the Linear layers named in ``layers`` quantized to int8, in place."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        # torch.ao.quantization warns that it moves to torchao, whose CPU int8
        # is slower than float32 uncompiled; its own kernels are what serve here.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        return quantize_dynamic(  # type: ignore[no-untyped-call]
            module, dict.fromkeys(layers, per_channel_dynamic_qconfig), inplace=True
        )


def linear_layers(network: Any) -> list[str]:
    import torch

    return [name for name, child in network.named_modules() if isinstance(child, torch.nn.Linear)]


# A reduced network's class, by its float32 class: made once each.
_FLOAT32_ANSWERS: dict[type, type] = {}


def _answering_in_float32(cls: type) -> type:
    """``cls`` with a ``forward`` that casts what it returns to float32.

    Not a forward hook: sentence-transformers (6.x) calls its transformer's
    ``forward`` method itself, which skips hooks, and its pooling and Dense
    modules would then get float16 (a Dense module in float32 refuses it).
    The instance's class is swapped rather than ``forward`` set on the
    instance, so that a deep copy of the network keeps calling its own.
    """
    made = _FLOAT32_ANSWERS.get(cls)
    if made is None:

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _in_float32(cls.forward(self, *args, **kwargs))  # type: ignore[attr-defined]

        made = _FLOAT32_ANSWERS[cls] = type(
            cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__}
        )
    return made


def _in_float32(output: Any) -> Any:
    import torch

    if isinstance(output, torch.Tensor):
        return output.float() if output.is_floating_point() else output
    if isinstance(output, dict):  # transformers' ModelOutput is one
        for key, value in list(output.items()):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                output[key] = value.float()
        return output
    if isinstance(output, tuple):
        return tuple(_in_float32(value) for value in output)
    return output


@dataclass(frozen=True)
class Choice:
    """What a check settled, so that other workers can apply it without checking again."""

    precision: str
    layers: tuple[str, ...] = ()
    exactness: dict[str, float] = field(default_factory=dict)
    kept_float32: tuple[str, ...] = ()
    fallback: str | None = None
    # The check itself failed (not the floor): not kept for other workers, which check afresh.
    failed: bool = False
    # The reduced network's speed over float32's on the samples, where the check measured it.
    speedup: float | None = None


def check(
    model: Any,
    task: str,
    precision: str,
    floor: Floor,
    run: Callable[[list[Any]], Any] | None = None,
    *,
    configured: Floor | None = None,
    measure: bool = False,
) -> Choice:
    """Try ``precision`` on ``model`` (a Reducible) against float32; the model is left as chosen.

    ``floor`` is what the outputs must meet; ``configured``, the settings'
    floor, where ``auto`` asked for a stricter one (only the messages differ).
    ``measure`` keeps a reduced float network only if it also runs the sample
    items at least MIN_SPEEDUP times as fast as float32 (``auto`` on a CPU
    whose bfloat16 may be slower). ``run`` predicts prepared items (the model's own predict by default). Once
    a reduced network is kept the float32 one is dropped: a settled worker
    holds one network. Whatever fails during the check (a sample the model
    refuses, a copy that does not fit, a reduced network that raises) leaves
    the model in float32 with the reason, never a worker that cannot start.
    """
    run = run or (lambda batch: in_chunks(model, batch))
    original = None
    try:
        original = model.network()
        choice = _search(
            model, task, precision, floor, run=run, original=original, configured=configured, measure=measure
        )
        return _settled(model, choice)
    except Exception as exc:  # any failure of the check falls back to float32, with its reason
        if original is not None:
            model.use_network(original)
        reason = f"{precision} falls back to float32: the check failed: {type(exc).__name__}: {exc}"
        return _settled(model, Choice(FLOAT32, fallback=reason, failed=True))


def _search(
    model: Any,
    task: str,
    precision: str,
    asked: Floor,
    *,
    run: Callable[[list[Any]], Any],
    original: Any,
    configured: Floor | None = None,
    measure: bool = False,
) -> Choice:
    floor = on_samples(asked)
    raw, group = sample_items(task, getattr(model, "mask_token", None) or "[MASK]")
    items = _prepared(model, raw, group)
    reference = run(items)

    def measured(candidate: Any) -> tuple[dict[str, float], str | None]:
        model.use_network(candidate)
        try:
            outputs = run(items)
        except Exception as exc:  # a network that cannot run reduced is refused, with its reason
            return {}, f"the {precision} network failed on the sample items: {type(exc).__name__}: {exc}"
        if not finite(outputs):
            return {}, f"the {precision} network's outputs are not finite"
        figures = compare(task, reference, outputs, group)
        return figures, shortfall(figures, floor, asked, configured)

    if precision != INT8:
        candidate = reduced(original, precision)
        figures, why = measured(candidate)
        speedup = None
        if why is None and measure:
            speedup = _speedup(model, items, run, original, candidate)
            if speedup < MIN_SPEEDUP:
                why = f"it ran the sample items at {speedup:.2f}x float32's speed, under {MIN_SPEEDUP:g}x"
        if why is None:
            return Choice(precision, exactness=figures, speedup=speedup)
        model.use_network(original)
        return Choice(FLOAT32, fallback=f"{precision} falls back to float32: {why}", speedup=speedup)

    every = linear_layers(original)
    figures, why = measured(reduced(original, INT8, every))
    if why is None:
        return Choice(INT8, tuple(every), figures)
    if not figures:  # it raised, or gave non-finite outputs: no search can measure from there
        model.use_network(original)
        return Choice(FLOAT32, fallback=f"int8 falls back to float32: {why}")
    # Each layer alone in int8, on the shorter half of the samples (rerank: all
    # of them, query by query; short texts move the most and cost the least to
    # run once a layer): how far it moves the outputs. Then the longest run of
    # the least moving that stays above the floor.
    few = list(range(len(items)))
    size = getattr(model, "item_size", None)
    if group == 1 and callable(size):
        few = sorted(few, key=lambda i: size(items[i]))[: max(1, len(items) // 2)]
    few_items, few_reference = [items[i] for i in few], _rows(reference, few)
    moved: dict[str, float] = {}
    for name in every:
        model.use_network(reduced(original, INT8, [name]))
        distance = _distance(task, compare(task, few_reference, run(few_items), group))
        moved[name] = distance if math.isfinite(distance) else math.inf
    order = sorted(every, key=lambda name: moved[name])  # ties keep the network's order
    count, figures, why = _longest_passing(
        len(order), lambda n: measured(reduced(original, INT8, order[:n])), figures, why
    )
    if count == 0:
        model.use_network(original)
        why = f"int8 falls back to float32: even the least moving layer alone puts {why}"
        return Choice(FLOAT32, fallback=why)
    chosen = set(order[:count])
    model.use_network(reduced(original, INT8, order[:count]))
    kept = tuple(name for name in every if name not in chosen)
    return Choice(INT8, tuple(name for name in every if name in chosen), figures, kept)


# What a reduced network must gain to be kept where its speed is measured (as
# SERVE_IMAGE_LAYOUT=auto asks of channels_last): timing noise on a busy
# machine is a few percent, and a gain within it is not worth the rounding.
MIN_SPEEDUP = 1.05


def _speedup(
    model: Any, items: list[Any], run: Callable[[list[Any]], Any], original: Any, candidate: Any
) -> float:
    """How many times float32's speed ``candidate`` runs ``items`` at; ``model`` is left on ``candidate``.

    Each network runs the samples twice, in turns, after the check's own
    (warming) passes; the faster pass of each counts.
    """
    best = {id(original): math.inf, id(candidate): math.inf}
    for network in (candidate, original, candidate, original):
        model.use_network(network)
        started = time.perf_counter()
        run(items)
        best[id(network)] = min(best[id(network)], time.perf_counter() - started)
    model.use_network(candidate)
    return best[id(original)] / max(best[id(candidate)], 1e-9)


def _prepared(model: Any, raw: list[Any], group: int) -> list[Any]:
    """The samples the model takes (a model of few positions refuses the longest); a ValueError if none."""
    if group > 1:  # rerank: whole queries, so that compare reads them in groups
        return [model.prepare(item) for item in raw]
    items = []
    for item in raw:
        try:
            items.append(model.prepare(item))
        except ValueError:
            continue
    if len(items) < len(raw) // 2:
        raise ValueError(f"the model takes only {len(items)} of the {len(raw)} sample items")
    return items


def _rows(outputs: Any, rows: list[int]) -> Any:
    return outputs[rows] if isinstance(outputs, np.ndarray) else [outputs[i] for i in rows]


def _settled(model: Any, choice: Choice) -> Choice:
    """Tell the model its network is final (the built-in model traces it then), and return ``choice``."""
    finish(model)
    return choice


def _longest_passing(
    total: int,
    measure: Callable[[int], tuple[dict[str, float], str | None]],
    figures: dict[str, float],
    why: str | None,
) -> tuple[int, dict[str, float], str | None]:
    """The largest n below ``total`` whose measure passes, by bisection, its figures, and the last refusal.

    Quantizing more layers moves the outputs further, near enough monotonically.
    """
    best, low, high = 0, 1, total - 1
    while low <= high:
        middle = (low + high) // 2
        measured_figures, reason = measure(middle)
        if reason is None:
            best, figures, low = middle, measured_figures, middle + 1
        else:
            why, high = reason, middle - 1
    return best, figures, why


def in_chunks(model: Any, items: list[Any], rows: int = 16) -> Any:
    """``model.predict`` on ``items``, a few of similar length at a time, as the batcher runs them.

    One call on every sample would pad each to the longest (700 characters),
    several times the work; the order of the outputs is the items' own.
    """
    size = getattr(model, "item_size", None)
    order = sorted(range(len(items)), key=lambda i: size(items[i]) if callable(size) else 0)
    outputs: list[Any] = [None] * len(items)
    for start in range(0, len(order), rows):
        chunk = order[start : start + rows]
        for index, output in zip(chunk, model.predict([items[i] for i in chunk]), strict=True):
            outputs[index] = output
    if all(isinstance(output, np.ndarray) for output in outputs):
        return np.stack(outputs)
    return outputs


def _distance(task: str, figures: dict[str, float]) -> float:
    """One number for how far a network moved: 0 is float32's outputs exactly."""
    if task == EMBEDDINGS:
        return 1 - figures["min_cosine"]
    if "max_score_diff" in figures:
        return figures["max_score_diff"] + (1 - figures["top1_agreement"])
    return 1 - figures["top1_agreement"]


def apply(model: Any, choice: Choice, *, finish: bool = True) -> None:
    """Put ``model`` in the precision another process's check chose, without checking again.

    ``finish=False`` leaves the network untold that it is final (the built-in
    model would trace it, a forward pass): the gunicorn master applies a choice
    that way before the fork, and each worker finishes it (service.host.preload).
    """
    if choice.precision == FLOAT32:
        return
    # In place: this process never needs its float32 network again, so no second copy is made.
    model.use_network(reduced(model.network(), choice.precision, choice.layers, in_place=True))
    if finish:
        _settled(model, choice)


def finish(model: Any) -> None:
    """Tell ``model`` its network is final, in the process that will run it (see ``apply``)."""
    done = getattr(model, "network_settled", None)
    if callable(done):
        done()

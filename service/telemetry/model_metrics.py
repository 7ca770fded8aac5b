# design:
# - One ModelMetrics per served model in a worker, made by Metrics.for_model
#   in the worker (never before the fork: a label child opens the worker's
#   metrics files). It is that model's BatchObserver: its Batcher's batch and
#   queue threads and its runtime's loader thread call its hooks, and every
#   series they write carries the label model=<served name>. The metric
#   objects, the Tally and the worker-level figures (memory, worker_info) are
#   the worker's Metrics', shared by every model it serves.
# - Label children are looked up once, when the name is known (labels() takes
#   the metric's lock on every call): at construction, or for a ModelMetrics
#   made without a name, at its first on_model_info. A batch-side hook that
#   comes before any name binds the label "" for good (NO_MODEL), so nothing
#   is lost; the runtime calls on_model_info first, so that is only a
#   fallback. The binding happens once, under a lock, since the loader thread
#   and a request thread could both reach it.

"""One served model's batching, queue, load and shedding series, each labelled with its name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.batching import native
from service.batching.observer import BatchObserver

if TYPE_CHECKING:
    from service.telemetry.metrics import Metrics

# The model label of what no model is known for: a health probe, a scrape, a
# request refused before its model was. Prometheus stores an empty label as
# none, so such series read as having no model label at all.
NO_MODEL = ""


@dataclass(frozen=True)
class ModelSeries:
    """The label children one model writes on every batch, looked up once."""

    model: str
    queue_wait: Any
    model_duration: Any
    batch_size: Any
    items: Any
    batches: Any
    real_tokens: Any
    padded_tokens: Any
    sub_batches: Any
    queue_depth: Any


class ModelMetrics(BatchObserver):
    """The BatchObserver of one served model: the worker's series, labelled ``model``."""

    def __init__(self, metrics: Metrics, name: str | None = None) -> None:
        self._metrics = metrics
        self._series: ModelSeries | None = None
        self._binding = native.allocate_lock()
        # on_model_loaded's time, kept while the name is not yet known.
        self._load_seconds: float | None = None
        if name is not None:
            self._bind(name)

    @property
    def model(self) -> str | None:
        """The model label this observer writes, None until it is known."""
        return self._series.model if self._series is not None else None

    def _bound(self) -> ModelSeries:
        series = self._series
        return series if series is not None else self._bind(NO_MODEL)

    def _bind(self, name: str) -> ModelSeries:
        with self._binding:
            if self._series is not None:  # named already: the first name stays
                return self._series
            m = self._metrics
            tokens = m.tokens
            series = ModelSeries(
                model=name,
                queue_wait=m.queue_wait.labels(name),
                model_duration=m.model_duration.labels(name),
                batch_size=m.batch_size.labels(name),
                items=m.items.labels(name),
                batches=m.batches.labels(name),
                real_tokens=tokens.labels(name, "real"),
                padded_tokens=tokens.labels(name, "padded"),
                sub_batches=m.sub_batches.labels(name),
                queue_depth=m.queue_depth.labels(name),
            )
            m.open_shedding(name)
            if self._load_seconds is not None:
                m.model_load.labels(m.slot, name).set(self._load_seconds)
            self._series = series
            return series

    # -- BatchObserver ------------------------------------------------------------

    def on_batch(self, items: int, requests: int, queue_waits: list[float], model_seconds: float) -> None:
        # Written with the request threads' updates: the batch thread takes no
        # metrics lock, and a burst of small batches costs one write per series.
        s = self._bound()
        tally = self._metrics.tally
        tally.observe(s.batch_size, items)
        tally.inc(s.items, items)
        tally.inc(s.batches)
        tally.observe(s.model_duration, model_seconds)
        tally.observe_many(s.queue_wait, queue_waits)
        tally.settle()
        self._metrics.batch_ran()

    def on_queue_depth(self, depth: int) -> None:
        # Twice a request (queued, taken): written with the request threads' updates.
        tally = self._metrics.tally
        tally.set(self._bound().queue_depth, depth)
        tally.settle()

    def on_sub_batches(self, real_tokens: int, padded_tokens: int, sub_batches: int) -> None:
        s = self._bound()
        tally = self._metrics.tally
        tally.inc(s.real_tokens, real_tokens)
        tally.inc(s.padded_tokens, padded_tokens)
        tally.observe(s.sub_batches, sub_batches)
        tally.settle()

    def on_model_loaded(self, device: str, seconds: float) -> None:
        m = self._metrics
        with self._binding:
            series = self._series
            if series is None:  # reported before the name: written once it is known (_bind)
                self._load_seconds = seconds
        if series is not None:
            m.model_load.labels(m.slot, series.model).set(seconds)
        m.model_loaded(device)

    def on_model_info(self, name: str, task: str, precision: str = "float32", reason: str = "asked") -> None:
        m = self._metrics
        # `name` is the model's own; the label is the served name, the same for a named observer's.
        model = self._series.model if self._series is not None else self._bind(name).model
        m.model_info.labels(m.slot, model, name, task, precision, reason).set(1)

    def on_precision(self, exactness: dict[str, float]) -> None:
        m, model = self._metrics, self._bound().model
        for figure, value in exactness.items():
            m.exactness.labels(m.slot, model, figure).set(value)

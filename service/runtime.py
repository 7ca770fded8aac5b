# design:
# - ModelRuntime serves one model: it owns the model, the Batcher and its
#   Watchdog; the worker's Flask extension is the set of them all
#   (service.model_set). start() runs in the worker process (never in the
#   gunicorn master); it sets torch's thread counts and, on a GPU, the worker's
#   share of its memory, then loads the model in a new OS thread (or lets the
#   model set load its models one after another in one) so that create_app()
#   returns at once, and starts the batch thread and the watchdog once the
#   model is ready. wait_loaded() lets a host hold back traffic until then
#   (service.host.lifecycle does, under gunicorn).
# - A model that fails to load leaves ``load_error`` set for good. Under
#   gunicorn the worker then exits with its boot error and the master stops
#   (service.host.lifecycle); without a host the app stays up and answers 503. The
#   error's text goes to the log only: it can name paths on the host, so
#   clients are told LOAD_FAILED.
# - Request threads read ``model`` and ``batcher`` only after ``ready`` says so;
#   both are assigned once and never replaced.
# - A batch thread that dies or stalls is a fault (service.batching.watchdog): from the
#   watchdog's thread, the runtime marks itself not ready for good, fails every
#   request the batcher holds with 503, and calls ``on_fault``, which the host
#   sets to replace the worker. Left unset, the process stays up, not ready.
# - stop() asks the batcher to drain; see service.batching.

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any

from service.batching import native
from service.batching.admission import AdmissionRule
from service.batching.batcher import RUN_HERE_BELOW_S, Batcher
from service.batching.calibration import calibrate
from service.batching.gather import GatherPolicy
from service.batching.model_time import ModelTime
from service.batching.observer import BatchObserver, notify
from service.batching.subbatch import CostModel
from service.batching.watchdog import Watchdog
from service.config.budget import Budget, body_budget_bytes
from service.config.model_list import ModelEntry
from service.config.settings import Settings
from service.errors import NotReady
from service.host import preload
from service.models import Model, describe, load_model
from service.models.base import Outputs, item_sizer, sample_item, task_of
from service.models.device import configure_torch, limit_gpu_memory, one_intra_op_thread, select_device
from service.models.precision import Outcome, finish, onednn_cache_capacity
from service.models.precision_cache import settle
from service.models.shapes import ShapeSteps
from service.outputs import check_outputs, client_error

log = logging.getLogger(__name__)

EXTENSION = "serve"
# What clients (/readyz, /info, 503 bodies) hear about a model that failed to load.
LOAD_FAILED = "the model failed to load; see the service log"


class ModelRuntime:
    """One served model: its loading, its batcher and their faults (several make a service.model_set)."""

    def __init__(
        self,
        settings: Settings,
        observer: BatchObserver | None = None,
        *,
        entry: ModelEntry | None = None,
        model_time: ModelTime | None = None,
        bodies: Budget | None = None,
    ) -> None:
        # The entry's spec is settings.model; its names, if any, are what clients call it by.
        self.entry = entry or settings.models[0]
        self.settings = settings.for_model(self.entry)
        self.observer = observer or BatchObserver()
        # Refuses what cannot be answered within the latency budget (service.http.door, the batcher).
        self.admission = AdmissionRule(settings.latency_budget_s)
        # Bytes of request bodies this worker's requests hold at once while they are
        # read and parsed (service.http.inference): a bound on memory, shared by its models.
        self.bodies = bodies or Budget(body_budget_bytes(settings.max_body_bytes))
        # The model time the worker's models share (service.batching.model_time); None when alone.
        self.model_time = model_time
        self.model: Model | None = None
        self.batcher: Batcher | None = None
        # Why the model could not be loaded (for the log; see LOAD_FAILED).
        self.load_error: str | None = None
        # Why a loaded worker can no longer serve (a batch-thread fault).
        self.failure: str | None = None
        self.load_seconds: float | None = None
        # The precision the model runs in and its cost in exactness (service.models.precision).
        self.precision: Outcome | None = None
        # Whether the model is the one the master built for every worker (service.host.preload).
        self.shared_weights = False
        self.pid = os.getpid()
        self.device = "cpu"
        # What the host does after a batch-thread fault, e.g. exit the worker.
        self.on_fault: Callable[[str], None] | None = None
        self._loading = native.allocate_lock()
        self._loading.acquire()  # released once the model has loaded or failed to

    @property
    def names(self) -> tuple[str, ...]:
        """What clients may call this model: its served name first; empty until an unnamed one loads."""
        if self.entry.names:
            return self.entry.names
        return (self.model.name,) if self.model is not None else ()

    @property
    def served_name(self) -> str | None:
        """The name answers and metric labels carry; None until an unnamed model has loaded."""
        return self.entry.name or (self.model.name if self.model is not None else None)

    @property
    def label(self) -> str:
        """The model as the log and errors name it: its served name, else its spec."""
        return self.served_name or self.settings.model

    def start(self, *, load: bool = True) -> None:
        """Set up torch and the device, and load the model in a thread of its own (``load``) or not yet."""
        configure_torch(self.settings.torch_threads)
        try:
            self.device = select_device(self.settings.worker_device)
            if self.device == "cuda" and self.settings.worker_gpu_memory_fraction is not None:
                limit_gpu_memory(self.settings.worker_gpu_memory_fraction)
        except RuntimeError as exc:
            log.error("cannot use the planned device: %s", exc)
            self.load_error = f"cannot use the planned device: {exc}"
            self._loading.release()  # nothing will load: wait_loaded() must not wait
            return
        if load:
            native.start_thread(self.load)

    def wait_loaded(self, timeout: float) -> bool:
        """Block until the model has loaded or failed to, for at most ``timeout`` seconds."""
        if self._loading.acquire(timeout=timeout):
            self._loading.release()
            return True
        return False

    def load(self) -> None:
        """Load the model, in the calling thread; start() calls it in a thread of its own."""
        if self.load_error is not None:
            return  # the device could not be used (start said why)
        try:
            self._load_model()
        finally:
            self._loading.release()

    def skip(self, reason: str) -> None:
        """Give up on loading (another model of the worker failed): never served."""
        if self.load_error is None:
            self.load_error = reason
            self._loading.release()

    def _load_model(self) -> None:
        started = time.monotonic()
        try:
            shared = preload.take(self.settings, self.device, self.entry)
            if shared is not None:
                # Built by the master before the fork, in its precision: what is
                # left is what only a process that runs the model may do (a trace).
                model, self.precision, self.shared_weights = shared.model, shared.precision, True
                finish(model)
            else:
                model = load_model(self.settings, self.device)
                # Before the cost model is measured: it is the reduced network that runs.
                self.precision = settle(model, task_of(model), self.settings, self.device)
            own_name = shared.own_name if shared is not None else model.name
            if self.entry.name is not None:
                model.name = self.entry.name  # what answers, /info and the metrics call it
        except Exception as exc:
            log.exception("model %r failed to load", self.label)
            self.load_error = f"model {self.label!r} failed to load: {type(exc).__name__}: {exc}"
            return
        self.load_seconds = time.monotonic() - started
        bound_shapes(model, self.settings, self.device)
        batcher = new_batcher(
            self.settings, model, observer=self.observer, admission=self.admission, model_time=self.model_time
        )
        # First: an observer made without a name takes the model's from it (Metrics.for_model).
        precision = self.precision.precision if self.precision is not None else "float32"
        reason = self.precision.code if self.precision is not None else "asked"
        notify(self.observer.on_model_info, own_name, task_of(model), precision, reason)
        batcher.start()
        self.model, self.batcher = model, batcher
        notify(self.observer.on_model_loaded, model.device, self.load_seconds)
        if self.precision is not None:
            notify(self.observer.on_precision, self.precision.exactness)
            log.info("model %s: %s", model.name, self.precision.summary())
        layout = getattr(model, "layout", None)  # an image program's (service.models.layout)
        if layout is not None:
            log.info("model %s: %s", model.name, layout.summary())
        Watchdog(batcher, limit_s=self.settings.stall_limit_s, on_fault=self._fault).start()
        task, seconds = task_of(model), self.load_seconds
        log.info("model %s (%s) loaded on %s in %.1f s", model.name, task, model.device, seconds)

    def _fault(self, reason: str) -> None:
        """The batch thread died or stalled (called from the watchdog's thread)."""
        self.failure = f"the batch thread {reason}; this worker is being replaced"
        if self.batcher is not None:
            error = NotReady(f"the worker's batch thread {reason}; retry", reason="batch_thread_failed")
            failed = self.batcher.abandon(error)
            log.error("answered the %d requests the batcher held with 503", failed)
        if self.on_fault is not None:
            self.on_fault(reason)

    def readiness(self) -> str | None:
        """None when ready to serve, else why not (fit for a client to read)."""
        if self.load_error is not None:
            return LOAD_FAILED
        if self.failure is not None:
            return self.failure
        if self.batcher is None:
            return "the model is loading"
        if not self.batcher.running:
            return "the batch thread has stopped"
        return None

    def require_ready(self) -> tuple[Model, Batcher]:
        reason = self.readiness()
        if reason == LOAD_FAILED:
            raise NotReady(LOAD_FAILED, retry_after_s=5)
        if reason is not None or self.model is None or self.batcher is None:
            raise NotReady(f"not ready: {reason}", retry_after_s=5)
        return self.model, self.batcher

    def predict_naive(self, items: list[Any]) -> Outputs:
        """Run the model on one request's items in the calling thread."""
        model, _ = self.require_ready()
        try:
            outputs = model.predict(items)
        except Exception as exc:
            # The batch thread's mapping, so both routes answer a fault alike.
            raise client_error(exc, len(items)) from None
        check_outputs(outputs, len(items))
        return outputs

    def stop(self, timeout: float | None = None) -> bool:
        """Drain the batcher: answer every accepted request, then end its thread."""
        if self.batcher is None:
            return True
        # After a fault the thread may never end; its requests have had their 503.
        return self.batcher.stop(0 if self.failure is not None else timeout)


def new_batcher(
    settings: Settings,
    model: Model,
    *,
    observer: BatchObserver | None = None,
    admission: AdmissionRule | None = None,
    model_time: ModelTime | None = None,
) -> Batcher:
    """The batcher a worker runs ``model`` with under ``settings``, not yet started.

    A model that reports item sizes gets its cost model measured here, first.
    scripts/bench/offline.py builds the same one to measure the batcher without HTTP.
    """
    sizer = item_sizer(model)
    shapes = getattr(model, "shapes", None)  # bound_shapes's, if any
    return Batcher(
        model.predict,
        max_batch_size=settings.max_batch_size,
        queue_limit=settings.queue_limit,
        policy=GatherPolicy(
            delay_s=settings.max_batch_delay_ms / 1000, adaptive=settings.batch_gather == "adaptive"
        ),
        observer=observer,
        sizer=sizer,
        max_tokens=settings.max_batch_tokens,
        cost=None if sizer is None else _calibrated(model, sizer, settings.max_batch_size, shapes),
        admission=admission,
        model_time=model_time,
        run_here_below_s=RUN_HERE_BELOW_S,
        # A lone cheap call in its request's thread, only where that starts no pool of its own.
        run_in_callers=one_intra_op_thread(),
    )


def _calibrated(
    model: Model, size: Callable[[Any], int], max_rows: int, shapes: ShapeSteps | None
) -> CostModel:
    """The batch cost measured on sample items, before the batch thread starts."""
    rng = random.Random(0)  # noqa: S311 - sample texts, not secrets
    try:
        items = [model.prepare(sample_item(describe(model), rng)) for _ in range(16)]
    except ValueError:
        items = []  # no sample items for this kind: the cost is learnt from live batches
    cost = CostModel(shape=shapes.shape if shapes is not None else None)
    return calibrate(model.predict, items, size, max_rows=max_rows, cost=cost)


def bound_shapes(model: Model, settings: Settings, device: str) -> None:
    """Pad a text model's calls to a few shapes where the worker's oneDNN cache is on (service.models.shapes).

    With the cache on (bfloat16's default, or SERVE_ONEDNN_CACHE set), every
    new shape is a kernel the cache keeps: bounded shapes keep the worker's
    memory flat. With it off (float32's default) nothing is kept, and padding
    would only cost time.
    """
    bound = getattr(model, "bound_shapes", None)
    cache = onednn_cache_capacity()
    if device != "cpu" or cache <= 0 or not callable(bound):
        return
    steps: ShapeSteps = bound(settings.max_batch_size)
    log.info(
        "model %s: calls padded to %d row counts (up to %d) and lengths in multiples of %d tokens "
        "to %d, then two steps a doubling, for the oneDNN cache of %d primitives",
        model.name,
        len(steps.rows),
        steps.rows[-1],
        steps.multiple,
        steps.fine,
        cache,
    )

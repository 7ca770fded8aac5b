# design:
# - Metric objects are created per app, by Metrics() in create_app, which runs
#   in the worker; none exist at import. prometheus_client picks where values
#   live when it is first imported (mmap files under PROMETHEUS_MULTIPROC_DIR
#   when that variable is set, else memory), so the launcher sets it first; and
#   it opens a process's files, named by pid, when a value is first created,
#   which must happen after the fork. Objects per app also let the tests build
#   several apps in one process, each with a registry of its own.
# - Under gunicorn every worker writes to its own files in the shared
#   directory. GET /metrics, answered by whichever worker took the connection,
#   reads every worker's files through a fresh CollectorRegistry and
#   MultiProcessCollector. Counters and histograms sum over every worker that
#   ran since the master started, dead ones included; gauges count live
#   workers only ('livesum' adds them up, 'liveall' keeps one series per pid),
#   because the master's child_exit hook deletes a dead worker's live-gauge
#   files (service.host.multiproc.mark_dead).
# - Outside gunicorn (settings.prometheus_multiproc_dir is None) the values
#   live in this app's own registry, which /metrics renders.
# - Threads: request threads record through the HTTP hooks (service.access)
#   and the door into a Tally (service.telemetry.tally), which writes a batch of their
#   updates at a time; each served model's batch thread and loader thread write
#   through its own BatchObserver (for_model: service.telemetry.model_metrics), into the
#   same Tally. prometheus_client holds a lock only for the length of one update, with no
#   switch to another greenlet inside. Under gunicorn its locks are native OS
#   locks even in a gevent worker, because gunicorn_conf.py imports it in the
#   master, before gevent patches the forked worker: the batch thread and the
#   greenlets share them as they share service.batching.native's.
# - The model label: a model's batching, queue, load and shedding series, and
#   the request series, carry model=<served name>. A request's comes from its
#   environ (MODEL_ENVIRON_KEY, set by the routing code once its model is
#   known), "" where it never was (probes, scrapes, refusals before routing).
#   Worker-level series (memory, worker_info, in flight) carry none: several
#   models share a worker's process and device.

"""Prometheus metrics of the service, aggregated over all gunicorn workers."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from flask import Flask, Response, current_app
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    values,
)
from prometheus_client.multiprocess import MultiProcessCollector

from service.batching.observer import BatchObserver
from service.config.settings import Settings
from service.errors import ClientClosed, DeadlineExceeded, Overloaded, ServeError, SettingsError
from service.telemetry.model_metrics import NO_MODEL, ModelMetrics
from service.telemetry.tally import Tally

EXTENSION = "serve_metrics"

# The route label of a request that matched no URL rule (404, 405): one value,
# so that scanners probing random paths cannot grow the series without bound.
UNMATCHED_ROUTE = "unmatched"

# From half a millisecond (a small model's batch) to 30 s (the default request timeout).
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# Powers of two up to the largest SERVE_MAX_BATCH_SIZE.
BATCH_SIZE_BUCKETS = tuple(float(2**i) for i in range(13))

# Created at zero so that rate() over them works before the first occurrence.
REJECTION_REASONS = (
    "queue_full",
    "over_budget",
    "not_ready",
    "shutting_down",
    "gpu_out_of_memory",
    "batch_thread_failed",
)
TIMEOUT_REASONS = ("expired_in_queue", "expired_in_batch")

_WORKER_LABELS = ("slot", "device")

# A worker reads its own RSS at most this often (on a batch, or a scrape it answers).
RSS_EVERY_S = 1.0
SMAPS_EVERY_S = 15.0
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")

# device -> (bytes allocated, bytes reserved) by torch's caching allocator.
GpuMemoryReader = Callable[[str], tuple[int, int]]


class Metrics(BatchObserver):
    """The worker's metrics: a Flask extension, and through ``for_model`` each served model's observer.

    Itself a BatchObserver too, for a runtime still given ``observer=metrics``:
    its hooks go to one ``for_model(None)`` observer, named by its first
    ``on_model_info``.
    """

    def __init__(self, settings: Settings, *, gpu_memory: GpuMemoryReader | None = None) -> None:
        self.multiproc_dir = settings.prometheus_multiproc_dir
        if self.multiproc_dir is not None:
            _check_multiprocess(self.multiproc_dir)
        # Multiprocess values are read back from the files, never from a registry.
        self.registry = CollectorRegistry() if self.multiproc_dir is None else None
        # The worker's stable slot and planned device (gunicorn_conf.py sets
        # both); a process outside gunicorn is slot 0 on whatever it loads on.
        self.slot = str(settings.worker_slot) if settings.worker_slot is not None else "0"
        self._planned_device = settings.worker_device
        self._gpu_memory = gpu_memory or cuda_memory
        # (torch device to read, device label): the planned "cuda:2" is "cuda" in the worker.
        self._gpu: tuple[str, str] | None = None
        r = self.registry
        # Gauges sum over live workers ('livesum') unless they say otherwise.
        self.requests = _counter(
            r, "serve_http_requests_total", "HTTP requests answered.", "route", "code", "model"
        )
        self.request_duration = _histogram(
            r,
            "serve_http_request_duration_seconds",
            "From a request's arrival to its response.",
            "route",
            "model",
        )
        self.wait_before_handler = _histogram(
            r,
            "serve_http_wait_before_handler_seconds",
            "From a predict request's arrival (nginx's X-Request-Start, else the worker's accept) "
            "until the service began to handle it.",
        )
        self.in_flight = _gauge(
            r, "serve_http_requests_in_flight", "Requests being handled now, /metrics scrapes included."
        )
        # Per served model (service.telemetry.model_metrics): each has its own batcher.
        self.queue_wait = _histogram(
            r,
            "serve_batch_queue_wait_seconds",
            "Time a batched request spent queued before its batch ran.",
            "model",
        )
        self.model_duration = _histogram(
            r, "serve_batch_model_duration_seconds", "Time the model took to run one batch.", "model"
        )
        self.batch_size = _histogram(
            r,
            "serve_batch_size_items",
            "Items in each batch the model ran.",
            "model",
            buckets=BATCH_SIZE_BUCKETS,
        )
        self.items = _counter(
            r, "serve_inferred_items_total", "Items the batcher ran through the model.", "model"
        )
        self.batches = _counter(
            r, "serve_batches_total", "Batches the batcher ran through the model.", "model"
        )
        # Length-aware batches (models that report item sizes): real against padded
        # tokens shows what padding wastes; sub-batches how the batches were cut.
        self.tokens = _counter(
            r,
            "serve_batch_tokens_total",
            "Token positions run: real (the items' own), padded (rows x longest, real included).",
            "model",
            "kind",
        )
        self.sub_batches = _histogram(
            r,
            "serve_batch_sub_batches",
            "Model calls each length-aware batch was cut into.",
            "model",
            buckets=BATCH_SIZE_BUCKETS,
        )
        self.queue_depth = _gauge(
            r, "serve_batch_queue_depth", "Batched requests queued, not yet in a batch.", "model"
        )
        self.rejected = _counter(
            r, "serve_rejected_requests_total", "Requests refused with 503.", "model", "reason"
        )
        self.timed_out = _counter(
            r, "serve_timed_out_requests_total", "Requests whose deadline passed (504).", "model", "reason"
        )
        self.abandoned = _counter(
            r,
            "serve_abandoned_requests_total",
            "Requests whose client closed the connection while they waited (499): never computed.",
            "model",
        )
        # Per worker: 'liveall' keeps one series per live process and adds its pid label.
        self.model_load = _gauge(
            r,
            "serve_model_load_seconds",
            "Time the worker took to load the model.",
            "slot",
            "model",
            per_worker=True,
        )
        self.worker_info = _gauge(
            r,
            "serve_worker_info",
            "1 per live worker whose model has loaded.",
            *_WORKER_LABELS,
            per_worker=True,
        )
        # Which models the workers serve and their tasks: what a dashboard's panels are about.
        # `model` is the served name, which the other series carry; `name` the model's own.
        self.model_info = _gauge(
            r,
            "serve_model_info",
            "1 per live worker and model it serves, labelled with its served name (model), its own name, "
            "its task, its precision and why it runs in it (precision_reason: asked, or what auto "
            "found, docs/precision.md).",
            "slot",
            "model",
            "name",
            "task",
            "precision",
            "precision_reason",
            per_worker=True,
        )
        # What reduced precision cost, against float32 on the sample items (service.models.precision).
        self.exactness = _gauge(
            r,
            "serve_model_exactness",
            "How close the model's outputs in the precision in use are to float32's on the sample items, "
            "by figure (min_cosine, median_cosine, top1_agreement, max_score_diff).",
            "slot",
            "model",
            "figure",
            per_worker=True,
        )
        self.gpu_allocated = _gauge(
            r,
            "serve_gpu_memory_allocated_bytes",
            "GPU memory in the worker's tensors.",
            *_WORKER_LABELS,
            per_worker=True,
        )
        self.gpu_reserved = _gauge(
            r,
            "serve_gpu_memory_reserved_bytes",
            "GPU memory the worker's allocator holds.",
            *_WORKER_LABELS,
            per_worker=True,
        )
        # prometheus_client's process collector is not served in multiprocess mode
        # (each scrape would report the one worker that answered it), so each
        # worker records its own resident memory: what a memory limit counts.
        self.resident_memory = _gauge(
            r,
            "serve_worker_resident_memory_bytes",
            "Resident memory (RSS) of the worker process, as of its last batch or scrape.",
            *_WORKER_LABELS,
            per_worker=True,
        )
        self._rss_read_at = -RSS_EVERY_S
        # RSS counts a page shared by every worker (the model, built once in the
        # master: service.host.preload) once in each; PSS divides it among them,
        # and private memory is what this worker alone holds: the figures that
        # sum to the service's memory, and that grow with each worker added.
        self.proportional_memory = _gauge(
            r,
            "serve_worker_proportional_memory_bytes",
            "Proportional set size (PSS) of the worker: its private memory plus its share of shared pages.",
            *_WORKER_LABELS,
            per_worker=True,
        )
        self.private_memory = _gauge(
            r,
            "serve_worker_private_memory_bytes",
            "Memory only this worker holds (private clean and dirty pages).",
            *_WORKER_LABELS,
            per_worker=True,
        )
        # The master's share of the pages it holds with its workers; set by slot 0's worker.
        self.master_memory = _gauge(
            r,
            "serve_master_proportional_memory_bytes",
            "Proportional set size (PSS) of the gunicorn master, which holds the shared model.",
            per_worker=True,
        )
        self._smaps_read_at = -SMAPS_EVERY_S
        self._device_label = self._planned_device or "cpu"
        # Looked up once: labels() takes the metric's lock on every call.
        self._request_series: dict[tuple[str, int, str], tuple[Any, Any]] = {}
        self._shed_series: dict[tuple[Counter, str, str], Any] = {}
        self._abandoned_series: dict[str, Any] = {}
        # Refusals before a request's model is known (the door's) count under no model.
        self.open_shedding(NO_MODEL)
        # Request threads' and batch threads' updates, written a batch at a time (service.telemetry.tally).
        self.tally = Tally(in_flight=self.in_flight)
        # Where the BatchObserver hooks of Metrics itself go (see the class's docstring).
        self._unnamed = ModelMetrics(self, None)

    def init_app(self, app: Flask) -> None:
        app.extensions[EXTENSION] = self
        app.add_url_rule("/metrics", "metrics", _metrics_view, methods=["GET"])

    # -- HTTP side (service.access) -----------------------------------------------

    def request_started(self) -> None:
        self.tally.enter()

    def request_finished(self) -> None:
        self.tally.leave()

    def observe_request(self, route: str, code: int, seconds: float, model: str = NO_MODEL) -> None:
        """One answered request; ``model``: the served name it was routed to, "" if none was known."""
        # labels() takes the metric's lock and checks its values on every call;
        # routes, codes and served models are few, so each one's series are looked up once.
        key = (route, code, model)
        series = self._request_series.get(key)
        if series is None:
            series = (
                self.requests.labels(route, str(code), model),
                self.request_duration.labels(route, model),
            )
            self._request_series[key] = series
        count, duration = series
        self.tally.inc(count)
        self.tally.observe(duration, seconds)
        self.tally.settle()

    def observe_wait(self, seconds: float) -> None:
        # The door's, just before the request enters (request_started) or is
        # refused (observe_request): either flushes it, so it is not flushed
        # here too, once more for every request that finds its worker idle.
        self.tally.observe(self.wait_before_handler, seconds)
        self.tally.defer()

    def count_error(self, exc: ServeError, model: str = NO_MODEL) -> None:
        """Count a shed request by its reason and model; called once per request, where it is answered."""
        if isinstance(exc, ClientClosed):
            self._count_abandoned(model)
            return
        if isinstance(exc, DeadlineExceeded):
            metric = self.timed_out
        elif isinstance(exc, Overloaded):
            metric = self.rejected
        else:
            return
        key = (metric, exc.reason, model)
        series = self._shed_series.get(key)
        if series is None:
            series = self._shed_series[key] = metric.labels(model, exc.reason)
        self.tally.inc(series)
        self.tally.settle()

    def _count_abandoned(self, model: str) -> None:
        series = self._abandoned_series.get(model)
        if series is None:
            series = self._abandoned_series[model] = self.abandoned.labels(model)
        self.tally.inc(series)
        self.tally.settle()

    def open_shedding(self, model: str) -> None:
        """Create ``model``'s shedding series at zero, so that rate() over them works before the first."""
        for metric, reasons in ((self.rejected, REJECTION_REASONS), (self.timed_out, TIMEOUT_REASONS)):
            for reason in reasons:
                self._shed_series[(metric, reason, model)] = metric.labels(model, reason)
        self._abandoned_series[model] = self.abandoned.labels(model)

    # -- per served model (BatchObserver) -----------------------------------------

    def for_model(self, name: str | None = None) -> ModelMetrics:
        """The BatchObserver of one served model: its series labelled model=``name``.

        Called once per model, in the worker. With ``name=None`` the label is
        the name of the observer's first ``on_model_info``.
        """
        return ModelMetrics(self, name)

    def on_batch(self, items: int, requests: int, queue_waits: list[float], model_seconds: float) -> None:
        self._unnamed.on_batch(items, requests, queue_waits, model_seconds)

    def on_queue_depth(self, depth: int) -> None:
        self._unnamed.on_queue_depth(depth)

    def on_sub_batches(self, real_tokens: int, padded_tokens: int, sub_batches: int) -> None:
        self._unnamed.on_sub_batches(real_tokens, padded_tokens, sub_batches)

    def on_model_loaded(self, device: str, seconds: float) -> None:
        self._unnamed.on_model_loaded(device, seconds)

    def on_model_info(self, name: str, task: str, precision: str = "float32", reason: str = "asked") -> None:
        self._unnamed.on_model_info(name, task, precision, reason)

    def on_precision(self, exactness: dict[str, float]) -> None:
        self._unnamed.on_precision(exactness)

    # -- the worker's own figures, whichever model's hooks call them --------------

    def batch_ran(self) -> None:
        """After any model's batch: the worker's memory figures, each read at most as often as it says."""
        self._record_gpu_memory()
        self._record_resident_memory()

    def model_loaded(self, device: str) -> None:
        """A model of this worker loaded on ``device``: the worker serves, on its (planned) device."""
        label = self._planned_device or device
        self.worker_info.labels(self.slot, label).set(1)
        self._device_label = label
        self._record_resident_memory(force=True, detail=True)
        if device.startswith("cuda"):
            self._gpu = (device, label)
            self._record_gpu_memory()

    def _record_resident_memory(self, force: bool = False, *, detail: bool = False) -> None:
        # Two models' batch threads may both pass the check and both read: harmless, and rare.
        now = time.monotonic()
        if not force and now - self._rss_read_at < RSS_EVERY_S:
            return
        self._rss_read_at = now
        self.resident_memory.labels(self.slot, self._device_label).set(resident_bytes())
        # A walk of the page tables (about 10 ms for a loaded worker), so less often.
        if not detail and now - self._smaps_read_at < SMAPS_EVERY_S:
            return
        self._smaps_read_at = now
        own = memory_rollup()
        if own is not None:
            self.proportional_memory.labels(self.slot, self._device_label).set(own.pss)
            self.private_memory.labels(self.slot, self._device_label).set(own.private)
        if self.slot == "0" and self._planned_device is not None:  # under gunicorn: the parent is the master
            master = memory_rollup(os.getppid())
            if master is not None:
                self.master_memory.set(master.pss)

    def _record_gpu_memory(self) -> None:
        if self._gpu is None:
            return
        device, label = self._gpu
        allocated, reserved = self._gpu_memory(device)
        self.gpu_allocated.labels(self.slot, label).set(allocated)
        self.gpu_reserved.labels(self.slot, label).set(reserved)

    # -- exposition ---------------------------------------------------------------

    def flush(self) -> None:
        """Write the request threads' updates not yet written (a worker about to exit)."""
        self.tally.flush()

    def render(self) -> bytes:
        """The Prometheus text exposition of every worker's metrics."""
        # Other workers' figures are as of their last batch and their last flush
        # (service.telemetry.tally: exact once idle); this one's are fresh.
        self.tally.flush()
        self._record_gpu_memory()
        self._record_resident_memory(force=True)
        if self.registry is not None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiproc_dir)  # type: ignore[no-untyped-call]
        return generate_latest(registry)


def _counter(registry: CollectorRegistry | None, name: str, doc: str, *labels: str) -> Counter:
    return Counter(name, doc, labels, registry=registry)


def _gauge(
    registry: CollectorRegistry | None, name: str, doc: str, *labels: str, per_worker: bool = False
) -> Gauge:
    # Both modes drop a dead worker's values: its queue and requests are gone with it.
    mode: Literal["liveall", "livesum"] = "liveall" if per_worker else "livesum"
    return Gauge(name, doc, labels, registry=registry, multiprocess_mode=mode)


def _histogram(
    registry: CollectorRegistry | None,
    name: str,
    doc: str,
    *labels: str,
    buckets: tuple[float, ...] = SECONDS_BUCKETS,
) -> Histogram:
    return Histogram(name, doc, labels, buckets=buckets, registry=registry)


def _metrics_view() -> Response:
    metrics: Metrics = current_app.extensions[EXTENSION]
    return Response(metrics.render(), content_type=CONTENT_TYPE_LATEST)


def resident_bytes() -> int:
    """This process's resident memory, from /proc (0 where there is none)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except OSError:
        return 0


@dataclass(frozen=True)
class Rollup:
    rss: int
    pss: int
    private: int


def memory_rollup(pid: int | str = "self") -> Rollup | None:
    """A process's PSS and private memory in bytes, from /proc/PID/smaps_rollup (None where unreadable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as rollup:
            text = rollup.read()
    except OSError:
        return None
    fields: dict[bytes, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(b":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == b"kB":
            fields[name] = int(parts[0]) * 1024
    if b"Pss" not in fields:
        return None
    private = fields.get(b"Private_Clean", 0) + fields.get(b"Private_Dirty", 0)
    return Rollup(rss=fields.get(b"Rss", 0), pss=fields[b"Pss"], private=private)


def cuda_memory(device: str) -> tuple[int, int]:
    import torch

    return int(torch.cuda.memory_allocated(device)), int(torch.cuda.memory_reserved(device))


def _check_multiprocess(path: str) -> None:
    if not getattr(values.ValueClass, "_multiprocess", False):
        raise SettingsError(
            f"PROMETHEUS_MULTIPROC_DIR={path!r} was set after prometheus_client was imported, so this "
            "process would keep its metrics to itself; set it before the process starts "
            "(gunicorn_conf.py does so for its workers)"
        )
    if not os.path.isdir(path):
        raise SettingsError(
            f"PROMETHEUS_MULTIPROC_DIR={path!r} is not a directory; create it, or leave the variable "
            "unset and gunicorn_conf.py creates a fresh one"
        )

"""The worker topology: gunicorn workers, their devices, threads and GPU memory shares.

``plan(settings, inventory)`` is pure: the same settings and machine always give
the same plan, so it is unit-tested on fake machines and shown without starting
anything by ``python -m service.topology``. ``gunicorn_conf.py`` only applies it.
Each rule's reason is in docs/topology.md and in the plan's table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from service.config.model_spec import Weights
from service.config.settings import Settings
from service.errors import SettingsError
from service.topology.inventory import Gpu, Inventory

# Requests a worker must still take while a full batch waits: /healthz, /readyz,
# /metrics and /info must answer even then.
PROBE_HEADROOM = 8
# Connections a worker accepts beyond its batch and queue: under overload it must
# accept a connection to refuse its request in a millisecond. One left in the listen
# backlog waits there unseen, and once the backlog is full the kernel drops new
# connections, whose clients wait out SYN retries (1, 3, 7 s...) before a byte is
# sent. Each refusal also keeps its connection held for up to a second with the
# default budget (service.host.hold), and a worker refuses up to about 1,600 a
# second on a core (0.6 ms each), so this many may be held at once. With 1,000
# (gthread's own default), two gthread workers filled theirs at five times the
# capacity of a 2-core machine in bfloat16: accepted p99 31.0 and 39.4 s, 873 and
# 1,679 connection errors; with this, 2.07 and 2.09 s and none (docs/overload.md).
SHED_HEADROOM = 4000
# Requests a worker keeps connections for beyond its running batch, in
# full batches: the queue itself is bounded in items (SERVE_MAX_QUEUE), not in
# connections, so this is what a worker's clients need while others wait.
QUEUED_BATCHES = 4
# A worker must be up within this: importing torch and building the app. The
# model loads afterwards in a thread of its own, outside the heartbeat.
BOOT_TIMEOUT_S = 60
# Time to write a response after its request's deadline.
ANSWER_MARGIN_S = 5
# Thread pools of libraries beside torch, off in every worker: the tokenizer's
# (minilm) would compete with the planned torch threads for the same cores.
LIBRARY_ENV = {"TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class WorkerPlan:
    slot: int
    device: str  # "cpu" or "cuda:N", N as nvidia-smi numbers the GPU
    gpu_uuid: str | None
    torch_threads: int
    gpu_memory_fraction: float | None


@dataclass(frozen=True)
class DevicePlan:
    device: str
    gpu: Gpu
    workers: int
    memory_fraction: float

    @property
    def allocator_mb(self) -> int:
        """What each worker's torch allocator may hold on this device."""
        return int(self.memory_fraction * self.gpu.total_mb)


@dataclass(frozen=True)
class Decision:
    what: str
    value: str
    why: str


@dataclass(frozen=True)
class Plan:
    worker_class: str
    workers: tuple[WorkerPlan, ...]
    devices: tuple[DevicePlan, ...]  # empty for a CPU plan
    threads: int  # request threads per gthread worker (1 for sync)
    worker_connections: int | None  # open connections per gevent or gthread worker (None for sync)
    timeout_s: int
    graceful_timeout_s: int
    inventory: Inventory
    decisions: tuple[Decision, ...]
    warnings: tuple[str, ...]
    onednn_cache: int = 0  # oneDNN primitives each worker caches (SERVE_ONEDNN_CACHE)

    def worker(self, slot: int) -> WorkerPlan:
        """The plan for ``slot``. Slots past the planned count (gunicorn's TTIN signal,
        or a reload while old workers drain) reuse the planned slots' devices in turn."""
        return self.workers[slot % len(self.workers)]

    def worker_env(self, slot: int) -> dict[str, str | None]:
        """Environment for the worker in ``slot``, set before it imports torch; None unsets."""
        worker = self.worker(slot)
        threads = str(worker.torch_threads)
        fraction = worker.gpu_memory_fraction
        return {
            "SERVE_WORKER_SLOT": str(slot),
            "SERVE_WORKER_DEVICE": worker.device,
            "SERVE_WORKER_GPU_MEMORY_FRACTION": None if fraction is None else repr(fraction),
            "SERVE_TORCH_THREADS": threads,
            # OpenMP and BLAS pools outside torch (numpy) would otherwise size to every core.
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            # One GPU per worker, named by UUID so no device-order setting can change it;
            # a CPU worker sees none, so nothing in it creates a CUDA context by accident.
            "CUDA_VISIBLE_DEVICES": worker.gpu_uuid or "",
            # oneDNN caches a compiled primitive per op and input shape: with
            # mixed-length batches nearly every call is a new shape, and at its
            # default capacity (1024) the cache, and the heap it fragments,
            # grow a worker by hundreds of MiB (docs/memory.md).
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(self.onednn_cache),
            **LIBRARY_ENV,
        }


def plan(
    settings: Settings,
    inventory: Inventory,
    weights: Weights | Sequence[Weights | None] | None = None,
) -> Plan:
    """The workers, threads and GPU shares for ``settings`` on ``inventory``.

    ``weights`` (service.config.model_spec.weights, read from disk by the caller; one
    per model SERVE_MODEL lists) lets a GPU plan say what each worker's copies
    of the weights take at the precision in use, and warn where its share
    cannot hold them. Every worker holds every model; its models take turns on
    its threads (service.batching.model_time), so the plan's threads are the
    worker's, whatever the number of models.
    """
    decisions: list[Decision] = []
    warnings: list[str] = []
    cores = inventory.usable_cores
    gpus = _chosen_gpus(settings, inventory, decisions)
    if gpus:
        workers, devices = _gpu_workers(settings, gpus, cores, decisions, warnings)
        _check_weights(settings, weights, devices, decisions, warnings)
    else:
        _warn_unused_gpu_settings(settings, warnings)
        workers, devices = _cpu_workers(settings, cores, decisions), ()
    busy = sum(w.torch_threads for w in workers)
    if busy > cores:
        warnings.append(
            f"{len(workers)} workers run {busy} torch threads on {cores} usable cores; they will "
            "contend for the cores (lower SERVE_WORKERS or SERVE_TORCH_THREADS)"
        )
    threads, connections = _concurrency(settings, decisions, warnings)
    timeout_s, graceful_s = _timeouts(settings, decisions)
    return Plan(
        worker_class=settings.worker_class,
        workers=workers,
        devices=devices,
        threads=threads,
        worker_connections=connections,
        timeout_s=timeout_s,
        graceful_timeout_s=graceful_s,
        inventory=inventory,
        decisions=tuple(decisions),
        warnings=tuple(warnings),
        onednn_cache=settings.onednn_cache if settings.onednn_cache is not None else 0,
    )


def _chosen_gpus(settings: Settings, inventory: Inventory, decisions: list[Decision]) -> tuple[Gpu, ...]:
    mode, gpus = settings.devices, inventory.gpus
    why_none = inventory.gpu_note or "no GPU"
    if mode == "cpu":
        decisions.append(Decision("devices", "cpu", "SERVE_DEVICES=cpu"))
        return ()
    if mode == "auto":
        value = ",".join(f"cuda:{g.index}" for g in gpus) or "cpu"
        why = "every GPU NVML lists" if gpus else why_none
        decisions.append(Decision("devices", value, f"SERVE_DEVICES=auto: {why}"))
        return gpus
    if not gpus:
        raise SettingsError(f"SERVE_DEVICES={mode} asks for GPUs, but none is usable: {why_none}")
    wanted = settings.gpu_indices
    if wanted is None:
        chosen = gpus
    else:
        available = ", ".join(f"cuda:{g.index}" for g in gpus)
        missing = [i for i in wanted if i >= len(gpus)]
        if missing:
            raise SettingsError(
                f"SERVE_DEVICES={mode} names cuda:{missing[0]}, but the GPUs here are {available}"
            )
        chosen = tuple(gpus[i] for i in wanted)
    decisions.append(
        Decision("devices", ",".join(f"cuda:{g.index}" for g in chosen), f"SERVE_DEVICES={mode}")
    )
    return chosen


def _warn_unused_gpu_settings(settings: Settings, warnings: list[str]) -> None:
    unused = {
        "SERVE_WORKERS_PER_DEVICE": settings.workers_per_device,
        "SERVE_GPU_MEMORY_PER_WORKER_MB": settings.gpu_memory_per_worker_mb,
        "SERVE_GPU_MEMORY_FRACTION": settings.gpu_memory_fraction,
    }
    for name, value in unused.items():
        if value is not None:
            warnings.append(f"{name}={value} is ignored: this plan uses no GPU")


def _cpu_workers(settings: Settings, cores: int, decisions: list[Decision]) -> tuple[WorkerPlan, ...]:
    match settings.workers, settings.torch_threads:
        case None, None:
            workers, threads = cores, 1
            why_workers = "one per usable core: measured faster than fewer workers with more threads"
            why_threads = "workers x threads = usable cores"
        case None, int(threads):
            workers = max(1, cores // threads)
            why_workers = f"usable cores {cores} // SERVE_TORCH_THREADS, at least 1"
            why_threads = f"SERVE_TORCH_THREADS={threads}"
        case int(workers), None:
            threads = max(1, cores // workers)
            why_workers = f"SERVE_WORKERS={workers}"
            why_threads = f"usable cores {cores} // SERVE_WORKERS, at least 1"
        case int(workers), int(threads):
            why_workers, why_threads = f"SERVE_WORKERS={workers}", f"SERVE_TORCH_THREADS={threads}"
    decisions.append(Decision("workers", str(workers), why_workers))
    decisions.append(Decision("torch threads per worker", str(threads), why_threads + "; inter-op threads 1"))
    return tuple(WorkerPlan(slot, "cpu", None, threads, None) for slot in range(workers))


def _gpu_workers(
    settings: Settings, gpus: tuple[Gpu, ...], cores: int, decisions: list[Decision], warnings: list[str]
) -> tuple[tuple[WorkerPlan, ...], tuple[DevicePlan, ...]]:
    counts, source = _gpu_counts(settings, gpus)
    devices = tuple(
        DevicePlan(f"cuda:{gpu.index}", gpu, count, _fraction(settings, gpu, count, source))
        for gpu, count in zip(gpus, counts, strict=True)
        if count > 0
    )
    total = sum(d.workers for d in devices)
    decisions.append(Decision("workers", str(total), source))
    if settings.gpu_memory_fraction is not None:
        why_fraction = "SERVE_GPU_MEMORY_FRACTION"
    else:
        why_fraction = (
            f"(free MiB / workers on it - SERVE_GPU_CONTEXT_MB={settings.gpu_context_mb}) / total MiB"
        )
    decisions.append(Decision("GPU memory fraction", "per device, above", why_fraction))
    _check_token_budget(settings, devices, decisions, warnings)
    threads = settings.torch_threads or max(1, cores // total)
    if settings.torch_threads:
        why_threads = f"SERVE_TORCH_THREADS={threads}"
    else:
        why_threads = f"usable cores {cores} // {total} workers, at least 1"
    decisions.append(Decision("torch threads per worker", str(threads), why_threads + "; inter-op threads 1"))
    workers = []
    # Interleaved, so that the first workers to start (or a partial restart) spread over the GPUs.
    for slot, position in enumerate(_interleave([d.workers for d in devices])):
        device = devices[position]
        workers.append(WorkerPlan(slot, device.device, device.gpu.uuid, threads, device.memory_fraction))
    return tuple(workers), devices


def _check_weights(
    settings: Settings,
    weights: Weights | Sequence[Weights | None] | None,
    devices: tuple[DevicePlan, ...],
    decisions: list[Decision],
    warnings: list[str],
) -> None:
    """Does each worker's share hold its copies of the weights, at the precision each runs in on a GPU?"""
    listed = [weights] if isinstance(weights, Weights) else list(weights or ())
    known = [w for w in listed if w is not None]
    if len(listed) > 1 and len(known) < len(listed):
        # A factory's weights are known only once it is built, in the worker.
        warnings.append(
            f"the weights of {len(listed) - len(known)} of the {len(listed)} models are unknown until they "
            "load (a factory): each worker's GPU share is checked against the others' alone"
        )
    if not known:
        return
    requested = settings.precision
    # SERVE_PRECISION=auto runs a text model in float16 on a GPU (service.models.precision.resolve).
    at = [("float16" if w.reducible else "float32") if requested == "auto" else requested for w in known]
    mb = sum(w.mb_at(p) for w, p in zip(known, at, strict=True))
    precision = "/".join(sorted(set(at)))
    on_disk = " + ".join(f"{w.mb:.0f} MiB at {w.bytes_per_number} bytes a number" for w in known)
    decisions.append(
        Decision(
            "weights per worker",
            f"{mb:.0f} MiB at {precision}",
            f"{on_disk} on disk; SERVE_PRECISION={requested}; each worker holds its own copy"
            + (f" of each of the {len(known)} models" if len(known) > 1 else "")
            + " on its GPU",
        )
    )
    per_token = settings.token_memory_kb
    activations = settings.max_batch_tokens * per_token / 1024 if per_token else 0
    owner = "models'" if len(known) > 1 else "model's"
    for device in devices:
        if mb + activations > device.allocator_mb:
            warnings.append(
                f"each worker's {device.allocator_mb} MiB share on {device.device} cannot hold the "
                f"{owner} {mb:.0f} MiB of weights at {precision}"
                + (f" and a full call's {activations:.0f} MiB of activations" if activations else "")
                + " (run fewer workers on it, or a smaller precision)"
            )


def _check_token_budget(
    settings: Settings, devices: tuple[DevicePlan, ...], decisions: list[Decision], warnings: list[str]
) -> None:
    """Does each worker's memory share hold one full call's activations?

    A length-aware batch runs as calls of at most SERVE_MAX_BATCH_TOKENS padded
    tokens, so one call's activations are at most that many tokens times the
    model's memory per token; the worker's allocator share must hold them on
    top of the weights, or the largest calls fail with out-of-memory (503).
    """
    tokens = settings.max_batch_tokens
    per_token = settings.token_memory_kb
    if per_token is None:
        decisions.append(
            Decision(
                "batch token budget",
                f"{tokens} tokens",
                "SERVE_MAX_BATCH_TOKENS; activation memory per token unknown (set SERVE_TOKEN_MEMORY_KB, "
                "measured on the GPU, to check it against each worker's share)",
            )
        )
        return
    activations_mb = tokens * per_token / 1024
    decisions.append(
        Decision(
            "batch token budget",
            f"{tokens} tokens, {activations_mb:.0f} MiB",
            f"SERVE_MAX_BATCH_TOKENS x SERVE_TOKEN_MEMORY_KB={per_token:g}: one call's activations, "
            "which each worker's allocator share must hold beside the weights",
        )
    )
    for device in devices:
        if activations_mb > device.allocator_mb:
            fits = int(device.allocator_mb * 1024 / per_token)
            warnings.append(
                f"a call of SERVE_MAX_BATCH_TOKENS={tokens} needs about {activations_mb:.0f} MiB of "
                f"activations, more than each worker's {device.allocator_mb} MiB share on {device.device}; "
                f"the largest batches will run out of memory (lower SERVE_MAX_BATCH_TOKENS below {fits}, "
                "or run fewer workers on it)"
            )


def _gpu_counts(settings: Settings, gpus: tuple[Gpu, ...]) -> tuple[list[int], str]:
    per_device, per_worker_mb = settings.workers_per_device, settings.gpu_memory_per_worker_mb
    if per_device is not None and per_worker_mb is not None:
        raise SettingsError(
            "SERVE_WORKERS_PER_DEVICE and SERVE_GPU_MEMORY_PER_WORKER_MB both set the workers per GPU; "
            "set one of them"
        )
    if settings.workers is not None and (per_device is not None or per_worker_mb is not None):
        raise SettingsError(
            f"SERVE_WORKERS={settings.workers} cannot be combined with SERVE_WORKERS_PER_DEVICE or "
            "SERVE_GPU_MEMORY_PER_WORKER_MB on GPUs; set one of them"
        )
    if per_device is not None:
        return [per_device] * len(gpus), f"SERVE_WORKERS_PER_DEVICE={per_device} on each GPU"
    if per_worker_mb is not None:
        need = per_worker_mb + settings.gpu_context_mb
        counts = [gpu.free_mb // need for gpu in gpus]
        for gpu, count in zip(gpus, counts, strict=True):
            if count == 0:
                raise SettingsError(
                    f"SERVE_GPU_MEMORY_PER_WORKER_MB={per_worker_mb} fits no worker on cuda:{gpu.index} "
                    f"({gpu.name}, {gpu.free_mb} MiB free): each worker also needs "
                    f"SERVE_GPU_CONTEXT_MB={settings.gpu_context_mb} for its CUDA context"
                )
        return (
            counts,
            f"free MiB // (SERVE_GPU_MEMORY_PER_WORKER_MB={per_worker_mb} "
            f"+ {settings.gpu_context_mb} context)",
        )
    if settings.workers is not None:
        share, extra = divmod(settings.workers, len(gpus))
        counts = [share + (i < extra) for i in range(len(gpus))]
        return counts, f"SERVE_WORKERS={settings.workers}, spread over the GPUs"
    return [1] * len(gpus), "one per GPU: a GPU runs one process's kernels at a time"


def _fraction(settings: Settings, gpu: Gpu, count: int, source: str) -> float:
    device = f"cuda:{gpu.index}"
    override = settings.gpu_memory_fraction
    if override is not None:
        if override * count > 1 + 1e-9:
            raise SettingsError(
                f"SERVE_GPU_MEMORY_FRACTION={override:g} for {count} workers on {device} adds up to "
                f"{override * count:.2f} of its memory; it may add up to 1 at most"
            )
        return override
    share_mb = gpu.free_mb / count
    # Rounded down: a share rounded up could tip the device's sum over its memory.
    fraction = math.floor((share_mb - settings.gpu_context_mb) / gpu.total_mb * 1000) / 1000
    if fraction <= 0:
        raise SettingsError(
            f"{count} workers on {device} ({gpu.free_mb} MiB free) leave each {share_mb:.0f} MiB, "
            f"no more than the SERVE_GPU_CONTEXT_MB={settings.gpu_context_mb} its CUDA context takes "
            f"(workers: {source})"
        )
    return fraction


def _interleave(counts: list[int]) -> list[int]:
    """Device positions in slot order: 2, 1 -> 0, 1, 0."""
    remaining, order = list(counts), []
    while any(remaining):
        for position, left in enumerate(remaining):
            if left:
                order.append(position)
                remaining[position] -= 1
    return order


def _concurrency(
    settings: Settings, decisions: list[Decision], warnings: list[str]
) -> tuple[int, int | None]:
    full = settings.max_batch_size + PROBE_HEADROOM
    if settings.threads is not None and settings.worker_class != "gthread":
        warnings.append(
            f"SERVE_THREADS={settings.threads} is ignored: only gthread workers have request threads"
        )
    if settings.worker_class == "sync":
        if settings.worker_connections is not None:
            warnings.append(
                f"SERVE_WORKER_CONNECTIONS={settings.worker_connections} is ignored: a sync worker "
                "holds one connection at a time"
            )
        warnings.append(
            "SERVE_WORKER_CLASS=sync: each worker takes one request at a time, so the batched route "
            "never sees more than one request per batch"
        )
        decisions.append(Decision("request threads per worker", "1", "sync runs one request at a time"))
        return 1, None
    # A greenlet or a connection in gthread's poller per open connection, idle
    # keep-alive ones included, and both are cheap: admit a running batch, a full
    # queue and the requests it is refusing, so an overloaded worker answers its own
    # 503 instead of leaving connections unaccepted.
    queued = QUEUED_BATCHES * settings.max_batch_size
    connections = settings.worker_connections or (
        settings.max_batch_size + queued + PROBE_HEADROOM + SHED_HEADROOM
    )
    why = (
        "SERVE_WORKER_CONNECTIONS"
        if settings.worker_connections
        else f"max batch size {settings.max_batch_size} + {queued} queued ({QUEUED_BATCHES} batches) "
        f"+ 8 for probes + {SHED_HEADROOM} to refuse under overload"
    )
    decisions.append(Decision("connections per worker", str(connections), why))
    if connections < full:
        warnings.append(
            f"SERVE_WORKER_CONNECTIONS={connections} is below max batch size + {PROBE_HEADROOM}: batches "
            "hold fewer requests and probes may wait behind them"
        )
    if settings.worker_class == "gevent":
        return 1, connections
    threads = settings.threads or full
    why = (
        "SERVE_THREADS"
        if settings.threads
        else f"max batch size {settings.max_batch_size} + 8 for the probes"
    )
    decisions.append(Decision("request threads per worker", str(threads), why))
    if threads < full:
        warnings.append(
            f"SERVE_THREADS={threads} is below max batch size + {PROBE_HEADROOM}: a batch gathers at most "
            f"{threads} requests, and probes may wait behind them"
        )
    return threads, connections


def _timeouts(settings: Settings, decisions: list[Decision]) -> tuple[int, int]:
    request_s = math.ceil(settings.request_timeout_ms / 1000)
    if settings.worker_class == "sync":
        # A sync worker's heartbeat stops while it runs a request, so the longest request
        # (a batched one waits at most its deadline) must fit in the timeout.
        timeout = max(BOOT_TIMEOUT_S, request_s + ANSWER_MARGIN_S)
        why = "covers boot and the longest request (SERVE_REQUEST_TIMEOUT_MS + 5 s)"
    else:
        timeout = BOOT_TIMEOUT_S
        why = "covers boot; model loading and batches run outside the worker's heartbeat"
    decisions.append(Decision("timeout", f"{timeout} s", why))
    graceful = request_s + ANSWER_MARGIN_S
    decisions.append(
        Decision(
            "graceful timeout", f"{graceful} s", "a request in flight ends by its deadline + 5 s to answer"
        )
    )
    return timeout, graceful

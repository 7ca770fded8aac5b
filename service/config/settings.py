"""Typed, immutable settings read once from ``SERVE_*`` environment variables.

Every other module receives a :class:`Settings`; none reads ``os.environ`` itself.
Errors name the variable, the value and what is allowed, so a typo is fixed in
one try.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.config.image_spec import LAYOUTS, PREPROCESS_FILE
from service.config.model_list import ModelEntry, parse_models
from service.config.precision_spec import PRECISIONS
from service.errors import SettingsError

WORKER_CLASSES = ("gthread", "gevent", "sync")
LOG_FORMATS = ("text", "json")
# The allocator the workers run on (service.host.allocator).
ALLOCATORS = ("auto", "jemalloc", "system")
BATCH_GATHER_POLICIES = ("adaptive", "eager")
DEVICE_MODES = ("auto", "cpu", "cuda")
# Pillow's own decompression-bomb threshold (PIL.Image.MAX_IMAGE_PIXELS), written
# out so that the master need not import Pillow: SERVE_MAX_IMAGE_PIXELS may only
# lower it, so that an image Pillow would warn about is refused by our limit first.
PILLOW_MAX_IMAGE_PIXELS = 89_478_485
# SERVE_MAX_BODY_BYTES's largest value.
_MAX_BODY_BYTES = 1 << 30


@dataclass(frozen=True)
class _Integer:
    """Parses an integer from ``lo`` to ``hi``, both included (docs/settings.md states the range)."""

    lo: int
    hi: int

    def __call__(self, name: str, raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            value = None
        if value is None or not self.lo <= value <= self.hi:
            raise SettingsError(f"{name} must be an integer from {self.lo} to {self.hi}, got {raw!r}")
        return value


@dataclass(frozen=True)
class _Number:
    """Parses a number from ``lo`` to ``hi``, both included (docs/settings.md states the range)."""

    lo: float
    hi: float

    def __call__(self, name: str, raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            value = None
        # NaN fails both comparisons, so it is refused here too.
        if value is None or not self.lo <= value <= self.hi:
            raise SettingsError(f"{name} must be a number from {self.lo:g} to {self.hi:g}, got {raw!r}")
        return value


@dataclass(frozen=True)
class _Choice:
    """Parses one of ``allowed``, in any case."""

    allowed: tuple[str, ...]

    def __call__(self, name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in self.allowed:
            raise SettingsError(f"{name} must be one of {', '.join(self.allowed)}, got {raw!r}")
        return value


_SWITCH = {
    **dict.fromkeys(("1", "true", "yes", "on"), True),
    **dict.fromkeys(("0", "false", "no", "off"), False),
}


def _switch(name: str, raw: str) -> bool:
    value = _SWITCH.get(raw.strip().lower())
    if value is None:
        raise SettingsError(f"{name} must be on or off (or 1/0, true/false, yes/no), got {raw!r}")
    return value


def _text(name: str, raw: str) -> str:
    value = raw.strip()
    if not value:
        raise SettingsError(f"{name} must not be empty")
    return value


def _model_list(name: str, raw: str) -> str:
    value = _text(name, raw)
    parse_models(value)  # refused now if its grammar is broken (service.config.model_list)
    return value


def _shape(name: str, raw: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(part) for part in raw.split(","))
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise SettingsError(
            f"{name} must be a comma-separated list of positive integers such as 3,32,32, got {raw!r}"
        )
    return dims


def _devices(name: str, raw: str) -> str:
    value = raw.strip().lower().replace(" ", "")
    if value in DEVICE_MODES:
        return value
    indices: list[int] = []
    for part in value.split(","):
        kind, sep, index = part.partition(":")
        if kind != "cuda" or not sep or not index.isdigit():
            indices = []
            break
        indices.append(int(index))
    if not indices or len(set(indices)) != len(indices):
        raise SettingsError(
            f"{name} must be one of {', '.join(DEVICE_MODES)}, or a list of distinct GPUs "
            f"such as cuda:0,cuda:2, got {raw!r}"
        )
    return ",".join(f"cuda:{i}" for i in indices)


def _device(name: str, raw: str) -> str:
    value = raw.strip().lower()
    kind, sep, index = value.partition(":")
    if value != "cpu" and not (kind == "cuda" and sep and index.isdigit()):
        raise SettingsError(f"{name} must be cpu or cuda:N, got {raw!r}")
    return value


def _bind(name: str, raw: str) -> str:
    value = raw.strip()
    if value.startswith("unix:"):
        return value
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise SettingsError(f"{name} must be HOST:PORT or unix:PATH, got {raw!r}")
    return value


def _networks(name: str, raw: str) -> tuple[str, ...]:
    """``*``, or a comma-separated list of IP addresses and CIDR networks (gunicorn's syntax)."""
    parts = tuple(part.strip() for part in raw.split(",") if part.strip())
    if parts == ("*",):
        return parts
    for part in parts:
        try:
            # strict, as gunicorn parses it: 10.0.0.1/8 has host bits set and is refused.
            ipaddress.ip_network(part)
        except ValueError:
            raise SettingsError(
                f"{name} must be * or a comma-separated list of IP addresses and networks "
                f"such as 127.0.0.1,10.0.0.0/8, got {raw!r} ({part!r} is neither)"
            ) from None
    if not parts:
        raise SettingsError(f"{name} must not be empty")
    return parts


# SERVE_MAX_QUEUE's default, in items.
DEFAULT_QUEUE_ITEMS = 32_768
# SERVE_MAX_BODY_BYTES's default for a model of text (or vectors): room for
# 2,048 texts of about 4,000 characters each, as JSON.
DEFAULT_BODY_BYTES = 8 << 20
# An image model's default is one image at SERVE_MAX_IMAGE_PIXELS, at this many
# bytes a pixel (a phone's JPEG or WebP is under 0.7, a PNG screenshot about
# 1), as base64 in JSON (4/3 of the file), rounded up to a whole MiB.
IMAGE_BODY_BYTES_PER_PIXEL = 1
# A refused body is read to its end, as nginx's lingering close does, if it is
# at most this large or twice the body limit, whichever is larger.
LINGER_MIN_BYTES = 16 << 20


def image_body_bytes(max_image_pixels: int) -> int:
    """SERVE_MAX_BODY_BYTES's default for an image model: one photo of the most pixels it decodes.

    Never below the text default, so that many small images fit too, and never
    above the setting's own maximum.
    """
    as_base64 = -(-max_image_pixels * IMAGE_BODY_BYTES_PER_PIXEL * 4 // 3)
    whole_mib = -(-as_base64 // (1 << 20)) << 20
    return min(max(DEFAULT_BODY_BYTES, whole_mib), _MAX_BODY_BYTES)


def default_body_bytes(model: str, max_image_pixels: int) -> int:
    """SERVE_MAX_BODY_BYTES when unset: the image rule for an image model directory, else the text default.

    An image model directory is known by its preprocess.json (service.config.model_spec
    checks the rest). A factory that serves images is not seen from here: it
    sets SERVE_MAX_BODY_BYTES itself.
    """
    specs = [entry.spec for entry in parse_models(model)]
    if any((Path(spec) / PREPROCESS_FILE).is_file() for spec in specs):
        return image_body_bytes(max_image_pixels)
    return DEFAULT_BODY_BYTES


@dataclass(frozen=True)
class Settings:
    """The service's configuration; ``Settings.from_env()`` is the only reader."""

    model: str = "minilm"
    max_batch_size: int = 64
    max_batch_delay_ms: float = 0.0
    batch_gather: str = "adaptive"
    # Padded tokens one model call may hold (rows x its longest item), for
    # models that report item sizes: what bounds a call's activation memory.
    max_batch_tokens: int = 8192
    # Activation memory one padded token needs in one model call, in KiB, as
    # measured on the GPU (docs/batching.md); None: unknown, not checked.
    token_memory_kb: float | None = None
    # OpenAI's limit on one embeddings request's inputs, and Cohere's on a rerank's documents.
    max_items_per_request: int = 2048
    max_documents_per_request: int = 1000
    # Set from the model when SERVE_MAX_BODY_BYTES is not (default_body_bytes).
    max_body_bytes: int = DEFAULT_BODY_BYTES
    # Width x height an image model decodes at most, read from the file's header
    # before any pixel is: 4096 x 4096, 48 MiB of RGB per image being decoded.
    max_image_pixels: int = 4096 * 4096
    # The memory layout an image program runs in on a CPU: measured at load
    # ("auto"), or as named (service.models.layout).
    image_layout: str = "auto"
    max_queue: int | None = None
    # How long a refused body still arriving is read before the connection
    # closes, so that its client sees the refusal (service.http.linger); 0: close at once.
    linger_ms: int = 5000
    request_timeout_ms: int = 30_000
    latency_budget_ms: int | None = None
    stall_timeout_ms: int | None = None
    # The arithmetic the network runs in, and how close to float32 a reduced one
    # must stay on the sample items to be kept (service.models.precision).
    precision: str = "auto"
    precision_min_cosine: float = 0.95
    precision_median_cosine: float = 0.98
    precision_min_top1: float = 0.95
    precision_max_score_diff: float = 0.1
    mlp_width: int = 256
    mlp_depth: int = 8
    mlp_seed: int = 0
    item_shape: tuple[int, ...] | None = None
    bind: str = "127.0.0.1:8000"
    forwarded_allow_ips: tuple[str, ...] = ("127.0.0.1", "::1")
    workers: int | None = None
    threads: int | None = None
    torch_threads: int | None = None
    worker_class: str = "gthread"
    worker_connections: int | None = None
    balance_connections: bool = True
    # On CPU workers: build the model once in the gunicorn master, before the
    # fork, so that every worker shares its pages (service.host.preload).
    share_weights: bool = True
    # Hold a refused client's connection before reading its next request (service.host.hold).
    hold_refused: bool = True
    # Requests after which gunicorn replaces a worker (0: never); see max_requests_jitter.
    max_requests: int = 0
    # oneDNN primitives each worker keeps (ONEDNN_PRIMITIVE_CACHE_CAPACITY): one
    # per op and input shape, so mixed-length batches fill oneDNN's default 1024
    # and the worker's memory with it (docs/memory.md). None: 0,
    # or 1024 for a model of fixed input shapes (service.config.model_spec).
    onednn_cache: int | None = None
    # auto: jemalloc where the host has it, preloaded by the master (service.host.allocator).
    allocator: str = "auto"
    devices: str = "auto"
    workers_per_device: int | None = None
    gpu_memory_per_worker_mb: int | None = None
    gpu_memory_fraction: float | None = None
    gpu_context_mb: int = 1024
    log_format: str = "text"
    api_token: str | None = None
    # Set by gunicorn_conf.py in each worker from its slot in the plan; unset elsewhere.
    worker_slot: int | None = None
    worker_device: str | None = None
    worker_gpu_memory_fraction: float | None = None
    # Set by the launcher (gunicorn_conf.py) for its workers; None serves
    # metrics from this process alone.
    prometheus_multiproc_dir: str | None = None
    # Set by gunicorn_conf.py: a directory its workers share, where the first to
    # check the model's precision leaves its choice for the others.
    run_dir: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        _refuse_unknown(env)
        values: dict[str, Any] = {}
        for field_name, (var, parse) in _FIELDS.items():
            raw = env.get(var)
            if raw is not None and raw.strip() != "":
                values[field_name] = parse(var, raw)
        if "max_body_bytes" not in values:
            values["max_body_bytes"] = default_body_bytes(
                values.get("model", cls.model), values.get("max_image_pixels", cls.max_image_pixels)
            )
        settings = cls(**values)
        budget, timeout = settings.latency_budget_ms, settings.request_timeout_ms
        if budget is not None and budget > timeout:
            raise SettingsError(
                f"SERVE_LATENCY_BUDGET_MS must not exceed SERVE_REQUEST_TIMEOUT_MS ({timeout}), "
                f"got {budget}: a request admitted for longer than its timeout would end in a 504"
            )
        return settings

    @property
    def queue_limit(self) -> int:
        """Most items one worker may hold queued before it answers 503: a bound on memory, not on waits.

        Waits are bounded by admission (service.batching.admission). The
        default, 32,768 items (Infinity queues as many), holds sixteen requests
        of the largest size. A request larger than the limit is still taken
        when nothing else waits.
        """
        return self.max_queue if self.max_queue is not None else DEFAULT_QUEUE_ITEMS

    @property
    def linger_bytes(self) -> int:
        """Most bytes of a refused body read before its connection closes: 16 MiB or twice the body limit."""
        return max(LINGER_MIN_BYTES, 2 * self.max_body_bytes)

    @property
    def models(self) -> tuple[ModelEntry, ...]:
        """The models SERVE_MODEL lists, the default first (service.config.model_list)."""
        return parse_models(self.model)

    def for_model(self, entry: ModelEntry) -> Settings:
        """These settings for one of the models: ``model`` is its spec alone."""
        return dataclasses.replace(self, model=entry.spec)

    @property
    def documents_limit(self) -> int:
        """Most documents in one rerank request: SERVE_MAX_DOCUMENTS_PER_REQUEST, within the items' limit."""
        return min(self.max_documents_per_request, self.max_items_per_request)

    @property
    def latency_budget_s(self) -> float:
        """How long after its arrival a request may still be answered; past it, 503 at once.

        Infinite when SERVE_LATENCY_BUDGET_MS is 0: then only the queue bound sheds.
        """
        if self.latency_budget_ms == 0:
            return math.inf
        if self.latency_budget_ms is not None:
            return self.latency_budget_ms / 1000
        # A fifteenth of the request timeout (2 s of the default 30 s), at least
        # half a second and never past the timeout: long enough to ride out a
        # burst, short enough that nobody waits half a minute for an answer and
        # that a backlog is gone within seconds of an overload ending.
        timeout_s = self.request_timeout_ms / 1000
        return min(timeout_s, max(0.5, timeout_s / 15))

    @property
    def gpu_indices(self) -> tuple[int, ...] | None:
        """The GPUs ``SERVE_DEVICES`` lists, or None for auto, cpu and cuda."""
        if self.devices in DEVICE_MODES:
            return None
        return tuple(int(part.partition(":")[2]) for part in self.devices.split(","))

    @property
    def stall_limit_s(self) -> float:
        """How long one batch may run before the watchdog declares the batch thread stuck."""
        if self.stall_timeout_ms is not None:
            return self.stall_timeout_ms / 1000
        # Twice the request timeout: after one, every caller of the batch has had
        # its 504, so a batch still running after two is not merely slow. At least
        # 10 s, so that a short client deadline never makes a slow model look hung.
        return max(10.0, 2 * self.request_timeout_ms / 1000)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


# field name -> (environment variable, parser). docs/settings.md has a row for each, with its
# default and range; tests/unit/test_settings_docs.py keeps the two in step.
_FIELDS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "model": ("SERVE_MODEL", _model_list),
    "max_batch_size": ("SERVE_MAX_BATCH_SIZE", _Integer(1, 4096)),
    "max_batch_delay_ms": ("SERVE_MAX_BATCH_DELAY_MS", _Number(0, 10_000)),
    "batch_gather": ("SERVE_BATCH_GATHER", _Choice(BATCH_GATHER_POLICIES)),
    "max_batch_tokens": ("SERVE_MAX_BATCH_TOKENS", _Integer(1, 1 << 24)),
    "token_memory_kb": ("SERVE_TOKEN_MEMORY_KB", _Number(0.001, 1 << 20)),
    "max_items_per_request": ("SERVE_MAX_ITEMS_PER_REQUEST", _Integer(1, 65_536)),
    "max_documents_per_request": ("SERVE_MAX_DOCUMENTS_PER_REQUEST", _Integer(1, 65_536)),
    "max_body_bytes": ("SERVE_MAX_BODY_BYTES", _Integer(1024, _MAX_BODY_BYTES)),
    "max_image_pixels": ("SERVE_MAX_IMAGE_PIXELS", _Integer(1, PILLOW_MAX_IMAGE_PIXELS)),
    "image_layout": ("SERVE_IMAGE_LAYOUT", _Choice(LAYOUTS)),
    "max_queue": ("SERVE_MAX_QUEUE", _Integer(1, 1_000_000)),
    "linger_ms": ("SERVE_LINGER_MS", _Integer(0, 60_000)),
    "request_timeout_ms": ("SERVE_REQUEST_TIMEOUT_MS", _Integer(1, 3_600_000)),
    "latency_budget_ms": ("SERVE_LATENCY_BUDGET_MS", _Integer(0, 3_600_000)),
    "stall_timeout_ms": ("SERVE_STALL_TIMEOUT_MS", _Integer(100, 86_400_000)),
    "precision": ("SERVE_PRECISION", _Choice(PRECISIONS)),
    "precision_min_cosine": ("SERVE_PRECISION_MIN_COSINE", _Number(0, 1)),
    "precision_median_cosine": ("SERVE_PRECISION_MEDIAN_COSINE", _Number(0, 1)),
    "precision_min_top1": ("SERVE_PRECISION_MIN_TOP1", _Number(0, 1)),
    "precision_max_score_diff": ("SERVE_PRECISION_MAX_SCORE_DIFF", _Number(0, 1000)),
    "mlp_width": ("SERVE_MLP_WIDTH", _Integer(1, 65_536)),
    "mlp_depth": ("SERVE_MLP_DEPTH", _Integer(1, 1024)),
    "mlp_seed": ("SERVE_MLP_SEED", _Integer(0, 2**31 - 1)),
    "item_shape": ("SERVE_ITEM_SHAPE", _shape),
    "bind": ("SERVE_BIND", _bind),
    "forwarded_allow_ips": ("SERVE_FORWARDED_ALLOW_IPS", _networks),
    "workers": ("SERVE_WORKERS", _Integer(1, 1024)),
    "threads": ("SERVE_THREADS", _Integer(1, 10_000)),
    "torch_threads": ("SERVE_TORCH_THREADS", _Integer(1, 1024)),
    "worker_class": ("SERVE_WORKER_CLASS", _Choice(WORKER_CLASSES)),
    "worker_connections": ("SERVE_WORKER_CONNECTIONS", _Integer(1, 100_000)),
    "balance_connections": ("SERVE_BALANCE_CONNECTIONS", _switch),
    "share_weights": ("SERVE_SHARE_WEIGHTS", _switch),
    "hold_refused": ("SERVE_HOLD_REFUSED", _switch),
    "max_requests": ("SERVE_MAX_REQUESTS", _Integer(0, 1 << 31)),
    "onednn_cache": ("SERVE_ONEDNN_CACHE", _Integer(0, 1 << 20)),
    "allocator": ("SERVE_ALLOCATOR", _Choice(ALLOCATORS)),
    "devices": ("SERVE_DEVICES", _devices),
    "workers_per_device": ("SERVE_WORKERS_PER_DEVICE", _Integer(1, 256)),
    "gpu_memory_per_worker_mb": ("SERVE_GPU_MEMORY_PER_WORKER_MB", _Integer(1, 16_777_216)),
    "gpu_memory_fraction": ("SERVE_GPU_MEMORY_FRACTION", _Number(0.01, 1)),
    "gpu_context_mb": ("SERVE_GPU_CONTEXT_MB", _Integer(0, 65_536)),
    "log_format": ("SERVE_LOG_FORMAT", _Choice(LOG_FORMATS)),
    "api_token": ("SERVE_API_TOKEN", _text),
    "worker_slot": ("SERVE_WORKER_SLOT", _Integer(0, 100_000)),
    "worker_device": ("SERVE_WORKER_DEVICE", _device),
    "worker_gpu_memory_fraction": ("SERVE_WORKER_GPU_MEMORY_FRACTION", _Number(0.001, 1)),
    # prometheus_client's own variable: it must be in the environment before
    # prometheus_client is imported, so it keeps its name.
    "prometheus_multiproc_dir": ("PROMETHEUS_MULTIPROC_DIR", _text),
    "run_dir": ("SERVE_RUN_DIR", _text),
}


_PREFIX = "SERVE_"


def _refuse_unknown(env: Mapping[str, str]) -> None:
    """A ``SERVE_*`` variable that is not a setting is a typo: refuse it rather than ignore it."""
    known = [var for var, _ in _FIELDS.values()]
    for name in sorted(env):
        if name.startswith(_PREFIX) and name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]}?" if close else "docs/settings.md lists them"
            raise SettingsError(f"{name} is not a setting; {hint}")


def cuda_visible_devices(environ: Mapping[str, str] | None = None) -> str | None:
    """CUDA's own ``CUDA_VISIBLE_DEVICES``, which limits the GPUs the service may plan on.

    Read here because this module is the one reader of the environment. Unlike a
    ``SERVE_*`` variable, an empty value means something: no GPU at all.
    """
    env = os.environ if environ is None else environ
    return env.get("CUDA_VISIBLE_DEVICES")

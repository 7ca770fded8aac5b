# design:
# - What a precision buys on a GPU, for scripts/bench/gpu_check.py: for each
#   precision in turn, scripts/bench/offline.py's measure runs `workers`
#   spawned processes on one GPU, each loading the model as a worker does,
#   and measures in them the offline limit (the model's predict on windows of
#   the texts, padded, or cut as the batcher's cost model cuts them) and then
#   the batcher without HTTP (the worker's own batcher fed by client threads),
#   as scripts/bench/bench.py measures it.
# - offline.py loads the model as it is on disk. To run it in a precision, the
#   processes load SERVE_MODEL=scripts.bench.gpu_speed:settled, a factory that
#   loads the directory and settles SERVE_PRECISION on it as a worker does
#   (service.models.precision_cache.settle, the start-up check included). A
#   factory takes no arguments, so the directory and the folder for its report
#   travel in the environment the spawned processes inherit (SPEED_MODEL_ENV,
#   SPEED_REPORTS_ENV); each process writes there what it settled and the
#   memory its weights hold, one JSON file per process.
# - GPU memory per process comes from NVML, sampled by one thread of the
#   parent every SAMPLE_S while the processes run: each one's last reading
#   (what it held as it finished: weights, cached activation blocks, its CUDA
#   context) and its peak (loading and the precision check included).

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.bench.gpu_report import Check, Report
from service.topology.inventory import Gpu

# The speed step, per precision: starting its processes, loading and settling the model,
# the cost model's calibration, the batcher's warm-up second and stopping them...
SPEED_SETUP_S = 20.0
# ...and its three measured spans (offline padded, offline cut by cost, batcher), each
# of the same seconds: at most SPEED_MOST_S, and never fewer than SPEED_LEAST_S.
SPEED_SPANS = 3
SPEED_MOST_S = 8.0
SPEED_LEAST_S = 2.0
# The speed step's texts: more words than any model here takes tokens, so each runs at
# its model's limit (256 tokens for MiniLM's pipeline and the BERT fixtures).
SPEED_WORDS = 512
SPEED_TEXTS = 64
SPEED_MODEL_ENV = "GPU_SPEED_MODEL"
SPEED_REPORTS_ENV = "GPU_SPEED_REPORTS"
FACTORY = "scripts.bench.gpu_speed:settled"
# Between two NVML readings of the processes' memory.
SAMPLE_S = 0.5
MIB = 1 << 20


@dataclass(frozen=True)
class SpeedRow:
    """One precision's figures on one GPU."""

    precision: str
    in_use: list[str]  # the precision each process settled, as its start-up check left it
    offline_items_per_s: float
    offline_strategy: str
    batcher_items_per_s: float
    weights_mb: list[float]  # each process's torch allocation once settled
    gpu_mb_last: list[float]  # NVML, per process: its last reading
    gpu_mb_peak: list[float]  # NVML, per process: its highest reading
    device_peak_mb: float | None  # NVML: the GPU's used memory at its highest
    token_limit: int | None  # the tokens each text ran as: the model's limit


# -- pure parts ---------------------------------------------------------------------


def long_texts(lines: list[str], words: int, count: int) -> list[str]:
    """``count`` texts of at least ``words`` words each, consecutive lines of ``lines`` joined.

    WordPiece gives each word one token or more, so a text of more words than
    a model's token limit runs at the limit, truncated.
    """
    texts: list[str] = []
    current: list[str] = []
    position = 0
    if not any(line.split() for line in lines):
        raise ValueError("no words in the lines given")
    while len(texts) < count:
        current.extend(lines[position % len(lines)].split())
        position += 1
        if len(current) >= words:
            texts.append(" ".join(current))
            current = []
    return texts


def best_offline(measured: Mapping[str, float]) -> tuple[str, float]:
    """The offline limit: the strategy with the most items/s, as scripts/bench/bench.py takes it."""
    strategy = max(measured, key=lambda name: measured[name])
    return strategy, measured[strategy]


def speed_seconds(left_s: float | None, precisions: int = 2) -> float | None:
    """Measured seconds per span of the speed step that fit in ``left_s``; None if too few would.

    Without a bound (``left_s`` None), SPEED_MOST_S.
    """
    if left_s is None:
        return SPEED_MOST_S
    per_span = (left_s / precisions - SPEED_SETUP_S) / SPEED_SPANS
    if per_span < SPEED_LEAST_S:
        return None
    return min(SPEED_MOST_S, per_span)


def speed_table(rows: list[SpeedRow]) -> str:
    """The speed step's rows as markdown, the first the reference of "vs first"."""
    base = rows[0]
    lines = [
        "| precision | in use | offline items/s | vs first | batcher without HTTP items/s "
        "| batcher / offline | weights MiB per process | GPU MiB per process, last / peak "
        "| GPU used at most MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    for row in rows:
        memory = ", ".join(
            f"{last:.0f} / {peak:.0f}" for last, peak in zip(row.gpu_mb_last, row.gpu_mb_peak, strict=True)
        )
        device = "-" if row.device_peak_mb is None else f"{row.device_peak_mb:.0f}"
        lines.append(
            f"| {row.precision} | {', '.join(sorted(set(row.in_use))) or '-'} | "
            f"{row.offline_items_per_s:.0f} | {row.offline_items_per_s / base.offline_items_per_s:.2f}x | "
            f"{row.batcher_items_per_s:.0f} | {row.batcher_items_per_s / row.offline_items_per_s:.2f}x | "
            f"{', '.join(f'{mb:.0f}' for mb in row.weights_mb) or '-'} | {memory or 'not listed by NVML'} | "
            f"{device} |"
        )
    return "\n".join(lines)


def judge_speed(rows: list[SpeedRow], need: float = 0.9) -> list[Check]:
    """In each precision the batcher within ``need`` of offline; float16 in use, faster and smaller."""
    checks = []
    for row in rows:
        ratio = row.batcher_items_per_s / row.offline_items_per_s
        checks.append(
            Check(
                f"{row.precision}: batcher without HTTP >= {need:g} x offline",
                ratio >= need,
                f"{row.batcher_items_per_s:.0f} / {row.offline_items_per_s:.0f} items/s = {ratio:.2f} x",
            )
        )
    by = {row.precision: row for row in rows}
    full, half = by.get("float32"), by.get("float16")
    if full is None or half is None:
        return checks
    speed = half.offline_items_per_s / full.offline_items_per_s
    in_use = ", ".join(sorted(set(half.in_use))) or "unknown"
    detail = f"in use: {in_use}; {speed:.2f}x float32's offline items/s"
    ok = set(half.in_use) == {"float16"} and speed > 1
    if half.weights_mb and full.weights_mb:
        held, held_full = max(half.weights_mb), max(full.weights_mb)
        detail += f"; weights {held:.0f} against {held_full:.0f} MiB a process"
        ok = ok and held < held_full
    checks.append(Check("float16 against float32: faster and smaller", ok, detail))
    return checks


# -- in each measuring process ---------------------------------------------------------------


def settled() -> Any:
    """SERVE_MODEL's factory: the directory in GPU_SPEED_MODEL, loaded and settled as a worker does."""
    import torch

    from service.config.settings import Settings
    from service.models import load_model
    from service.models.base import task_of
    from service.models.device import select_device
    from service.models.precision_cache import settle

    # SERVE_PRECISION, the floor and the rest, as the parent set them for this precision.
    settings = Settings.from_env().replace(model=os.environ[SPEED_MODEL_ENV], run_dir=None)
    device = select_device()
    model = load_model(settings, device)
    outcome = settle(model, task_of(model), settings, device)
    cuda = device.startswith("cuda")
    report = {
        "outcome": outcome.describe(),
        "weights_mb": torch.cuda.memory_allocated() / MIB if cuda else None,
        # The model's token limit: what a text longer than any it takes runs as.
        "token_limit": model.item_size(model.prepare(" ".join(["word"] * 2000))),
    }
    Path(os.environ[SPEED_REPORTS_ENV], f"{os.getpid()}.json").write_text(json.dumps(report))
    return model


# -- in the parent -------------------------------------------------------------------------


@dataclass
class GpuMemory:
    """NVML's readings of the compute processes on one GPU, taken every SAMPLE_S by a thread."""

    uuid: str
    last_mb: dict[int, float] = field(default_factory=dict)
    peak_mb: dict[int, float] = field(default_factory=dict)
    device_peak_mb: float | None = None

    @contextlib.contextmanager
    def sampling(self) -> Iterator[GpuMemory]:
        """Readings while inside; none where NVML cannot read the GPU, and the report says so."""
        import pynvml

        handle = self._open(pynvml)
        if handle is None:
            yield self
            return
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(SAMPLE_S):  # a reading every SAMPLE_S: there is nothing to wait on
                try:
                    self._read(pynvml, handle)
                except pynvml.NVMLError:
                    continue  # a process that exits between listing and reading

        thread = threading.Thread(target=sample, name="nvml-sampler", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            pynvml.nvmlShutdown()

    def _open(self, pynvml: Any) -> Any:
        """NVML's handle on the GPU, NVML left open; None where it cannot be had."""
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            return None
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(self.uuid)
        except pynvml.NVMLError:
            pynvml.nvmlShutdown()
            return None

    def _read(self, pynvml: Any, handle: Any) -> None:
        used = pynvml.nvmlDeviceGetMemoryInfo(handle).used / MIB
        self.device_peak_mb = max(self.device_peak_mb or 0.0, used)
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.usedGpuMemory is None:  # NVML may withhold it (some containers)
                continue
            pid, mb = int(process.pid), process.usedGpuMemory / MIB
            self.last_mb[pid] = mb
            self.peak_mb[pid] = max(self.peak_mb.get(pid, 0.0), mb)


@contextlib.contextmanager
def environment(changes: Mapping[str, str]) -> Iterator[None]:
    """``changes`` in os.environ while inside: what processes spawned there inherit."""
    before = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def measure_precision(
    model: str, precision: str, *, gpu_uuid: str, workers: int, clients: int, seconds: float, texts: list[str]
) -> SpeedRow:
    """``workers`` processes on the GPU ``gpu_uuid``, the model in ``precision``: offline, then batcher."""
    from scripts.bench.offline import Split, Strategy, measure
    from service.config.settings import Settings
    from service.topology.inventory import read_inventory

    cores = read_inventory().usable_cores
    with tempfile.TemporaryDirectory(prefix="gpu-speed-") as reports:
        changes = {
            "CUDA_VISIBLE_DEVICES": gpu_uuid,
            "SERVE_MODEL": FACTORY,
            "SERVE_PRECISION": precision,
            SPEED_MODEL_ENV: model,
            SPEED_REPORTS_ENV: reports,
        }
        with environment(changes):
            settings = Settings.from_env()
            window = settings.max_batch_size
            strategies = [
                Strategy(window),
                Strategy(window, cost=True),
                Strategy(window, clients=max(1, clients // workers)),
            ]
            with GpuMemory(gpu_uuid).sampling() as memory:
                found = measure(
                    settings,
                    Split(workers, max(1, cores // workers)),
                    [window],
                    seconds=seconds,
                    corpus=texts,
                    strategies=strategies,
                )
        settled_in = [json.loads(path.read_text()) for path in sorted(Path(reports).glob("*.json"))]
    *offline, batcher = found
    strategy, limit = best_offline({m.strategy: m.items_per_s for m in offline})
    return SpeedRow(
        precision=precision,
        in_use=[report["outcome"]["in_use"] for report in settled_in],
        offline_items_per_s=limit,
        offline_strategy=strategy,
        batcher_items_per_s=batcher.items_per_s,
        weights_mb=[report["weights_mb"] for report in settled_in if report["weights_mb"] is not None],
        gpu_mb_last=[memory.last_mb[pid] for pid in sorted(memory.last_mb)],
        gpu_mb_peak=[memory.peak_mb[pid] for pid in sorted(memory.last_mb)],
        device_peak_mb=memory.device_peak_mb,
        token_limit=max((int(report["token_limit"]) for report in settled_in), default=None),
    )


def speed_step(report: Report, model: str, gpu: Gpu, *, workers: int, clients: int, seconds: float) -> None:
    """float32, then float16: the offline limit and the batcher without HTTP on ``gpu``, and GPU memory."""
    from scripts.bench.precision import corpus

    texts = long_texts(corpus(), SPEED_WORDS, SPEED_TEXTS)
    rows = [
        measure_precision(
            model,
            precision,
            gpu_uuid=gpu.uuid,
            workers=workers,
            clients=clients,
            seconds=seconds,
            texts=texts,
        )
        for precision in ("float32", "float16")
    ]
    report.add(
        f"Speed on {gpu.name}, model `{model}`",
        f"{workers} processes on the GPU, each loading the model as a worker does and settling the "
        f"precision (its start-up check included); {len(texts)} texts of the corpus of {SPEED_WORDS} words "
        f"or more, each running as {rows[0].token_limit or 'its model limit in'} tokens; {seconds:.1f} s "
        f"per span; the batcher fed by {clients} client threads in all. Offline: the best of windows of "
        f"SERVE_MAX_BATCH_SIZE padded and cut by the batcher's cost model ({rows[0].offline_strategy} won "
        "in float32). GPU memory per process from NVML: its last reading, as it finished, and its peak "
        "(loading and the precision check included).\n\n" + speed_table(rows),
    )
    report.extend(judge_speed(rows))

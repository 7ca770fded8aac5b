#!/usr/bin/env python3
"""Check the GPU paths on a host with NVIDIA GPUs, and print a markdown report.

    .venv/bin/python scripts/bench/gpu_check.py                  # every GPU, default model
    .venv/bin/python scripts/bench/gpu_check.py --out gpu-report.md --speed-model DIR --seconds 8

On a GPU host that reaches no package registry, scripts/bench/gpu_run.py runs it in one
command within 5 minutes, from what scripts/bench/gpu_pack.py prepared beforehand.

In order, each step on the GPUs the inventory shows (``CUDA_VISIBLE_DEVICES`` narrows them):

1. the inventory through NVML (service.topology.inventory) and the plan gunicorn will apply;
2. the model's activation memory per padded token (``SERVE_TOKEN_MEMORY_KB``): the peak of
   ``torch.cuda.max_memory_allocated`` over a few batch shapes, in a spawned process, in the
   precision the workers settle;
3. gunicorn with 2 or more workers per GPU (more if needed, so that one call of the largest
   batch the settings allow outgrows a worker's share): each worker's /info against the plan
   (slot, device, memory fraction), its GPU by UUID against NVML's list of processes, then in
   ``--overruns`` workers (default: each) a naive request past its share, which must fail
   alone with the service's 503 while that worker and every other one keeps serving;
4. exactness, for a text model, on the first GPU: float16 against float32, the figures of the
   check the service runs at start and the same measures over the project's corpus
   (scripts/bench/precision.py); float16 must be kept and hold less memory;
5. speed on the first GPU, on ``--speed-model`` (default: the model), texts longer than its
   token limit: in float32, then in float16, the offline limit against the batcher without
   HTTP in ``--workers-per-device`` processes, as scripts/bench/bench.py measures them
   (scripts/bench/gpu_speed.py), and each process's GPU memory; float16 must be faster and
   smaller, and the batcher reach 0.9 x the offline limit.

A step that raises is reported as failed and the next one runs. With ``--deadline S`` no step
starts that would not end within S seconds of the start: it is reported as not verified, and
the speed step's measured seconds shrink to fit. With ``--out`` the report is rewritten after
every step, so that a run stopped from outside leaves what it reached.

Exits 0 when every check passes, 1 when one fails, 2 when there is no GPU (one line says so;
``--out`` gets a report that says so too) or the settings cannot be used.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.gpu_report import Check, Report, format_report  # noqa: E402
from scripts.bench.gpu_speed import SPEED_MOST_S, environment, speed_seconds, speed_step  # noqa: E402
from service.config.settings import Settings, cuda_visible_devices  # noqa: E402
from service.errors import SettingsError  # noqa: E402
from service.topology.inventory import Gpu, Inventory, read_inventory  # noqa: E402
from service.topology.plan import Plan, plan  # noqa: E402
from service.topology.table import render  # noqa: E402

NO_GPU_EXIT = 2
# The batch shapes (rows, tokens per row) the token memory is measured on: short and long
# rows, small and large batches, so that a cost that does not grow with tokens shows up.
SHAPES = ((8, 64), (32, 128), (64, 256), (256, 256))
# Most items one request may carry (SERVE_MAX_ITEMS_PER_REQUEST's upper bound): the largest
# single model call the naive route can be made to run.
MAX_ITEMS = 4096
# An overrun asks for this many times a worker's share, so that rounding in the token
# memory or the allocator's block sizes cannot make it fit.
OVERRUN_FACTOR = 1.5
# A planned fraction and the one a worker reports may differ by this: the master plans
# from its own NVML reading, taken moments after this script's.
FRACTION_TOLERANCE = 0.002
MIB = 1 << 20
# Seconds each step takes at most on one H100-class GPU host with 16 cores, spawned
# processes' imports of torch included. Estimates, not yet measured there: each report
# gives the time every step took. A step is not started with less than this left.
NEEDS_S = {"token memory": 25.0, "workers": 60.0, "exactness": 30.0}


class CheckError(RuntimeError):
    """The service did not start, or what a worker answered cannot be read as its /info."""


@dataclass(frozen=True)
class WorkerSeen:
    """A worker as its /info describes it."""

    pid: int
    slot: int
    device: str
    fraction: float | None


@dataclass(frozen=True)
class Sample:
    """One measured model call: its shape and the allocator's memory before and at its peak."""

    rows: int
    padded_tokens: int
    base_bytes: int
    peak_bytes: int

    @property
    def kb_per_token(self) -> float:
        return (self.peak_bytes - self.base_bytes) / 1024 / self.padded_tokens


# -- pure parts ---------------------------------------------------------------------


def parse_info(info: Mapping[str, Any]) -> WorkerSeen:
    """The worker in a /info answer; CheckError naming the field when it is not one of a planned worker."""
    try:
        pid, slot, device, fraction = info["pid"], info["slot"], info["device"], info["gpu_memory_fraction"]
    except KeyError as exc:
        raise CheckError(f"/info has no {exc.args[0]!r} field; is this the service's /info?") from None
    if not isinstance(pid, int) or not isinstance(slot, int):
        raise CheckError(
            f"/info gave pid {pid!r} and slot {slot!r}; a worker started by gunicorn_conf.py reports "
            "both as integers (is the service running under gunicorn with its config?)"
        )
    if fraction is not None and not isinstance(fraction, (int, float)):
        raise CheckError(f"/info gave gpu_memory_fraction {fraction!r}; expected a number or null")
    return WorkerSeen(pid, slot, str(device), None if fraction is None else float(fraction))


def compare_workers(expected: Plan, seen: list[WorkerSeen], gpu_of_pid: Mapping[int, str]) -> list[Check]:
    """Each planned slot against the worker that holds it: device, memory fraction, GPU by UUID.

    ``gpu_of_pid`` is NVML's list of compute processes, pid to GPU UUID. NVML
    reports pids of the host's pid namespace; inside a container they match no
    worker, and the UUID check is then reported as not verifiable.
    """
    by_slot = {w.slot: w for w in seen}
    namespaced = bool(seen) and not any(w.pid in gpu_of_pid for w in seen)
    checks = []
    for planned in expected.workers:
        name = f"slot {planned.slot}"
        worker = by_slot.get(planned.slot)
        if worker is None:
            checks.append(Check(name, False, f"no worker answered for slot {planned.slot}"))
            continue
        problems = []
        if worker.device != planned.device:
            problems.append(f"device {worker.device}, planned {planned.device}")
        if planned.gpu_memory_fraction is None:
            problems.append("the plan puts this slot on the CPU, so there is no GPU share to check")
        elif worker.fraction is None:
            problems.append(f"no memory fraction, planned {planned.gpu_memory_fraction:.3f}")
        elif abs(worker.fraction - planned.gpu_memory_fraction) > FRACTION_TOLERANCE:
            problems.append(
                f"memory fraction {worker.fraction:.3f}, planned {planned.gpu_memory_fraction:.3f}"
            )
        if problems:
            checks.append(Check(name, False, f"pid {worker.pid}: " + "; ".join(problems)))
            continue
        facts = f"pid {worker.pid} on {worker.device}, fraction {worker.fraction:.3f}"
        uuid = gpu_of_pid.get(worker.pid)
        if namespaced:
            checks.append(Check(name, None, f"{facts}; NVML lists no worker's pid (another pid namespace?)"))
        elif uuid != planned.gpu_uuid:
            checks.append(Check(name, False, f"{facts}; NVML has it on {uuid}, planned {planned.gpu_uuid}"))
        else:
            checks.append(Check(name, True, f"{facts}, NVML: {uuid}"))
    return checks


def token_memory_kb(samples: list[Sample]) -> float:
    """SERVE_TOKEN_MEMORY_KB from measured calls: the largest per token, since the plan needs a bound."""
    if not samples:
        raise ValueError("no measured call: the token memory needs at least one")
    return max(s.kb_per_token for s in samples)


def overrun_rows(
    share_mb: int, kb_per_token: float, item_tokens: int, max_items: int = MAX_ITEMS
) -> int | None:
    """Rows of ``item_tokens`` whose one call needs OVERRUN_FACTOR x the share; None past ``max_items``."""
    rows = math.ceil(OVERRUN_FACTOR * share_mb * 1024 / (kb_per_token * item_tokens))
    return rows if rows <= max_items else None


def workers_for_overrun(
    gpu: Gpu, context_mb: int, largest_call_mb: float, at_least: int, at_most: int
) -> int | None:
    """The fewest workers per GPU, from ``at_least``, whose share one call of ``largest_call_mb`` outgrows.

    Mirrors the plan's rule (free MiB / workers - context); None if even
    ``at_most`` workers leave each a share the largest call fits in.
    """
    for workers in range(at_least, at_most + 1):
        share_mb = gpu.free_mb / workers - context_mb
        if 0 < share_mb * OVERRUN_FACTOR <= largest_call_mb:
            return workers
    return None


def judge_overrun(
    *,
    status: int,
    error: str,
    need_mb: float,
    share_mb: int,
    free_mb: int,
    pid_before: int,
    pid_after: int | None,
    others_ok: bool,
    workers_before: list[int],
    workers_after: list[int],
) -> Check:
    """Did a call past the share fail as the service's own 503, alone, with no worker replaced?

    An out-of-memory error proves the cap only if the GPU itself had room for
    the call: the call needs more than the share and less than what was free.
    """
    facts = f"pid {pid_before}: call of {need_mb:.0f} MiB, share {share_mb} MiB, GPU free {free_mb} MiB"
    failures = []
    # The message service.outputs.client_error gives a torch.cuda.OutOfMemoryError.
    if status != 503 or "GPU ran out of memory" not in error:
        failures.append(f"answered {status} ({error!r}), expected the service's 503 for a GPU out of memory")
    if pid_after != pid_before:
        failures.append(f"the next request on its connection was answered by {pid_after}")
    if not others_ok:
        failures.append("another worker failed a request right after")
    if workers_after != workers_before:
        failures.append(f"the master's workers changed from {workers_before} to {workers_after}")
    if failures:
        return Check("overrun", False, facts + "; " + "; ".join(failures))
    if need_mb >= free_mb:
        return Check("overrun", None, facts + "; failed alone, but the GPU had no room for it either")
    return Check("overrun", True, facts + "; 503 alone, worker kept serving")


def samples_table(samples: list[Sample]) -> str:
    lines = [
        "| rows | padded tokens | peak above base MiB | KiB per token |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for s in samples:
        above_mb = (s.peak_bytes - s.base_bytes) / MIB
        lines.append(f"| {s.rows} | {s.padded_tokens} | {above_mb:.1f} | {s.kb_per_token:.2f} |")
    return "\n".join(lines)


# -- the shell: NVML, a spawned measuring process, gunicorn, HTTP ----------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    env = dict(os.environ)
    if args.model:
        env["SERVE_MODEL"] = args.model
    out = Path(args.out) if args.out else None
    inventory = read_inventory(cuda_visible_devices(env))
    if not inventory.gpus:
        why = inventory.gpu_note or "no GPU"
        if out is not None:
            no_gpu = Check("a GPU", None, f"no NVIDIA GPU here ({why}); nothing was checked")
            out.write_text(format_report("GPU check: no GPU", [], [no_gpu]))
        print(f"gpu_check: no NVIDIA GPU here ({why}); nothing to check", file=sys.stderr)
        return NO_GPU_EXIT
    gpus = ", ".join(sorted({g.name for g in inventory.gpus}))
    report = Report(
        f"GPU check on {len(inventory.gpus)} x {gpus}",
        out=out,
        deadline=None if args.deadline is None else started + args.deadline,
    )
    try:
        settings = Settings.from_env(env)
        if settings.devices == "cpu":
            raise SettingsError("SERVE_DEVICES=cpu plans no GPU worker; unset it to check the GPUs")
        run_checks(args, env, settings, inventory, report)
    except SettingsError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return NO_GPU_EXIT
    print(report.text())
    if out is not None:
        print(f"wrote {out}")
    return 1 if report.failed() else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="SERVE_MODEL (default: the environment's, else the service's default)")
    p.add_argument(
        "--workers-per-device",
        type=int,
        default=2,
        help="workers per GPU for the plan shown and the speed step, 2 or more",
    )
    p.add_argument(
        "--overruns", type=int, help="workers sent a request past their share (default: every worker)"
    )
    p.add_argument("--speed-model", help="SERVE_MODEL of the speed step (default: the model)")
    p.add_argument("--clients", type=int, default=64, help="the batcher's client threads, over all processes")
    p.add_argument(
        "--seconds",
        type=float,
        help=f"measured seconds per span of the speed step (default {SPEED_MOST_S:g}, "
        "less if --deadline leaves less)",
    )
    p.add_argument("--deadline", type=float, help="seconds from the start by which every step must end")
    p.add_argument("--out", help="also write the report to this file, after every step")
    args = p.parse_args(argv)
    if args.workers_per_device < 2:
        p.error(f"--workers-per-device must be 2 or more, got {args.workers_per_device}")
    if args.overruns is not None and args.overruns < 1:
        p.error(f"--overruns must be 1 or more, got {args.overruns}")
    return args


def run_checks(
    args: argparse.Namespace, env: dict[str, str], settings: Settings, inventory: Inventory, report: Report
) -> None:
    first = inventory.gpus[0]
    report.add("Command", f"`{' '.join(['python', *sys.argv])}`")
    served = {**env, "SERVE_WORKERS_PER_DEVICE": str(args.workers_per_device)}
    report.add(
        f"Plan with {args.workers_per_device} workers per GPU",
        "```\n" + render(plan(Settings.from_env(served), inventory)) + "\n```",
    )
    measured = report.step(
        "token memory", NEEDS_S["token memory"], lambda: token_memory_step(report, settings.model, first)
    )
    if measured is None:
        report.extend([Check("workers", None, "not reached: the step needs the token memory")])
    else:
        report.step(
            "workers",
            NEEDS_S["workers"],
            lambda: workers_step(report, args, env, settings, inventory, *measured),
        )
    report.step("exactness", NEEDS_S["exactness"], lambda: exactness_step(report, settings.model, first))
    seconds = args.seconds or speed_seconds(report.left())
    if seconds is None:
        left = max(0.0, report.left() or 0.0)
        report.extend([Check("speed", None, f"not reached: {left:.0f} s left, too few to measure in")])
        return
    report.step(
        "speed",
        0,
        lambda: speed_step(
            report,
            args.speed_model or settings.model,
            first,
            workers=args.workers_per_device,
            clients=args.clients,
            seconds=seconds,
        ),
    )


def token_memory_step(report: Report, model: str, gpu: Gpu) -> tuple[float, int]:
    """SERVE_TOKEN_MEMORY_KB measured in a spawned process on ``gpu``: it, and the longest item's tokens."""
    with visible(gpu.uuid):
        item_tokens, samples, device_name = _in_spawned_process(measure_token_memory, model)
    per_token = token_memory_kb(samples)
    report.add(
        "Token memory",
        f"{device_name}, model `{model}`: **SERVE_TOKEN_MEMORY_KB={per_token:.2f}** "
        f"(the largest of these calls; longest item {item_tokens} tokens)\n\n" + samples_table(samples),
    )
    return per_token, item_tokens


def workers_step(
    report: Report,
    args: argparse.Namespace,
    env: dict[str, str],
    settings: Settings,
    inventory: Inventory,
    per_token: float,
    item_tokens: int,
) -> None:
    """gunicorn with enough workers per GPU that the largest call outgrows a share: plan, UUIDs, overruns."""
    largest_mb = MAX_ITEMS * item_tokens * per_token / 1024
    workers = workers_for_overrun(
        inventory.gpus[0], settings.gpu_context_mb, largest_mb, args.workers_per_device, 64
    )
    checks = []
    if workers is None:
        checks.append(
            Check("overrun", None, f"one call of {largest_mb:.0f} MiB fits every share up to 64 workers")
        )
        workers = args.workers_per_device
    topology_env = {
        **env,
        "SERVE_WORKERS_PER_DEVICE": str(workers),
        "SERVE_MAX_ITEMS_PER_REQUEST": str(MAX_ITEMS),
        # A call's texts, each its model's longest item, travel in one body.
        "SERVE_MAX_BODY_BYTES": str(1 << 28),
        "SERVE_REQUEST_TIMEOUT_MS": "600000",
    }
    expected = plan(Settings.from_env(topology_env), inventory)
    overruns = 0 if checks else (args.overruns or len(expected.workers))
    left = report.left()
    text, topology_checks = check_topology(
        topology_env,
        expected,
        per_token,
        item_tokens,
        overruns=overruns,
        ready_timeout=600 if left is None else max(1.0, left),
    )
    report.add(f"Workers ({workers} per GPU)", "```\n" + render(expected) + "\n```\n\n" + text)
    report.extend(checks + topology_checks)


def exactness_step(report: Report, model: str, gpu: Gpu) -> None:
    with visible(gpu.uuid):
        rows = _in_spawned_process(compare_precisions, model)
    report.add(f"Exactness: float16 against float32 on {gpu.name}, model `{model}`", precision_table(rows))
    report.extend([judge_exactness(rows)])


def compare_precisions(model_spec: str) -> list[dict[str, Any]]:
    """In a spawned process: float32, then float16, each loaded and settled on the GPU as a worker does."""
    import torch

    from scripts.bench.precision import against_float32, corpus

    rows: list[dict[str, Any]] = []
    for precision, found in against_float32(model_spec, ["float16"], corpus(), 1, device="cuda"):
        rows.append(
            {
                "precision": precision,
                "in_use": found["outcome"]["in_use"],
                "weights_mb": found["weights_mb"],
                "exactness": found["exactness"],
                "check": found["outcome"].get("exactness") or found["outcome"].get("fallback") or {},
            }
        )
        torch.cuda.empty_cache()
    return rows


def precision_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| precision | in use | weights MiB | exactness on the corpus | the service's check at start |",
        "| --- | --- | ---: | --- | --- |",
    ]
    for row in rows:
        figures = ", ".join(f"{k} {v:.4f}" for k, v in row["exactness"].items()) or "-"
        lines.append(
            f"| {row['precision']} | {row['in_use']} | {row['weights_mb']:.0f} | {figures} | "
            f"{row['check'] or '-'} |"
        )
    return "\n".join(lines)


def judge_exactness(rows: list[dict[str, Any]]) -> Check:
    """float16 kept by the service's check at start, holding less memory than float32."""
    full, half = rows[0], rows[1]
    detail = (
        f"float16 {half['in_use']!r} in use, {half['weights_mb']:.0f} against {full['weights_mb']:.0f} MiB "
        f"of weights; at start: {half['check'] or '-'}"
    )
    ok = half["in_use"] == "float16" and half["weights_mb"] < full["weights_mb"]
    return Check("float16 kept by the start-up check", ok, detail)


@contextlib.contextmanager
def visible(uuid: str) -> Iterator[None]:
    """Processes spawned inside see this GPU alone, as a planned worker does."""
    with environment({"CUDA_VISIBLE_DEVICES": uuid}):
        yield


def _in_spawned_process(function: Any, *args: Any) -> Any:
    # Spawned, and gone before gunicorn starts: a CUDA context left in this process would
    # hold memory that the master's NVML reading would then count as used.
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def measure_token_memory(model_spec: str) -> tuple[int, list[Sample], str]:
    """In a spawned process: the model's longest item in tokens, a Sample per shape, the GPU's name."""
    import torch

    from service.models import describe, load_model

    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA device; install a CUDA build of torch")
    from service.models.base import task_of
    from service.models.precision_cache import settle

    model = load_model(Settings(model=model_spec), "cuda")
    # In the precision the workers settle (SERVE_PRECISION; float16 for a text model by default):
    # activations in float16 take half the memory.
    settings = Settings.from_env().replace(model=model_spec, run_dir=None)
    settle(model, task_of(model), settings, "cuda")
    size = getattr(model, "item_size", None)
    if size is None or describe(model)["item_kind"] != "text":
        raise SettingsError(
            f"SERVE_MODEL={model_spec!r} is not a text model with item sizes; token memory needs one"
        )
    # One token per word for the default model's tokenizer; the sizes below are the model's own count.
    longest = int(size(model.prepare(" ".join(["hello"] * 2000))))
    model.predict([model.prepare("warm up")])  # the first call's one-off allocations stay out of the peaks
    samples = []
    for rows, tokens in SHAPES:
        batch = [model.prepare(" ".join(["hello"] * max(1, min(tokens, longest) - 2)))] * rows
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model.predict(batch)
        torch.cuda.synchronize()
        samples.append(
            Sample(rows, rows * max(size(i) for i in batch), base, torch.cuda.max_memory_allocated())
        )
    return longest, samples, torch.cuda.get_device_name()


def check_topology(
    env: dict[str, str],
    expected: Plan,
    per_token: float,
    item_tokens: int,
    *,
    overruns: int,
    ready_timeout: float = 600,
) -> tuple[str, list[Check]]:
    """gunicorn on ``env``: each worker held on a connection and compared with ``expected``.

    The first ``overruns`` workers are then sent a call past their share, one at a time.
    """
    from scripts.common.launcher import LaunchError, serve

    try:
        with serve(env, ready_timeout=ready_timeout, all_workers=True, grace=60) as service:
            held = reach_workers("127.0.0.1", service.port, len(expected.workers))
            try:
                seen = [worker for worker, _ in held.values()]
                gpu_of_pid = gpu_processes()
                checks = compare_workers(expected, seen, gpu_of_pid)
                for pid in list(held)[:overruns]:
                    checks.append(overrun(expected, held, pid, per_token, item_tokens, service.workers))
            finally:
                for _, connection in held.values():
                    connection.close()
    except LaunchError as exc:
        raise CheckError(f"the service did not start: {exc}") from None
    lines = ["| slot | pid | device | memory fraction | GPU (NVML) |", "| ---: | ---: | --- | ---: | --- |"]
    for w in sorted(seen, key=lambda w: w.slot):
        lines.append(
            f"| {w.slot} | {w.pid} | {w.device} | {w.fraction} | {gpu_of_pid.get(w.pid, 'not listed')} |"
        )
    return "\n".join(lines), checks


def reach_workers(
    host: str, port: int, workers: int
) -> dict[int, tuple[WorkerSeen, http.client.HTTPConnection]]:
    """A kept-alive connection to each worker: a gthread worker keeps every request of its connections.

    Connections stay open while more are made, so that the service's
    connection balance (service.host.balance) steers the new ones to the
    workers that hold fewer.
    """
    held: dict[int, tuple[WorkerSeen, http.client.HTTPConnection]] = {}
    spare = []
    for _ in range(workers * 8):
        if len(held) == workers:
            break
        connection = http.client.HTTPConnection(host, port, timeout=600)
        _, info = call(connection, "GET", "/info")
        worker = parse_info(info)
        if worker.pid in held:
            spare.append(connection)
        else:
            held[worker.pid] = (worker, connection)
    for connection in spare:
        connection.close()
    if len(held) < workers:
        raise CheckError(f"reached {len(held)} of {workers} workers over {workers * 8} connections")
    return held


def call(connection: http.client.HTTPConnection, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    payload = None if body is None else json.dumps(body).encode()
    headers = {} if payload is None else {"Content-Type": "application/json"}
    connection.request(method, path, body=payload, headers=headers)
    response = connection.getresponse()
    return response.status, json.loads(response.read() or b"null")


def overrun(
    expected: Plan,
    held: dict[int, tuple[WorkerSeen, http.client.HTTPConnection]],
    pid: int,
    per_token: float,
    item_tokens: int,
    master_workers: Callable[[], list[int]],
) -> Check:
    """One naive call past ``pid``'s share; then that worker and every other one must still serve."""
    from service.topology.inventory import read_gpus

    worker, connection = held[pid]
    device = next(d for d in expected.devices if d.device == worker.device)
    rows = overrun_rows(device.allocator_mb, per_token, item_tokens)
    if rows is None:
        return Check(
            f"overrun slot {worker.slot}", None, f"no call of at most {MAX_ITEMS} items outgrows its share"
        )
    free_mb = next(g.free_mb for g in read_gpus()[0] if g.uuid == device.gpu.uuid)
    before = master_workers()
    text = " ".join(["hello"] * (item_tokens * 2))  # truncated by the model to its longest item
    status, answer = call(connection, "POST", "/predict/naive", {"inputs": [text] * rows})
    _, info = call(connection, "GET", "/info")
    others_ok = all(
        call(other, "POST", "/predict/naive", {"inputs": ["still serving"]})[0] == 200
        for other_pid, (_, other) in held.items()
        if other_pid != pid
    )
    check = judge_overrun(
        status=status,
        error=str((answer or {}).get("error", "")),
        need_mb=rows * item_tokens * per_token / 1024,
        share_mb=device.allocator_mb,
        free_mb=free_mb,
        pid_before=pid,
        pid_after=parse_info(info).pid,
        others_ok=others_ok,
        workers_before=before,
        workers_after=master_workers(),
    )
    return Check(f"overrun slot {worker.slot}", check.ok, check.detail)


def gpu_processes() -> dict[int, str]:
    """NVML's compute processes, pid to the UUID of their GPU; empty if NVML cannot list them."""
    import pynvml

    found: dict[int, str] = {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return found
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                found[int(process.pid)] = uuid
    except pynvml.NVMLError:
        return {}
    finally:
        pynvml.nvmlShutdown()
    return found


if __name__ == "__main__":
    sys.exit(main())

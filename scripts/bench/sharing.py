#!/usr/bin/env python3
"""One copy of the model per host against one per worker: memory, throughput and start-up time.

    .venv/bin/python scripts/fixtures/make_bert_base.py /tmp/bert-base-random
    .venv/bin/python scripts/bench/sharing.py --models minilm,/tmp/bert-base-random --workers 2,4

For each model and worker count, gunicorn is started with SERVE_SHARE_WEIGHTS on
and off in turn (on the same machine, one after the other, --repeat times) and:

- start-up: seconds from the launch until every planned worker has loaded its
  model and answers;
- throughput: --clients closed-loop clients on /predict/batched, each request
  1 to 8 lines of scripts/fixtures/corpus/mixed.txt (mixed-length real text),
  --seconds after a short warm-up; texts/s and p50;
- memory, read from /proc/PID/smaps_rollup after the traffic: the service's PSS
  (the master's and every worker's: shared pages counted once in all), each
  worker's private memory (what it alone holds, what grows with each worker
  added), and the RSS sum for comparison (shared pages counted once per process).

Prints a Markdown table with medians over the repeats and, per model and
worker count, shared against not: the service's PSS and the throughput as
ratios. Loopback only; bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.common.launcher import serve  # noqa: E402
from scripts.load.loadgen import run_load  # noqa: E402
from service.telemetry.metrics import memory_rollup  # noqa: E402

CORPUS = ROOT / "scripts" / "fixtures" / "corpus" / "mixed.txt"
PATH = "/predict/batched"
MIB = 1 << 20


def bodies(seed: int = 0, count: int = 400) -> tuple[list[bytes], float]:
    """Request bodies of 1 to 8 corpus lines each, and their mean number of texts."""
    lines = [line for line in CORPUS.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    sizes = [rng.randint(1, 8) for _ in range(count)]
    return [json.dumps({"inputs": rng.sample(lines, n)}).encode() for n in sizes], statistics.mean(sizes)


def memory(master: int, workers: list[int]) -> dict[str, float]:
    """The service's memory as it is: PSS of the master and workers, each worker's private memory, RSS."""
    rollups = {}
    for pid in [master, *workers]:
        rollup = memory_rollup(pid)
        if rollup is None:
            raise RuntimeError(f"cannot read /proc/{pid}/smaps_rollup")
        rollups[pid] = rollup
    worker_private = [rollups[pid].private / MIB for pid in workers]
    return {
        "service_pss_mib": sum(r.pss for r in rollups.values()) / MIB,
        "master_pss_mib": rollups[master].pss / MIB,
        "worker_private_mib_max": max(worker_private),
        "worker_private_mib_mean": statistics.mean(worker_private),
        "rss_sum_mib": sum(r.rss for r in rollups.values()) / MIB,
    }


def one(
    model: str, workers: int, share: str, load: list[bytes], per_body: float, args: Any
) -> dict[str, Any]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SERVE_")},
        "SERVE_MODEL": model,
        "SERVE_WORKERS": str(workers),
        "SERVE_SHARE_WEIGHTS": share,
    }
    started = time.monotonic()
    with serve(env, all_workers=True, ready_timeout=900) as service:
        startup = time.monotonic() - started
        run_load(service.url + PATH, load, args.clients, min(5.0, args.seconds))  # every worker's shapes
        result = run_load(service.url + PATH, load, args.clients, args.seconds)
        pids = service.workers()
        if len(pids) != workers:
            raise RuntimeError(f"{len(pids)} workers, not {workers}: one was replaced")
        figures = memory(service.process.pid, pids)
    return {
        "startup_s": startup,
        "texts_per_s": result.rps * per_body,
        "p50_ms": result.p50_ms,
        "errors": result.errors,
        **figures,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="minilm", help="comma-separated SERVE_MODEL values")
    p.add_argument("--workers", default="2,4", help="comma-separated worker counts")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json", help="write every run's numbers here")
    args = p.parse_args(argv)
    load, per_body = bodies()
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for model in args.models.split(","):
        for workers in (int(n) for n in args.workers.split(",")):
            for _ in range(args.repeat):
                for share in ("on", "off"):
                    found = one(model, workers, share, load, per_body, args)
                    runs.setdefault((model, workers, share), []).append(found)
                    print(f"{Path(model).name} workers={workers} share={share}: {found}", flush=True)

    def median(key: tuple[str, int, str], field: str) -> float:
        return statistics.median(run[field] for run in runs[key])

    print(
        "\n| model | workers | weights | start-up s | texts/s | p50 ms | service PSS MiB | "
        "worker private MiB (max) | master PSS MiB | RSS sum MiB | PSS vs one per worker | "
        "texts/s vs one per worker |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (model, workers, share), found in runs.items():
        key, other = (model, workers, share), (model, workers, "off")
        ratio_pss = median(key, "service_pss_mib") / median(other, "service_pss_mib")
        ratio_speed = median(key, "texts_per_s") / median(other, "texts_per_s")
        label = "one copy (on)" if share == "on" else "one per worker (off)"
        print(
            f"| {Path(model).name} | {workers} | {label} | {median(key, 'startup_s'):.1f} | "
            f"{median(key, 'texts_per_s'):.0f} | {median(key, 'p50_ms'):.0f} | "
            f"{median(key, 'service_pss_mib'):.0f} | {median(key, 'worker_private_mib_max'):.0f} | "
            f"{median(key, 'master_pss_mib'):.0f} | {median(key, 'rss_sum_mib'):.0f} | "
            f"{ratio_pss:.2f}x | {ratio_speed:.2f}x |"
        )
        if any(run["errors"] for run in found):
            print(f"  errors: {[run['errors'] for run in found]}")
    if args.json:
        Path(args.json).write_text(json.dumps([[*k, v] for k, v in runs.items()], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

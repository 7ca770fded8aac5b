#!/usr/bin/env python3
"""Measure the model's batch-latency curve offline and recommend SERVE_* settings for this machine.

    .venv/bin/python scripts/deploy/tune.py          # the default model (SERVE_MODEL), ~2 min
    .venv/bin/python scripts/deploy/tune.py --model mlp --max-batch 128 --seconds 2
    .venv/bin/python scripts/deploy/tune.py \
        --corpus scripts/fixtures/corpus/mixed.txt   # also SERVE_MAX_BATCH_TOKENS
    .venv/bin/python scripts/deploy/tune.py --precision   # also SERVE_PRECISION

For every workers x torch-threads split that fits the usable cores it runs full batches of
1, 2, 4, ... up to --max-batch in every worker process at once, with no HTTP, and reports
items/s and the median batch time. It recommends the split with the highest throughput, and
the smallest max batch size that reaches 95% of that split's best throughput: larger batches
add latency under load for almost no gain.

With --corpus (a text model's real traffic, one text per line) it also runs the corpus in windows
of SERVE_MAX_BATCH_SIZE texts, sorted by length and cut by the batcher's cost model, under padded-
token budgets from 256 up, on the best split, and recommends the smallest SERVE_MAX_BATCH_TOKENS
that reaches 95% of the best throughput: a smaller budget bounds each call's activation memory,
and on a GPU that is what each worker's memory share must hold (see docs/topology.md).

With --precision (an embeddings, classification or rerank model) it loads the model in each
precision this machine allows, settles it as a worker does (the exactness check, and for int8 the
choice of layers), and measures items/s and exactness against float32 on the corpus (the
project's own without --corpus; a rerank model gets queries of 8 of its lines); it recommends the
fastest precision the check kept that runs at least 1.1x float32.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.offline import Measurement, OfflineError, Split, Strategy, measure, splits_for
from service.config.settings import Settings
from service.errors import SettingsError
from service.topology.inventory import read_inventory

GOOD_ENOUGH = 0.95
TOKEN_BUDGETS = (256, 512, 1024, 2048, 4096, 8192, 16384)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="SERVE_MODEL to tune (default: the environment's)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--seconds", type=float, default=3, help="measured seconds per batch size")
    p.add_argument("--corpus", help="a text file, one text per line: also recommend SERVE_MAX_BATCH_TOKENS")
    p.add_argument(
        "--precision",
        action="store_true",
        help="also measure each precision this machine allows against float32, and recommend one",
    )
    args = p.parse_args()
    env = dict(os.environ)
    if args.model:
        env["SERVE_MODEL"] = args.model
    settings = Settings.from_env(env)
    cores = read_inventory().usable_cores  # CPU affinity and cgroup quota
    sizes = [1 << i for i in range(args.max_batch.bit_length()) if 1 << i <= args.max_batch]
    curves: dict[str, list[Measurement]] = {}
    print(f"model {settings.model}, {cores} usable cores, batch sizes {sizes}\n")
    print("| split (workers x torch threads) | batch | items/s | batch ms (median) |")
    print("| --- | ---: | ---: | ---: |")
    for split in splits_for(cores):
        try:
            curves[str(split)] = measure(settings, split, sizes, seconds=args.seconds)
        except OfflineError as exc:
            raise SystemExit(f"tune: {exc}") from None
        for m in curves[str(split)]:
            print(f"| {split} | {m.batch_size} | {m.items_per_s:.0f} | {m.batch_ms_median:.1f} |", flush=True)
    best_split, best_curve = max(curves.items(), key=lambda kv: max(m.items_per_s for m in kv[1]))
    peak = max(m.items_per_s for m in best_curve)
    batch = next(m for m in best_curve if m.items_per_s >= GOOD_ENOUGH * peak)
    workers, threads = best_split.split("x")
    print()
    for name, curve in curves.items():
        top = max(curve, key=lambda m: m.items_per_s)
        print(f"split {name}: peak {top.items_per_s:.0f} items/s at batch {top.batch_size}")
    print(f"\nRecommended for {settings.model} on this machine:")
    print(f"  SERVE_WORKERS={workers} SERVE_TORCH_THREADS={threads}    # {peak:.0f} items/s peak, best split")
    print(
        f"  SERVE_MAX_BATCH_SIZE={batch.batch_size}    # {batch.items_per_s:.0f} items/s, "
        f">= {GOOD_ENOUGH:.0%} of the peak at {batch.batch_ms_median:.1f} ms per batch"
    )
    if args.corpus:
        split = Split(int(workers), int(threads))
        # Windows as large as the service gathers under load (SERVE_MAX_BATCH_SIZE), not the
        # recommended size, which was measured on one repeated sample item.
        token_budget(settings, split, args.corpus, args.seconds)
    if args.precision:
        precision(settings, args.corpus)


# A reduced precision must pay this much over float32 offline to be worth its cost in exactness.
WORTH_IT = 1.1


def precision(settings: Settings, corpus_path: str | None) -> None:
    """Each precision this machine allows, checked as the service checks it, against float32 on the corpus."""
    from scripts.bench.precision import CORPUS, against_float32, rerank_pairs
    from service.config.model_spec import directory_task
    from service.models.precision import PRECISIONS, check_device

    texts = [line.strip() for line in Path(corpus_path or CORPUS).read_text().splitlines() if line.strip()]
    path = Path(settings.model)
    task = directory_task(path) if path.is_dir() else "embeddings"
    if task not in ("embeddings", "classification", "rerank"):
        raise SystemExit(f"tune: --precision measures embeddings, classification and rerank models; {task}?")
    items, group = rerank_pairs(texts, 8) if task == "rerank" else (texts, 1)
    device = "cuda:0" if read_inventory().gpus else "cpu"
    allowed = []
    for name in PRECISIONS[1:]:
        try:
            check_device(name, device)
        except SettingsError as exc:
            print(f"  {name}: not on this machine: {exc}")
            continue
        allowed.append(name)
    print(f"\nprecisions on {device}, over {len(items)} items:\n")
    print("| precision | in use | items/s | vs float32 | exactness on the corpus | check at start |")
    print("| --- | --- | ---: | ---: | --- | --- |")
    base = None
    best, best_speed = "float32", 1.0
    for name, found in against_float32(settings.model, allowed, items, group, device):
        base = base or found["items_per_s"]
        figures = found["exactness"]
        shown = ", ".join(f"{k} {v:.3f}" for k, v in figures.items()) or "-"
        outcome = found["outcome"]
        speed = found["items_per_s"] / base
        print(
            f"| {name} | {outcome['in_use']} | {found['items_per_s']:.0f} | {speed:.2f}x | {shown} | "
            f"{outcome.get('fallback') or outcome.get('exactness') or '-'} |",
            flush=True,
        )
        # The fastest the check kept, if it is worth its cost in exactness at all.
        if outcome["in_use"] == name != "float32" and speed >= WORTH_IT and speed > best_speed:
            best, best_speed = name, speed
    print(f"\n  SERVE_PRECISION={best}    # {best_speed:.2f}x float32 offline, kept by the exactness check")


def token_budget(settings: Settings, split: Split, corpus_path: str, seconds: float) -> None:
    """Throughput on the corpus under each token budget; the smallest within GOOD_ENOUGH of the best."""
    corpus = [line.strip() for line in Path(corpus_path).read_text().splitlines() if line.strip()]
    window = settings.max_batch_size
    strategies = [Strategy(window), *(Strategy(window, cost=True, max_tokens=b) for b in TOKEN_BUDGETS)]
    try:
        found = measure(settings, split, [], seconds=seconds, corpus=corpus, strategies=strategies)
    except OfflineError as exc:
        raise SystemExit(f"tune: {exc}") from None
    print(f"\n{corpus_path}, windows of {window}, split {split}:\n")
    print("| how the window runs | items/s | window ms (median) |")
    print("| --- | ---: | ---: |")
    for m in found:
        print(f"| {m.strategy} | {m.items_per_s:.0f} | {m.batch_ms_median:.1f} |")
    cut = [(budget, m) for budget, m in zip(TOKEN_BUDGETS, found[1:], strict=True)]
    best = max(m.items_per_s for _, m in cut)
    budget, chosen = next((b, m) for b, m in cut if m.items_per_s >= GOOD_ENOUGH * best)
    print(
        f"\n  SERVE_MAX_BATCH_TOKENS={budget}    # {chosen.items_per_s:.0f} items/s, >= {GOOD_ENOUGH:.0%} "
        f"of the best budget; padded as gathered: {found[0].items_per_s:.0f} items/s"
    )


if __name__ == "__main__":
    main()

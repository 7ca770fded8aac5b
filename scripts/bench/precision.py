#!/usr/bin/env python3
"""What a reduced precision buys and costs: throughput against float32, and exactness on a real corpus.

    .venv/bin/python scripts/bench/precision.py --precisions float32,int8 --clients 64 --seconds 20
    .venv/bin/python scripts/bench/precision.py --precisions float32,auto --texts 32 --clients 16
    .venv/bin/python scripts/bench/precision.py --model DIR --rerank 16 --precisions float32,int8

For each precision (float32 first, as the reference) in one run:

- exactness on every line of scripts/fixtures/corpus/mixed.txt, in this process,
  the model loaded and its precision settled as a worker settles it: for
  embeddings the smallest and median cosine with float32's; with --rerank N, a
  query (the opening words of one line) against N lines, the top document's
  agreement with float32 over every query and the largest score difference;
- the offline limit: texts/s of the model's predict on the corpus, in batches
  of 32 sorted by length, one process with every core;
- the batched route: gunicorn started with SERVE_PRECISION, --clients
  closed-loop clients each sending --texts corpus lines a request (one by
  default; a rerank of N lines with --rerank) to /predict/batched
  (/rerank/batched); items/s and p50;
- for embeddings, through the service: the first --served-check lines of the
  corpus (512 by default) sent to /v1/embeddings 32 a request, their smallest
  and median cosine against the float32 service's.
  The services run in turn, float32 and each other precision alternately,
  --repeat times; the table gives medians and each precision's ratio to float32.

Prints a Markdown table; --json writes the numbers. Loopback only; bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.common.launcher import serve  # noqa: E402
from scripts.load.loadgen import run_load  # noqa: E402

CORPUS = ROOT / "scripts" / "fixtures" / "corpus" / "mixed.txt"


def corpus() -> list[str]:
    return [line.strip() for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]


def rerank_pairs(texts: list[str], documents: int) -> tuple[list[list[str]], int]:
    """Queries (a line's opening words) each against ``documents`` lines, that line among them."""
    pairs = []
    for start in range(0, len(texts) - documents + 1, documents):
        window = texts[start : start + documents]
        query = " ".join(window[(start // documents) % documents].split()[:6])
        pairs.extend([query, document] for document in window)
    return pairs, documents


def offline(
    model_spec: str, precision: str, items: list[Any], group: int, device: str = "cpu"
) -> dict[str, Any]:
    """Load and settle the model in ``precision``; its outputs on ``items`` and its offline texts/s."""
    import torch

    from service.config.settings import Settings
    from service.models import load_model
    from service.models.base import task_of
    from service.models.precision import in_chunks
    from service.models.precision_cache import settle

    settings = Settings.from_env({**os.environ, "SERVE_MODEL": model_spec, "SERVE_PRECISION": precision})
    from service.runtime import bound_shapes

    torch.set_num_threads(os.cpu_count() or 1)  # one process, every core
    model = load_model(settings, device)
    outcome = settle(model, task_of(model), settings.replace(run_dir=None), device)
    bound_shapes(model, settings, device)  # as a worker pads its calls
    cuda = device.startswith("cuda")
    weights_mb = torch.cuda.memory_allocated() / 2**20 if cuda else None
    prepared = [model.prepare(item) for item in items]
    outputs = in_chunks(model, prepared, rows=32)  # a first pass, unmeasured: warms every shape
    order = sorted(range(len(prepared)), key=lambda i: model.item_size(prepared[i]))  # type: ignore[attr-defined]
    if cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    for start in range(0, len(order), 32):
        model.predict([prepared[i] for i in order[start : start + 32]])
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    return {
        "outcome": outcome.describe(),
        "outputs": outputs,
        "items_per_s": len(prepared) / seconds,
        "task": task_of(model),
        # On a GPU: what the loaded model holds there (its weights, in the precision in use).
        "weights_mb": weights_mb,
    }


def against_float32(
    model_spec: str, precisions: list[str], items: list[Any], group: int, device: str = "cpu"
) -> Iterator[tuple[str, dict[str, Any]]]:
    """``offline`` for each precision in turn, float32 first, each with its ``exactness`` against it."""
    from service.models.precision import compare

    reference = None
    for precision in ["float32", *(name for name in precisions if name != "float32")]:
        found = offline(model_spec, precision, items, group, device)
        if reference is None:
            reference = found["outputs"]
        found["exactness"] = (
            {} if precision == "float32" else compare(found["task"], reference, found["outputs"], group)
        )
        yield precision, found


def route(
    model_spec: str,
    precision: str,
    bodies: list[bytes],
    path: str,
    clients: int,
    seconds: float,
    served_check: list[str] = (),  # type: ignore[assignment]
) -> dict:
    env = {**os.environ, "SERVE_MODEL": model_spec, "SERVE_PRECISION": precision}
    with serve(env, all_workers=True, ready_timeout=600) as service:
        with urllib.request.urlopen(service.url + "/info") as answer:
            info = json.loads(answer.read())
        run_load(service.url + path, bodies, clients, min(5.0, seconds))  # warm every worker's shapes
        result = run_load(service.url + path, bodies, clients, seconds)
        name = info["model"]["name"]
        embedded = served_embeddings(service.url, name, served_check) if served_check else None
    return {
        "precision_in_use": info["precision"]["in_use"],
        "precision": info["precision"],
        "requests_per_s": result.rps,
        "p50_ms": result.p50_ms,
        "errors": result.errors,
        "embeddings": embedded,
    }


def served_embeddings(url: str, model: str, texts: list[str], per_request: int = 32) -> list[list[float]]:
    """``texts`` embedded by the service's /v1/embeddings, ``per_request`` at a time, in order."""
    out: list[list[float]] = []
    for start in range(0, len(texts), per_request):
        body = json.dumps({"input": texts[start : start + per_request], "model": model}).encode()
        request = urllib.request.Request(
            url + "/v1/embeddings", body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            data = json.loads(answer.read())["data"]
        out.extend(entry["embedding"] for entry in sorted(data, key=lambda entry: entry["index"]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="minilm", help="SERVE_MODEL (default: the built-in MiniLM)")
    p.add_argument("--precisions", default="float32,int8")
    p.add_argument("--rerank", type=int, default=0, help="documents per rerank request (a cross-encoder)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--texts", type=int, default=1, help="corpus lines per embeddings request (default 1)")
    p.add_argument(
        "--served-check", type=int, default=512, help="corpus lines compared through /v1/embeddings (0: none)"
    )
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args(argv)
    # float32 first, the reference (against_float32 runs it first too).
    precisions = ["float32", *(name for name in args.precisions.split(",") if name != "float32")]
    texts = corpus()

    if args.rerank:
        items, group = rerank_pairs(texts, args.rerank)
        path = "/rerank/batched"
        bodies = [
            json.dumps({"query": items[i][0], "documents": [d for _, d in items[i : i + group]]}).encode()
            for i in range(0, len(items), group)
        ]
        unit = "pairs"
    else:
        items, group, path = texts, 1, "/predict/batched"
        rng = random.Random(0)
        bodies = [json.dumps({"inputs": rng.sample(texts, args.texts)}).encode() for _ in range(len(texts))]
        unit = "texts"
    rows: dict[str, dict[str, Any]] = {}
    for precision, measured in against_float32(args.model, precisions, items, group):
        figures = measured["exactness"]
        rows[precision] = {
            "offline": measured["items_per_s"],
            "outcome": measured["outcome"],
            "corpus_exactness": figures,
            "route": [],
        }
        print(f"{precision}: offline {measured['items_per_s']:.0f} {unit}/s, {figures}", flush=True)
    check = [] if args.rerank else texts[: args.served_check]
    served: dict[str, list[list[float]]] = {}
    for _ in range(args.repeat):
        for precision in precisions:
            result = route(args.model, precision, bodies, path, args.clients, args.seconds, check)
            embedded = result.pop("embeddings")
            if embedded is not None:
                served.setdefault(precision, embedded)
            result["items_per_s"] = result["requests_per_s"] * (group if args.rerank else args.texts)
            rows[precision]["route"].append(result)
            print(f"{precision}: route {result}", flush=True)
    if served:
        from service.models.precision import compare

        for precision, embedded in served.items():
            rows[precision]["served_exactness"] = compare("embeddings", served["float32"], embedded)
    base_offline = rows["float32"]["offline"]
    base_route = statistics.median(r["items_per_s"] for r in rows["float32"]["route"])
    per_request = f"{args.rerank} documents" if args.rerank else f"{args.texts} texts"
    print(f"\nprocessor: {processor()}; {per_request} a request")
    print(
        f"\n| precision | in use | offline {unit}/s | vs float32 | batched route {unit}/s at {args.clients} "
        "clients (median) | vs float32 | served / offline | p50 ms | exactness on the corpus | "
        "through /v1/embeddings |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for precision, row in rows.items():
        speed = statistics.median(r["items_per_s"] for r in row["route"])
        p50 = statistics.median(r["p50_ms"] for r in row["route"])
        figures = ", ".join(f"{k} {v:.4f}" for k, v in row["corpus_exactness"].items()) or "float32 itself"
        through = ", ".join(f"{k} {v:.5f}" for k, v in row.get("served_exactness", {}).items()) or "-"
        print(
            f"| {precision} | {row['outcome']['in_use']} | {row['offline']:.0f} | "
            f"{row['offline'] / base_offline:.2f}x | {speed:.0f} | {speed / base_route:.2f}x | "
            f"{speed / row['offline']:.2f} | {p50:.0f} | {figures} | {through} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def processor() -> str:
    """The CPU's model and which of the flags bfloat16 depends on it has."""
    from service.config.precision_spec import cpu_flags

    name = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown",
    )
    wanted = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni")
    have = [flag for flag in wanted if flag in cpu_flags()] or ["none of amx_bf16, avx512_bf16"]
    return f"{name} ({', '.join(have)}), {os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main())

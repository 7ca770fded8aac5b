#!/usr/bin/env python3
"""Naive vs batched: sweep closed-loop concurrency on both routes and compare with the model's limit.

    .venv/bin/python scripts/bench/bench.py                # default model, full sweep (~6 min)
    .venv/bin/python scripts/bench/bench.py --model mlp --concurrency 1,8,64 --seconds 5
    .venv/bin/python scripts/bench/bench.py --url http://127.0.0.1:8000  # a service already running
    .venv/bin/python scripts/bench/bench.py --corpus scripts/fixtures/corpus/mixed.txt  # one text a request
    .venv/bin/python scripts/bench/bench.py --model DIR --corpus scripts/fixtures/corpus/mixed.txt --rerank 16

Unless --url is given it starts the service itself (gunicorn, with the SERVE_* settings of this
environment plus --model) and waits until every worker has loaded its model. Before that it
measures the model's offline limit: the highest items/s that predict reaches on full batches of
the model's sample item, with no HTTP, over every workers x torch-threads split that fits the
cores, all processes busy at once. With --corpus (a text model; one text per line, one text per
request, cycling) the offline limit is measured on the same texts, in windows of SERVE_MAX_BATCH_SIZE
run padded as they come, sorted by length in chunks of 1 to 16, and cut by the batcher's cost
model: the best of them is the limit. Beside it, with --corpus, the batcher without HTTP: the
worker's own batcher in each of the service's processes, fed by as many threads as the sweep's
most clients give a process, each tokenizing a text and waiting for its answer; between it and the
service at that many clients is what HTTP costs. With --rerank N (a cross-encoder, and --corpus) each request
is a rerank of N consecutive lines of the corpus against a query that is another of its lines, sent
to /rerank/naive and /rerank/batched; throughput counts (query, document) pairs, and the offline
limit is measured on the same pairs, the same ways. Writes results.md, results.json, results.csv,
throughput.png and latency.png to --out, and prints the table and the targets.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.common.launcher import LaunchError, planned, serve  # noqa: E402
from scripts.load.loadgen import LoadResult, check_loopback, run_load  # noqa: E402
from service.models.base import sample_item  # noqa: E402

# Fixed chunk sizes the offline limit tries on length-sorted windows of real text.
CHUNKS = (1, 2, 4, 8, 16)
ITEMS_METRIC = "serve_inferred_items_total"
BATCHES_METRIC = "serve_batches_total"
# A worker reaps a closed keep-alive connection on its event loop's next turn,
# which a busy worker reaches within a batch; a second covers the slowest model here.
SETTLE_S = 1.0


@dataclass(frozen=True)
class Row:
    route: str
    clients: int
    rps: float
    items_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    errors: int
    mean_batch: float | None


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()}
    if args.model:
        env["SERVE_MODEL"] = args.model
    corpus = read_corpus(args.corpus) if args.corpus else None
    reranks = rerank_requests(corpus, args.rerank) if corpus and args.rerank else None
    if reranks is not None and not args.url:
        check_rerank_settings(env, args.rerank)
    pairs = [[query, doc] for query, docs in reranks for doc in docs] if reranks else None
    measured = pairs or corpus  # what the service gets as items, in the order it gets them
    clients = max(int(c) for c in args.concurrency.split(","))
    offline = (
        None if args.url or args.no_offline else offline_limit(env, args.offline_seconds, measured, clients)
    )
    with service(args.url, env) as url:
        info = get_json(url + "/info")
        if reranks is not None:
            if info["model"]["task"] != "rerank":
                raise SystemExit(
                    f"bench: --rerank needs a rerank model; {info['model']['name']!r} serves "
                    f"{info['model']['task']}"
                )
            bodies = [json.dumps({"query": q, "documents": docs}).encode() for q, docs in reranks]
        elif corpus is not None:
            bodies = [json.dumps({"inputs": [text] * args.items}).encode() for text in corpus]
        else:
            try:
                item = sample_item(info["model"])
            except ValueError as exc:
                raise SystemExit(f"bench: {exc}") from None
            bodies = [json.dumps({"inputs": [item] * args.items}).encode()]
        rows, generator = sweep(url, bodies, args)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": info["model"]["name"],
        "items_per_request": per_request(args),
        "rerank_documents": args.rerank,
        "corpus": args.corpus,
        "repeats": args.repeat,
        "seconds_per_run": args.seconds,
        "offline": offline,
        "rows": [asdict(r) for r in rows],
        "generator": generator,
    }
    write_outputs(out, report, rows, offline)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="benchmark a running service (loopback only) instead of starting one")
    p.add_argument("--model", help="SERVE_MODEL for the service it starts (default: the environment's)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128", help="comma-separated client counts")
    p.add_argument("--seconds", type=float, default=10, help="measured seconds per level and route")
    p.add_argument("--warmup", type=float, default=2, help="unmeasured seconds before each level")
    p.add_argument("--items", type=int, default=1, help="items per request")
    p.add_argument("--corpus", help="a text file, one text per line: each request sends the next one")
    p.add_argument(
        "--rerank",
        type=int,
        metavar="N",
        help="with --corpus: each request reranks N lines against another line, on the /rerank routes",
    )
    p.add_argument("--repeat", type=int, default=1, help="runs per level and route; the table shows medians")
    p.add_argument("--routes", default="naive,batched")
    p.add_argument("--offline-seconds", type=float, default=8)
    p.add_argument("--no-offline", action="store_true", help="skip the offline-limit measurement")
    p.add_argument("--generator", choices=["auto", "asyncio"], default="auto", help="auto: wrk if installed")
    p.add_argument("--out", default="bench-results", help="directory for the table, data and plots")
    args = p.parse_args()
    if args.rerank is not None:
        if args.rerank < 1:
            p.error(f"--rerank must be at least 1, got {args.rerank}")
        if not args.corpus:
            p.error("--rerank needs --corpus: the documents and queries are its lines")
        if args.items != 1:
            p.error("--rerank N sets the items per request (N pairs); leave --items out")
    return args


def per_request(args: argparse.Namespace) -> int:
    """Items the model runs per request: --items, or with --rerank, its N (query, document) pairs."""
    return int(args.rerank or args.items)


# -- the service -------------------------------------------------------------------


@contextlib.contextmanager
def service(url: str | None, env: dict[str, str]) -> Iterator[str]:
    if url:
        check_loopback(url)
        yield url.rstrip("/")
        return
    try:
        # Every worker must be up, or the first levels measure a half-started service.
        with serve(env, ready_timeout=180, all_workers=True, grace=60) as started:
            yield started.url
    except LaunchError as exc:
        raise SystemExit(f"bench: the service did not start: {exc}") from None


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


# -- measuring -------------------------------------------------------------------


def read_corpus(path: str) -> list[str]:
    texts = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if not texts:
        raise SystemExit(f"bench: {path} holds no text")
    return texts


def rerank_requests(texts: list[str], documents: int) -> list[tuple[str, list[str]]]:
    """(query, documents) per request: ``documents`` consecutive lines, and the line half the corpus on.

    The query is then a text of the same mix of lengths, and never one of its own documents.
    """
    if documents > len(texts) // 2:
        raise SystemExit(
            f"bench: --rerank {documents} needs a corpus of {2 * documents} lines at least, got {len(texts)}"
        )
    half = len(texts) // 2
    return [
        (texts[(start + half) % len(texts)], texts[start : start + documents])
        for start in range(0, len(texts) - documents + 1, documents)
    ]


def check_rerank_settings(env: dict[str, str], documents: int) -> None:
    """Stop before measuring if the service to start cannot take a rerank of ``documents`` pairs."""
    from service.config.model_spec import directory_task, kind
    from service.config.settings import Settings

    settings = Settings.from_env(env)
    spec = settings.model
    if kind(spec) in ("minilm", "mlp") or (
        kind(spec) == "directory" and directory_task(Path(spec)) != "rerank"
    ):
        raise SystemExit(
            f"bench: --rerank needs a cross-encoder, and SERVE_MODEL={spec!r} is not one; "
            "make one with scripts/fixtures/make_rerank_model.py DIR and pass --model DIR"
        )
    if documents > settings.max_items_per_request:
        raise SystemExit(
            f"bench: --rerank {documents} sends {documents} documents a request, over "
            f"SERVE_MAX_ITEMS_PER_REQUEST={settings.max_items_per_request}; raise it or lower N"
        )


def offline_limit(
    env: dict[str, str], seconds: float, corpus: list[Any] | None = None, clients: int | None = None
) -> dict[str, Any]:
    """The offline limit over every split; with a corpus and ``clients``, the batcher without HTTP too.

    The batcher is measured on the split the service runs (its workers and their
    torch threads), with ``clients`` shared among them, and is kept apart from
    the offline figures.
    """
    from scripts.bench.offline import OfflineError, Strategy, measure, splits_for
    from service.config.settings import Settings
    from service.topology.inventory import read_inventory

    settings = Settings.from_env(env)
    cores = read_inventory().usable_cores  # CPU affinity and cgroup quota
    window = settings.max_batch_size
    strategies = [Strategy(window), *(Strategy(window, chunk=k) for k in CHUNKS), Strategy(window, cost=True)]
    results = []
    for split in splits_for(cores):
        try:
            found = measure(settings, split, [window], seconds=seconds, corpus=corpus, strategies=strategies)
        except OfflineError as exc:
            raise SystemExit(f"bench: {exc}") from None
        for m in found:
            how = m.strategy or f"batch {m.batch_size}"
            print(
                f"offline {split}, {how}: {m.items_per_s:.0f} items/s "
                f"({m.batch_ms_median:.1f} ms per {'window' if m.strategy else 'batch'})",
                flush=True,
            )
            results.append(
                {
                    "split": str(split),
                    "strategy": how,
                    "items_per_s": m.items_per_s,
                    "batch_ms": m.batch_ms_median,
                }
            )
    batcher = None
    if corpus is not None and clients:
        split = service_split(env)
        through = Strategy(window, clients=max(1, clients // split.workers))
        try:
            (m,) = measure(settings, split, [window], seconds=seconds, corpus=corpus, strategies=[through])
        except OfflineError as exc:
            raise SystemExit(f"bench: {exc}") from None
        print(f"{through} a process, {split}: {m.items_per_s:.0f} items/s", flush=True)
        batcher = {"items_per_s": m.items_per_s, "split": str(split), "clients": through.clients}
    best = max(results, key=lambda r: r["items_per_s"])
    return {
        "items_per_s": best["items_per_s"],
        "split": best["split"],
        "strategy": best["strategy"],
        "batch_size": window,
        "splits": results,
        "batcher": batcher,
    }


def metric_totals(url: str) -> tuple[float, float] | None:
    """Items inferred and batches run so far, over all workers; None if /metrics is absent."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    totals = {ITEMS_METRIC: 0.0, BATCHES_METRIC: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals[ITEMS_METRIC], totals[BATCHES_METRIC]


def sweep(url: str, bodies: list[bytes], args: argparse.Namespace) -> tuple[list[Row], str]:
    """Every (level, route) run --repeat times, interleaved so that drift hits both routes alike."""
    from tqdm import tqdm

    levels = [int(c) for c in args.concurrency.split(",")]
    routes = args.routes.split(",")
    runs: dict[tuple[str, int], list[Row]] = {}
    steps = [(rep, c, route) for rep in range(args.repeat) for c in levels for route in routes]
    generator = ""
    with tqdm(steps, desc="sweep", unit="run") as bar:
        for _, clients, route in bar:
            bar.set_postfix_str(f"{route} x{clients}")
            target = f"{url}/rerank/{route}" if args.rerank else f"{url}/predict/{route}"
            if args.warmup > 0:
                run_load(target, bodies, clients, args.warmup, args.generator == "auto")
                settle()
            before = metric_totals(url)
            result = run_load(target, bodies, clients, args.seconds, args.generator == "auto")
            after = metric_totals(url)
            settle()
            row = to_row(route, result, per_request(args), before, after)
            runs.setdefault((route, clients), []).append(row)
            generator = result.generator
    return [median_row(rows) for rows in runs.values()], generator


def settle() -> None:
    """Let the service close the last run's connections before the next run's clients connect.

    Workers share connections by how many each holds open (service.host.balance); a
    worker still holding closed connections that it has not yet reaped would
    take too few of the new ones, for the whole of the next run.
    """
    time.sleep(SETTLE_S)  # the closes happen inside the service; nothing to wait on from here


def median_row(rows: list[Row]) -> Row:
    """The median of each figure over repeated runs (errors: their sum)."""

    def med(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    first = rows[0]
    return Row(
        route=first.route,
        clients=first.clients,
        rps=statistics.median(r.rps for r in rows),
        items_per_s=statistics.median(r.items_per_s for r in rows),
        p50_ms=statistics.median(r.p50_ms for r in rows),
        p90_ms=statistics.median(r.p90_ms for r in rows),
        p99_ms=statistics.median(r.p99_ms for r in rows),
        errors=sum(r.errors for r in rows),
        mean_batch=med([r.mean_batch for r in rows]),
    )


def to_row(route: str, r: LoadResult, items: int, before: Any, after: Any) -> Row:
    mean_batch = None
    if route == "naive":
        mean_batch = float(items)  # each request is its own model call
    elif before and after and after[1] > before[1]:
        mean_batch = (after[0] - before[0]) / (after[1] - before[1])
    return Row(route, r.clients, r.rps, r.rps * items, r.p50_ms, r.p90_ms, r.p99_ms, r.errors, mean_batch)


# -- reporting -------------------------------------------------------------------


def targets(
    rows: list[Row], offline: dict[str, Any] | None, corpus: bool = False
) -> list[tuple[str, str, bool]]:
    """The goals docs/bench-text.md sets: one fixed sentence, or real text (``corpus``)."""
    by = {(r.route, r.clients): r for r in rows}
    out = []
    if corpus:
        for clients in sorted({c for route, c in by if route == "batched"}):
            if clients < 2 or ("naive", clients) not in by:
                continue
            ratio = by["batched", clients].rps / by["naive", clients].rps
            need = 0.9 if clients == 2 else 1.0
            out.append(
                (f"{clients} clients: batched req/s >= {need:g} x naive", f"{ratio:.2f} x", ratio >= need)
            )
    elif ("naive", 1) in by and ("batched", 1) in by:
        ratio = by["batched", 1].p50_ms / by["naive", 1].p50_ms
        out.append(("1 client: batched p50 <= 1.1 x naive p50", f"{ratio:.2f} x", ratio <= 1.1))
    if offline:
        limit = offline["items_per_s"]
        if ("batched", 8) in by and not corpus:
            ratio = by["batched", 8].items_per_s / limit
            out.append(
                ("8 clients: batched throughput >= 0.5 x offline limit", f"{ratio:.2f} x", ratio >= 0.5)
            )
        if ("batched", 64) in by:
            r = by["batched", 64]
            need = 0.9 if corpus else 0.8
            ratio, tail = r.items_per_s / limit, r.p99_ms / r.p50_ms
            out.append(
                (
                    f"64 clients: batched throughput >= {need:g} x offline limit",
                    f"{ratio:.2f} x",
                    ratio >= need,
                )
            )
            out.append(("64 clients: batched p99 <= 2 x batched p50", f"{tail:.2f} x", tail <= 2))
    return out


def markdown(report: dict[str, Any], rows: list[Row], offline: dict[str, Any] | None) -> str:
    corpus = report.get("corpus")
    documents = report.get("rerank_documents")
    unit = units(report)
    if documents:
        source = (
            f"a rerank per request: a query and {documents} documents, lines of `{corpus}`; "
            "an item is one (query, document) pair"
        )
    elif corpus:
        source = f"texts from `{corpus}`, one per request in turn"
    else:
        source = "the model's sample item"
    lines = [
        f"Model `{report['model']}`, {report['items_per_request']} item(s) per request, {source}, "
        f"{report['seconds_per_run']:g} s per run, median of {report['repeats']} run(s), "
        f"load from {report['generator']}.",
        "",
    ]
    if offline:
        lines.append(
            f"Offline limit: **{offline['items_per_s']:.0f} {unit}/s** "
            f"(split {offline['split']}, {offline.get('strategy') or 'batch ' + str(offline['batch_size'])}; "
            + "all: "
            + ", ".join(
                f"{s['split']} {s.get('strategy', '')} {s['items_per_s']:.0f}".replace("  ", " ")
                for s in offline["splits"]
            )
            + ")"
        )
        lines.append("")
        lines += batcher_line(offline.get("batcher"), rows, unit)
    lines += [
        f"| route | clients | req/s | {unit}/s | p50 ms | p90 ms | p99 ms | errors | mean batch |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        batch = f"{r.mean_batch:.1f}" if r.mean_batch is not None else "n/a"
        lines.append(
            f"| {r.route} | {r.clients} | {r.rps:.1f} | {r.items_per_s:.1f} | {r.p50_ms:.1f} | "
            f"{r.p90_ms:.1f} | {r.p99_ms:.1f} | {r.errors} | {batch} |"
        )
    checks = targets(rows, offline, corpus=bool(corpus))
    if checks:
        lines += ["", "| target | measured | met |", "| --- | ---: | --- |"]
        lines += [f"| {name} | {value} | {'yes' if ok else 'NO'} |" for name, value, ok in checks]
    return "\n".join(lines) + "\n"


def service_split(env: dict[str, str]) -> Any:
    """The service's own workers x torch threads, as gunicorn_conf.py plans them for ``env``."""
    from scripts.bench.offline import Split

    workers = planned(env).workers
    return Split(len(workers), workers[0].torch_threads)


def batcher_line(batcher: dict[str, Any] | None, rows: list[Row], unit: str) -> list[str]:
    """The batcher without HTTP, and how near the batched route came to it at the most clients."""
    if not batcher:
        return []
    served = [r for r in rows if r.route == "batched"]
    line = (
        f"Batcher without HTTP: **{batcher['items_per_s']:.0f} {unit}/s** (split {batcher['split']}, "
        f"{batcher['clients']} clients a process)"
    )
    if served:
        top = max(served, key=lambda r: r.clients)
        ratio = top.items_per_s / batcher["items_per_s"]
        line += f"; the batched route at {top.clients} clients reaches {ratio:.2f} x of it, the rest is HTTP"
    return [line + ".", ""]


def units(report: dict[str, Any]) -> str:
    """What the throughput counts: items, or for a rerank, (query, document) pairs."""
    return "pairs" if report.get("rerank_documents") else "items"


def write_outputs(out: Path, report: dict[str, Any], rows: list[Row], offline: dict[str, Any] | None) -> None:
    table = markdown(report, rows, offline)
    (out / "results.md").write_text(table)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    plot(out, report, rows, offline)
    print(table)
    print(f"wrote {out}/results.md, results.json, results.csv, throughput.png, latency.png")


def plot(out: Path, report: dict[str, Any], rows: list[Row], offline: dict[str, Any] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routes = sorted({r.route for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for route in routes:
        rs = [r for r in rows if r.route == route]
        ax.plot([r.clients for r in rs], [r.items_per_s for r in rs], marker="o", label=route)
    if offline:
        ax.axhline(offline["items_per_s"], linestyle="--", color="grey", label="offline limit")
    ax.set(
        xscale="log",
        xlabel="concurrent clients",
        ylabel=f"{units(report)}/s",
        title=f"Throughput, {report['model']}",
    )
    ax.set_xticks(
        sorted({r.clients for r in rows}), labels=[str(c) for c in sorted({r.clients for r in rows})]
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for route in routes:
        rs = [r for r in rows if r.route == route]
        line = ax.plot([r.clients for r in rs], [r.p50_ms for r in rs], marker="o", label=f"{route} p50")
        ax.plot(
            [r.clients for r in rs],
            [r.p99_ms for r in rs],
            marker="x",
            linestyle=":",
            color=line[0].get_color(),
            label=f"{route} p99",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="concurrent clients",
        ylabel="latency (ms)",
        title=f"Latency, {report['model']}",
    )
    ax.set_xticks(
        sorted({r.clients for r in rows}), labels=[str(c) for c in sorted({r.clients for r in rows})]
    )
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

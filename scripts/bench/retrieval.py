#!/usr/bin/env python3
"""An embedder and a reranker in one service, against two services side by side, on searches.

    .venv/bin/python scripts/bench/retrieval.py                        # 8 and 32 users, 20 s each
    .venv/bin/python scripts/fixtures/make_rerank_model.py /tmp/minilm-rerank-random
    .venv/bin/python scripts/bench/retrieval.py --users 8 32 --seconds 20 \\
        --embedder minilm --cross-encoder /tmp/minilm-rerank-random

Each user runs searches in a closed loop with no think time: a line of
scripts/fixtures/corpus/mixed.txt embedded (POST /v1/embeddings, one text), then the
--documents lines after it reranked against it (POST /v2/rerank, 16 by default); the next
search starts when the rerank answers, and one whose embedding failed goes no further
(scripts/load/loadtest/retrieval.py makes the requests, as Locust's RetrievalUser does).
Two setups, one after the other on this machine, with the default settings (the
environment's SERVE_* variables are left out):

- one service: SERVE_MODEL='embed=EMBEDDER,rerank=CROSS_ENCODER', one plan for the
  cores, the two models taking turns on each worker's threads;
- two services side by side: SERVE_MODEL=embed=EMBEDDER and SERVE_MODEL=rerank=CROSS_ENCODER,
  each planning for all the cores as if it were alone, the users embedding on one port
  and reranking on the other.

For each setup and user count, after a warm-up, a Markdown table: searches a second (both
steps answered 200), p50 and p99 of a whole search, p50 of each step, answers other than
200 (a request with no answer counts too), and the one service's searches a second over
the two services'. Without --cross-encoder, a MiniLM-shaped cross-encoder with RANDOM
weights is written to a temporary directory (scripts/fixtures/make_rerank_model.py): its
cost per pair is a MiniLM cross-encoder's, its scores mean nothing. Loopback only; bounded
in time. Exits 1 if any answer was neither 200 nor 503.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.common.launcher import planned, serve  # noqa: E402
from scripts.load import openloop  # noqa: E402
from scripts.load.loadgen import REQUEST_TIMEOUT_S  # noqa: E402
from scripts.load.loadtest.retrieval import (  # noqa: E402
    DEFAULT_DOCUMENTS_PER_QUERY,
    embed_request,
    query_and_candidates,
    rerank_request,
)
from scripts.load.loadtest.workload import read_corpus  # noqa: E402

ONE, TWO = "one service", "two services"
EMBED, RERANK = "/v1/embeddings", "/v2/rerank"
# Load before the first measured level, not counted: the first batches pay for lazy
# allocations and the tokenizer's caches.
WARM_S = 5.0
# Between levels: the previous level's connections close before the next opens its own.
SETTLE_S = 2.0
NO_ANSWER = "no answer"
# The served names, the same in both setups: the bodies need not know which runs.
MODELS = ("embed", "rerank")

# -- pure: flags, specs, summaries, the table ----------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--users", type=positive_int, nargs="+", default=[8, 32], help="concurrent users (default 8 32)"
    )
    parser.add_argument("--seconds", type=positive_float, default=20.0, help="seconds a level (default 20)")
    parser.add_argument(
        "--documents",
        type=positive_int,
        default=DEFAULT_DOCUMENTS_PER_QUERY,
        help=f"candidates reranked a search (default {DEFAULT_DOCUMENTS_PER_QUERY})",
    )
    parser.add_argument(
        "--embedder", default="minilm", help="the embedder's SERVE_MODEL spec (default minilm, built in)"
    )
    parser.add_argument(
        "--cross-encoder",
        type=Path,
        default=None,
        help="a cross-encoder directory (default: one with random weights, written for the run)",
    )
    return parser.parse_args(argv)


def entry(name: str, spec: str) -> str:
    """``name=spec`` for SERVE_MODEL, a spec's ``\\``, ``,`` and ``=`` escaped as its grammar says."""
    escaped = spec.replace("\\", "\\\\").replace(",", "\\,").replace("=", "\\=")
    return f"{name}={escaped}"


def command_line(argv: Sequence[str]) -> str:
    """The command that reruns this benchmark with ``argv``, from the repository root."""
    return shlex.join([".venv/bin/python", "scripts/bench/retrieval.py", *argv])


@dataclass
class Tally:
    """One user's searches: each answered one's (whole, embed, rerank) seconds, and what was not 200."""

    searches: list[tuple[float, float, float]] = field(default_factory=list)
    not_200: Counter[str] = field(default_factory=Counter)


def merge(tallies: Sequence[Tally]) -> Tally:
    merged = Tally()
    for tally in tallies:
        merged.searches.extend(tally.searches)
        merged.not_200.update(tally.not_200)
    return merged


def summarize(tally: Tally, elapsed_s: float) -> dict[str, Any]:
    """A row's figures: searches a second over ``elapsed_s``, latency percentiles in ms, the failures."""
    whole = openloop.percentiles([s[0] for s in tally.searches])
    embed = openloop.percentiles([s[1] for s in tally.searches])
    rerank = openloop.percentiles([s[2] for s in tally.searches])
    unexpected = {s: n for s, n in tally.not_200.items() if s not in ("503", NO_ANSWER)}
    return {
        "searches": len(tally.searches),
        "searches_per_s": round(len(tally.searches) / elapsed_s, 2) if elapsed_s > 0 else 0.0,
        "p50_ms": whole["p50"],
        "p99_ms": whole["p99"],
        "embed_p50_ms": embed["p50"],
        "rerank_p50_ms": rerank["p50"],
        "not_200": sum(tally.not_200.values()),
        "not_200_by_status": dict(sorted(tally.not_200.items())),
        "unexpected": sum(unexpected.values()),
    }


def with_ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each one-service row with its searches a second over the two services' at the same user count."""
    two = {row["users"]: row["searches_per_s"] for row in rows if row["setup"] == TWO}
    out = []
    for row in rows:
        base = two.get(row["users"])
        ratio = round(row["searches_per_s"] / base, 2) if row["setup"] == ONE and base else None
        out.append({**row, "one_over_two": ratio})
    return out


def plan_label(plans: Sequence[tuple[int, int]]) -> str:
    """(workers, torch threads each) of each service: ``2x1``, or ``2x1 + 2x1`` side by side."""
    return " + ".join(f"{workers}x{threads}" for workers, threads in plans)


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = ["users", "setup", "workers x threads", "searches/s", "one / two", "p50", "p99"]
    head += ["embed p50", "rerank p50", "non-200"]
    lines = ["| " + " | ".join(head) + " |", "|---:|---|---|" + "---:|" * (len(head) - 3)]
    for r in sorted(rows, key=lambda r: (r["users"], r["setup"] != ONE)):
        ratio = "-" if r["one_over_two"] is None else f"{r['one_over_two']:.2f}x"
        failed = ", ".join(f"{s}: {n}" for s, n in r["not_200_by_status"].items()) or "0"
        cells = [r["users"], r["setup"], r["plan"], f"{r['searches_per_s']:.1f}", ratio]
        cells += [f"{r[k]:.0f} ms" for k in ("p50_ms", "p99_ms", "embed_p50_ms", "rerank_p50_ms")]
        lines.append("| " + " | ".join(str(cell) for cell in [*cells, failed]) + " |")
    return "\n".join(lines)


# -- load ---------------------------------------------------------------------


def search(
    session: requests.Session,
    urls: tuple[str, str],
    models: tuple[str, str],
    query: str,
    candidates: list[str],
    tally: Tally,
) -> None:
    """One search: the query embedded, then its candidates reranked; timed if both answer 200."""
    started = time.monotonic()
    steps = (EMBED, embed_request(models[0], query)), (RERANK, rerank_request(models[1], query, candidates))
    times = []
    for (route, sent), url in zip(steps, urls, strict=True):
        step_started = time.monotonic()
        try:
            response = session.post(url + route, timeout=REQUEST_TIMEOUT_S, **sent)  # reads the whole answer
        except requests.RequestException:
            tally.not_200[NO_ANSWER] += 1
            return
        if response.status_code != 200:
            tally.not_200[str(response.status_code)] += 1
            return  # a failed embedding has no candidates to rerank
        times.append(time.monotonic() - step_started)
    tally.searches.append((time.monotonic() - started, times[0], times[1]))


def run_users(
    urls: tuple[str, str], lines: Sequence[str], users: int, documents: int, seconds: float
) -> tuple[Tally, float]:
    """``users`` threads searching for ``seconds``: their tallies merged, and the seconds until all stop."""
    end = time.monotonic() + seconds
    tallies = [Tally() for _ in range(users)]

    def user(seed: int) -> None:
        rng = random.Random(seed)
        with requests.Session() as session:  # keep-alive, one connection a port
            while time.monotonic() < end:
                query, candidates = query_and_candidates(lines, documents, rng)
                search(session, urls, MODELS, query, candidates, tallies[seed])

    threads = [threading.Thread(target=user, args=(seed,)) for seed in range(users)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return merge(tallies), time.monotonic() - began


def measure(
    setup: str, urls: tuple[str, str], plan: str, args: argparse.Namespace, lines: Sequence[str]
) -> list[dict[str, Any]]:
    run_users(urls, lines, args.users[0], args.documents, min(WARM_S, args.seconds))
    rows = []
    for users in args.users:
        time.sleep(SETTLE_S)
        tally, elapsed = run_users(urls, lines, users, args.documents, args.seconds)
        rows.append({"setup": setup, "users": users, "plan": plan, **summarize(tally, elapsed)})
        print(f"retrieval: {setup}, {users} users: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def plan_of(env: Mapping[str, str]) -> tuple[int, int]:
    """(workers, torch threads each) that gunicorn_conf.py plans for ``env`` on this machine."""
    workers = planned(env).workers
    return len(workers), (workers[0].torch_threads if workers else 0)


@contextlib.contextmanager
def cross_encoder(given: Path | None) -> Iterator[Path]:
    """``given``, or a MiniLM-shaped cross-encoder with random weights, written for the run only."""
    if given is not None:
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="rerank-model-") as directory:
        # A child process: torch stays out of the users' process, and its thread pool
        # off the cores the services need.
        make = [sys.executable, str(ROOT / "scripts/fixtures/make_rerank_model.py"), directory]
        subprocess.run(make, check=True, stdout=subprocess.DEVNULL)  # it prints the directory's path
        yield Path(directory)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
    lines = read_corpus()
    with cross_encoder(args.cross_encoder) as reranker:
        embed, rerank = entry(MODELS[0], args.embedder), entry(MODELS[1], str(reranker))
        one_env = {**base, "SERVE_MODEL": f"{embed},{rerank}"}
        pair_envs = [{**base, "SERVE_MODEL": embed}, {**base, "SERVE_MODEL": rerank}]
        with serve(one_env, ready_timeout=300, all_workers=True) as service:
            rows = measure(ONE, (service.url, service.url), plan_label([plan_of(one_env)]), args, lines)
        with contextlib.ExitStack() as stack:
            embedder = stack.enter_context(serve(pair_envs[0], ready_timeout=300, all_workers=True))
            ranker = stack.enter_context(serve(pair_envs[1], ready_timeout=300, all_workers=True))
            plan = plan_label([plan_of(env) for env in pair_envs])
            rows += measure(TWO, (embedder.url, ranker.url), plan, args, lines)
    rows = with_ratios(rows)

    print(f"\nCommand: `{command_line(argv)}`")
    if args.cross_encoder is None:
        print(
            "Cross-encoder: MiniLM-shaped, RANDOM weights (scripts/fixtures/make_rerank_model.py): "
            "its cost per pair is a real one's, its scores mean nothing."
        )
    print(
        f"\nSearches: one query embedded, then {args.documents} candidates reranked; closed loop, "
        f"no think time, {args.seconds:g} s a level; embedder {args.embedder}, cross-encoder "
        f"{args.cross_encoder or 'random weights'}; default settings.\n"
    )
    print(table(rows), flush=True)
    unexpected = sum(row["unexpected"] for row in rows)
    if unexpected:
        print(f"retrieval: {unexpected} answer(s) were neither 200 nor 503", file=sys.stderr)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())

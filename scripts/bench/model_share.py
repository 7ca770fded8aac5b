"""Two models in one service: does a flood of one model's requests leave the other's answered, and quick?

    .venv/bin/python scripts/bench/model_share.py --seconds 20
    .venv/bin/python scripts/bench/model_share.py --flood 32 --texts 1,32 --rerankers 4 --documents 16

This starts one service (gunicorn on 127.0.0.1, the ``SERVE_*`` settings of the
environment) serving an embedder and a cross-encoder side by side:
``SERVE_MODEL=embed=minilm,rerank=<dir>``, the directory written for the run by
scripts/fixtures/make_rerank_model.py (MiniLM-sized, random weights: its cost
per pair is a MiniLM cross-encoder's, its scores mean nothing). After a warm-up:

1. ``--rerankers`` closed-loop clients rerank ``--documents`` corpus lines
   against another line on /v1/rerank, alone, for ``--seconds``;
2. then, for each ``--texts`` size, the same rerankers beside ``--flood``
   closed-loop clients sending that many texts a request to /v1/embeddings as
   fast as answers come, for ``--seconds``.

It prints, per run, the rerankers' requests, p50, p99 and refusals, their p50
against the alone run's, and the flood's texts a second and refusals, as a
Markdown table. Loopback only; bounded in time. Exits 1 if any answer was
neither 2xx nor 503.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.batched_clients import (  # noqa: E402
    BODIES,
    EMBEDDINGS,
    RERANK,
    SETTLE_S,
    Tally,
    clients_list,
    closed_loop,
    embeddings_bodies,
    markdown,
    millis,
    read_lines,
    rerank_bodies,
    summarize,
    warm,
)
from scripts.common.launcher import serve  # noqa: E402

EMBED, CROSS = "embed", "rerank"


def spec(cross_encoder: str) -> str:
    """SERVE_MODEL for the pair: MiniLM as ``embed`` (the default), the directory as ``rerank``."""
    return f"{EMBED}=minilm,{CROSS}={cross_encoder}"


def row(label: str, rerank: dict[str, Any], alone_p50: float, flood: dict[str, Any] | None) -> list[object]:
    """One table row: the rerankers' figures, their p50 against alone, and the flood's."""
    ratio = rerank["p50_ms"] / alone_p50 if alone_p50 > 0 else float("nan")
    cells: list[object] = [
        label,
        rerank["requests"],
        millis(rerank["p50_ms"]),
        millis(rerank["p99_ms"]),
        f"{ratio:.2f}x",
        rerank["refused_503"],
    ]
    if flood is None:
        return [*cells, "-", "-"]
    return [*cells, f"{flood['items_per_s']:.0f}", flood["refused_503"]]


HEAD = [
    "run",
    "reranks",
    "rerank p50",
    "rerank p99",
    "p50 vs alone",
    "rerank 503",
    "flood texts/s",
    "flood 503",
]


def unexpected_answers(rows: list[dict[str, Any]]) -> int:
    return int(sum(sum(r["other_non2xx"].values()) + r["connection_errors"] for r in rows))


def measure(args: argparse.Namespace, directory: str, lines: list[str]) -> dict[str, Any]:
    env = {"SERVE_MODEL": spec(directory)}
    with serve(env, ready_timeout=300, all_workers=True) as service:
        url = service.url
        reranks = rerank_bodies(lines, CROSS, args.documents, BODIES)
        warm(url + RERANK, reranks, args.rerankers, args.seconds)
        warm(
            url + EMBEDDINGS,
            embeddings_bodies(lines, EMBED, max(args.texts), BODIES),
            args.flood,
            args.seconds,
        )
        time.sleep(SETTLE_S)
        alone = summarize(asyncio.run(closed_loop(url + RERANK, reranks, args.rerankers, args.seconds)), 1)
        results: dict[str, Any] = {"alone": alone, "flooded": []}
        for texts in args.texts:
            time.sleep(SETTLE_S)
            flood_bodies = embeddings_bodies(lines, EMBED, texts, BODIES)

            async def both(bodies: list[bytes] = flood_bodies) -> tuple[Tally, Tally]:
                flood = closed_loop(url + EMBEDDINGS, bodies, args.flood, args.seconds)
                ranked = closed_loop(url + RERANK, reranks, args.rerankers, args.seconds)
                return await asyncio.gather(ranked, flood)

            ranked, flood = asyncio.run(both())
            results["flooded"].append(
                {"texts": texts, "rerank": summarize(ranked, 1), "flood": summarize(flood, texts)}
            )
            print(f"model_share: {texts} texts: {results['flooded'][-1]}", file=sys.stderr)
    return results


def table(args: argparse.Namespace, results: dict[str, Any]) -> str:
    alone = results["alone"]
    rows = [row(f"{args.rerankers} rerankers alone", alone, alone["p50_ms"], None)]
    for run in results["flooded"]:
        label = f"beside {args.flood} clients of {run['texts']} texts"
        rows.append(row(label, run["rerank"], alone["p50_ms"], run["flood"]))
    return markdown(HEAD, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="each run's length (default 20)")
    parser.add_argument("--flood", type=int, default=32, help="embedding clients in the flood (default 32)")
    parser.add_argument(
        "--texts",
        type=clients_list,
        default=[1, 32],
        help="texts a flood request, one run each (default 1,32)",
    )
    parser.add_argument("--rerankers", type=int, default=4, help="rerank clients (default 4)")
    parser.add_argument("--documents", type=int, default=16, help="documents a rerank request (default 16)")
    parser.add_argument(
        "--cross-encoder", help="a cross-encoder directory (default: one written for the run)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    lines = read_lines()
    with tempfile.TemporaryDirectory(prefix="rerank-model-") as made:
        directory = args.cross_encoder
        if directory is None:
            make = [sys.executable, str(ROOT / "scripts/fixtures/make_rerank_model.py"), made]
            subprocess.run(make, check=True, stdout=subprocess.DEVNULL)
            directory = made
        results = measure(args, directory, lines)
    command = " ".join(["scripts/bench/model_share.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"\n`{command}`; SERVE_MODEL={spec('<cross-encoder>')}\n\n{table(args, results)}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    runs = [results["alone"], *(r[part] for r in results["flooded"] for part in ("rerank", "flood"))]
    return 1 if unexpected_answers(runs) else 0


if __name__ == "__main__":
    sys.exit(main())

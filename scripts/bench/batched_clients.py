"""What real clients send: many texts a request, from closed-loop clients, the openai SDK, and a probe.

    .venv/bin/python scripts/bench/batched_clients.py --embeddings 4,16,64 --texts 32 --seconds 20
    .venv/bin/python scripts/bench/batched_clients.py --rerank 16x8,16x32,100x8
    .venv/bin/python scripts/bench/batched_clients.py --openai-threads 16 --interactive 64 \
        --json /tmp/clients.json

An application that embeds a document store or reranks search results sends
dozens of texts a request. This starts its own service (gunicorn on 127.0.0.1,
the ``SERVE_*`` settings of the environment, default model all-MiniLM-L6-v2),
warms it, and runs the scenarios asked for, ``--seconds`` each, as Markdown tables:

- ``--embeddings C,...``: C closed-loop clients, each on its own keep-alive
  connection, each request ``--texts`` consecutive lines of
  scripts/fixtures/corpus/mixed.txt from a random one, to /v1/embeddings;
- ``--rerank CxD,...``: C clients reranking D corpus lines against another line
  on /v1/rerank, on a service of its own serving the cross-encoder that
  scripts/fixtures/make_rerank_model.py writes (MiniLM-sized, random weights);
- ``--openai-threads T``: the openai SDK with its defaults (2 retries, which
  honour Retry-After; 600 s timeout), one client shared by T threads calling
  ``embeddings.create`` with ``--texts`` lines in a loop: what reaches the caller;
- ``--interactive C``: C such bulk clients and a one-text probe to /v1/embeddings
  at ``--probe-rate`` a second on a Poisson schedule, each probe its own task and
  connection, timed from its scheduled send (scripts/load/openloop.py).

A refused (503) client sends its next request at once, as wrk and hand-written
loops do: the service holds a refused connection for its Retry-After itself
(service.http.arrival.ask_to_hold), so that is the client it is built to meet.
Loopback only; bounded in time. Exits 1 if any answer was neither 2xx nor 503.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.common.launcher import serve  # noqa: E402
from scripts.load import openloop  # noqa: E402
from scripts.load.loadgen import RECONNECT_PAUSE_S, REQUEST_TIMEOUT_S, check_loopback  # noqa: E402

EMBEDDINGS = "/v1/embeddings"
RERANK = "/v1/rerank"
# Load before the first measured level, not counted: the first batches pay for
# lazy allocations and the tokenizer's caches.
WARM_S = 5.0
# Between levels: the previous level's connections close before the next opens its own.
SETTLE_S = 2.0
# Distinct bodies a level sends, encoded once: with 1,584 corpus lines, enough
# that no cache could answer from memory, few enough to build in a blink.
BODIES = 1024
# What a search page keeps of a rerank: Cohere's clients send top_n.
TOP_N = 3
# After --seconds, how long the openai threads may take to return (a call in
# its retries); one still out then is reported, not waited for.
OPENAI_GRACE_S = 60.0

# -- pure: bodies -------------------------------------------------------------


def read_lines(path: Path = openloop.CORPUS) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def window(lines: Sequence[str], start: int, count: int) -> list[str]:
    """``count`` consecutive lines from ``start``, wrapping around: a passage of a document."""
    return [lines[(start + i) % len(lines)] for i in range(count)]


def embeddings_body(model: str, texts: Sequence[str]) -> bytes:
    return json.dumps({"model": model, "input": list(texts)}).encode()


def rerank_body(model: str, query: str, documents: Sequence[str], top_n: int = TOP_N) -> bytes:
    top = min(top_n, len(documents))
    return json.dumps({"model": model, "query": query, "documents": list(documents), "top_n": top}).encode()


def embeddings_bodies(lines: Sequence[str], model: str, texts: int, count: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [embeddings_body(model, window(lines, rng.randrange(len(lines)), texts)) for _ in range(count)]


def rerank_bodies(lines: Sequence[str], model: str, documents: int, count: int, seed: int = 0) -> list[bytes]:
    """The query is the line half the corpus away: of the same mix of lengths, never one of its documents."""
    rng = random.Random(seed)
    starts = [rng.randrange(len(lines)) for _ in range(count)]
    half = len(lines) // 2
    return [rerank_body(model, lines[(s + half) % len(lines)], window(lines, s, documents)) for s in starts]


# -- pure: flags and summaries ------------------------------------------------


def clients_list(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of client counts") from None
    if min(levels) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every client count must be at least 1")
    return levels


def rerank_levels(text: str) -> list[tuple[int, int]]:
    """``16x8,100x8`` -> [(16 clients, 8 documents), (100, 8)]."""
    levels = []
    for part in text.split(","):
        clients, x, documents = part.partition("x")
        if not (x and clients.isdigit() and documents.isdigit() and int(clients) and int(documents)):
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} is not CLIENTSxDOCUMENTS, e.g. 16x8")
        levels.append((int(clients), int(documents)))
    return levels


def is_2xx(status: int) -> bool:
    return 200 <= status < 300


def unexpected(statuses: Mapping[str, int]) -> dict[str, int]:
    """The answers that are a bug: HTTP statuses neither 2xx nor 503 (connection errors are not answers)."""
    return {s: n for s, n in sorted(statuses.items()) if s.isdigit() and not is_2xx(int(s)) and s != "503"}


@dataclass
class Tally:
    """What a load got: every answer's (latency, status), and the requests that got none."""

    answers: list[tuple[float, int]] = field(default_factory=list)
    connection_errors: int = 0
    elapsed_s: float = 0.0


def summarize(tally: Tally, items_per_request: int) -> dict[str, Any]:
    """A row's numbers; throughput counts the items of 2xx answers until the last client returned."""
    ok = [latency for latency, status in tally.answers if is_2xx(status)]
    statuses = Counter(str(status) for _, status in tally.answers)
    ms = openloop.percentiles(ok)
    rate = len(ok) * items_per_request / tally.elapsed_s if tally.elapsed_s > 0 else 0.0
    return {
        "sent": len(tally.answers) + tally.connection_errors,
        "requests": len(ok),
        "items_per_s": round(rate, 1),
        "refused_503": statuses["503"],
        "other_non2xx": unexpected(statuses),
        "connection_errors": tally.connection_errors,
        **{f"{q}_ms": ms[q] for q in ("p50", "p99", "max")},
    }


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's items a second against the first row's (None when the first served none)."""
    first = rows[0]["items_per_s"] if rows else 0.0
    return [{**row, "vs_first": round(row["items_per_s"] / first, 2) if first else None} for row in rows]


def probe_tally(result: openloop.Result) -> Tally:
    """An open-loop result as a tally, each latency still timed from its scheduled send."""
    answered = [(o.latency_s, int(o.status)) for o in result.outcomes if o.status.isdigit()]
    return Tally(answered, len(result.outcomes) - len(answered), result.seconds)


def failure_name(exc: BaseException) -> str:
    """An exception as its caller would log it: the type, and the HTTP status if it carries one."""
    status = getattr(exc, "status_code", None)
    return f"{type(exc).__name__} ({status})" if isinstance(status, int) else type(exc).__name__


def bugs(results: Mapping[str, Any]) -> int:
    """Answers neither 2xx nor 503, over every scenario in ``results``."""
    rows = [*results.get("embeddings", []), *results.get("rerank", [])]
    rows += [results["interactive"][part] for part in ("probe", "bulk") if "interactive" in results]
    rows.append({"other_non2xx": results.get("openai", {}).get("failed_non503", {})})
    return int(sum(sum(row["other_non2xx"].values()) for row in rows))


def markdown(head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def millis(value: float) -> str:
    return f"{value:.0f} ms"


def load_table(rows: Sequence[dict[str, Any]], unit: str, items_column: bool) -> str:
    head = ["clients", *([f"{unit} a request"] if items_column else [])]
    head += ["requests", f"{unit}/s", "vs first", "503", "other non-2xx", "connection errors", "p50", "p99"]
    cells = []
    for r in rows:
        level = [r["clients"], *([r["items"]] if items_column else [])]
        ratio = "-" if r["vs_first"] is None else f"{r['vs_first']:.2f}x"
        others = ", ".join(f"{s}: {n}" for s, n in r["other_non2xx"].items()) or 0
        counts = [
            r["requests"],
            f"{r['items_per_s']:.0f}",
            ratio,
            r["refused_503"],
            others,
            r["connection_errors"],
        ]
        cells.append([*level, *counts, millis(r["p50_ms"]), millis(r["p99_ms"])])
    return markdown(head, cells)


def openai_table(row: dict[str, Any]) -> str:
    head = ["threads", "calls succeeded", "calls failed", "exceptions", "still out", "texts/s", "p50", "p99"]
    failed = sum(row["failures"].values())
    types = ", ".join(f"{name}: {n}" for name, n in row["failures"].items()) or "none"
    cells = [row["threads"], row["succeeded"], failed, types, row["still_out"], f"{row['texts_per_s']:.0f}"]
    return markdown(head, [[*cells, millis(row["p50_ms"]), millis(row["p99_ms"])]])


def interactive_table(row: dict[str, Any]) -> str:
    head = ["bulk clients", "probe requests", "probe p50", "probe p99", "probe max", "probe non-2xx"]
    probe, bulk = row["probe"], row["bulk"]
    cells = [row["clients"], probe["sent"], *(millis(probe[f"{q}_ms"]) for q in ("p50", "p99", "max"))]
    cells += [probe["sent"] - probe["requests"], f"{bulk['items_per_s']:.0f}", bulk["refused_503"]]
    return markdown([*head, "bulk texts/s", "bulk 503"], [cells])


# -- load ---------------------------------------------------------------------


async def closed_loop(url: str, bodies: Sequence[bytes], clients: int, seconds: float) -> Tally:
    """``clients`` on a keep-alive connection each, sending one of ``bodies`` as each answer comes."""
    check_loopback(url)
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    wires = [openloop._encode(openloop.Request(b, parts.path), f"{host}:{port}", ()) for b in bodies]
    tally = Tally()
    end = time.monotonic() + seconds

    async def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < end:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port), REQUEST_TIMEOUT_S
                )
            except OSError:  # refused, or timed out (TimeoutError is an OSError)
                tally.connection_errors += 1
                # A refused connect fails at once: pause, or the client spins on the service's CPU.
                await asyncio.sleep(RECONNECT_PAUSE_S)
                continue
            try:
                while time.monotonic() < end:
                    started = time.monotonic()
                    writer.write(rng.choice(wires))
                    read = openloop._read_response(reader)
                    status, headers = await asyncio.wait_for(read, REQUEST_TIMEOUT_S)
                    tally.answers.append((time.monotonic() - started, status))
                    if headers.get("connection", "").lower() == "close":
                        break
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError):
                tally.connection_errors += 1
            finally:
                writer.close()

    began = time.monotonic()
    await asyncio.gather(*(client(seed) for seed in range(clients)))
    tally.elapsed_s = time.monotonic() - began
    return tally


def warm(url: str, bodies: Sequence[bytes], clients: int, seconds: float) -> None:
    asyncio.run(closed_loop(url, bodies, clients, min(WARM_S, seconds)))


def sweep(
    url: str, levels: Sequence[tuple[int, int]], bodies: Callable[[int], list[bytes]], seconds: float
) -> list[dict[str, Any]]:
    """A row per (clients, items a request) level, after a warm-up at the first level."""
    warm(url, bodies(levels[0][1]), levels[0][0], seconds)
    rows = []
    for clients, items in levels:
        time.sleep(SETTLE_S)
        tally = asyncio.run(closed_loop(url, bodies(items), clients, seconds))
        rows.append({"clients": clients, "items": items, **summarize(tally, items)})
        print(f"batched_clients: {url} at {clients} clients x {items}: {rows[-1]}", file=sys.stderr)
    return with_ratios(rows)


def service_info(url: str) -> tuple[str, int]:
    """The served model's name and the most items a request may carry (SERVE_MAX_ITEMS_PER_REQUEST)."""
    with urllib.request.urlopen(url + "/info", timeout=30) as response:
        info = json.load(response)
    return info["model"]["name"], int(info["limits"]["max_items_per_request"])


def check_items(items: int, limit: int, flag: str) -> None:
    if items > limit:
        raise SystemExit(
            f"batched_clients: {flag} sends {items} items a request, over the service's "
            f"SERVE_MAX_ITEMS_PER_REQUEST={limit}; raise it or send fewer"
        )


def rerank_scenario(
    env: dict[str, str], lines: list[str], levels: list[tuple[int, int]], seconds: float
) -> list[dict[str, Any]]:
    """On a service of its own, serving a cross-encoder written for the run and removed after."""
    with tempfile.TemporaryDirectory(prefix="rerank-model-") as directory:
        # A child process: torch stays out of the generator's process, and its
        # thread pool off the cores the service needs.
        make = [sys.executable, str(ROOT / "scripts/fixtures/make_rerank_model.py"), directory]
        subprocess.run(make, check=True, stdout=subprocess.DEVNULL)  # it prints the directory's path
        with serve({**env, "SERVE_MODEL": directory}, ready_timeout=300, all_workers=True) as service:
            model, limit = service_info(service.url)
            check_items(max(documents for _, documents in levels), limit, "--rerank")
            return sweep(
                service.url + RERANK, levels, lambda d: rerank_bodies(lines, model, d, BODIES), seconds
            )


def openai_scenario(
    url: str, model: str, lines: list[str], threads: int, texts: int, seconds: float
) -> dict[str, Any]:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused")  # its defaults: retries, timeout, pool
    latencies: list[float] = []  # appended from every thread: list.append is atomic
    failures: Counter[str] = Counter()
    wrong: Counter[str] = Counter()  # failures on an answer neither 2xx nor 503: a bug
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def caller(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < end:
            batch = window(lines, rng.randrange(len(lines)), texts)
            started = time.monotonic()
            try:
                client.embeddings.create(model=model, input=batch)
            except Exception as exc:  # whatever reaches the caller, after the SDK's own retries
                with lock:
                    failures[failure_name(exc)] += 1
                    wrong.update(unexpected({str(getattr(exc, "status_code", "")): 1}))
                continue
            latencies.append(time.monotonic() - started)

    # Daemons: a call still in its retries after the grace is reported, not waited for.
    workers = [threading.Thread(target=caller, args=(seed,), daemon=True) for seed in range(threads)]
    began = time.monotonic()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=max(0.0, end + OPENAI_GRACE_S - time.monotonic()))
    elapsed = time.monotonic() - began
    still_out = sum(worker.is_alive() for worker in workers)
    if not still_out:
        client.close()
    ms = openloop.percentiles(latencies)
    return {
        "threads": threads,
        "texts": texts,
        "succeeded": len(latencies),
        "failures": dict(sorted(failures.items())),
        "failed_non503": dict(wrong),
        "still_out": still_out,
        "texts_per_s": round(len(latencies) * texts / elapsed, 1),
        "p50_ms": ms["p50"],
        "p99_ms": ms["p99"],
    }


def interactive_scenario(
    url: str, model: str, lines: list[str], clients: int, texts: int, seconds: float, rate: float
) -> dict[str, Any]:
    bulk_bodies = embeddings_bodies(lines, model, texts, BODIES)
    probes = [openloop.Request(embeddings_body(model, [line]), EMBEDDINGS) for line in lines]
    times = openloop.schedule(rate, seconds, "poisson", random.Random(0))

    def pick(index: int) -> openloop.Request:
        return probes[(index * 7919) % len(probes)]  # a spread of lengths, the same every run

    async def both() -> tuple[Tally, openloop.Result]:
        # One loop for both: the probe leaves on its schedule whatever the bulk clients wait for.
        bulk = closed_loop(url + EMBEDDINGS, bulk_bodies, clients, seconds)
        return await asyncio.gather(bulk, openloop._run(url, pick, times, seconds, REQUEST_TIMEOUT_S, ()))

    bulk, probe = asyncio.run(both())
    return {
        "clients": clients,
        "texts": texts,
        "probe_rate": rate,
        "probe": summarize(probe_tally(probe), 1),
        "bulk": summarize(bulk, texts),
    }


def show(title: str, table: str) -> None:
    print(f"\n{title}:\n\n{table}", flush=True)


def on_embedding_service(env: dict[str, str], args: argparse.Namespace, lines: list[str]) -> dict[str, Any]:
    """The scenarios that share one warm service of the environment's model."""
    results: dict[str, Any] = {}
    texts, seconds = args.texts, args.seconds
    with serve(env, ready_timeout=300, all_workers=True) as service:
        url = service.url
        model, limit = service_info(url)
        check_items(texts, limit, "--texts")
        bodies = embeddings_bodies(lines, model, texts, BODIES)
        if args.embeddings:
            levels = [(clients, texts) for clients in args.embeddings]
            rows = results["embeddings"] = sweep(url + EMBEDDINGS, levels, lambda _: bodies, seconds)
            show(
                f"Embeddings, {texts} texts a request, {seconds:g} s a level",
                load_table(rows, "texts", False),
            )
        else:
            warm(url + EMBEDDINGS, bodies, 16, seconds)
        if args.openai_threads:
            time.sleep(SETTLE_S)
            row = results["openai"] = openai_scenario(url, model, lines, args.openai_threads, texts, seconds)
            show(f"openai SDK with its defaults, {texts} texts a call, {seconds:g} s", openai_table(row))
        if args.interactive:
            time.sleep(SETTLE_S)
            row = interactive_scenario(url, model, lines, args.interactive, texts, seconds, args.probe_rate)
            results["interactive"] = row
            rate = args.probe_rate
            show(f"One-text probe at {rate:g}/s beside bulk clients of {texts} texts", interactive_table(row))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--embeddings", type=clients_list, metavar="C,...", help="closed-loop client levels")
    parser.add_argument("--rerank", type=rerank_levels, metavar="CxD,...", help="clients x documents levels")
    parser.add_argument("--openai-threads", type=int, metavar="T", help="threads calling the openai SDK")
    parser.add_argument("--interactive", type=int, metavar="C", help="bulk clients beside a one-text probe")
    parser.add_argument("--texts", type=int, default=32, help="texts an embeddings request (default 32)")
    parser.add_argument("--probe-rate", type=float, default=5.0, help="probes a second (default 5)")
    parser.add_argument("--seconds", type=float, default=20, help="seconds a level (default 20)")
    parser.add_argument("--json", type=Path, default=None, help="also write every result here as JSON")
    args = parser.parse_args(argv)
    if not (args.embeddings or args.rerank or args.openai_threads or args.interactive):
        parser.error("choose a scenario: --embeddings, --rerank, --openai-threads or --interactive")
    if args.texts < 1 or args.seconds <= 0 or min(args.openai_threads or 1, args.interactive or 1) < 1:
        parser.error("--texts, --seconds, --openai-threads and --interactive must be positive")

    # Its own service on a loopback port: no token, and no token to write into the JSON.
    env = {k: v for k, v in os.environ.items() if k not in ("SERVE_BIND", "SERVE_API_TOKEN")}
    lines = read_lines()
    results: dict[str, Any] = {
        "seconds": args.seconds,
        "settings": {k: v for k, v in sorted(env.items()) if k.startswith("SERVE_")},
    }
    if args.embeddings or args.openai_threads or args.interactive:
        results.update(on_embedding_service(env, args, lines))
    if args.rerank:
        rows = results["rerank"] = rerank_scenario(env, lines, args.rerank, args.seconds)
        title = f"Rerank, a query and D documents a request, {args.seconds:g} s a level"
        show(title, load_table(rows, "documents", True))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    found = bugs(results)
    if found:
        print(f"batched_clients: {found} answer(s) were neither 2xx nor 503", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

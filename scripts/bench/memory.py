"""The service's memory over a long run of mixed-length real text at capacity, without worker recycling.

    .venv/bin/python scripts/bench/memory.py                        # 10 minutes, gthread
    .venv/bin/python scripts/bench/memory.py --worker-class gevent
    .venv/bin/python scripts/bench/memory.py --seconds 180 --env SERVE_ONEDNN_CACHE=1024  # as before the fix

It starts its own gunicorn on 127.0.0.1 with the default settings (SERVE_MAX_REQUESTS=0:
no worker is ever replaced) and keeps it at capacity with closed-loop clients, each
sending its next request as soon as it has an answer: 1 to 8 lines of
scripts/fixtures/corpus/mixed.txt per request on /predict/batched. Every ``--sample`` seconds
it reads, from /proc/PID/smaps_rollup, each worker's RSS, PSS and private memory and the
master's PSS. CPU workers share one copy of the model with the master (docs/topology.md,
"Memory: one copy per host"): RSS counts it in full in each worker, PSS divides it among
them, so the workers' PSS plus the master's is the service's memory, each page counted once.
At the end it prints a table of them over time, the requests answered a second, and the
verdict on the figures that say whether memory is flat:

- growth over the last half of the run (the last 5 minutes of 10): each worker's RSS, and
  the service's PSS (workers and master);
- the same at the end against the one-minute mark;
- flat: each of those growths is at most 3%.

Run it on a quiet machine: PSS divides the pages of shared files (torch's libraries) with
every process that maps them, so other torch processes starting and stopping move the
service's PSS by tens of MiB.

It exits 1 if a worker was replaced (its pid changed), since then its memory says
nothing, or if any request failed; a run that is not flat says so, and exits 0.
``SERVE_*`` variables in the environment reach the service, and ``--env NAME=VALUE``
adds more (any variable, e.g. LD_PRELOAD).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.common.launcher import Service, serve  # noqa: E402
from scripts.common.procs import rss_bytes  # noqa: E402
from service.telemetry.metrics import memory_rollup  # noqa: E402

CORPUS = ROOT / "scripts" / "fixtures" / "corpus" / "mixed.txt"
ROUTE = "/predict/batched"
MIB = 1 << 20
# Growth over the last half that still counts as flat: the goal for the service's PSS
# and for each worker.
FLAT_GROWTH_PCT = 3.0


@dataclass
class Tally:
    """What the clients got; one lock, taken once per answer."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    statuses: Counter[str] = field(default_factory=Counter)

    def add(self, status: str) -> None:
        with self.lock:
            self.statuses[status] += 1


def client(port: int, lines: list[str], seed: int, stop: threading.Event, tally: Tally) -> None:
    """One closed-loop client on its own kept-alive connection."""
    rng = random.Random(seed)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while not stop.is_set():
        body = json.dumps({"inputs": rng.sample(lines, rng.randint(1, 8))})
        try:
            conn.request("POST", ROUTE, body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            tally.add(str(response.status))
            if response.getheader("Connection", "").lower() == "close":
                conn.close()
        except (OSError, http.client.HTTPException):
            tally.add("connection error")
            conn.close()
    conn.close()


def measure(t: int, live: list[int], pids: list[int], master: int) -> dict:
    """One sample: each worker's RSS, PSS and private memory, the master's PSS, their total (MiB)."""
    rollups = [memory_rollup(pid) for pid in pids]
    master_rollup = memory_rollup(master)

    def mib(value: int) -> int:
        return round(value / MIB)

    pss = [mib(r.pss) if r else 0 for r in rollups]
    master_pss = mib(master_rollup.pss) if master_rollup else 0
    return {
        "t": t,
        "workers": live,
        "rss_mib": [mib(rss_bytes(pid) or 0) for pid in pids],
        "pss_mib": pss,
        "private_mib": [mib(r.private) if r else 0 for r in rollups],
        "master_pss_mib": master_pss,
        "service_pss_mib": sum(pss) + master_pss,
    }


def sample_memory(
    service: Service, pids: list[int], every: float, stop: threading.Event, rows: list[dict]
) -> None:
    started = time.monotonic()
    while not stop.wait(every):
        rows.append(measure(round(time.monotonic() - started), service.workers(), pids, service.process.pid))


def _growth_pct(end: float, start: float) -> float:
    return round(100 * (end - start) / start, 1) if start else 0.0


def verdict(rows: list[dict], pids: list[int], seconds: float) -> dict:
    """The flatness figures from the samples (pure): per worker, and for the service's PSS."""

    def at(t: float) -> dict:
        return min(rows, key=lambda row: abs(row["t"] - t))

    def growth(key: str) -> list[float]:
        return [_growth_pct(e, h) for e, h in zip(end[key], half[key], strict=True)]

    one_minute, half, end = at(60), at(seconds / 2), rows[-1]
    rss_growth = growth("rss_mib")
    service_growth = _growth_pct(end["service_pss_mib"], half["service_pss_mib"])
    return {
        "last_half_growth_pct": rss_growth,
        "end_over_one_minute": [
            round(e / m, 3) for e, m in zip(end["rss_mib"], one_minute["rss_mib"], strict=True)
        ],
        "pss_last_half_growth_pct": growth("pss_mib"),
        "private_last_half_growth_pct": growth("private_mib"),
        "service_pss_last_half_growth_pct": service_growth,
        "service_pss_end_over_one_minute": round(end["service_pss_mib"] / one_minute["service_pss_mib"], 3),
        "flat": all(g <= FLAT_GROWTH_PCT for g in (*rss_growth, service_growth)),
        "pids": pids,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=600, help="seconds of load (default 600)")
    parser.add_argument("--clients", type=int, default=64, help="closed-loop clients (default 64)")
    parser.add_argument("--worker-class", default="gthread", choices=("gthread", "gevent"))
    parser.add_argument("--sample", type=float, default=10, help="seconds between samples (default 10)")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the service (repeatable)")
    parser.add_argument("--json", type=Path, default=None, help="also write the samples and verdict here")
    args = parser.parse_args()

    env = {**os.environ, "SERVE_WORKER_CLASS": args.worker_class, "SERVE_MAX_REQUESTS": "0"}
    env.pop("SERVE_BIND", None)
    for pair in args.env:
        name, _, value = pair.partition("=")
        env[name] = value
    lines = [line.strip() for line in CORPUS.read_text().splitlines() if line.strip()]
    tally, rows = Tally(), []
    stop = threading.Event()
    with serve(env, all_workers=True) as service:
        pids = service.workers()
        with urllib.request.urlopen(f"{service.url}/info", timeout=30) as response:
            info = json.load(response)
        threads = [
            threading.Thread(target=client, args=(service.port, lines, seed, stop, tally), daemon=True)
            for seed in range(args.clients)
        ]
        sampler = threading.Thread(target=sample_memory, args=(service, pids, args.sample, stop, rows))
        started = time.monotonic()
        for thread in (*threads, sampler):
            thread.start()
        time.sleep(args.seconds)
        stop.set()
        elapsed = time.monotonic() - started
        for thread in (*threads, sampler):
            thread.join(timeout=70)
        replaced = any(row["workers"] != pids for row in rows)

    answered = sum(tally.statuses.values())
    result = {
        "worker_class": args.worker_class,
        "clients": args.clients,
        "env": args.env,
        "seconds": round(elapsed),
        "precision": info["precision"]["in_use"] if info["precision"] else None,
        "allocator": info["allocator"],
        "statuses": dict(tally.statuses),
        "ok_per_s": round(tally.statuses["200"] / elapsed, 1),
        "samples": rows,
        **verdict(rows, pids, args.seconds),
    }
    print(
        f"{args.worker_class}, {args.clients} clients, {result['seconds']} s, env {args.env or 'default'}; "
        f"precision {result['precision']}, allocator {result['allocator']}"
    )
    print(f"answers: {dict(tally.statuses)}; 200s a second: {result['ok_per_s']}")
    header = [f"worker {i} {what} (MiB)" for i in range(len(pids)) for what in ("RSS", "PSS", "private")]
    header += ["master PSS (MiB)", "service PSS (MiB)"]
    print("| t (s) | " + " | ".join(header) + " |")
    print("| ---: | " + " | ".join("---:" for _ in header) + " |")
    step = max(1, len(rows) // 20)
    shown = rows[::step] if rows[::step][-1] is rows[-1] else [*rows[::step], rows[-1]]
    for row in shown:
        cells = [
            f"{figure:,}"
            for worker in zip(row["rss_mib"], row["pss_mib"], row["private_mib"], strict=True)
            for figure in worker
        ]
        cells += [f"{row['master_pss_mib']:,}", f"{row['service_pss_mib']:,}"]
        print(f"| {row['t']} | " + " | ".join(cells) + " |")
    print(
        f"growth over the last half, per worker: RSS {result['last_half_growth_pct']} %,"
        f" PSS {result['pss_last_half_growth_pct']} %"
    )
    print(f"end / one-minute mark, per worker (RSS): {result['end_over_one_minute']}")
    print(
        "service PSS (workers + master): growth over the last half"
        f" {result['service_pss_last_half_growth_pct']} %,"
        f" end / one-minute mark {result['service_pss_end_over_one_minute']}"
    )
    last_half = rows[len(rows) // 2 :]

    def medians(key: str) -> list[float]:
        return [statistics.median(column) for column in zip(*(row[key] for row in last_half), strict=True)]

    service_pss = statistics.median(row["service_pss_mib"] for row in last_half)
    private = medians("private_mib")
    print(
        f"median over the last half: RSS {medians('rss_mib')} MiB, private {private} MiB per worker;"
        f" master PSS {statistics.median(row['master_pss_mib'] for row in last_half)} MiB;"
        f" service PSS {service_pss} MiB, of which held once (not the workers' private)"
        f" {service_pss - sum(private)} MiB"
    )
    flat = "yes" if result["flat"] else "no"
    print(
        f"flat (each worker's RSS and the service's PSS grow at most {FLAT_GROWTH_PCT:g}%"
        f" over the last half): {flat}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    # A 503 is the service shedding load, not a fault; anything else is.
    failed = answered - tally.statuses["200"] - tally.statuses["503"]
    if replaced:
        print("a worker was replaced during the run: its memory says nothing", file=sys.stderr)
    return 1 if replaced or failed else 0


if __name__ == "__main__":
    sys.exit(main())

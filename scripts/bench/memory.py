"""Worker memory over a long run of mixed-length real text at capacity, without worker recycling.

    .venv/bin/python scripts/bench/memory.py                        # 10 minutes, gthread
    .venv/bin/python scripts/bench/memory.py --worker-class gevent
    .venv/bin/python scripts/bench/memory.py --seconds 180 --env SERVE_ONEDNN_CACHE=1024  # as before the fix

It starts its own gunicorn on 127.0.0.1 with the default settings (SERVE_MAX_REQUESTS=0:
no worker is ever replaced) and keeps it at capacity with closed-loop clients, each
sending its next request as soon as it has an answer: 1 to 8 lines of
scripts/fixtures/corpus/mixed.txt per request on /predict/batched. Every ``--sample`` seconds
it reads each worker's RSS from /proc. At the end it prints a table of RSS per worker
over time, the requests answered a second, and the verdict on the two figures that
say whether memory is flat:

- growth over the last half of the run (the last 5 minutes of 10), per worker;
- RSS at the end against RSS at the one-minute mark, per worker.

It exits 1 if a worker was replaced (its pid changed), since then its RSS says
nothing, or if any request failed. ``SERVE_*`` variables in the environment reach the
service, and ``--env NAME=VALUE`` adds more (any variable, e.g. LD_PRELOAD).
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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.common.launcher import Service, serve  # noqa: E402
from scripts.common.procs import rss_bytes  # noqa: E402

CORPUS = ROOT / "scripts" / "fixtures" / "corpus" / "mixed.txt"
ROUTE = "/predict/batched"
MIB = 1 << 20


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


def sample_rss(
    service: Service, pids: list[int], every: float, stop: threading.Event, rows: list[dict]
) -> None:
    started = time.monotonic()
    while not stop.wait(every):
        rows.append(
            {
                "t": round(time.monotonic() - started),
                "workers": service.workers(),
                "rss_mib": [round((rss_bytes(pid) or 0) / MIB) for pid in pids],
            }
        )


def verdict(rows: list[dict], pids: list[int], seconds: float) -> dict:
    """The two flatness figures per worker, from the samples (pure)."""

    def at(t: float) -> list[int]:
        return min(rows, key=lambda row: abs(row["t"] - t))["rss_mib"]

    one_minute, half, end = at(60), at(seconds / 2), rows[-1]["rss_mib"]
    return {
        "last_half_growth_pct": [round(100 * (e - h) / h, 1) for e, h in zip(end, half, strict=True)],
        "end_over_one_minute": [round(e / m, 3) for e, m in zip(end, one_minute, strict=True)],
        "pids": pids,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=600, help="seconds of load (default 600)")
    parser.add_argument("--clients", type=int, default=64, help="closed-loop clients (default 64)")
    parser.add_argument("--worker-class", default="gthread", choices=("gthread", "gevent"))
    parser.add_argument("--sample", type=float, default=10, help="seconds between RSS samples (default 10)")
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
        threads = [
            threading.Thread(target=client, args=(service.port, lines, seed, stop, tally), daemon=True)
            for seed in range(args.clients)
        ]
        sampler = threading.Thread(target=sample_rss, args=(service, pids, args.sample, stop, rows))
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
        "statuses": dict(tally.statuses),
        "ok_per_s": round(tally.statuses["200"] / elapsed, 1),
        "samples": rows,
        **verdict(rows, pids, args.seconds),
    }
    print(f"{args.worker_class}, {args.clients} clients, {result['seconds']} s, env {args.env or 'default'}")
    print(f"answers: {dict(tally.statuses)}; 200s a second: {result['ok_per_s']}")
    print("| t (s) | " + " | ".join(f"worker {i} RSS (MiB)" for i in range(len(pids))) + " |")
    print("| ---: | " + " | ".join("---:" for _ in pids) + " |")
    step = max(1, len(rows) // 20)
    shown = rows[::step] if rows[::step][-1] is rows[-1] else [*rows[::step], rows[-1]]
    for row in shown:
        print(f"| {row['t']} | " + " | ".join(f"{rss:,}" for rss in row["rss_mib"]) + " |")
    print(f"growth over the last half, per worker: {result['last_half_growth_pct']} %")
    print(f"end / one-minute mark, per worker: {result['end_over_one_minute']}")
    last_half = zip(*(row["rss_mib"] for row in rows[len(rows) // 2 :]), strict=True)
    print(f"median RSS over the last half: {[statistics.median(column) for column in last_half]} MiB")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    # A 503 is the service shedding load, not a fault; anything else is.
    failed = answered - tally.statuses["200"] - tally.statuses["503"]
    if replaced:
        print("a worker was replaced during the run: its RSS says nothing", file=sys.stderr)
    return 1 if replaced or failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Clients that resend the moment they are answered, 503 included: goodput per 5 s window.

    .venv/bin/python scripts/load/resenders.py --worker-class gthread  # the three scenarios below
    .venv/bin/python scripts/load/resenders.py --worker-class gevent --seconds 20 --json /tmp/gevent.json

wrk, Locust's default users and most hand-written client loops send their next
request as soon as they have an answer and ignore ``Retry-After``. This script
reproduces that against its own gunicorn on 127.0.0.1 (default settings, the
``SERVE_*`` variables in the environment, default model), with each client on its
own kept-alive connection sending 1 to 8 lines of scripts/fixtures/corpus/mixed.txt to
/predict/batched. It runs three scenarios and prints goodput (200s a second) per
5 s window for each:

- **warm**: a started, warmed service meets 32, then 64, then 256 such clients
  (``--seconds`` each); 32 clients are within the latency budget, so their goodput
  is the capacity the others are compared with;
- **cold**: a fresh service meets 64, then (another fresh one) 256 clients the moment it
  is ready, as a new replica joining a busy cluster does; goodput over its first 20 s
  against the warm capacity;
- **disturbance**: 64 clients on a warm service, and 4 processes that spin on the
  CPU for 10 s in the middle; goodput from 15 s after they stop against before.

With ``--behind-nginx`` it runs the warm levels only, through nginx in front of
the service (deploy/nginx.conf as scripts/deploy/serve_behind_nginx.py renders it): nginx's
connections to the service carry every client's requests, so the service holds
none of them, and nginx's own settings decide what immediate resenders cost.

Loopback only; every part is bounded in time. It exits 1 if any answer was
neither 200 nor 503.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.common.launcher import serve  # noqa: E402
from scripts.deploy.serve_behind_nginx import fronting  # noqa: E402

CORPUS = ROOT / "scripts" / "fixtures" / "corpus" / "mixed.txt"
ROUTE = "/predict/batched"
WINDOW_S = 5.0
SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


class Load:
    """Closed-loop resenders for a bounded time; every answer's time and status, kept for windows."""

    def __init__(self, port: int, clients: int, lines: list[str]) -> None:
        self._port = port
        self._clients = clients
        self._lines = lines
        self._stop = threading.Event()
        self.started = 0.0
        self.answers: list[tuple[float, int]] = []  # (seconds since start, status); appends are atomic
        self.errors = 0

    def run(self, seconds: float, during: Any = None) -> None:
        threads = [threading.Thread(target=self._client, args=(seed,)) for seed in range(self._clients)]
        self.started = time.monotonic()
        for thread in threads:
            thread.start()
        if during is not None:
            during(self.started)
        time.sleep(max(0.0, self.started + seconds - time.monotonic()))
        self._stop.set()
        for thread in threads:
            thread.join(timeout=70)

    def windows(self, seconds: float) -> list[float]:
        """200s a second in each whole window of the run."""
        counts = Counter(int(t // WINDOW_S) for t, status in self.answers if status == 200 and t < seconds)
        return [counts[i] / WINDOW_S for i in range(int(seconds // WINDOW_S))]

    def statuses(self) -> dict[str, int]:
        found = Counter(str(status) for _, status in self.answers)
        if self.errors:
            found["connection error"] = self.errors
        return dict(found)

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        conn = http.client.HTTPConnection("127.0.0.1", self._port, timeout=60)
        while not self._stop.is_set():
            body = json.dumps({"inputs": rng.sample(self._lines, rng.randint(1, 8))})
            try:
                conn.request("POST", ROUTE, body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
            except (OSError, http.client.HTTPException):
                self.errors += 1
                conn.close()
                continue
            self.answers.append((time.monotonic() - self.started, response.status))
        conn.close()


def spin(processes: int, seconds: float) -> list[subprocess.Popen[bytes]]:
    """``processes`` busy loops that end by themselves after ``seconds``."""
    code = SPIN.format(seconds=seconds)
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(processes)]


def report(name: str, load: Load, seconds: float) -> dict[str, Any]:
    windows = load.windows(seconds)
    row = {"scenario": name, "windows_rps": windows, "statuses": load.statuses()}
    shown = [round(w, 1) for w in windows]
    print(f"{name}: 200s/s per {WINDOW_S:g} s window {shown}; answers {row['statuses']}")
    return row


def warm_levels(port: int, lines: list[str], seconds: float) -> list[dict[str, Any]]:
    Load(port, 32, lines).run(10)  # warm-up, not counted
    rows = []
    for clients in (32, 64, 256):
        load = Load(port, clients, lines)
        load.run(seconds)
        rows.append(report(f"warm, {clients} clients", load, seconds))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker-class", default="gthread", choices=("gthread", "gevent"))
    parser.add_argument("--seconds", type=float, default=30, help="seconds per warm level (default 30)")
    parser.add_argument("--json", type=Path, default=None, help="also write the windows here as JSON")
    parser.add_argument("--behind-nginx", action="store_true", help="only the warm levels, through nginx")
    args = parser.parse_args()
    env = {**os.environ, "SERVE_WORKER_CLASS": args.worker_class}
    env.pop("SERVE_BIND", None)
    lines = [line.strip() for line in CORPUS.read_text().splitlines() if line.strip()]
    rows = []

    if args.behind_nginx:
        with serve(env, all_workers=True) as service, fronting(service.port) as port:
            rows = warm_levels(port, lines, args.seconds)
        capacity = statistics.median(rows[0]["windows_rps"])
        print()
        print(f"behind nginx: capacity (median window, 32 clients): {capacity:.1f} req/s")
        for row in rows[1:]:
            print(f"{row['scenario']}: median window {statistics.median(row['windows_rps']) / capacity:.2f}x")
        if args.json:
            args.json.write_text(json.dumps({"behind_nginx": True, "capacity": capacity, "rows": rows}))
        return 1 if [row for row in rows if set(row["statuses"]) - {"200", "503"}] else 0

    with serve(env, all_workers=True) as service:
        rows = warm_levels(service.port, lines, args.seconds)
        capacity = statistics.median(rows[0]["windows_rps"])

        disturbed = Load(service.port, 64, lines)
        spinners: list[subprocess.Popen[bytes]] = []
        # 20 s before, 10 s of 4 spinning processes, then 40 s after.
        disturbed.run(
            70, during=lambda began: threading.Timer(20, lambda: spinners.extend(spin(4, 10))).start()
        )
        for process in spinners:
            process.wait(timeout=30)
        rows.append(report("disturbance at 20-30 s, 64 clients", disturbed, 70))

    for clients in (64, 256):
        with serve(env, all_workers=True) as service:
            cold = Load(service.port, clients, lines)
            cold.run(30)
            rows.append(report(f"cold, {clients} clients", cold, 30))

    before = statistics.median(rows[3]["windows_rps"][1:4])  # 5-20 s
    after = statistics.median(rows[3]["windows_rps"][9:])  # from 45 s: 15 s after the spinning ends
    print()
    print(f"capacity (median window, 32 clients): {capacity:.1f} req/s")
    for row in rows[1:3]:
        ratio = statistics.median(row["windows_rps"]) / capacity
        print(f"{row['scenario']}: median window {ratio:.2f}x capacity")
    for row in rows[4:]:
        first = statistics.mean(row["windows_rps"][:4])
        print(f"{row['scenario']}: first 20 s {first / capacity:.2f}x capacity")
    recovered, steady = after / before, before / capacity
    print(f"disturbance: from 15 s after it ends {recovered:.2f}x before it, {steady:.2f}x capacity")
    if args.json:
        args.json.write_text(
            json.dumps({"worker_class": args.worker_class, "capacity": capacity, "rows": rows})
        )
    unexpected = [row for row in rows if set(row["statuses"]) - {"200", "503"}]
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())

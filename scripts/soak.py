"""Soak test: the service under twice its capacity, bad requests and worker faults, for a bounded time.

    .venv/bin/python scripts/soak.py                       # 10 minutes on the default model
    .venv/bin/python scripts/soak.py --duration 60 --model mlp --workers 2

It starts its own gunicorn on 127.0.0.1 (it must own the master to signal it) and
sends traffic to that loopback address only. First it measures capacity with
closed-loop clients sending valid requests; then, for the rest of the time, it
sends requests at twice that rate on a fixed schedule (open loop), a share of
them malformed, while it SIGKILLs one worker a minute and sends one SIGHUP.

It reports requests sent, 2xx, 4xx, 503, 504, other 5xx, connection errors, lost
requests (sent and never answered within the client timeout) and the RSS of each
worker, and exits 1 if any request got another 5xx or was lost.
``SERVE_*`` variables in the environment reach the service, except SERVE_BIND.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import select
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.launcher import Service, serve  # noqa: E402
from scripts.procs import children, rss_bytes  # noqa: E402
from service.models.base import sample_item  # noqa: E402

OUTCOMES = ("2xx", "4xx", "503", "504", "other 5xx", "connection error", "lost")
JSON_HEADERS = {"Content-Type": "application/json"}


def classify(status: int) -> str:
    if 200 <= status < 300:
        return "2xx"
    if 400 <= status < 500:
        return "4xx"
    if status in (503, 504):
        return str(status)
    return "other 5xx"


# -- requests ---------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    kind: str
    body: bytes
    headers: dict[str, str]
    path: str = "/predict"


def valid_request(info: dict[str, Any], rng: random.Random) -> Request:
    item = sample_item(info["model"], rng)
    # The batched route: the naive one, there for comparison, has no queue of its own to bound.
    path = rng.choice(("/predict", "/predict/batched"))
    return Request("valid", json.dumps({"inputs": [item]}).encode(), JSON_HEADERS, path)


def bad_request(info: dict[str, Any], rng: random.Random) -> Request:
    """A malformed request of a random kind; each should get its 4xx (or a 504 for "deadline")."""
    limits = info["limits"]
    kind = rng.choice(("json", "type", "items", "media", "empty", "deadline", "oversize"))
    if kind == "json":
        return Request(kind, b'{"inputs": [', JSON_HEADERS)
    if kind == "type":
        return Request(kind, b'{"inputs": [{"not": "an item"}]}', JSON_HEADERS)
    if kind == "items":
        body = json.dumps({"inputs": [0] * (limits["max_items_per_request"] + 1)}).encode()
        return Request(kind, body, JSON_HEADERS)
    if kind == "media":
        return Request(kind, b"inputs=1", {"Content-Type": "application/x-www-form-urlencoded"})
    if kind == "empty":
        return Request(kind, b"", JSON_HEADERS)
    if kind == "deadline":  # a valid body with a deadline too short to meet: 504, or 200 if quick
        valid = valid_request(info, rng)
        return Request(kind, valid.body, {**JSON_HEADERS, "X-Request-Timeout-Ms": "1"}, "/predict/batched")
    return Request(kind, b" " * (limits["max_body_bytes"] + 1), JSON_HEADERS)


# -- client -------------------------------------------------------------------------


class Client:
    """One keep-alive connection, reopened when the server has closed it."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self._host, self._port, self._timeout = host, port, timeout
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        elif self._conn.sock is not None and select.select([self._conn.sock], [], [], 0)[0]:
            # As urllib3 does: an idle kept-alive socket that reads as ready was closed by
            # the server; http.client opens a new one on the next request.
            self._conn.close()
        return self._conn

    def send(self, request: Request) -> str:
        conn = self._connection()
        try:
            conn.request("POST", request.path, body=request.body, headers=request.headers)
            response = conn.getresponse()
            response.read()
            return classify(response.status)
        except TimeoutError:
            self.close()
            return "lost"
        except (OSError, http.client.HTTPException):
            self.close()
            return "connection error"

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    bad: Counter[tuple[str, str]] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: Request, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if request.kind != "valid":
                self.bad[(request.kind, outcome)] += 1

    @property
    def sent(self) -> int:
        with self.lock:
            return sum(self.outcomes.values())


def run_clients(count: int, target: Callable[[int], None]) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


def measure_capacity(
    server: Service, info: dict[str, Any], seconds: float, clients: int, timeout: float
) -> float:
    """Valid requests answered 2xx per second by closed-loop clients."""
    tally = Tally()
    until = time.monotonic() + seconds

    def loop(index: int) -> None:
        rng, client = random.Random(index), Client("127.0.0.1", server.port, timeout)
        while time.monotonic() < until:
            request = valid_request(info, rng)
            tally.add(request, client.send(request))
        client.close()

    started = time.monotonic()
    for thread in run_clients(clients, loop):
        thread.join()
    return tally.outcomes["2xx"] / (time.monotonic() - started)


def overload(
    server: Service,
    info: dict[str, Any],
    rate: float,
    seconds: float,
    bad_share: float,
    clients: int,
    timeout: float,
) -> tuple[Tally, float]:
    """Requests at ``rate`` per second on a fixed schedule, whatever the answers take (open loop)."""
    tally = Tally()
    lock = threading.Lock()
    next_ticket = [0]
    start = time.monotonic()
    tickets = int(rate * seconds)

    def loop(index: int) -> None:
        rng, client = random.Random(1000 + index), Client("127.0.0.1", server.port, timeout)
        while True:
            with lock:
                ticket = next_ticket[0]
                next_ticket[0] += 1
            if ticket >= tickets or time.monotonic() >= start + seconds:
                break  # bounded in time: a schedule the clients cannot keep is cut short
            # Pacing to the schedule; a client running late sends at once.
            time.sleep(max(0.0, start + ticket / rate - time.monotonic()))
            bad = rng.random() < bad_share
            request = bad_request(info, rng) if bad else valid_request(info, rng)
            tally.add(request, client.send(request))
        client.close()

    threads = run_clients(clients, loop)
    give_up = start + seconds + 2 * timeout
    for thread in threads:
        thread.join(max(0.0, give_up - time.monotonic()))
    # A client still blocked past every timeout holds a request nobody answered.
    tally.outcomes["lost"] += sum(thread.is_alive() for thread in threads)
    return tally, time.monotonic() - start


# -- faults and memory ----------------------------------------------------------------


@dataclass
class Faults:
    """SIGKILL one worker a minute and SIGHUP the master once, while ``stop`` is unset."""

    server: Service
    seconds: float
    log: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def schedule(self) -> list[tuple[float, str]]:
        kills = [(t, "SIGKILL") for t in range(15, int(self.seconds) - 5, 60)]
        return sorted([*kills, (self.seconds / 2 + 7, "SIGHUP")])

    def run(self) -> None:
        start = time.monotonic()
        for at, what in self.schedule():
            if self.stop.wait(max(0.0, start + at - time.monotonic())):
                return
            if what == "SIGHUP":
                os.kill(self.server.process.pid, signal.SIGHUP)
                self.log.append(f"{time.monotonic() - start:6.1f} s  SIGHUP master {self.server.process.pid}")
            elif workers := children(self.server.process.pid):
                victim = random.choice(workers)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
                self.log.append(f"{time.monotonic() - start:6.1f} s  SIGKILL worker {victim}")


@dataclass
class Memory:
    """RSS of every worker seen, sampled every few seconds once it has warmed up.

    A worker's first seconds (loading its model, filling its pools) are skipped,
    so growth measures what serving adds.
    """

    server: Service
    samples: dict[int, list[int]] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    warmup_s: float = 10.0
    first_seen: dict[int, float] = field(default_factory=dict)

    def run(self) -> None:
        while True:
            now = time.monotonic()
            for pid in children(self.server.process.pid):
                if now - self.first_seen.setdefault(pid, now) < self.warmup_s:
                    continue
                rss = rss_bytes(pid)
                if rss is not None:
                    self.samples.setdefault(pid, []).append(rss)
            if self.stop.wait(2.0):
                return


@contextlib.contextmanager
def background(task: Faults | Memory) -> Iterator[None]:
    thread = threading.Thread(target=task.run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        task.stop.set()
        thread.join(10)


# -- report ---------------------------------------------------------------------------


def report(
    capacity: float, rate: float, seconds: float, tally: Tally, faults: Faults, memory: Memory
) -> dict[str, Any]:
    mib = 1 << 20
    workers = [
        {
            "pid": pid,
            "samples": len(rss),
            "first_mib": round(rss[0] / mib, 1),
            "last_mib": round(rss[-1] / mib, 1),
            "peak_mib": round(max(rss) / mib, 1),
            "growth_mib": round((rss[-1] - rss[0]) / mib, 1),
        }
        for pid, rss in sorted(memory.samples.items())
    ]
    return {
        "capacity_rps": round(capacity, 1),
        "target_rps": round(rate, 1),
        "achieved_rps": round(tally.sent / seconds, 1),
        "seconds": round(seconds, 1),
        "sent": tally.sent,
        "outcomes": {name: tally.outcomes[name] for name in OUTCOMES},
        "bad_requests": {f"{kind} -> {outcome}": n for (kind, outcome), n in sorted(tally.bad.items())},
        "faults": faults.log,
        "workers": workers,
    }


def print_report(result: dict[str, Any]) -> None:
    print(f"capacity (closed loop)  {result['capacity_rps']} req/s")
    print(
        f"load (open loop)        target {result['target_rps']} req/s, "
        f"achieved {result['achieved_rps']} req/s for {result['seconds']} s"
    )
    print(f"requests sent           {result['sent']}")
    for name, count in result["outcomes"].items():
        print(f"  {name:<21} {count}")
    print("bad requests (kind -> outcome)")
    for name, count in result["bad_requests"].items():
        print(f"  {name:<21} {count}")
    print("faults")
    for line in result["faults"]:
        print(f"  {line}")
    print("worker RSS (MiB), warm  pid: first -> last (peak), growth, samples")
    for w in result["workers"]:
        print(
            f"  {w['pid']:>8}: {w['first_mib']} -> {w['last_mib']} ({w['peak_mib']}), "
            f"{w['growth_mib']:+}, {w['samples']}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600, help="total seconds of traffic (default 600)")
    parser.add_argument("--model", default=None, help="SERVE_MODEL for the service (default: the service's)")
    parser.add_argument("--workers", type=int, default=None, help="SERVE_WORKERS (default: the service's)")
    parser.add_argument("--bad-share", type=float, default=0.1, help="share of malformed requests (0.1)")
    parser.add_argument("--clients", type=int, default=128, help="client threads for the open-loop phase")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here as JSON")
    args = parser.parse_args(argv)
    if args.duration < 30:
        parser.error("--duration must be at least 30 seconds")

    env = dict(os.environ)
    if args.model:
        env["SERVE_MODEL"] = args.model
    if args.workers:
        env["SERVE_WORKERS"] = str(args.workers)
    calibrate = min(20.0, args.duration / 6)
    # Every worker up before calibrating, or the capacity measured is a fraction of the real one.
    with serve(env, ready_timeout=300, all_workers=True) as server:
        info = json.loads(_get(server, "/info"))
        try:
            sample_item(info["model"])
        except ValueError as exc:
            parser.error(str(exc))
        timeout = info["limits"]["request_timeout_ms"] / 1000 + 30  # a deadline, then some
        print(
            f"soak: {info['model']['name']} on {server.url}, calibrating for {calibrate:.0f} s",
            file=sys.stderr,
        )
        capacity = measure_capacity(server, info, calibrate, clients=32, timeout=timeout)
        rate = max(1.0, 2 * capacity)
        seconds = args.duration - calibrate
        print(
            f"soak: capacity {capacity:.0f} req/s; sending {rate:.0f} req/s for {seconds:.0f} s",
            file=sys.stderr,
        )
        faults, memory = Faults(server, seconds), Memory(server)
        with background(memory), background(faults):
            tally, elapsed = overload(server, info, rate, seconds, args.bad_share, args.clients, timeout)
        result = report(capacity, rate, elapsed, tally, faults, memory)
    print_report(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    failed = result["outcomes"]["other 5xx"] + result["outcomes"]["lost"]
    print("PASS" if not failed else f"FAIL: {failed} requests got another 5xx or were lost")
    return 1 if failed else 0


def _get(server: Service, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main())

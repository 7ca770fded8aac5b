"""Soak test: open-loop overload, a spike, bad requests and worker faults, for a bounded time.

    .venv/bin/python scripts/load/soak.py                  # 10 minutes on the default model
    .venv/bin/python scripts/load/soak.py --duration 60 --model mlp --workers 2 --spike-seconds 10

It starts its own gunicorn on 127.0.0.1 (it must own the master to signal it) and
sends traffic to that loopback address only. First it measures capacity with
32 closed-loop clients sending valid requests; then, for the rest of the time,
requests arrive on a Poisson schedule at twice that rate, whatever the service
does (open loop, scripts/load/openloop.py), with a spike to five times it for
``--spike-seconds`` in the middle, a share of them malformed, while it SIGKILLs
one worker a minute and sends one SIGHUP. Valid requests are lines of
scripts/fixtures/corpus/mixed.txt (real mixed-length prose) for a text model, random
items for others.

It reports what was offered, the goodput (200s a second), accepted latency
p50/p99 from each request's scheduled send, answers by status (2xx, 4xx, 503,
504, other 5xx, connection errors, lost: never answered within the client
timeout), the service's own count of refusals by reason, and each worker's RSS
over time. It exits 1 if any request got another 5xx or was lost. A worker's
memory over a long run, with no worker replaced, is scripts/bench/memory.py's.
``SERVE_*`` variables in the environment reach the service, except SERVE_BIND.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.common.launcher import Service, serve  # noqa: E402
from scripts.common.procs import children, rss_bytes  # noqa: E402
from scripts.load import openloop  # noqa: E402
from service.models.base import sample_item  # noqa: E402

OUTCOMES = ("2xx", "4xx", "503", "504", "other 5xx", "connection error", "lost")
JSON_HEADERS = {"Content-Type": "application/json"}


def classify(status: str) -> str:
    """An open-loop outcome (an HTTP status, or openloop's words for the others) as one of OUTCOMES."""
    if status == openloop.CONNECTION_ERROR:
        return "connection error"
    if status == openloop.TIMED_OUT:
        return "lost"
    code = int(status)
    if 200 <= code < 300:
        return "2xx"
    if 400 <= code < 500:
        return "4xx"
    if code in (503, 504):
        return str(code)
    return "other 5xx"


# -- requests ---------------------------------------------------------------------


Request = openloop.Request
JSON = (("Content-Type", "application/json"),)


def valid_requests(info: dict[str, Any], rng: random.Random, count: int = 256) -> list[Request]:
    """Valid requests for the batched route (the naive one has no queue of its own to bound)."""
    paths = ("/predict", "/predict/batched")
    if info["model"]["item_kind"] == "text":
        return [Request(r.body, rng.choice(paths)) for r in openloop.corpus_requests("/predict/batched")]
    return [
        Request(json.dumps({"inputs": [sample_item(info["model"], rng)]}).encode(), rng.choice(paths))
        for _ in range(count)
    ]


def bad_request(info: dict[str, Any], valid: Request, rng: random.Random) -> Request:
    """A malformed request of a random kind; each should get its 4xx (or a 504 for "deadline")."""
    limits = info["limits"]
    kind = rng.choice(("json", "type", "items", "media", "empty", "deadline", "oversize"))
    path = "/predict"
    if kind == "json":
        return Request(b'{"inputs": [', path, headers=JSON, kind=kind)
    if kind == "type":
        return Request(b'{"inputs": [{"not": "an item"}]}', path, headers=JSON, kind=kind)
    if kind == "items":
        body = json.dumps({"inputs": [0] * (limits["max_items_per_request"] + 1)}).encode()
        return Request(body, path, headers=JSON, kind=kind)
    if kind == "media":
        return Request(
            b"inputs=1", path, headers=(("Content-Type", "application/x-www-form-urlencoded"),), kind=kind
        )
    if kind == "empty":
        return Request(b"", path, headers=JSON, kind=kind)
    if kind == "deadline":  # a valid body with a deadline too short to meet: 504, or 200/503
        return Request(
            valid.body, "/predict/batched", headers=(*JSON, ("X-Request-Timeout-Ms", "1")), kind=kind
        )
    return Request(b" " * (limits["max_body_bytes"] + 1), path, headers=JSON, kind=kind)


def mix(info: dict[str, Any], bad_share: float, seed: int = 1000) -> Callable[[int], Request]:
    """Request ``index`` of the open-loop schedule: valid, or malformed with probability ``bad_share``."""
    rng = random.Random(seed)
    valid = valid_requests(info, rng)
    # Drawn up front: the generator's loop should not pay for JSON encoding.
    drawn = []
    for _ in range(8192):
        pick = rng.choice(valid)
        drawn.append(bad_request(info, pick, rng) if rng.random() < bad_share else pick)
    return lambda index: drawn[index % len(drawn)]


def overload_schedule(
    rate: float, seconds: float, spike_rate: float, spike_seconds: float, seed: int = 7
) -> tuple[list[float], float]:
    """Poisson send times at ``rate``, plus more during a spike to ``spike_rate`` in the middle; its start."""
    rng = random.Random(seed)
    spike_start = max(0.0, (seconds - spike_seconds) / 2)
    extra = [spike_start + t for t in openloop.schedule(spike_rate - rate, spike_seconds, "poisson", rng)]
    return sorted(openloop.schedule(rate, seconds, "poisson", rng) + extra), spike_start


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
    so growth measures what serving adds. ``timeline`` is the RSS of all live
    workers together, from the start of the overload.
    """

    server: Service
    samples: dict[int, list[int]] = field(default_factory=dict)
    timeline: list[tuple[float, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    warmup_s: float = 10.0
    first_seen: dict[int, float] = field(default_factory=dict)

    def run(self) -> None:
        start = time.monotonic()
        while True:
            now = time.monotonic()
            total = 0
            for pid in children(self.server.process.pid):
                rss = rss_bytes(pid)
                total += rss or 0
                if now - self.first_seen.setdefault(pid, now) < self.warmup_s:
                    continue
                if rss is not None:
                    self.samples.setdefault(pid, []).append(rss)
            self.timeline.append((now - start, total))
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


def rejections(server: Service) -> dict[str, int]:
    """The service's own count of 503s by reason, over every worker and model since the master started."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(_get(server, "/metrics")):
        for sample in family.samples:
            if sample.name == "serve_rejected_requests_total":  # one series per (model, reason)
                counts[sample.labels["reason"]] += sample.value
    return {reason: round(n) for reason, n in counts.items() if n}


def phase(result: openloop.Result, start: float, end: float) -> dict[str, Any]:
    """Offered rate, goodput and accepted latency of the valid requests scheduled in [start, end)."""
    inside = [o for o in result.outcomes if start <= o.scheduled < end]
    ok = [o for o in inside if o.status == "200" and o.kind == "valid"]
    seconds = max(end - start, 1e-9)
    return {
        "offered_rps": round(len(inside) / seconds, 1),
        "goodput_rps": round(len(ok) / seconds, 1),
        "accepted_ms": openloop.percentiles([o.latency_s for o in ok]),
    }


def report(
    capacity: float,
    result: openloop.Result,
    spike: tuple[float, float],
    faults: Faults,
    memory: Memory,
    refused: dict[str, int],
) -> dict[str, Any]:
    mib = 1 << 20
    outcomes = Counter(classify(o.status) for o in result.outcomes)
    bad = Counter((o.kind, classify(o.status)) for o in result.outcomes if o.kind != "valid")
    summary = result.summary()
    spike_start, spike_seconds = spike
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
    # One point every 30 s is enough to see a trend in a report.
    timeline = [(round(t), round(total / mib, 1)) for t, total in memory.timeline[::15]]
    return {
        "capacity_rps": round(capacity, 1),
        "target_rps": round(2 * capacity, 1),
        "spike_rps": round(5 * capacity, 1),
        "achieved_rps": summary["sent_rps"],
        "seconds": round(result.seconds, 1),
        "sent": len(result.outcomes),
        "goodput_rps": summary["goodput_rps"],
        "accepted_ms": openloop.percentiles(
            [o.latency_s for o in result.outcomes if o.status == "200" and o.kind == "valid"]
        ),
        "steady": phase(result, 0, spike_start),
        "spike": phase(result, spike_start, spike_start + spike_seconds),
        "outcomes": {name: outcomes[name] for name in OUTCOMES},
        "refused_by_reason": refused,
        "drain_s": summary["drain_s"],
        "behind_schedule": summary["behind_schedule"],
        "generator_cpu_s": summary["generator_cpu_s"],
        "bad_requests": {f"{kind} -> {outcome}": n for (kind, outcome), n in sorted(bad.items())},
        "faults": faults.log,
        "workers": workers,
        "rss_timeline_mib": timeline,
    }


def print_report(result: dict[str, Any]) -> None:
    def latency(ms: dict[str, float]) -> str:
        return f"p50 {ms['p50']:.0f} ms, p99 {ms['p99']:.0f} ms, max {ms['max']:.0f} ms"

    print(f"capacity (32 closed-loop clients)  {result['capacity_rps']} req/s")
    print(
        f"offered (open loop, Poisson)       {result['target_rps']} req/s, {result['spike_rps']} req/s "
        f"in the spike; sent {result['achieved_rps']} req/s on average for {result['seconds']} s"
    )
    print(f"goodput                            {result['goodput_rps']} req/s (valid and bad requests' 200s)")
    print(f"accepted latency (valid)           {latency(result['accepted_ms'])}")
    for name in ("steady", "spike"):
        p = result[name]
        print(
            f"  {name:<6} offered {p['offered_rps']} req/s, goodput {p['goodput_rps']} req/s, "
            f"{latency(p['accepted_ms'])}"
        )
    print(f"backlog drained {result['drain_s']} s after the last send")
    behind = result["behind_schedule"]
    print(
        f"generator: {behind['late_sends']} sends over 10 ms late (p99 {behind['p99_ms']} ms), "
        f"{result['generator_cpu_s']} s of CPU"
    )
    print(f"requests sent                      {result['sent']}")
    for name, count in result["outcomes"].items():
        print(f"  {name:<21} {count}")
    print("503s by the service's reason       " + json.dumps(result["refused_by_reason"]))
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
    print(
        "all workers' RSS over time (s: MiB)  "
        + ", ".join(f"{t}: {m}" for t, m in result["rss_timeline_mib"])
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600, help="total seconds of traffic (default 600)")
    parser.add_argument("--model", default=None, help="SERVE_MODEL for the service (default: the service's)")
    parser.add_argument("--workers", type=int, default=None, help="SERVE_WORKERS (default: the service's)")
    parser.add_argument("--bad-share", type=float, default=0.1, help="share of malformed requests (0.1)")
    parser.add_argument("--spike-seconds", type=float, default=30, help="seconds at 5x capacity (default 30)")
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
        url = server.url + "/predict/batched"
        print(
            f"soak: {info['model']['name']} on {server.url}, calibrating for {calibrate:.0f} s",
            file=sys.stderr,
        )
        capacity = openloop.closed_loop(url, valid_requests(info, random.Random(0)), 32, calibrate)
        rate = max(1.0, 2 * capacity)
        seconds = args.duration - calibrate
        spike_seconds = min(args.spike_seconds, seconds / 2)
        times, spike_start = overload_schedule(rate, seconds, 5 * capacity, spike_seconds)
        print(
            f"soak: capacity {capacity:.0f} req/s; offering {rate:.0f} req/s for {seconds:.0f} s, "
            f"{5 * capacity:.0f} req/s for {spike_seconds:.0f} s of it",
            file=sys.stderr,
        )
        faults, memory = Faults(server, seconds), Memory(server)
        with background(memory), background(faults):
            result = openloop.run(
                url, mix(info, args.bad_share), rate, seconds, times=times, timeout_s=timeout
            )
        refused = rejections(server)
        outcome = report(capacity, result, (spike_start, spike_seconds), faults, memory, refused)
    print_report(outcome)
    if args.json is not None:
        args.json.write_text(json.dumps(outcome, indent=2) + "\n")
    failed = outcome["outcomes"]["other 5xx"] + outcome["outcomes"]["lost"]
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

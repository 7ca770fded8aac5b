"""The overload table: open-loop load at multiples of the measured capacity, per worker class.

    .venv/bin/python scripts/load/overload.py --worker-class gthread --multiples 2 5 --seconds 30
    .venv/bin/python scripts/load/overload.py --worker-class gevent --multiples 2 5 --seconds 30
    .venv/bin/python scripts/load/overload.py --multiples 20 --texts 1-8 --recovery-seconds 15
    .venv/bin/python scripts/load/overload.py --refusal-cost

For each worker class it starts the service (its own gunicorn on 127.0.0.1, the
``SERVE_*`` settings in the environment, default model: all-MiniLM-L6-v2),
measures capacity with 32 closed-loop clients sending lines of
scripts/fixtures/corpus/mixed.txt, and a lone request's latency; then, for each multiple,
offers that many times the capacity on a Poisson schedule (scripts/load/openloop.py)
and reports goodput, answers by status, accepted latency from the scheduled
send, how long the backlog took to drain after the last send, and /readyz and
a lone request's latency right after. Capacity is measured again after each row, and
the row's goodput is set against the mean of the readings before and after it: a
shared machine's speed can drift by a third within minutes, and one reading taken in
a fast or a slow minute would make the ratio. Rows print as a Markdown table.

``--texts 1-8``: each request carries 1 to 8 lines instead of one, as clients
that send a few texts at a time do (capacity is then measured with the same
requests). ``--recovery-seconds S``: after the overload the schedule goes on at
capacity itself for S seconds, and the row adds goodput from 5 s after the
overload ended to the end, against capacity: whether the service came back.

``--behind-nginx``: everything (capacity included) goes through nginx in front
of the service (scripts/deploy/serve_behind_nginx.py, deploy/nginx.conf as rendered);
``--nginx-arg=--max-in-flight=N`` passes an argument on to it.

``--refusal-cost`` measures the worker CPU one refusal costs: requests whose
``X-Request-Start`` says they already waited past the budget, at a fixed rate
against one worker, beside the CPU one served request costs at capacity.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.common.launcher import serve  # noqa: E402
from scripts.common.procs import children  # noqa: E402
from scripts.deploy.serve_behind_nginx import fronting  # noqa: E402
from scripts.load import openloop  # noqa: E402

# Goodput is back when, from this long after the overload ends, it matches capacity again.
RECOVERED_AFTER_S = 5.0
# Closed-loop clients for capacity: enough to fill batches (more are answered
# too, up to their deadline, but only wait longer).
CLIENTS = 32
LONE_TEXT = "A man is eating food while the children play outside in the garden."


def lone_latency_ms(port: int, tries: int = 5) -> float:
    """Median latency of ``tries`` requests sent one after another on one connection."""
    body = json.dumps({"inputs": [LONE_TEXT]}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    took = []
    try:
        for _ in range(tries):
            started = time.monotonic()
            conn.request("POST", "/predict/batched", body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            if response.status == 200:
                took.append(time.monotonic() - started)
    finally:
        conn.close()
    return round(1000 * statistics.median(took), 1) if took else float("nan")


def readyz(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/readyz")
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def table(
    worker_class: str,
    multiples: list[float],
    seconds: float,
    texts: tuple[int, int] = (1, 1),
    recovery_s: float = 0.0,
    nginx: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    env = dict(os.environ, SERVE_WORKER_CLASS=worker_class)
    requests = openloop.corpus_requests("/predict/batched", texts=texts)
    rows = []
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(serve(env, ready_timeout=300, all_workers=True))
        # Through nginx, capacity and everything after are measured through it too.
        port = server.port if nginx is None else stack.enter_context(fronting(server.port, nginx))
        url = f"http://127.0.0.1:{port}/predict/batched"
        before = lone_latency_ms(port)
        capacity_s = min(20.0, seconds)
        service = server.process.pid
        capacity, cores = _capacity(url, requests, capacity_s, service)
        print(f"overload: {worker_class}: capacity {capacity:.0f} req/s", file=sys.stderr)
        for multiple in multiples:
            time.sleep(2)  # let the previous run's connections close
            rng = random.Random(0)
            times = openloop.schedule(multiple * capacity, seconds, "poisson", rng)
            # Then capacity itself: what the service serves once the overload is over.
            times += [seconds + t for t in openloop.schedule(capacity, recovery_s, "poisson", rng)]
            cpu, started = _service_cpu_s(service), time.monotonic()
            result = openloop.run(url, requests, multiple * capacity, seconds + recovery_s, times=times)
            wall = time.monotonic() - started
            used = _service_cpu_s(service) - cpu
            rows.append(
                {
                    "worker_class": worker_class + (" behind nginx" if nginx is not None else ""),
                    "capacity_rps": round(capacity, 1),
                    "texts_per_request": f"{texts[0]}-{texts[1]}" if texts[0] != texts[1] else str(texts[0]),
                    "multiple": multiple,
                    **overload_phase(result, seconds).summary(),
                    "recovered_rps": recovered_rps(result, seconds, recovery_s),
                    "readyz_after": readyz(port),
                    "lone_ms_before": before,
                    "lone_ms_after": lone_latency_ms(port),
                    "cores": {
                        "machine": len(os.sched_getaffinity(0)),
                        "service_at_capacity": round(cores, 3),
                        "service": round(used / wall, 3),
                        "generator": round(result.cpu_s / wall, 3),
                    },
                    "refusal_cpu_ms": refusal_cpu_ms(result, used, capacity, cores),
                }
            )
            # This machine's speed drifts within minutes, so each row is judged against the
            # capacity measured on both sides of it, and the next row starts from the later one.
            time.sleep(2)
            after, cores = _capacity(url, requests, capacity_s, service)
            print(f"overload: {worker_class}: {after:.0f} req/s after {multiple:g}x", file=sys.stderr)
            rows[-1]["capacity_after_rps"] = round(after, 1)
            capacity, before = after, rows[-1]["lone_ms_after"]
    return rows


def _capacity(
    url: str, requests: list[openloop.Request], seconds: float, service: int
) -> tuple[float, float]:
    """Capacity (req/s) from CLIENTS closed-loop clients, and the cores the service used meanwhile."""
    cpu, started = _service_cpu_s(service), time.monotonic()
    rps = openloop.closed_loop(url, requests, clients=CLIENTS, seconds=seconds)
    return rps, (_service_cpu_s(service) - cpu) / (time.monotonic() - started)


def _service_cpu_s(master: int) -> float:
    """CPU seconds of gunicorn's master and its workers so far (a worker replaced meanwhile is missed)."""
    total = 0.0
    for pid in (master, *children(master)):
        with contextlib.suppress(OSError):  # it exited meanwhile
            total += _cpu_s(pid)
    return total


def refusal_cpu_ms(
    result: openloop.Result, service_cpu_s: float, capacity: float, cores: float
) -> float | None:
    """The service's CPU per refusal in a run: what it used less its served requests at their capacity cost.

    Rough: a served request costs more under contention than at capacity, and
    less in the fuller batches an overload makes; either difference lands here.
    """
    statuses = result.by_status()
    refused, served = statuses.get("503", 0), statuses.get("200", 0)
    if not refused or capacity <= 0:
        return None
    return round(1000 * max(0.0, service_cpu_s - served * cores / capacity) / refused, 3)


def refusal_free_bound(row: dict[str, Any]) -> float | None:
    """The goodput a row could reach, against capacity, if refusals cost nothing.

    The cores the generator leaves the service, against those the service used at capacity.
    """
    cores = row.get("cores")
    if not cores or cores["service_at_capacity"] <= 0:
        return None
    return (cores["machine"] - cores["generator"]) / cores["service_at_capacity"]


def bracketed(row: dict[str, Any]) -> float:
    """The capacity a row's goodput is set against: the mean of the readings before and after it."""
    return (row["capacity_rps"] + row.get("capacity_after_rps", row["capacity_rps"])) / 2


def overload_phase(result: openloop.Result, seconds: float) -> openloop.Result:
    """The requests sent during the overload alone, as if nothing followed them."""
    sent = [o for o in result.outcomes if o.scheduled < seconds]
    return openloop.Result(
        rate=len(sent) / seconds,
        seconds=seconds,
        outcomes=sent,
        cpu_s=result.cpu_s,
        last_answer_s=max((o.scheduled + o.latency_s for o in sent), default=0.0),
        peak_connections=result.peak_connections,
    )


def recovered_rps(result: openloop.Result, seconds: float, recovery_s: float) -> float | None:
    """200s a second answered from RECOVERED_AFTER_S after the overload ended until the run's end."""
    if recovery_s <= RECOVERED_AFTER_S:
        return None
    start, end = seconds + RECOVERED_AFTER_S, seconds + recovery_s
    ok = sum(o.status == "200" and start <= o.scheduled + o.latency_s < end for o in result.outcomes)
    return round(ok / (end - start), 1)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| offered | texts a request | capacity before → after | goodput (against their mean) "
        "| 200 | 503 | other | accepted p50 | accepted p99 "
        f"| drained after | goodput from {RECOVERED_AFTER_S:g} s after | /readyz after "
        "| lone request before → after | cores: service at capacity / in the row, generator "
        "| bound | a refusal |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        status = dict(r["by_status"])
        ok, refused = status.pop("200", 0), status.pop("503", 0)
        other = ", ".join(f"{k}: {v}" for k, v in status.items()) or "none"
        recovered = r["recovered_rps"]
        capacity = bracketed(r)
        back = "not run"
        if recovered is not None:
            back = f"{recovered:.0f} req/s ({recovered / capacity:.2f}x)"
        lines.append(
            f"| {r['multiple']:g}x capacity, {r['worker_class']} ({r['offered_rps']:.0f} req/s) "
            f"| {r['texts_per_request']} | {r['capacity_rps']:.0f} → {r['capacity_after_rps']:.0f} req/s "
            f"| {r['goodput_rps']:.0f} req/s ({r['goodput_rps'] / capacity:.2f}x) "
            f"| {ok} | {refused} | {other} "
            f"| {r['accepted_ms']['p50'] / 1000:.2f} s | {r['accepted_ms']['p99'] / 1000:.2f} s "
            f"| {r['drain_s']:.2f} s | {back} | {r['readyz_after']} "
            f"| {r['lone_ms_before']:.0f} → {r['lone_ms_after']:.0f} ms "
            f"| {_cores(r)} | {_ratio(refusal_free_bound(r))} | {_ms(r.get('refusal_cpu_ms'))} |"
        )
    return "\n".join(lines)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def refusal_cost(rate: float, seconds: float) -> dict[str, Any]:
    """Worker CPU per refused request, and per served one at capacity, on one worker."""
    env = dict(os.environ, SERVE_WORKERS="1")
    requests = openloop.corpus_requests("/predict/batched")
    with serve(env, ready_timeout=300, all_workers=True) as server:
        [worker] = children(server.process.pid)
        url = server.url + "/predict/batched"
        # As nginx would stamp a request that waited 300 s: past any budget, and
        # within what the service trusts (service.http.arrival, 600 s) for the whole run.
        stale = (("X-Request-Start", f"t={time.time() - 300:.3f}"),)
        cpu = _cpu_s(worker)
        refused = openloop.run(url, requests, rate, seconds, headers=stale)
        refused_cpu = _cpu_s(worker) - cpu
        n_refused = refused.by_status().get("503", 0)
        cpu = _cpu_s(worker)
        started = time.monotonic()
        # Few clients: one worker, and none of them refused, so that only served requests count.
        capacity = openloop.closed_loop(url, requests, clients=8, seconds=seconds)
        served_cpu = _cpu_s(worker) - cpu
        n_served = capacity * (time.monotonic() - started)
    return {
        "refused": n_refused,
        "refused_statuses": refused.by_status(),
        "refusal_cpu_ms": round(1000 * refused_cpu / max(n_refused, 1), 3),
        "refused_latency_ms": refused.summary()["refused_ms"],
        "served_rps": round(capacity, 1),
        "served_cpu_ms": round(1000 * served_cpu / max(n_served, 1), 2),
    }


def _cores(row: dict[str, Any]) -> str:
    cores = row.get("cores")
    if not cores:
        return ""
    used = f"{cores['service_at_capacity']:.2f} / {cores['service']:.2f}"
    return f"{used}, {cores['generator']:.2f} of {cores['machine']}"


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.2f} ms"


def texts_range(text: str) -> tuple[int, int]:
    low, dash, high = text.partition("-")
    try:
        span = (int(low), int(high if dash else low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or LOW-HIGH") from None
    if not 1 <= span[0] <= span[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LOW <= HIGH")
    return span


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker-class", choices=("gthread", "gevent", "sync"), default="gthread")
    parser.add_argument("--multiples", type=float, nargs="+", default=[2.0, 5.0])
    parser.add_argument("--seconds", type=float, default=30, help="seconds of load per row (default 30)")
    parser.add_argument(
        "--texts",
        type=texts_range,
        default=(1, 1),
        help="texts a request: N, or LOW-HIGH drawn at random per request (default 1)",
    )
    parser.add_argument(
        "--recovery-seconds",
        type=float,
        default=0.0,
        help=f"then offer capacity itself this long, and report goodput from {RECOVERED_AFTER_S:g} s "
        "after the overload ended (default 0: no recovery phase)",
    )
    parser.add_argument(
        "--behind-nginx",
        action="store_true",
        help="send everything through nginx in front of the service (scripts/deploy/serve_behind_nginx.py)",
    )
    parser.add_argument(
        "--nginx-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="with --behind-nginx, one more argument to scripts/deploy/serve_behind_nginx.py; repeatable",
    )
    parser.add_argument("--refusal-cost", action="store_true", help="instead: what one refusal costs")
    parser.add_argument("--rate", type=float, default=500, help="refusals a second for --refusal-cost")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here as JSON")
    args = parser.parse_args(argv)
    if args.refusal_cost:
        result: Any = refusal_cost(args.rate, args.seconds)
        print(json.dumps(result, indent=2))
    else:
        result = table(
            args.worker_class,
            args.multiples,
            args.seconds,
            args.texts,
            args.recovery_seconds,
            args.nginx_arg if args.behind_nginx else None,
        )
        print(markdown(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

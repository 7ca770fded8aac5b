#!/usr/bin/env python3
"""What the request path costs: the service on a free model against a bare Flask handler.

    .venv/bin/python scripts/bench/overhead.py                 # 64 clients, 4 routes, 3 rounds
    .venv/bin/python scripts/bench/overhead.py --routes batched --seconds 10 --repeat 1
    .venv/bin/python scripts/bench/overhead.py --worker-class gevent
    .venv/bin/python scripts/bench/overhead.py --routes batched --repeat 1 --profile  # where the time goes
    .venv/bin/python scripts/bench/overhead.py --rate 200 --routes batched,naive  # at a model's pace

The model takes no time (scripts/fixtures/free_model.py: each text in, the same 384 floats
out), so what a request costs is the request path alone. Beside the service runs
scripts/bench/bare_flask.py under plain gunicorn with the same worker class, workers and
threads: it parses the same JSON bodies with orjson and returns the same floats.
wrk drives each with the same closed-loop clients (one text of
scripts/fixtures/corpus/mixed.txt per request, cycling); CPU per request is the CPU of the
whole gunicorn process tree over the run (utime + stime from /proc, master and
workers) divided by the requests answered; beside it, the share of that CPU spent in the
kernel and the voluntary context switches of the workers' threads per request (each time
one waited: for the GIL, a lock, a socket), also from /proc. Each round measures the bare handler
and then every route of the service, each in a gunicorn of its own started for it;
the table gives medians over the rounds and the ratios against the bare handler.
Both servers run with SERVE_*/gunicorn defaults otherwise: the service's access
line, metrics, admission and request ids all stay on, as in production.

With --rate R the load is open-loop instead (scripts/load/openloop.py, one process,
outside the measured tree): R requests a second on a Poisson schedule, the pace a
real model sets rather than the most a free one allows. A request then costs more
than at saturation, for the bare handler too: each one wakes gunicorn's event loop
and a thread of its own instead of sharing their turns with its neighbours, and
what the request path takes at that pace is what it takes from the model's cores.

With --profile it then runs the first route once more while py-spy samples one
worker's Python, counting only the thread that holds the GIL (``--gil``), and
prints where those samples fall: each sample goes to the innermost frame of a
known part (metrics, the access line, the batcher, the door, Flask, gunicorn...).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.common.launcher import LaunchError, free_port, planned, serve, stop  # noqa: E402
from scripts.common.procs import children, cpu_split_seconds, voluntary_switches  # noqa: E402
from scripts.load.loadgen import LoadResult, run_load  # noqa: E402
from scripts.load.openloop import Request, percentiles  # noqa: E402
from scripts.load.openloop import run as run_open_loop  # noqa: E402

CORPUS = ROOT / "scripts" / "fixtures" / "corpus" / "mixed.txt"
FREE_MODEL = "scripts.fixtures.free_model:create"
BARE = "bare Flask"
# route name -> (path, how one text becomes that protocol's request body)
ROUTES = {
    "batched": ("/predict/batched", lambda text: {"inputs": [text]}),
    "naive": ("/predict/naive", lambda text: {"inputs": [text]}),
    "embeddings": ("/v1/embeddings", lambda text: {"input": text, "model": "free"}),
    "v2": (
        "/v2/models/free/infer",
        lambda text: {"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES", "data": [text]}]},
    ),
}
WARM_UP_S = 2.0
SAMPLE_RATE = 200  # py-spy samples a second
# Where a sampled stack's time goes: the innermost frame whose file matches a part wins.
PARTS = (
    ("metrics (prometheus-client)", ("prometheus_client/", "service/telemetry/metrics.py")),
    ("access line (logging)", ("logging/", "service/telemetry/logs.py", "service/http/access.py")),
    ("batcher and hand-off", ("service/batching/",)),
    ("admission at the door", ("service/http/door.py", "service/http/arrival.py")),
    (
        "parse, validate, encode",
        (
            "service/http/payload.py",
            "service/http/v2",
            "service/http/openai_api.py",
            "service/models/",
            "orjson",
        ),
    ),
    ("Flask and werkzeug", ("flask/", "werkzeug/", "blinker/")),
    (
        "gunicorn (HTTP, event loop)",
        ("gunicorn/", "service/host/", "selectors.py", "concurrent/futures/thread.py"),
    ),
)
# Frames of no part (threading.py, concurrent/futures/_base.py: a Future, a Condition) count
# toward the part that called them: the batcher's futures to the batcher, gunicorn's to gunicorn.


@dataclass(frozen=True)
class Run:
    server: str
    requests: int
    errors: int
    seconds: float
    cpu_s: float
    p50_ms: float
    sys_s: float = 0.0  # of cpu_s, in the kernel
    switches: int = 0  # voluntary context switches of the workers' threads

    @property
    def sys_share(self) -> float:
        return self.sys_s / self.cpu_s if self.cpu_s else 0.0

    @property
    def switches_per_request(self) -> float:
        return self.switches / max(1, self.requests)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000 * self.cpu_s / max(1, self.requests)


def main() -> int:
    args = parse_args()
    texts = [line for line in CORPUS.read_text().splitlines() if line][: args.texts]
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SERVE_")},
        "SERVE_MODEL": FREE_MODEL,
        "SERVE_WORKERS": str(args.workers),
        "SERVE_WORKER_CLASS": args.worker_class,
        "SERVE_MAX_REQUESTS": "0",  # a replaced worker would take its CPU time with it
        "PYTHONPATH": str(ROOT),
    }
    threads = planned_threads(env)
    load = f"{args.rate:g} req/s open-loop" if args.rate else f"{args.clients} clients"
    print(
        f"{args.workers} workers x {threads} threads ({args.worker_class}), {load}, "
        f"{args.seconds:g} s a run, {args.repeat} round(s), {len(texts)} texts of {CORPUS.name}",
        flush=True,
    )
    runs: dict[str, list[Run]] = {}
    for round_ in range(args.repeat):
        for name in (BARE, *args.routes):
            path, make = ROUTES.get(name, ("/predict/batched", ROUTES["batched"][1]))
            bodies = [json.dumps(make(text)).encode() for text in texts]
            starter = (
                bare_flask(env, args.workers, threads, args.worker_class) if name == BARE else service(env)
            )
            with starter as (url, pid):
                run = measure(name, url + path, pid, bodies, args)
            runs.setdefault(name, []).append(run)
            print(
                f"round {round_ + 1}: {name:<11} {run.rps:8.0f} req/s  "
                f"{run.cpu_ms_per_request:6.3f} ms CPU/request ({run.sys_share:4.0%} system, "
                f"{run.switches_per_request:4.1f} switches)  p50 {run.p50_ms:6.2f} ms  "
                f"errors {run.errors}",
                flush=True,
            )
    if runs:
        print()
        print(table(runs, args.routes))
    if args.profile:
        path, make = ROUTES[args.routes[0]]
        bodies = [json.dumps(make(text)).encode() for text in texts]
        with bare_flask(env, args.workers, threads, args.worker_class) as (url, pid):
            bare = profile(url + path, pid, bodies, args)
        with service(env) as (url, pid):
            served = profile(url + path, pid, bodies, args)
        print()
        print(f"Where a worker's Python time goes on `{path}` (py-spy --gil; us of GIL held per request):")
        print()
        print(parts_table(bare, served))
    return 1 if any(run.errors for rs in runs.values() for run in rs) else 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument(
        "--rate", type=float, help="offer this many requests a second, open-loop, in place of --clients"
    )
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the table gives medians (0: none)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker-class", choices=("gthread", "gevent"), default="gthread")
    parser.add_argument(
        "--routes",
        type=lambda s: [r for r in s.split(",") if r],
        default=list(ROUTES),
        help=f"comma-separated, of {', '.join(ROUTES)} (default: all)",
    )
    parser.add_argument("--texts", type=int, default=2000, help="lines of the corpus to cycle through")
    parser.add_argument("--profile", action="store_true", help="then profile the first route with py-spy")
    args = parser.parse_args()
    unknown = set(args.routes) - set(ROUTES)
    if unknown:
        parser.error(f"unknown routes {sorted(unknown)}; pick from {', '.join(ROUTES)}")
    return args


def planned_threads(env: dict[str, str]) -> int:
    """The request threads per worker gunicorn_conf.py plans for ``env``: the bare server gets as many."""
    return planned(env).threads


@contextlib.contextmanager
def service(env: dict[str, str]) -> Iterator[tuple[str, int]]:
    with serve(env, all_workers=True) as running:
        yield running.url, running.process.pid


@contextlib.contextmanager
def bare_flask(
    env: dict[str, str], workers: int, threads: int, worker_class: str
) -> Iterator[tuple[str, int]]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "gunicorn",
        f"--worker-class={worker_class}",
        f"--workers={workers}",
        f"--threads={threads}",
        "--keep-alive=75",  # as the service's gunicorn_conf.py
        f"--bind=127.0.0.1:{port}",
        "scripts.bench.bare_flask:app",
    ]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_answers(url + "/predict", process, log)
            yield url, process.pid
        finally:
            stop(process)


def wait_answers(url: str, process: subprocess.Popen[bytes], log: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            request = urllib.request.Request(
                url, data=b'{"inputs": ["x"]}', headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=2):
                return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise LaunchError(f"the bare Flask app did not answer on {url}") from None
            time.sleep(0.2)  # a port coming up: nothing to block on


def measure(name: str, url: str, pid: int, bodies: list[bytes], args: argparse.Namespace) -> Run:
    drive(url, bodies, args, WARM_UP_S)  # connections, caches, the batch thread's first batches
    user0, system0, switches0 = tree_counts(pid)
    result = drive(url, bodies, args, args.seconds)
    user1, system1, switches1 = tree_counts(pid)
    user, system = user1 - user0, system1 - system0
    return Run(
        name,
        result.requests,
        result.errors,
        result.seconds,
        user + system,
        result.p50_ms,
        system,
        switches1 - switches0,
    )


def drive(url: str, bodies: list[bytes], args: argparse.Namespace, seconds: float) -> LoadResult:
    """Closed-loop wrk with ``args.clients``, or with ``args.rate`` open-loop arrivals."""
    if not args.rate:
        return run_load(url, bodies, args.clients, seconds)
    path = urllib.parse.urlsplit(url).path
    outcomes = run_open_loop(url, [Request(body, path) for body in bodies], args.rate, seconds).outcomes
    ok = [o.latency_s for o in outcomes if o.status == "200"]
    ms = percentiles(ok)
    errors = len(outcomes) - len(ok)
    return LoadResult(0, seconds, len(ok), errors, ms["p50"], ms["p90"], ms["p99"], "openloop")


def tree_counts(pid: int) -> tuple[float, float, int]:
    """User CPU, system CPU and voluntary context switches of gunicorn's master and workers so far."""
    processes = [pid, *children(pid)]
    splits = [cpu_split_seconds(p) for p in processes]
    return (
        sum(user for user, _ in splits),
        sum(system for _, system in splits),
        sum(voluntary_switches(p) for p in processes),
    )


@dataclass(frozen=True)
class Profile:
    samples: Counter[str]  # py-spy samples by part
    seconds: float  # sampled
    requests: int  # answered by all workers meanwhile
    workers: int

    def us_per_request(self, part: str) -> float:
        """GIL-held time in ``part`` per request, taking the sampled worker to serve its share."""
        held_s = self.samples[part] / SAMPLE_RATE
        return 1e6 * held_s / max(1.0, self.requests / self.workers)


def profile(url: str, pid: int, bodies: list[bytes], args: argparse.Namespace) -> Profile:
    """py-spy's GIL-holding samples of one worker under the same load, counted by part."""
    worker = children(pid)[0]
    drive(url, bodies, args, WARM_UP_S)
    seconds = max(1, round(args.seconds))
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp, "profile.txt")
        command = [
            str(Path(sys.executable).with_name("py-spy")),
            "record",
            "--gil",
            "--rate",
            str(SAMPLE_RATE),
        ]
        command += ["--format", "raw", "--duration", str(seconds), "--pid", str(worker), "--output", str(raw)]
        spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # The load spans the sampling: it runs as long, and py-spy starts first.
        result = drive(url, bodies, args, seconds)
        if spy.wait(timeout=60) != 0 or not raw.exists():
            raise SystemExit("py-spy could not sample the worker (it needs ptrace: run as root or allow it)")
        samples = count_parts(raw.read_text().splitlines())
    return Profile(samples, seconds, result.requests, len(children(pid)))


def count_parts(lines: list[str]) -> Counter[str]:
    """Samples by part, from py-spy's raw format: ``frame;frame;... count`` per line, outermost first."""
    counts: Counter[str] = Counter()
    for line in lines:
        stack, _, number = line.rstrip().rpartition(" ")
        if not stack or not number.isdigit():
            continue
        counts[part_of(stack.split(";"))] += int(number)
    return counts


def part_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, markers in PARTS:
            if any(marker in frame for marker in markers):
                return name
    return "other"


def parts_table(bare: Profile, served: Profile) -> str:
    lines = ["| part | bare Flask | service |", "| --- | ---: | ---: |"]
    for name in [name for name, _ in PARTS] + ["other"]:
        lines.append(f"| {name} | {bare.us_per_request(name):.0f} | {served.us_per_request(name):.0f} |")
    total = [
        sum(p.us_per_request(name) for name in [*(n for n, _ in PARTS), "other"]) for p in (bare, served)
    ]
    lines.append(f"| all | {total[0]:.0f} | {total[1]:.0f} |")
    return "\n".join(lines)


def table(runs: dict[str, list[Run]], routes: list[str]) -> str:
    bare_cpu = statistics.median(r.cpu_ms_per_request for r in runs[BARE])
    bare_rps = statistics.median(r.rps for r in runs[BARE])
    lines = [
        "| server | CPU per request (ms) | of it, system | switches per request | req/s "
        "| CPU vs bare | req/s vs bare |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in [BARE, *routes]:
        label = BARE if name == BARE else f"service `{ROUTES[name][0]}`"
        cpu = statistics.median(r.cpu_ms_per_request for r in runs[name])
        system = statistics.median(r.sys_share for r in runs[name])
        switches = statistics.median(r.switches_per_request for r in runs[name])
        rps = statistics.median(r.rps for r in runs[name])
        lines.append(
            f"| {label} | {cpu:.3f} | {system:.0%} | {switches:.1f} | {rps:,.0f} "
            f"| {cpu / bare_cpu:.2f}x | {rps / bare_rps:.2f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

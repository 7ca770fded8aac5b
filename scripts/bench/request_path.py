#!/usr/bin/env python3
"""The request path's own Python time: the service's WSGI app against a bare Flask handler, in process.

    .venv/bin/python scripts/bench/request_path.py                # 4 routes, 5 rounds
    .venv/bin/python scripts/bench/request_path.py --routes naive --profile

scripts/bench/overhead.py measures what users pay, through gunicorn and wrk, and on a
small shared VM its figures move by a tenth or more from one run to the next.
This measures the part that code changes move, with nothing else in the way:
no server, no sockets, no other process. Each request's WSGI environ is built
beforehand (werkzeug's EnvironBuilder, one line of scripts/fixtures/corpus/mixed.txt a
request); the app is called with it, one request at a time, and the figure is
the process's CPU time (every thread's: the batch thread's share included) over
the requests. The service runs the free model (scripts/fixtures/free_model.py) with
everything on but the access line's output (its record is made and dropped);
scripts/bench/bare_flask.py is the reference, measured in the same rounds. One
request at a time means every request finds the worker idle: the metrics are
flushed twice a request, and each batched request is a batch of its own.

With --profile, cProfile then shows where the first route's time goes (request
thread only: cProfile does not follow the batch thread).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.overhead import CORPUS, FREE_MODEL, ROUTES  # noqa: E402

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def main() -> int:
    args = parse_args()
    from werkzeug.test import EnvironBuilder

    from scripts.bench import bare_flask
    from service import create_app
    from service.config.settings import Settings
    from service.runtime import EXTENSION
    from service.telemetry.logs import ACCESS_LOGGER

    # The line's record is made and handled, as in production; a handler that
    # drops it keeps the output out of the figures (and of the terminal).
    access = logging.getLogger(ACCESS_LOGGER)
    access.setLevel(logging.INFO)
    access.addHandler(logging.NullHandler())
    access.propagate = False

    texts = [line for line in CORPUS.read_text().splitlines() if line]
    service = create_app(Settings(model=FREE_MODEL))
    service.extensions[EXTENSION].wait_loaded(60)

    def environs(route: str) -> list[dict[str, Any]]:
        path, make = ROUTES[route]
        return [
            EnvironBuilder(
                path=path,
                method="POST",
                data=orjson.dumps(make(texts[i % len(texts)])),
                content_type="application/json",
            ).get_environ()
            for i in range(args.requests)
        ]

    print(
        f"{args.requests} requests a run, one at a time, {args.rounds} rounds; "
        f"us of CPU a request (all threads), medians",
        flush=True,
    )
    bare: list[float] = []
    served: dict[str, list[float]] = {route: [] for route in args.routes}
    for _ in range(args.rounds):
        bare.append(cpu_us_per_request(bare_flask.app, environs(args.routes[0])))
        for route in args.routes:
            served[route].append(cpu_us_per_request(service, environs(route)))
    reference = statistics.median(bare)
    print()
    print("| app | us a request | vs bare |")
    print("| --- | ---: | ---: |")
    print(f"| bare Flask | {reference:.1f} | 1.00x |")
    for route, runs in served.items():
        us = statistics.median(runs)
        print(f"| `{ROUTES[route][0]}` | {us:.1f} | {us / reference:.2f}x |")
    if args.profile:
        print()
        print(profile(service, environs(args.routes[0]), args.top))
    sys.stdout.flush()
    # The batch thread is a native thread that the interpreter would wait on at exit.
    os._exit(0)


def cpu_us_per_request(app: WsgiApp, environs: list[dict[str, Any]]) -> float:
    started = time.process_time()
    for environ in environs:
        answer = app(environ, _start_response)
        for _ in answer:
            pass
        close = getattr(answer, "close", None)
        if close is not None:
            close()
    return 1e6 * (time.process_time() - started) / len(environs)


def _start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
    if not status.startswith("200"):
        raise SystemExit(f"the app answered {status}")


def profile(app: WsgiApp, environs: list[dict[str, Any]], top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    cpu_us_per_request(app, environs)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=5000, help="requests a run")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each app; the table gives medians")
    parser.add_argument(
        "--routes",
        type=lambda s: [r for r in s.split(",") if r],
        default=list(ROUTES),
        help=f"comma-separated, of {', '.join(ROUTES)} (default: all)",
    )
    parser.add_argument("--profile", action="store_true", help="then cProfile the first route")
    parser.add_argument("--top", type=int, default=30, help="functions the profile lists")
    args = parser.parse_args()
    unknown = set(args.routes) - set(ROUTES)
    if unknown:
        parser.error(f"unknown routes {sorted(unknown)}; pick from {', '.join(ROUTES)}")
    return args


if __name__ == "__main__":
    sys.exit(main())

"""Open-loop HTTP load: requests leave on a schedule whatever the service does, as from many users.

    .venv/bin/python scripts/load/openloop.py http://127.0.0.1:8000/predict/batched --rate 400 --seconds 30
    .venv/bin/python scripts/load/openloop.py http://127.0.0.1:8000/healthz --method GET \
        --rate 3000 --seconds 10

Each request has a scheduled send time, fixed (``--schedule fixed``: every
1/rate s) or Poisson (exponential gaps, the default), and its latency is timed
from that time, not from when it actually left: a generator that fell behind,
or a request that waited for a connection, still counts the whole delay (no
coordinated omission). Every request gets its own keep-alive connection for as
long as it is in flight, so in-flight requests never wait for each other; the
generator reports how far behind its own schedule it fell, and its own CPU time.

By default the bodies are lines of scripts/fixtures/corpus/mixed.txt (real mixed-length
prose, one sentence a line) as ``{"inputs": [line]}``. Loopback targets only.
``run()`` is the library entry (scripts/load/soak.py and the tests use it); the
command line prints its summary as JSON.

One asyncio loop in one process, by design: on a 2-core machine the generator
must leave the service most of the CPU. Its own ceiling (measured against
/healthz, see docs/overload.md) is what it can offer while staying on
schedule; past it, the "behind" figures grow and the summary says so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.common.launcher import free_port  # noqa: E402
from scripts.deploy.serve_behind_nginx import find_nginx  # noqa: E402
from scripts.load.loadgen import check_loopback  # noqa: E402

CORPUS = ROOT / "scripts" / "fixtures" / "corpus" / "mixed.txt"
# A send later than this behind its scheduled time counts as behind schedule.
LATE_S = 0.010
# Idle keep-alive connections kept for reuse; enough for thousands of short requests a second.
MAX_IDLE = 64
# Outcomes that are not an HTTP status.
CONNECTION_ERROR = "connection error"
TIMED_OUT = "timed out"


@dataclass(frozen=True)
class Request:
    """What one scheduled request sends; ``kind`` groups the outcomes in the report."""

    body: bytes
    path: str
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)
    kind: str = "valid"


@dataclass
class Outcome:
    scheduled: float  # seconds from the start
    sent_late_s: float
    latency_s: float
    status: str  # "200", "503", ..., CONNECTION_ERROR or TIMED_OUT
    kind: str
    retry_after: bool


@dataclass
class Result:
    rate: float
    seconds: float
    outcomes: list[Outcome] = field(default_factory=list)
    cpu_s: float = 0.0
    last_answer_s: float = 0.0  # from the start until the last answer came back
    peak_connections: int = 0

    def by_status(self, kind: str | None = None) -> dict[str, int]:
        counts = Counter(o.status for o in self.outcomes if kind is None or o.kind == kind)
        return dict(sorted(counts.items()))

    def summary(self) -> dict[str, Any]:
        ok = [o for o in self.outcomes if o.status == "200"]
        refused = [o for o in self.outcomes if o.status == "503"]
        late = sorted(o.sent_late_s for o in self.outcomes)
        last_ok = max((o.scheduled + o.latency_s for o in ok), default=0.0)
        return {
            "offered_rps": round(self.rate, 1),
            "seconds": round(self.seconds, 1),
            "sent": len(self.outcomes),
            "sent_rps": round(len(self.outcomes) / self.seconds, 1) if self.seconds else 0.0,
            "by_status": self.by_status(),
            # 200s per second, counted until the last 200 came back.
            "goodput_rps": round(len(ok) / last_ok, 1) if last_ok else 0.0,
            "accepted_ms": percentiles([o.latency_s for o in ok]),
            "refused_ms": percentiles([o.latency_s for o in refused]),
            "refused_with_retry_after": sum(o.retry_after for o in refused),
            # After the last scheduled send, until the last answer: the backlog left behind.
            "drain_s": round(max(0.0, self.last_answer_s - self.seconds), 2),
            "behind_schedule": {
                "late_sends": sum(x > LATE_S for x in late),
                "p99_ms": round(1000 * late[int(0.99 * (len(late) - 1))], 1) if late else 0.0,
                "max_ms": round(1000 * late[-1], 1) if late else 0.0,
            },
            "peak_connections": self.peak_connections,
            "generator_cpu_s": round(self.cpu_s, 2),
            "generator_cpu_share": round(self.cpu_s / max(self.last_answer_s, 1e-9), 3),
        }


def percentiles(seconds: Sequence[float]) -> dict[str, float]:
    if not seconds:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    ms = sorted(1000 * s for s in seconds)

    def at(q: float) -> float:
        return round(ms[min(len(ms) - 1, int(q * len(ms)))], 1)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": round(ms[-1], 1)}


def schedule(rate: float, seconds: float, kind: str, rng: random.Random) -> list[float]:
    """Send times from the start: every 1/rate s, or Poisson arrivals at ``rate``."""
    if rate <= 0 or seconds <= 0:
        return []
    if kind == "fixed":
        return [i / rate for i in range(int(rate * seconds))]
    times, t = [], rng.expovariate(rate)
    while t < seconds:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def corpus_requests(
    path: str, corpus: Path = CORPUS, texts: tuple[int, int] = (1, 1), count: int = 4096, seed: int = 0
) -> list[Request]:
    """Batched requests of corpus lines: one per line, ``{"inputs": [line]}``, by default.

    ``texts=(low, high)``: ``count`` requests instead, each of between ``low``
    and ``high`` lines drawn at random (seeded), as clients that send a few
    texts at a time do.
    """
    lines = [line.strip() for line in corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    if texts == (1, 1):
        return [Request(json.dumps({"inputs": [line]}).encode(), path) for line in lines]
    rng = random.Random(seed)
    return [
        Request(json.dumps({"inputs": rng.sample(lines, rng.randint(*texts))}).encode(), path)
        for _ in range(count)
    ]


def _encode(request: Request, host: str, extra: Sequence[tuple[str, str]]) -> bytes:
    head = [f"{request.method} {request.path} HTTP/1.1", f"Host: {host}"]
    head += [f"{name}: {value}" for name, value in (*request.headers, *extra)]
    if request.method != "GET" or request.body:
        head.append(f"Content-Length: {len(request.body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + request.body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ", 2)[1])
    headers = {name.strip().lower(): value.strip() for name, _, value in (ln.partition(":") for ln in lines)}
    await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers


class _Pool:
    """Idle keep-alive connections; a request takes one or opens a new one, never waits for one."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.open = 0
        self.peak = 0

    async def take(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self.idle:
            reader, writer = self.idle.pop()
            # Closed by the server while idle (a restarted worker, its keep-alive timeout).
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            self.drop(writer)
        reader, writer = await asyncio.open_connection(self.host, self.port)
        self.open += 1
        self.peak = max(self.peak, self.open)
        return reader, writer

    def give(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        # Past a burst, surplus idle connections are closed: held open, each would
        # keep one of a worker's connections (SERVE_WORKER_CONNECTIONS) for its whole
        # keep-alive time, as a real client's pool does not.
        if len(self.idle) >= MAX_IDLE:
            self.drop(conn[1])
        else:
            self.idle.append(conn)

    def drop(self, writer: asyncio.StreamWriter) -> None:
        self.open -= 1
        writer.close()


async def _run(
    url: str,
    pick: Callable[[int], Request],
    times: list[float],
    seconds: float,
    timeout_s: float,
    headers: Sequence[tuple[str, str]],
) -> Result:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    pool = _Pool(host, port)
    result = Result(rate=len(times) / seconds if seconds else 0.0, seconds=seconds)
    encoded: dict[int, bytes] = {}
    start = time.monotonic()
    cpu_start = time.process_time()

    async def one(index: int, at: float, late: float) -> None:
        request = pick(index)
        key = id(request)
        wire = encoded.get(key)
        if wire is None:
            wire = encoded[key] = _encode(request, f"{host}:{port}", headers)
        status, retry_after = CONNECTION_ERROR, False
        writer = None
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await pool.take()
                writer.write(wire)
                code, got = await _read_response(reader)
            status, retry_after = str(code), "retry-after" in got
            if got.get("connection", "").lower() == "close":
                pool.drop(writer)
            else:
                pool.give((reader, writer))
            writer = None
        except TimeoutError:
            status = TIMED_OUT
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError):
            pass
        finally:
            if writer is not None:
                pool.drop(writer)
        now = time.monotonic() - start
        result.last_answer_s = max(result.last_answer_s, now)
        result.outcomes.append(Outcome(at, late, now - at, status, request.kind, retry_after))

    tasks = set()
    for index, at in enumerate(times):
        delay = at - (time.monotonic() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        late = max(0.0, time.monotonic() - start - at)
        task = asyncio.create_task(one(index, at, late))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks)
    for _, writer in pool.idle:
        writer.close()
    result.cpu_s = time.process_time() - cpu_start
    result.peak_connections = pool.peak
    return result


def run(
    url: str,
    requests: Sequence[Request] | Callable[[int], Request],
    rate: float,
    seconds: float,
    *,
    kind: str = "poisson",
    seed: int = 0,
    timeout_s: float = 60.0,
    headers: Sequence[tuple[str, str]] = (),
    times: Sequence[float] | None = None,
) -> Result:
    """Send ``rate`` requests a second for ``seconds``; wait for every answer (or its timeout).

    ``requests``: a list taken in a seeded random order, or a function of the
    request's index (to mix kinds of requests). ``times``: send times from the
    start, in order, in place of a schedule at ``rate`` (a spike on top of it).
    """
    check_loopback(url)
    rng = random.Random(seed)
    if callable(requests):
        pick = requests
    else:
        pool = list(requests)
        order = [rng.randrange(len(pool)) for _ in range(4096)]

        def pick(index: int) -> Request:
            return pool[order[index % len(order)]]

    sends = list(times) if times is not None else schedule(rate, seconds, kind, rng)
    return asyncio.run(_run(url, pick, sends, seconds, timeout_s, headers))


def closed_loop(url: str, requests: Sequence[Request], clients: int, seconds: float) -> float:
    """Capacity: 200s per second from ``clients`` each sending its next request when the last is answered."""
    check_loopback(url)
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    wires = [_encode(r, f"{host}:{port}", ()) for r in requests]

    async def main() -> float:
        ok = refused = 0
        end = time.monotonic() + seconds

        async def client(index: int) -> None:
            nonlocal ok, refused
            rng = random.Random(index)
            while time.monotonic() < end:
                try:
                    reader, writer = await asyncio.open_connection(host, port)
                except OSError:
                    await asyncio.sleep(0.05)
                    continue
                try:
                    while time.monotonic() < end:
                        writer.write(rng.choice(wires))
                        status, got = await asyncio.wait_for(_read_response(reader), 60)
                        ok += status == 200
                        refused += status == 503
                        if got.get("connection", "").lower() == "close":
                            break
                except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                    pass
                finally:
                    writer.close()

        began = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(clients)))
        if refused:
            # A refused client asks again at once: with too many clients for the
            # latency budget, the closed loop turns into a storm of retries.
            print(
                f"openloop: {refused} of {ok + refused} closed-loop requests were refused (503); "
                "capacity is measured with fewer clients than the budget sheds",
                file=sys.stderr,
            )
        return ok / (time.monotonic() - began)

    return asyncio.run(main())


# nginx answering every request itself: far cheaper than the generator, so that
# the generator's own limit shows.
_STUB_CONF = """
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    keepalive_requests 1000000;
    server {{
        listen 127.0.0.1:{port};
        location / {{ default_type application/json; return 200 '{{}}'; }}
    }}
}}
"""


@contextlib.contextmanager
def stub_server() -> Iterator[str]:
    """A loopback URL answered by a stub nginx (Debian's nginx package), for measuring the ceiling."""
    nginx = find_nginx()
    if nginx is None:
        raise SystemExit("the ceiling is measured against nginx: install Debian's nginx package")
    with tempfile.TemporaryDirectory() as prefix:
        port = free_port()
        conf = Path(prefix, "nginx.conf")
        conf.write_text(_STUB_CONF.format(prefix=prefix, port=port))
        process = subprocess.Popen([nginx, "-p", prefix, "-c", str(conf), "-g", "daemon off;"])
        try:
            _wait_listening(port)
            yield f"http://127.0.0.1:{port}/"
        finally:
            process.terminate()
            process.wait(10)


def _wait_listening(port: int, timeout_s: float = 10.0) -> None:
    give_up = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > give_up:
                raise
            time.sleep(0.05)


def ceiling(rates: Sequence[float], seconds: float) -> list[dict[str, Any]]:
    """The generator against a stub at each rate: what it sent, how late, and its CPU."""
    rows = []
    with stub_server() as url:
        requests = corpus_requests("/")
        for rate in rates:
            summary = run(url, requests, rate, seconds).summary()
            rows.append(
                {
                    "offered_rps": rate,
                    "sent_rps": summary["sent_rps"],
                    "answered_200": summary["by_status"].get("200", 0),
                    "late_p99_ms": summary["behind_schedule"]["p99_ms"],
                    "generator_cpu_share": summary["generator_cpu_share"],
                    "on_schedule": summary["behind_schedule"]["p99_ms"] <= 1000 * LATE_S,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", nargs="?", help="a loopback URL, e.g. http://127.0.0.1:8000/predict/batched")
    parser.add_argument("--rate", type=float, help="requests per second to offer")
    parser.add_argument(
        "--ceiling",
        type=float,
        nargs="+",
        metavar="RATE",
        help="instead: measure this generator's own ceiling at these rates against a stub nginx",
    )
    parser.add_argument("--seconds", type=float, default=30, help="how long to send (default 30)")
    parser.add_argument("--schedule", choices=("poisson", "fixed"), default="poisson")
    parser.add_argument("--method", choices=("POST", "GET"), default="POST")
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="one request body's text a line")
    parser.add_argument("--timeout", type=float, default=60, help="seconds before a request counts as lost")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.ceiling:
        for row in ceiling(args.ceiling, args.seconds):
            print(json.dumps(row))
        return 0
    if args.url is None or args.rate is None:
        parser.error("give a URL and --rate (or --ceiling RATE...)")
    path = urlsplit(args.url).path or "/"
    get = [Request(b"", path, "GET", ())]
    requests = get if args.method == "GET" else corpus_requests(path, args.corpus)
    result = run(
        args.url,
        requests,
        args.rate,
        args.seconds,
        kind=args.schedule,
        seed=args.seed,
        timeout_s=args.timeout,
    )
    summary = result.summary()
    print(json.dumps(summary, indent=2))
    behind = summary["behind_schedule"]
    if behind["p99_ms"] > 1000 * LATE_S:
        print(
            f"openloop: fell behind its schedule (p99 {behind['p99_ms']} ms late): "
            "the offered rate is past this generator's ceiling on this machine",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

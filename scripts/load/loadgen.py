"""Closed-loop HTTP load: N clients, each sending its next request as soon as the last one answers.

wrk drives the load when it is installed (it is written in C and is never the
bottleneck); otherwise an asyncio client with one keep-alive connection per
client does. Both return the same :class:`LoadResult`, and both count an error
(a refused or broken connection, a timeout, a non-2xx answer) and go on until
the time is up, so a failure never lowers the concurrency. Loopback targets only.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

WRK_SCRIPT = r"""
-- One request body per line of the file; the requests take them in turn.
init = function(args)
  reqs = {}
  for body in io.lines(args[1]) do
    reqs[#reqs + 1] = wrk.format("POST", nil, {["Content-Type"] = "application/json"}, body)
  end
  n = 0
end
request = function()
  n = n % #reqs + 1
  return reqs[n]
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\nRESULT {"requests":%d,"duration_us":%d,"non2xx":%d,"connect":%d,"read":%d,"write":%d,' ..
    '"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d}\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99)))
end
"""


# As wrk's --timeout below: a request not answered by then counts as an error.
REQUEST_TIMEOUT_S = 60.0
# Between a client's attempts to reconnect after a failed connect.
RECONNECT_PAUSE_S = 0.05


@dataclass(frozen=True)
class LoadResult:
    clients: int
    seconds: float
    requests: int
    errors: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    generator: str

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        raise SystemExit(f"refusing to send load to {host!r}: only loopback targets are allowed")


def run_load(
    url: str, body: bytes | list[bytes], clients: int, seconds: float, prefer_wrk: bool = True
) -> LoadResult:
    """Closed-loop load; a list of bodies (JSON, one line each) is sent in turn, cycling."""
    check_loopback(url)
    bodies = [body] if isinstance(body, bytes) else body
    if not bodies or any(b"\n" in b for b in bodies):
        raise ValueError("request bodies must be non-empty and hold no newline")
    if prefer_wrk and shutil.which("wrk"):
        return _wrk(url, bodies, clients, seconds)
    return asyncio.run(_asyncio_load(url, bodies, clients, seconds))


def _wrk(url: str, bodies: list[bytes], clients: int, seconds: float) -> LoadResult:
    with tempfile.TemporaryDirectory() as tmp:
        script, body_file = Path(tmp, "post.lua"), Path(tmp, "body.json")
        script.write_text(WRK_SCRIPT)
        body_file.write_bytes(b"\n".join(bodies) + b"\n")
        # One wrk thread drives every connection: enough for loopback, and it
        # leaves the cores to the service being measured.
        out = subprocess.run(
            [
                "wrk",
                "-t1",
                f"-c{clients}",
                f"-d{max(1, round(seconds))}s",
                "--timeout",
                "60s",
                "-s",
                str(script),
                url,
                "--",
                str(body_file),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    r = json.loads(line.removeprefix("RESULT "))
    errors = r["non2xx"] + r["connect"] + r["read"] + r["write"] + r["timeout"]
    return LoadResult(
        clients=clients,
        seconds=r["duration_us"] / 1e6,
        requests=r["requests"] - r["non2xx"],
        errors=errors,
        p50_ms=r["p50_us"] / 1000,
        p90_ms=r["p90_us"] / 1000,
        p99_ms=r["p99_us"] / 1000,
        generator="wrk",
    )


async def _asyncio_load(url: str, bodies: list[bytes], clients: int, seconds: float) -> LoadResult:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    requests = [
        (
            f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
        for body in bodies
    ]
    turn = itertools.count()
    latencies: list[float] = []
    errors = 0
    end = time.monotonic() + seconds

    async def client() -> None:
        # Until the deadline, whatever happens: an error is counted and the client
        # reconnects, so the load keeps its concurrency for the whole run.
        nonlocal errors
        while time.monotonic() < end:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port), REQUEST_TIMEOUT_S
                )
            except OSError:  # refused, unreachable, or timed out (TimeoutError is an OSError)
                errors += 1
                # A refused connection fails at once: pause, or the client spins on the CPU
                # that the service under test needs.
                await asyncio.sleep(min(RECONNECT_PAUSE_S, max(0.0, end - time.monotonic())))
                continue
            try:
                while time.monotonic() < end:
                    started = time.monotonic()
                    writer.write(requests[next(turn) % len(requests)])
                    status, keep_alive = await asyncio.wait_for(_read_response(reader), REQUEST_TIMEOUT_S)
                    if 200 <= status < 300:
                        latencies.append(time.monotonic() - started)
                    else:
                        errors += 1
                    if not keep_alive:
                        break
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
                errors += 1
            finally:
                writer.close()

    began = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.monotonic() - began
    ms = sorted(x * 1000 for x in latencies) or [float("nan")]

    def pct(q: float) -> float:
        return ms[min(len(ms) - 1, int(q * len(ms)))]

    return LoadResult(
        clients, elapsed, len(latencies), errors, statistics.median(ms), pct(0.9), pct(0.99), "asyncio"
    )


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """One response's status, and whether the server keeps the connection open after it.

    Raises ValueError for a response this client cannot read (no Content-Length:
    the service always sends one).
    """
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.partition(" ")[2][:3])  # "HTTP/1.1 200 OK"; garbage is a ValueError
    headers = {
        name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)
    }
    if "content-length" not in headers:
        raise ValueError(f"a response without Content-Length: {status_line!r}")
    await reader.readexactly(int(headers["content-length"]))
    return status, headers.get("connection", "").lower() != "close"

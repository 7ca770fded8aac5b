"""Start the service (gunicorn) as a subprocess, wait until it serves, and stop it with all its workers.

The one way the scripts here (bench.py, soak.py, serve_behind_nginx.py) and the
end-to-end tests start gunicorn. Standard library only, apart from the
service's own settings and topology plan, which it reads to learn how many
workers to wait for:

    with serve(env, all_workers=True) as service:   # gunicorn on a free loopback port
        urllib.request.urlopen(service.url + "/info")
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from scripts.common.procs import children

if TYPE_CHECKING:
    from service.topology.plan import Plan

ROOT = Path(__file__).resolve().parents[2]

# One series per live worker whose model has loaded (prometheus_client's
# 'liveall' mode gives each its pid label; a dead worker's series is dropped).
_WORKER_INFO = re.compile(r"^serve_worker_info\{[^}]*\}\s+(\S+)", re.MULTILINE)
# Between readiness probes, as a load balancer or an orchestrator runs them.
_PROBE_INTERVAL_S = 0.2


class LaunchError(RuntimeError):
    """The service exited, or did not become ready in time; the message ends with its log."""


@dataclass
class Service:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def workers(self) -> list[int]:
        """The master's worker pids now."""
        return children(self.process.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def gunicorn_command(args: Sequence[str] = ()) -> list[str]:
    """gunicorn with the service's config, in this interpreter; ``args`` go before the app."""
    return [sys.executable, "-m", "gunicorn", "-c", "gunicorn_conf.py", *args, "wsgi:app"]


def planned(env: Mapping[str, str]) -> Plan:
    """The topology plan gunicorn_conf.py makes with the SERVE_* settings in ``env``, on this machine."""
    from service.config.settings import Settings, cuda_visible_devices
    from service.topology.inventory import read_inventory
    from service.topology.plan import plan

    return plan(Settings.from_env(env), read_inventory(cuda_visible_devices(env)))


def planned_workers(env: Mapping[str, str]) -> int:
    """How many workers gunicorn_conf.py will start with the SERVE_* settings in ``env``."""
    return len(planned(env).workers)


def ready_workers(url: str) -> int:
    """How many workers report a loaded model on ``url``/metrics (0 if it cannot be read)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return 0
    return sum(float(value) > 0 for value in _WORKER_INFO.findall(text))


def _is_ready(url: str, workers: int | None) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as response:
            if response.status != 200:
                return False
    except urllib.error.HTTPError as error:  # 503 while the model loads
        error.close()
        return False
    except OSError:  # nothing listens yet
        return False
    return workers is None or ready_workers(url) >= workers


def wait_ready(
    url: str,
    processes: Sequence[subprocess.Popen[bytes]],
    *,
    timeout: float,
    workers: int | None = None,
    log_path: Path | None = None,
) -> None:
    """Until ``url``/readyz answers 200 and, if ``workers`` is given, that many workers have loaded.

    Raises LaunchError at once if one of ``processes`` exits, or after ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    while not _is_ready(url, workers):
        for process in processes:
            if process.poll() is not None:
                command = " ".join(str(arg) for arg in process.args)
                raise LaunchError(f"{command!r} exited with {process.returncode}{_tail(log_path)}")
        if time.monotonic() > deadline:
            what = f"{url}/readyz did not answer 200"
            if workers is not None:
                what += f" with {workers} worker(s) loaded (found {ready_workers(url)})"
            raise LaunchError(f"{what} within {timeout:g} s{_tail(log_path)}")
        time.sleep(_PROBE_INTERVAL_S)  # a probe over HTTP: there is no event to block on


def stop(process: subprocess.Popen[bytes], signum: int = signal.SIGTERM, grace: float = 30) -> None:
    """``signum``, then SIGKILL after ``grace`` s: to its whole process group if it leads one.

    Signals go only while the process runs: once it is reaped, its pid (and
    group id) may already belong to another process.
    """

    def send(sig: int) -> None:
        if process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(process.pid) == process.pid:
                os.killpg(process.pid, sig)  # the workers too, even those the master lost track of
            else:
                process.send_signal(sig)

    send(signum)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        process.wait(10)


def start(
    env: Mapping[str, str],
    bind: str,
    *,
    args: Sequence[str] = (),
    log: int | None = None,
    new_group: bool = True,
) -> subprocess.Popen[bytes]:
    """gunicorn bound to ``bind``, with exactly ``env`` for its environment (plus SERVE_BIND).

    ``log`` is a file descriptor for its stdout and stderr (default: this
    process's). In a new process group by default, so that ``stop`` reaches
    every worker; ``new_group=False`` keeps it in the caller's, where a
    terminal's Ctrl-C reaches it too.
    """
    return subprocess.Popen(
        gunicorn_command(args),
        cwd=ROOT,
        env={**env, "SERVE_BIND": bind, "PYTHONUNBUFFERED": "1"},
        stdout=log,
        stderr=None if log is None else subprocess.STDOUT,
        start_new_session=new_group,
    )


@contextlib.contextmanager
def serve(
    env: Mapping[str, str],
    *,
    host: str = "127.0.0.1",
    args: Sequence[str] = (),
    ready_timeout: float = 90,
    all_workers: bool = False,
    grace: float = 30,
) -> Iterator[Service]:
    """gunicorn on a free port of ``host``, ready; stopped with every worker on the way out.

    ``env`` is its whole environment (SERVE_BIND is set here). With
    ``all_workers`` it waits until every worker the topology plan for ``env``
    holds has loaded its model, not only the first: a benchmark's first
    levels would otherwise measure a half-started service. The log goes to a
    temporary file, named in the error if it does not start, removed after.
    """
    port = free_port(host)
    with tempfile.NamedTemporaryFile("wb", prefix="gunicorn-", suffix=".log", delete=False) as log_file:
        log_path = Path(log_file.name)
        process = start(env, f"{host}:{port}", args=args, log=log_file.fileno())
    url = f"http://{host}:{port}"
    try:
        workers = planned_workers(env) if all_workers else None
        wait_ready(url, [process], timeout=ready_timeout, workers=workers, log_path=log_path)
        yield Service(url, process, log_path)
    finally:
        stop(process, grace=grace)
        log_path.unlink(missing_ok=True)


def _tail(log_path: Path | None, chars: int = 20_000) -> str:
    if log_path is None or not log_path.exists():
        return ""
    return f"; its log ({log_path}):\n" + log_path.read_text(errors="replace")[-chars:]

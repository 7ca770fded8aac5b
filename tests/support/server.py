"""Start real gunicorn as a subprocess on a free port, and stop its whole process group."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import requests

from tests.support.procs import children

ROOT = Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
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

    def get(self, path: str, **kwargs: object) -> requests.Response:
        return requests.get(self.url + path, timeout=30, **kwargs)  # type: ignore[arg-type]

    def post(self, path: str, **kwargs: object) -> requests.Response:
        return requests.post(self.url + path, timeout=60, **kwargs)  # type: ignore[arg-type]

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)


def wait_ready(url: str, process: subprocess.Popen[bytes] | None, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url + "/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.1)  # a readiness probe, as an orchestrator would run it
    raise TimeoutError(f"server not ready after {timeout} s:\n{log_path.read_text()}")


def stop_group(process: subprocess.Popen[bytes], grace: float = 20) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


@contextlib.contextmanager
def gunicorn(
    env: Mapping[str, str] | None = None,
    *,
    host: str = "127.0.0.1",
    args: tuple[str, ...] = (),
    ready_timeout: float = 90,
) -> Iterator[Server]:
    port = free_port(host)
    process, log_path = _start(env, host, port, args)
    url = f"http://{host}:{port}"
    try:
        wait_ready(url, process, ready_timeout, log_path)
        yield Server(url, process, log_path)
    finally:
        stop_group(process)
        log_path.unlink(missing_ok=True)


def _start(
    env: Mapping[str, str] | None, host: str, port: int, args: tuple[str, ...]
) -> tuple[subprocess.Popen[bytes], Path]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
    full_env.update({"SERVE_BIND": f"{host}:{port}", "PYTHONUNBUFFERED": "1"})
    full_env.update(env or {})
    with tempfile.NamedTemporaryFile("wb", prefix="gunicorn-", suffix=".log", delete=False) as log_file:
        log_path = Path(log_file.name)
        process = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "gunicorn_conf.py", *args, "wsgi:app"],
            cwd=ROOT,
            env=full_env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return process, log_path


def gunicorn_exit(env: Mapping[str, str], *, timeout: float = 90, host: str = "127.0.0.1") -> tuple[int, str]:
    """Start gunicorn expecting it to stop by itself; its exit code and log.

    Raises TimeoutError (after killing its process group) if it is still up after ``timeout``.
    """
    process, log_path = _start(env, host, free_port(host), ())
    try:
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"gunicorn still running after {timeout} s:\n{log_path.read_text()}") from None
        return code, log_path.read_text(errors="replace")
    finally:
        stop_group(process)
        log_path.unlink(missing_ok=True)

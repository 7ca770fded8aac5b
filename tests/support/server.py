"""Real gunicorn for the end-to-end tests, started and stopped by scripts.common.launcher."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import requests

from scripts.common.launcher import ROOT, Service, free_port, serve, start, stop

__all__ = ["ROOT", "Server", "free_port", "gunicorn", "gunicorn_exit"]


@dataclass
class Server(Service):
    """The launcher's service, with requests-based helpers for tests."""

    def get(self, path: str, **kwargs: object) -> requests.Response:
        return requests.get(self.url + path, timeout=30, **kwargs)  # type: ignore[arg-type]

    def post(self, path: str, **kwargs: object) -> requests.Response:
        return requests.post(self.url + path, timeout=60, **kwargs)  # type: ignore[arg-type]

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)


@contextlib.contextmanager
def gunicorn(
    env: Mapping[str, str] | None = None,
    *,
    host: str = "127.0.0.1",
    args: tuple[str, ...] = (),
    ready_timeout: float = 90,
    all_workers: bool = True,
) -> Iterator[Server]:
    """gunicorn on a free port of ``host`` with the SERVE_* settings in ``env`` and no others.

    By default it is yielded once every planned worker has loaded its model: a
    test that waited only for the first would race the others' start (on a busy
    machine every request could reach the one worker that was up).
    """
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
    full_env.update(env or {})
    with serve(
        full_env, host=host, args=args, ready_timeout=ready_timeout, all_workers=all_workers, grace=20
    ) as service:
        yield Server(service.url, service.process, service.log_path)


def gunicorn_exit(env: Mapping[str, str], *, timeout: float = 90, host: str = "127.0.0.1") -> tuple[int, str]:
    """Start gunicorn expecting it to stop by itself; its exit code and log.

    Raises TimeoutError (after stopping its process group) if it is still up after ``timeout``.
    """
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")} | dict(env)
    with tempfile.NamedTemporaryFile("wb", prefix="gunicorn-", suffix=".log", delete=False) as log_file:
        log_path = Path(log_file.name)
        process = start(full_env, f"{host}:{free_port(host)}", log=log_file.fileno())
    try:
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"gunicorn still running after {timeout} s:\n{log_path.read_text()}") from None
        return code, log_path.read_text(errors="replace")
    finally:
        stop(process)
        log_path.unlink(missing_ok=True)

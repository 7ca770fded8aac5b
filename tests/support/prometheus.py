"""Debian's Prometheus tools for the tests: where they are, and why a test skips without them."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import requests
import yaml

from scripts.common.launcher import ROOT, free_port, stop

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULE_FILES = (PROMETHEUS_DIR / "recording.yaml", PROMETHEUS_DIR / "alerts.yaml")
RULE_TESTS = tuple(sorted((PROMETHEUS_DIR / "tests").glob("*_test.yaml")))

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
SKIP_PROMTOOL = "promtool not found on PATH: install Debian's prometheus package (.ci/run does)"
SKIP_PROMETHEUS = "prometheus not found on PATH: install Debian's prometheus package (.ci/run does)"


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run promtool; the result carries its exit code and output, for the test to check."""
    assert PROMTOOL is not None, SKIP_PROMTOOL
    command: Sequence[str | Path] = (PROMTOOL, *args)
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)


class Prometheus:
    """A running Prometheus server on loopback, queried through its HTTP API."""

    def __init__(self, url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
        self.url = url
        self.process = process
        self.log_path = log_path

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result; fails the test with Prometheus's error if the query is refused."""
        response = requests.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        assert body["status"] == "success", f"{expr!r}: {body}"
        return list(body["data"]["result"])

    def rule_groups(self) -> list[dict[str, Any]]:
        response = requests.get(f"{self.url}/api/v1/rules", timeout=10)
        return list(response.json()["data"]["groups"])

    def wait_for(self, expr: str, check: Callable[[list[dict[str, Any]]], bool], timeout: float = 60) -> None:
        """Query ``expr`` until ``check`` accepts its result (Prometheus offers no event to wait on)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if check(result):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{expr!r} still gives {result} after {timeout} s\n{self.log()}")
            time.sleep(0.5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-10_000:]


@contextlib.contextmanager
def prometheus(targets: Sequence[str], *, scrape_interval: str = "1s") -> Iterator[Prometheus]:
    """Debian's prometheus on a free loopback port scraping ``targets`` as the service's job,
    with deploy/prometheus's rules loaded, keeping its data in a temporary directory."""
    assert PROMETHEUS is not None, SKIP_PROMETHEUS
    with tempfile.TemporaryDirectory(prefix="prometheus-") as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
                    "rule_files": [str(path) for path in RULE_FILES],
                    "scrape_configs": [
                        {"job_name": "torch-serve-batched", "static_configs": [{"targets": list(targets)}]}
                    ],
                }
            )
        )
        address = f"127.0.0.1:{free_port()}"
        log_path = Path(tmp) / "prometheus.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp}/data",
                    f"--web.listen-address={address}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        server = Prometheus(f"http://{address}", process, log_path)
        try:
            _wait_ready(server)
            yield server
        finally:
            stop(process, grace=10)


def _wait_ready(server: Prometheus, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {server.process.returncode}:\n{server.log()}")
        with contextlib.suppress(requests.ConnectionError):
            if requests.get(f"{server.url}/-/ready", timeout=5).status_code == 200:
                return
        time.sleep(0.2)  # no event to block on before the port opens
    raise TimeoutError(f"prometheus not ready after {timeout} s:\n{server.log()}")

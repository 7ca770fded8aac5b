"""The container image, for real: built by scripts/deploy/build-image, run on loopback, serving embeddings.

The first build on a machine makes the wheelhouse and, with no registry, a Debian base
(several minutes); both are cached in .image-cache/ and reused by later builds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest
import requests

from scripts.common.launcher import ROOT, free_port
from tests.support.metrics import Scrape

PODMAN = shutil.which("podman")
BUILD_TIMEOUT_S = 1500
READY_TIMEOUT_S = 180
# The user the Containerfile creates; deploy/k8s/deployment.yaml runs the pod as it too.
IMAGE_UID = "10001"


def podman_unusable() -> str | None:
    """Why podman cannot run containers here, or None if it can."""
    if PODMAN is None:
        return (
            "podman not found on PATH: install Debian's podman, runc and mmdebstrap packages (.ci/run does)"
        )
    try:
        info = subprocess.run([PODMAN, "info"], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "`podman info` did not answer within 120 s"
    if info.returncode != 0:
        return f"`podman info` fails here, so podman cannot run containers: {info.stderr.strip()[-500:]}"
    return None


SKIP_REASON = podman_unusable()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or ""),
]


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    assert PODMAN is not None
    return subprocess.run([PODMAN, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def image() -> str:
    build = subprocess.run(
        ["bash", "scripts/deploy/build-image"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert build.returncode == 0, build.stderr[-5000:]
    reference = build.stdout.strip().splitlines()[-1]
    assert podman("image", "exists", reference).returncode == 0, reference
    return reference


@pytest.fixture
def container(image: str) -> Iterator[tuple[str, str]]:
    """The image started by scripts/deploy/run-image on a free loopback port: (name, url)."""
    name = f"serve-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    run = subprocess.run(
        ["bash", "scripts/deploy/run-image", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "IMAGE_TAG": image},
    )
    assert run.returncode == 0, run.stderr
    try:
        yield name, f"http://127.0.0.1:{port}"
    finally:
        podman("rm", "--force", "--time", "0", name)


def wait_ready(url: str, name: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/readyz", timeout=5).status_code == 200:
                return
        except (requests.ConnectionError, requests.Timeout):
            # Until a worker has loaded its model, connections wait unanswered in the backlog.
            pass
        time.sleep(1)  # the container's port gives no event to block on
    logs = podman("logs", name).stderr
    raise TimeoutError(f"{name} not ready after {READY_TIMEOUT_S} s:\n{logs[-5000:]}")


@pytest.mark.timeout(BUILD_TIMEOUT_S + 600)
def test_image_builds_runs_and_serves_embeddings(container: tuple[str, str]) -> None:
    name, url = container
    wait_ready(url, name)
    response = requests.post(f"{url}/predict", json={"inputs": ["A man is eating food."]}, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "all-MiniLM-L6-v2"
    (embedding,) = body["outputs"]
    assert len(embedding) == 384
    assert abs(sum(x * x for x in embedding) - 1) < 1e-3  # L2-normalised
    # The image has jemalloc, and its master preloaded it for the workers (docs/memory.md).
    assert requests.get(f"{url}/info", timeout=30).json()["allocator"] == "jemalloc"
    # Its metrics, from the tmpfs directory every worker writes to.
    metrics = Scrape.parse(requests.get(f"{url}/metrics", timeout=30).text)
    assert metrics.total("serve_http_requests_total", code="200", route="/predict") == 1
    # Not root; the build's CA secret is in no layer.
    assert podman("exec", name, "id", "-u").stdout.strip() == IMAGE_UID
    assert podman("exec", name, "ls", "/run/secrets").stdout.strip() == ""
    # A read-only root: only the tmpfs mounts take writes.
    assert podman("exec", name, "touch", "/app/x").returncode != 0
    # SIGTERM: gunicorn drains and exits cleanly within its graceful timeout.
    assert podman("stop", "--time", "40", name, timeout=60).returncode == 0
    state = podman("inspect", "--format", "{{.State.ExitCode}}", name)
    if state.returncode == 0:  # run-image's --rm may already have removed it
        assert state.stdout.strip() == "0"

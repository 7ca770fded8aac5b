"""scripts/common/launcher.py: gunicorn started, awaited until each worker serves, stopped with them all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scripts.common.launcher import LaunchError, ready_workers, serve

pytestmark = pytest.mark.e2e

# A model that takes 2 s to load in each worker (not once in the master), so that
# /readyz answers 200 for the first worker well before the second has loaded.
SLOW_START = {
    "SERVE_MODEL": "tests.support.models:scripted_slow_start",
    "SERVE_WORKERS": "2",
    "SERVE_SHARE_WEIGHTS": "off",
}


def service_env(serve_vars: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")} | serve_vars


def test_all_workers_waits_for_every_planned_worker_and_stop_ends_them_all() -> None:
    with serve(service_env(SLOW_START), all_workers=True) as service:
        assert ready_workers(service.url) == 2
        workers = service.workers()
        assert len(workers) == 2
    assert service.process.returncode is not None
    # The master reaped them; their pids are gone.
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]


def test_a_service_that_exits_at_start_raises_with_its_log() -> None:
    with (
        pytest.raises(LaunchError, match="exited with") as raised,
        serve(service_env({"SERVE_MAX_BATCH_SIZE": "lots"}), ready_timeout=60),
    ):
        pass
    assert "SERVE_MAX_BATCH_SIZE must be" in str(raised.value)

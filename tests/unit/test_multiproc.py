"""The launcher's metrics directory: fresh, or the user's wiped of stale files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from service.config.settings import Settings
from service.host import multiproc


def test_no_directory_given_makes_a_fresh_one_that_cleanup_removes() -> None:
    path = Path(multiproc.prepare(None))
    try:
        assert path.is_dir() and not any(path.iterdir())
        assert path.name.startswith("serve-metrics-")
    finally:
        multiproc.cleanup()
    assert not path.exists()


def test_a_given_directory_loses_its_stale_metric_files_and_survives_cleanup(tmp_path: Path) -> None:
    (tmp_path / "counter_123.db").write_bytes(b"stale")
    (tmp_path / "gauge_livesum_123.db").write_bytes(b"stale")
    (tmp_path / "notes.txt").write_text("not ours")
    assert multiproc.prepare(str(tmp_path)) == str(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    multiproc.cleanup()
    assert tmp_path.is_dir()


def test_a_missing_given_directory_is_created(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    assert Path(multiproc.prepare(str(target))).is_dir()


def test_mark_dead_drops_only_the_live_gauges(tmp_path: Path) -> None:
    kept = ["counter_7.db", "gauge_livesum_8.db", "histogram_7.db"]  # counters, and another worker
    for name in [*kept, "gauge_livesum_7.db", "gauge_liveall_7.db"]:
        (tmp_path / name).write_bytes(b"")
    multiproc.mark_dead(str(tmp_path), 7)
    assert sorted(p.name for p in tmp_path.iterdir()) == kept


def test_settings_read_prometheus_multiproc_dir() -> None:
    assert Settings.from_env({}).prometheus_multiproc_dir is None
    assert Settings.from_env({"PROMETHEUS_MULTIPROC_DIR": "/run/m"}).prometheus_multiproc_dir == "/run/m"


FORKED_WRITES = """
import os, sys
from service.host import multiproc
from service.host.pid import current_pid
multiproc.import_client()
from prometheus_client import CollectorRegistry, Counter, multiprocess
counter = Counter("forked_writes", "writes", registry=None)
counter.inc()
child = os.fork()
if child == 0:
    ok = current_pid() == os.getpid()
    counter.inc(2)
    os._exit(0 if ok else 3)
_, status = os.waitpid(child, 0)
assert os.waitstatus_to_exitcode(status) == 0, "the child's pid was not its own"
assert current_pid() == os.getpid()
counter.inc(4)
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
print(sorted(os.listdir(os.environ["PROMETHEUS_MULTIPROC_DIR"])) == sorted(
    [f"counter_{os.getpid()}.db", f"counter_{child}.db"]), registry.get_sample_value("forked_writes_total"))
"""


def test_metric_writes_after_a_fork_go_to_the_childs_own_file(tmp_path: Path) -> None:
    # A fresh interpreter: prometheus_client picks its mode when first imported.
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", FORKED_WRITES],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "7.0"]

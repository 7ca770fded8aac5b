"""Debian's Prometheus tools for the tests: where they are, and why a test skips without them."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from scripts.launcher import ROOT

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

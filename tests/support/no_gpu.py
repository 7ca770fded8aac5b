"""Run one of the GPU scripts with every GPU hidden, as on a host that has none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_without_gpu(script: str, out: Path) -> subprocess.CompletedProcess[str]:
    """``script --out out`` from the repository root; an empty CUDA_VISIBLE_DEVICES hides a GPU host's too."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")} | {"CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, script, "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

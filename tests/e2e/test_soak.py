"""The soak script's 60-second version: open-loop overload and a spike on the default worker class
(gthread), bad requests, a SIGKILL and a SIGHUP; the overload is shed, nothing is lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.server import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]


def test_a_one_minute_soak_gets_no_other_5xx_and_loses_nothing(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    # A model that holds each batch of up to 8 texts for 0.2 s and leaves the CPU
    # free, as one on a GPU does: capacity is about 80 requests a second whatever
    # else the machine runs, so 2x and the 5x spike stay within what the
    # generator and the refusals' CPU can do on 2 shared cores (a fast model's
    # 5x is thousands of refusals a second).
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
    # The body limit of 1 MiB: each oversized bad request sends one byte more than it,
    # and 8 MiB a time (the default) would cost the generator more than the test needs.
    env.update({"SERVE_MAX_BATCH_SIZE": "8", "SERVE_MAX_BODY_BYTES": str(1 << 20)})
    done = subprocess.run(
        [
            sys.executable,
            "scripts/load/soak.py",
            "--duration",
            "60",
            "--model",
            "tests.support.models:slow_echo",
            "--workers",
            "2",
            "--spike-seconds",
            "10",
            "--json",
            str(report),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=380,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(report.read_text())
    outcomes = result["outcomes"]
    assert outcomes["other 5xx"] == 0 and outcomes["lost"] == 0
    assert outcomes["2xx"] > 0 and outcomes["4xx"] > 0
    # Twice capacity and a spike to five times it: shed for the latency budget,
    # with 503s, rather than queued.
    assert outcomes["503"] > 0
    assert result["refused_by_reason"].get("over_budget", 0) > 0, result["refused_by_reason"]
    assert result["spike"]["offered_rps"] > result["steady"]["offered_rps"]
    assert result["sent"] == sum(outcomes.values())
    assert [line.split()[2] for line in result["faults"]] == ["SIGKILL", "SIGHUP"]
    assert result["seconds"] < 90, "the soak must end on time"

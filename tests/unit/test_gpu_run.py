"""The one-command GPU run (scripts/bench/gpu_run.py) and its speed step (scripts/bench/gpu_speed.py).

No GPU can be exercised where these tests run: the entry command is run with every GPU
hidden, and what it would measure on one is judged here on figures made up for the test.
"""

from __future__ import annotations

import os
import select
import sys
from pathlib import Path

import pytest

from scripts.bench.gpu_check import NEEDS_S
from scripts.bench.gpu_run import BUDGET_S, NO_GPU_EXIT, Run, check_seconds, demote, supervise, weights_note
from scripts.bench.gpu_speed import (
    SPEED_LEAST_S,
    SPEED_MOST_S,
    SpeedRow,
    best_offline,
    judge_speed,
    long_texts,
    measure_precision,
    speed_seconds,
    speed_table,
)
from scripts.bench.precision import corpus
from scripts.fixtures.make_bert_base import Shape, write
from tests.support.no_gpu import run_without_gpu

# A check that never ends: it writes part of its report, starts a process in a session of
# its own (as gunicorn runs) and waits.
ENDLESS_CHECK = """
import subprocess, sys, time
from pathlib import Path
server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
Path(sys.argv[2]).write_text(str(server.pid))
Path(sys.argv[1]).write_text("# GPU check on 1 x NVIDIA H100\\n\\n## Plan\\n\\nplanned\\n")
print("token memory: measuring", file=sys.stderr, flush=True)
time.sleep(120)
"""


def test_without_a_gpu_the_run_installs_nothing_says_so_in_one_line_and_writes_a_report(
    tmp_path: Path,
) -> None:
    out = tmp_path / "gpu-report.md"
    done = run_without_gpu("scripts/bench/gpu_run.py", out)
    assert done.returncode == NO_GPU_EXIT == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("gpu_run: no NVIDIA GPU here (")
    report = out.read_text()
    assert "## No GPU" in report and "nothing was installed or checked" in report


def ends_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` has ended, or ends within ``seconds`` (a zombie has ended)."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([handle], [], [], seconds)
    finally:
        os.close(handle)
    return bool(readable)


def test_a_check_past_its_bound_is_stopped_with_what_it_started_and_its_report_kept(tmp_path: Path) -> None:
    run = Run(tmp_path / "gpu-report.md")
    inner, server = tmp_path / "check.md", tmp_path / "server.pid"
    command = [sys.executable, "-c", ENDLESS_CHECK, str(inner), str(server)]
    code = supervise(run, command, dict(os.environ), inner, tmp_path / "check.log", limit_s=3)
    assert code == 1
    report = run.out.read_text()
    assert "| gpu_check.py |" in report and "FAIL: stopped at the time bound, after 3 s" in report
    assert "## GPU check on 1 x NVIDIA H100\n\n### Plan\n\nplanned" in report  # what it reached, kept
    assert "the steps after the last one above were not verified" in report
    assert "token memory: measuring" in report  # the end of its log
    assert ends_within(int(server.read_text()), 10)  # killed, though out of the check's group


# -- time --------------------------------------------------------------------------------------


def test_the_check_gets_what_setup_leaves_of_the_bound_less_the_time_to_stop_it() -> None:
    assert BUDGET_S < 300  # the whole run, on a GPU host: under 5 minutes
    assert check_seconds(280, 50) == 280 - 50 - 15 - 5
    assert check_seconds(280, 230) is None  # 30 s would verify nothing


def test_the_speed_step_measures_in_what_is_left_and_not_at_all_in_too_little() -> None:
    assert speed_seconds(None) == SPEED_MOST_S
    assert speed_seconds(1000) == SPEED_MOST_S
    # 70 s for two precisions: 35 each, 20 of them to start, 15 over three spans.
    assert speed_seconds(70) == pytest.approx(5.0)
    assert speed_seconds(100) == SPEED_MOST_S  # 10 s a span would fit
    assert speed_seconds(50) is None
    assert speed_seconds(2 * (20 + 3 * SPEED_LEAST_S)) == pytest.approx(SPEED_LEAST_S)


def test_after_a_minute_of_setup_every_step_at_its_estimate_still_leaves_the_speed_step_room() -> None:
    deadline = check_seconds(BUDGET_S, 60)
    assert deadline is not None
    left = deadline - sum(NEEDS_S.values())
    assert speed_seconds(left) is not None, left


# -- the speed step --------------------------------------------------------------------------


def test_texts_for_the_speed_step_each_hold_at_least_the_words_asked_for() -> None:
    lines = ["one two three", "", "four five", "six seven eight nine"]
    texts = long_texts(lines, words=4, count=3)
    assert texts == ["one two three four five", "six seven eight nine", "one two three four five"]
    with pytest.raises(ValueError, match="no words"):
        long_texts(["", " "], words=4, count=1)


def test_the_offline_limit_is_the_best_strategy() -> None:
    assert best_offline({"64 padded": 900.0, "64 sorted, cut by cost": 950.0}) == (
        "64 sorted, cut by cost",
        950.0,
    )


@pytest.mark.slow
def test_the_speed_steps_processes_load_settle_and_measure_a_directory(tmp_path: Path) -> None:
    # On the CPU, in float32: the plumbing (the factory in offline.py's spawned processes,
    # their reports, the batcher) as it runs on a GPU host, where float16 and NVML join in.
    tiny = write(tmp_path / "tiny", seed=0, shape=Shape(layers=2, hidden=32, heads=2, intermediate=64))
    texts = long_texts(corpus(), words=300, count=8)
    row = measure_precision(
        str(tiny), "float32", gpu_uuid="GPU-none", workers=1, clients=4, seconds=0.3, texts=texts
    )
    assert row.in_use == ["float32"]
    assert row.token_limit == 256  # MiniLM's pipeline's limit, which the fixture takes
    assert row.offline_items_per_s > 0 and row.batcher_items_per_s > 0
    assert row.offline_strategy in ("64 padded", "64 sorted, cut by cost")
    assert row.weights_mb == [] and row.gpu_mb_last == [] and row.device_peak_mb is None  # no GPU, no NVML


def speed_row(precision: str, offline: float, batcher: float, weights: float, **changes: object) -> SpeedRow:
    row = SpeedRow(
        precision=precision,
        in_use=[precision, precision],
        offline_items_per_s=offline,
        offline_strategy="64 padded",
        batcher_items_per_s=batcher,
        weights_mb=[weights, weights],
        gpu_mb_last=[weights + 900, weights + 910],
        gpu_mb_peak=[2 * weights + 900, 2 * weights + 910],
        device_peak_mb=4 * weights + 1800,
        token_limit=256,
    )
    return SpeedRow(**(row.__dict__ | changes))  # type: ignore[arg-type]


def test_float16_faster_and_smaller_with_the_batcher_near_offline_passes() -> None:
    rows = [speed_row("float32", 300.0, 290.0, 1278.0), speed_row("float16", 1200.0, 1100.0, 640.0)]
    checks = judge_speed(rows)
    assert [(c.name, c.ok) for c in checks] == [
        ("float32: batcher without HTTP >= 0.9 x offline", True),
        ("float16: batcher without HTTP >= 0.9 x offline", True),
        ("float16 against float32: faster and smaller", True),
    ]
    assert "4.00x float32's offline items/s; weights 640 against 1278 MiB a process" in checks[2].detail
    table = speed_table(rows)
    assert (
        "| float16 | float16 | 1200 | 4.00x | 1100 | 0.92x | 640, 640 | 1540 / 2180, 1550 / 2190 | 4360 |"
        in table
    )


def test_a_float16_the_start_up_check_refused_or_a_slow_batcher_fails() -> None:
    rows = [
        speed_row("float32", 300.0, 200.0, 1278.0),
        speed_row("float16", 310.0, 300.0, 1278.0, in_use=["float32", "float32"]),
    ]
    checks = judge_speed(rows)
    assert checks[0].ok is False and "200 / 300 items/s = 0.67 x" in checks[0].detail
    assert checks[2].ok is False and "in use: float32" in checks[2].detail


def test_processes_nvml_does_not_list_are_said_to_be_unlisted() -> None:
    rows = [speed_row("float32", 300.0, 290.0, 1278.0, gpu_mb_last=[], gpu_mb_peak=[], device_peak_mb=None)]
    assert "| not listed by NVML | - |" in speed_table(rows)


# -- the report ------------------------------------------------------------------------------


def test_the_checks_report_sits_under_the_runs_title_with_code_left_as_it_is() -> None:
    inner = "# GPU check\n\n## Plan\n\n```\n# a comment in a block\n```\n"
    assert demote(inner) == "## GPU check\n\n### Plan\n\n```\n# a comment in a block\n```"


def test_the_report_says_which_weights_are_random_and_why_minilm_is_not_timed() -> None:
    note = weights_note({"min_cosine": 0.9999994654, "median_cosine": 0.99999964})
    assert "RANDOM weights" in note and "24 layers, 1024 wide, 16 heads, 4096" in note
    assert "limited by the CPU that feeds it" in note
    assert (
        "min_cosine 0.9999995, median_cosine 0.9999996" in note
    )  # rounding the weights alone, measured when the pack was made

"""scripts/bench/gpu_check.py's pure parts on fake inventories and observations; no GPU is used or mocked.

A GPU cannot be exercised on the machines these tests run on: what needs one (NVML's
processes, gunicorn's workers on their GPUs, the measured memory and speed) is checked by
the script itself on a GPU host. Here: its judgements on fake figures, its report and time
bound, and the script with every GPU hidden, as on a host without one.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from scripts.bench.gpu_check import (
    NO_GPU_EXIT,
    CheckError,
    Sample,
    WorkerSeen,
    compare_workers,
    judge_exactness,
    judge_overrun,
    overrun_rows,
    parse_info,
    precision_table,
    token_memory_kb,
    workers_for_overrun,
)
from scripts.bench.gpu_report import Check, Report, format_report
from service.config.settings import Settings
from service.topology.inventory import Gpu, Inventory
from service.topology.plan import Plan, plan
from tests.support.no_gpu import run_without_gpu

H100_MB = 81559


def gpu(index: int) -> Gpu:
    return Gpu(
        index=index, uuid=f"GPU-{index}-fake", name="NVIDIA H100", total_mb=H100_MB, free_mb=H100_MB - 500
    )


TWO_H100 = Inventory(affinity_cores=16, gpus=(gpu(0), gpu(1)))


def two_per_gpu() -> Plan:
    return plan(Settings.from_env({"SERVE_WORKERS_PER_DEVICE": "2"}), TWO_H100)


def seen_as_planned(p: Plan) -> list[WorkerSeen]:
    return [WorkerSeen(1000 + w.slot, w.slot, w.device, w.gpu_memory_fraction) for w in p.workers]


def nvml_as_planned(p: Plan) -> dict[int, str]:
    return {1000 + w.slot: w.gpu_uuid or "" for w in p.workers}


# -- /info --------------------------------------------------------------------------


def test_a_gpu_workers_info_gives_its_pid_slot_device_and_fraction() -> None:
    info = {"pid": 41, "slot": 3, "device": "cuda:1", "gpu_memory_fraction": 0.487, "ready": True}
    assert parse_info(info) == WorkerSeen(41, 3, "cuda:1", 0.487)


def test_info_without_a_field_names_it() -> None:
    with pytest.raises(CheckError, match="no 'gpu_memory_fraction' field"):
        parse_info({"pid": 41, "slot": 0, "device": "cuda:0"})


def test_info_of_a_worker_outside_gunicorn_is_refused_with_the_reason() -> None:
    # Outside gunicorn_conf.py a worker has no slot: /info gives null.
    with pytest.raises(CheckError, match=r"pid 41 and slot None.*under gunicorn"):
        parse_info({"pid": 41, "slot": None, "device": "cpu", "gpu_memory_fraction": None})


# -- plan against workers ---------------------------------------------------------------


def test_workers_as_planned_pass_every_slot() -> None:
    p = two_per_gpu()
    checks = compare_workers(p, seen_as_planned(p), nvml_as_planned(p))
    assert [c.name for c in checks] == ["slot 0", "slot 1", "slot 2", "slot 3"]
    assert all(c.ok for c in checks), checks
    assert "NVML: GPU-1-fake" in checks[1].detail  # slots alternate between the GPUs


def test_a_worker_on_another_gpu_than_planned_fails_its_slot_naming_both_uuids() -> None:
    p = two_per_gpu()
    nvml = nvml_as_planned(p) | {1000: "GPU-1-fake"}  # slot 0 is planned on GPU-0
    checks = compare_workers(p, seen_as_planned(p), nvml)
    assert checks[0].ok is False
    assert "NVML has it on GPU-1-fake, planned GPU-0-fake" in checks[0].detail
    assert all(c.ok for c in checks[1:])


def test_a_fraction_off_the_plan_fails_and_one_within_tolerance_passes() -> None:
    p = two_per_gpu()
    planned = p.workers[0].gpu_memory_fraction
    assert planned is not None
    seen = seen_as_planned(p)
    seen[0] = WorkerSeen(1000, 0, "cuda:0", planned + 0.05)
    seen[1] = WorkerSeen(1001, 1, "cuda:1", planned + 0.001)  # the master read NVML moments later
    checks = compare_workers(p, seen, nvml_as_planned(p))
    assert checks[0].ok is False and f"planned {planned:.3f}" in checks[0].detail
    assert checks[1].ok is True


def test_a_missing_slot_and_a_cpu_worker_fail() -> None:
    p = two_per_gpu()
    seen = seen_as_planned(p)[:3]
    seen[2] = WorkerSeen(1002, 2, "cpu", None)
    checks = compare_workers(p, seen, nvml_as_planned(p))
    assert checks[2].ok is False and "device cpu, planned cuda:0" in checks[2].detail
    assert checks[3] == Check("slot 3", False, "no worker answered for slot 3")


def test_a_cpu_plan_has_no_share_to_check() -> None:
    p = plan(Settings.from_env({"SERVE_WORKERS": "2"}), Inventory(affinity_cores=2))
    seen = [WorkerSeen(1000 + w.slot, w.slot, "cpu", None) for w in p.workers]
    checks = compare_workers(p, seen, {})
    assert [c.ok for c in checks] == [False, False]
    assert "on the CPU, so there is no GPU share" in checks[0].detail


def test_pids_nvml_does_not_list_leave_the_uuids_unverified_not_failed() -> None:
    # In a container NVML lists the host's pids, which match no worker's.
    p = two_per_gpu()
    checks = compare_workers(p, seen_as_planned(p), {77: "GPU-0-fake"})
    assert [c.ok for c in checks] == [None] * 4
    assert "another pid namespace" in checks[0].detail


# -- token memory and overruns -------------------------------------------------------------


def test_token_memory_is_the_largest_per_token_cost_of_the_measured_calls() -> None:
    samples = [
        Sample(rows=8, padded_tokens=512, base_bytes=100 << 20, peak_bytes=(100 << 20) + 512 * 10 * 1024),
        Sample(
            rows=64, padded_tokens=16384, base_bytes=100 << 20, peak_bytes=(100 << 20) + 16384 * 24 * 1024
        ),
    ]
    assert [s.kb_per_token for s in samples] == [10.0, 24.0]
    assert token_memory_kb(samples) == 24.0


def test_token_memory_of_no_call_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        token_memory_kb([])


def test_an_overrun_asks_for_one_and_a_half_shares_or_says_it_cannot() -> None:
    # A 1000 MiB share at 20 KiB per token, 256 tokens a row: 1500 MiB is 300 rows.
    assert overrun_rows(1000, 20.0, 256) == 300
    assert overrun_rows(40_000, 20.0, 256) is None  # 12,000 rows: past the 4,096 a request may hold


def test_workers_per_gpu_grow_until_the_largest_call_outgrows_a_share() -> None:
    h100 = gpu(0)  # 81059 MiB free
    # 20 GiB for the largest call: a share of at most 13.6 GiB, 6 workers (12.5 GiB each).
    assert workers_for_overrun(h100, 1024, 20_480, at_least=2, at_most=64) == 6
    assert workers_for_overrun(h100, 1024, 200_000, at_least=2, at_most=64) == 2
    assert workers_for_overrun(h100, 1024, 10, at_least=2, at_most=8) is None


def overrun_facts(**changes: object) -> Check:
    facts: dict[str, object] = {
        "status": 503,
        "error": "the GPU ran out of memory for a batch of 300 items; retry, or send fewer items",
        "need_mb": 1500.0,
        "share_mb": 1000,
        "free_mb": 60_000,
        "pid_before": 1000,
        "pid_after": 1000,
        "others_ok": True,
        "workers_before": [1000, 1001],
        "workers_after": [1000, 1001],
    }
    return judge_overrun(**(facts | changes))  # type: ignore[arg-type]


def test_an_overrun_that_fails_alone_with_the_services_503_passes() -> None:
    check = overrun_facts()
    assert check.ok is True
    assert "1500 MiB, share 1000 MiB" in check.detail


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"status": 200, "error": ""}, "answered 200"),
        ({"status": 500, "error": "internal server error"}, "answered 500"),
        ({"pid_after": 1002}, "answered by 1002"),
        ({"others_ok": False}, "another worker failed"),
        ({"workers_after": [1001, 1003]}, "changed from [1000, 1001] to [1001, 1003]"),
    ],
)
def test_an_overrun_that_is_not_a_lone_503_fails_saying_how(changes: dict[str, object], reason: str) -> None:
    check = overrun_facts(**changes)
    assert check.ok is False
    assert reason in check.detail


def test_an_overrun_the_gpu_had_no_room_for_proves_no_cap() -> None:
    check = overrun_facts(need_mb=70_000.0, free_mb=60_000)
    assert check.ok is None
    assert "no room" in check.detail


# -- exactness and report ---------------------------------------------------------------


FLOAT32 = {"precision": "float32", "in_use": "float32", "weights_mb": 87.0, "exactness": {}, "check": {}}
FLOAT16 = {
    "precision": "float16",
    "in_use": "float16",
    "weights_mb": 44.0,
    "exactness": {"min_cosine": 0.9999, "median_cosine": 1.0},
    "check": {"min_cosine": 0.99991},
}


def test_float16_passes_when_the_start_up_check_keeps_it_and_it_holds_less() -> None:
    check = judge_exactness([FLOAT32, FLOAT16])
    assert check.ok is True
    assert "44 against 87 MiB" in check.detail and "0.99991" in check.detail
    table = precision_table([FLOAT32, FLOAT16])
    assert (
        "| float16 | float16 | 44 | min_cosine 0.9999, median_cosine 1.0000 | {'min_cosine': 0.99991} |"
        in table
    )


def test_float16_the_start_up_check_refused_fails_saying_so() -> None:
    fell_back = {**FLOAT16, "in_use": "float32", "weights_mb": 87.0, "check": "float16 falls back to float32"}
    check = judge_exactness([FLOAT32, fell_back])
    assert check.ok is False
    assert "'float32' in use" in check.detail and "falls back" in check.detail


def test_the_report_holds_each_section_the_time_of_each_step_and_every_check() -> None:
    checks = [Check("slot 0", True, "fine"), Check("slot 1", False, "a | b\nc"), Check("slot 2", None, "why")]
    report = format_report(
        "GPU check on 1 x NVIDIA H100", [("Plan", "```\nplan\n```")], checks, [("token memory", 12.4)]
    )
    assert report.startswith("# GPU check on 1 x NVIDIA H100\n\n## Plan\n\n```\nplan\n```\n")
    assert "| token memory | 12 |" in report
    assert "| slot 0 | pass | fine |" in report
    assert "| slot 1 | FAIL | a / b c |" in report  # a pipe or a line break would split the table's row
    assert "| slot 2 | not verified | why |" in report


def test_the_report_is_rewritten_after_every_step_and_a_failing_step_does_not_stop_the_next(
    tmp_path: Path,
) -> None:
    out = tmp_path / "report.md"
    report = Report("GPU check", out=out)

    def broken() -> None:
        raise RuntimeError("the service did not start\nlog line 1\nlog line 2")

    assert report.step("workers", 10, broken) is None
    assert "| workers | FAIL | stopped: RuntimeError: the service did not start |" in out.read_text()
    assert report.step("exactness", 10, lambda: report.add("Exactness", "figures")) is None
    assert "## Exactness" in out.read_text()
    assert [name for name, _ in report.timings] == ["workers", "exactness"]
    assert report.failed()


def test_a_step_that_would_end_past_the_deadline_is_not_started_and_not_verified() -> None:
    report = Report("GPU check", deadline=time.monotonic() + 20)
    ran = []

    def step(name: str) -> float:
        ran.append(name)
        return 1.5

    assert report.step("workers", 75, lambda: step("workers")) is None
    assert report.step("token memory", 5, lambda: step("token memory")) == 1.5
    assert ran == ["token memory"]
    (skipped,) = report.checks
    assert skipped.ok is None and skipped.name == "workers"
    assert "not reached" in skipped.detail and "takes up to 75 s" in skipped.detail
    assert not report.failed()


# -- the script on a host without a GPU ----------------------------------------------------------


def test_without_a_gpu_the_script_says_so_in_one_line_exits_2_and_writes_a_report(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    done = run_without_gpu("scripts/bench/gpu_check.py", out)
    assert done.returncode == NO_GPU_EXIT == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("gpu_check: no NVIDIA GPU here (")
    assert "| a GPU | not verified | no NVIDIA GPU here (" in out.read_text()

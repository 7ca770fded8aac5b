"""scripts/load/overload.py's pure parts: requests of several texts, and the overload and recovery phases."""

from __future__ import annotations

import argparse
import json

import pytest

from scripts.load import openloop, overload
from scripts.load.openloop import Outcome, Result


def test_requests_of_several_texts_stay_within_the_range_and_are_seeded() -> None:
    requests = openloop.corpus_requests("/predict/batched", texts=(1, 8), count=200)
    sizes = [len(json.loads(r.body)["inputs"]) for r in requests]
    assert min(sizes) == 1 and max(sizes) == 8
    assert requests == openloop.corpus_requests("/predict/batched", texts=(1, 8), count=200)
    # The default stays one request per line of the corpus.
    single = openloop.corpus_requests("/predict/batched")
    assert all(len(json.loads(r.body)["inputs"]) == 1 for r in single)


@pytest.mark.parametrize(("text", "span"), [("1", (1, 1)), ("1-8", (1, 8)), ("3-3", (3, 3))])
def test_texts_range(text: str, span: tuple[int, int]) -> None:
    assert overload.texts_range(text) == span


@pytest.mark.parametrize("text", ["0", "8-1", "a", "1-", "-2"])
def test_texts_range_refuses_nonsense(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        overload.texts_range(text)


def outcome(scheduled: float, latency: float, status: str = "200") -> Outcome:
    return Outcome(scheduled, 0.0, latency, status, "valid", False)


def test_the_overload_phase_leaves_out_what_was_sent_after_it() -> None:
    result = Result(
        rate=0,
        seconds=30,
        outcomes=[outcome(1.0, 0.5), outcome(9.0, 2.0), outcome(9.5, 0.001, "503"), outcome(12.0, 0.1)],
    )
    phase = overload.overload_phase(result, seconds=10)
    assert [o.scheduled for o in phase.outcomes] == [1.0, 9.0, 9.5]
    summary = phase.summary()
    assert summary["by_status"] == {"200": 2, "503": 1}
    assert summary["drain_s"] == 1.0  # the last answer came 11 s in, 1 s after the overload ended


def test_recovered_goodput_counts_the_200s_answered_from_5_s_after_the_overload() -> None:
    result = Result(
        rate=0,
        seconds=25,
        outcomes=[
            outcome(11.0, 0.5),  # answered 11.5 s in: before the window
            outcome(15.0, 0.5),
            outcome(16.0, 1.0),
            outcome(17.0, 0.1, "503"),
            outcome(24.0, 2.0),  # answered after the run's end
        ],
    )
    assert overload.recovered_rps(result, seconds=10, recovery_s=15) == pytest.approx(2 / 10)
    assert overload.recovered_rps(result, seconds=10, recovery_s=0) is None


def test_a_row_is_judged_against_the_capacity_measured_on_both_sides_of_it() -> None:
    # 2,400 answered by 10 s in: 240 req/s.
    served = [outcome(9.8, 0.2)] * 2400 + [outcome(0.5, 0.001, "503")] * 7600
    summary = Result(rate=1000, seconds=10, outcomes=served, last_answer_s=10.0)
    row = {
        "worker_class": "gthread",
        "capacity_rps": 300.0,
        "capacity_after_rps": 200.0,
        "texts_per_request": "1",
        "multiple": 5.0,
        **summary.summary(),
        "recovered_rps": None,
        "readyz_after": 200,
        "lone_ms_before": 9.0,
        "lone_ms_after": 10.0,
    }
    assert overload.bracketed(row) == 250.0
    line = overload.markdown([row]).splitlines()[-1]
    # 0.96x of the mean, where the first reading alone would say 0.80x.
    assert "| 300 → 200 req/s | 240 req/s (0.96x) | 2400 | 7600 |" in line


def test_the_cpu_accounting_gives_a_refusals_cost_and_the_bound_the_generator_leaves() -> None:
    # 2,000 served and 8,000 refused; at capacity, 400 req/s took 1.9 cores: 4.75 ms each.
    outcomes = [outcome(1.0, 0.5)] * 2000 + [outcome(1.0, 0.001, "503")] * 8000
    result = Result(rate=1000, seconds=10, outcomes=outcomes, last_answer_s=10.0)
    # The service used 11.5 CPU seconds: 9.5 for the served, 2.0 for 8,000 refusals.
    assert overload.refusal_cpu_ms(result, 11.5, capacity=400.0, cores=1.9) == pytest.approx(0.25)
    assert overload.refusal_cpu_ms(Result(rate=0, seconds=1), 1.0, capacity=400.0, cores=1.9) is None
    row = {"cores": {"machine": 2, "service_at_capacity": 1.9, "service": 1.7, "generator": 0.48}}
    # 1.52 cores left to the service where capacity took 1.9: 0.8x at most, were refusals free.
    assert overload.refusal_free_bound(row) == pytest.approx(0.8)
    assert overload.refusal_free_bound({}) is None

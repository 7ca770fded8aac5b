"""The offline measurement (scripts.bench.offline): spawned processes report, or the parent raises at once."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest

from scripts.bench.offline import OfflineError, Split, Strategy, measure
from service.config.settings import Settings

# Each case spawns processes that import torch.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODELS = "tests.support.models"
# Far above what a failure takes to surface even on a loaded machine, far below a
# hang, which lasts until the barrier's 300 s timeout or forever.
PROMPT_S = 120


def settings(factory: str) -> Settings:
    return Settings(model=f"{MODELS}:{factory}", torch_threads=1)


def test_a_factory_model_is_measured_on_its_own_sample_item() -> None:
    results = measure(settings("echo"), Split(2, 1), [1, 4], seconds=0.2, warmup=1)
    assert [m.batch_size for m in results] == [1, 4]
    assert all(m.items_per_s > 0 and m.batch_ms_median >= 0 for m in results)
    assert not mp.active_children()


def test_a_corpus_runs_offline_and_through_the_workers_batcher_from_client_threads() -> None:
    texts = [" ".join(["word"] * (1 + k % 7)) for k in range(40)]
    offline, batcher = measure(
        settings("sized_echo"),
        Split(2, 1),
        [],
        seconds=0.3,
        corpus=texts,
        strategies=[Strategy(8, cost=True), Strategy(8, clients=4)],
    )
    assert offline.strategy == "8 sorted, cut by cost"
    assert batcher.strategy == "batcher without HTTP, 4 clients"
    # Answers counted in the measured span, from both processes; their round trips.
    assert offline.items_per_s > 0 and batcher.items_per_s > 0
    assert batcher.batch_ms_median > 0
    assert not mp.active_children()


@pytest.mark.parametrize(
    ("factory", "workers", "message"),
    [
        ("broken_load", 1, "RuntimeError: injected load failure"),
        ("broken_predict", 1, "RuntimeError: injected predict failure"),
        # The other process loads and waits at the barrier for the one that failed.
        ("fails_in_one_process", 2, "RuntimeError: injected load failure in one process"),
        ("sleepy", 1, "ValueError: no sample item for model 'sleepy'"),
    ],
)
def test_a_failing_model_makes_measure_raise_promptly_and_stops_every_process(
    factory: str, workers: int, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_FAIL_DIR", str(tmp_path))  # the spawned processes inherit it
    started = time.monotonic()
    with pytest.raises(OfflineError, match=f"SERVE_MODEL='{MODELS}:{factory}' failed") as raised:
        measure(settings(factory), Split(workers, 1), [1, 2], seconds=0.2, warmup=1)
    assert time.monotonic() - started < PROMPT_S
    assert message in str(raised.value)
    assert not mp.active_children()

"""The topology planner on fake machines: pure, so no machine is needed."""

from __future__ import annotations

import pytest

from service.config.settings import Settings
from service.errors import SettingsError
from service.topology.inventory import Gpu, Inventory
from service.topology.plan import Plan, plan
from service.topology.table import render

H100_MB, RTX4090_MB = 81559, 24564  # what NVML reports as their total memory


def gpu(index: int, total_mb: int, free_mb: int | None = None, name: str = "NVIDIA H100 80GB HBM3") -> Gpu:
    free = total_mb - 500 if free_mb is None else free_mb
    return Gpu(index=index, uuid=f"GPU-{index:08d}-fake", name=name, total_mb=total_mb, free_mb=free)


TWO_CORES = Inventory(affinity_cores=2, gpu_note="NVML is unavailable: no driver")
QUOTA_1_5_ON_16 = Inventory(affinity_cores=16, cpu_quota=1.5)
FOUR_H100 = Inventory(affinity_cores=16, gpus=tuple(gpu(i, H100_MB) for i in range(4)))
MIXED = Inventory(
    affinity_cores=16,
    gpus=(gpu(0, RTX4090_MB, name="NVIDIA GeForce RTX 4090"), gpu(1, H100_MB)),
)


def env_plan(inventory: Inventory, **variables: str) -> Plan:
    return plan(Settings.from_env(variables), inventory)


def devices(p: Plan) -> list[str]:
    return [w.device for w in p.workers]


# -- CPU --------------------------------------------------------------------------


def test_two_cores_without_a_gpu_run_one_single_threaded_worker_per_core() -> None:
    p = env_plan(TWO_CORES)
    assert devices(p) == ["cpu", "cpu"]
    assert [w.torch_threads for w in p.workers] == [1, 1]
    assert [w.gpu_memory_fraction for w in p.workers] == [None, None]
    assert p.devices == ()
    assert p.threads == 64 + 8
    assert p.worker_connections == 64 + 256 + 8 + 4000
    assert (p.timeout_s, p.graceful_timeout_s) == (60, 35)
    assert p.warnings == ()
    env = p.worker_env(1)
    assert env["SERVE_WORKER_SLOT"] == "1"
    assert env["SERVE_WORKER_DEVICE"] == "cpu"
    assert env["SERVE_TORCH_THREADS"] == env["OMP_NUM_THREADS"] == "1"
    assert env["SERVE_WORKER_GPU_MEMORY_FRACTION"] is None
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # a CPU worker never sees a GPU
    assert env["TOKENIZERS_PARALLELISM"] == "false"  # its pool would compete with torch's threads
    # One compiled oneDNN primitive per op and shape would fill the worker with mixed lengths.
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"


def test_the_onednn_cache_setting_reaches_every_worker() -> None:
    p = env_plan(TWO_CORES, SERVE_ONEDNN_CACHE="1024")
    assert [p.worker_env(slot)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] for slot in (0, 1)] == ["1024", "1024"]


@pytest.mark.parametrize(
    ("variables", "workers", "threads"),
    [
        ({"SERVE_WORKERS": "1"}, 1, 2),
        ({"SERVE_TORCH_THREADS": "2"}, 1, 2),
        ({"SERVE_WORKERS": "2", "SERVE_TORCH_THREADS": "1"}, 2, 1),
        ({"SERVE_TORCH_THREADS": "8"}, 1, 8),
    ],
)
def test_cpu_overrides_keep_workers_times_threads_within_the_cores(
    variables: dict[str, str], workers: int, threads: int
) -> None:
    p = env_plan(TWO_CORES, **variables)
    assert len(p.workers) == workers
    assert {w.torch_threads for w in p.workers} == {threads}
    assert bool(p.warnings) == (workers * threads > 2)


def test_oversubscribing_overrides_are_allowed_with_a_warning() -> None:
    p = env_plan(TWO_CORES, SERVE_WORKERS="2", SERVE_TORCH_THREADS="2")
    assert len(p.workers) == 2
    assert any("4 torch threads on 2 usable cores" in w for w in p.warnings)


def test_a_cgroup_quota_of_one_and_a_half_cpus_on_sixteen_cores_gives_one_worker() -> None:
    assert QUOTA_1_5_ON_16.usable_cores == 1
    p = env_plan(QUOTA_1_5_ON_16)
    assert devices(p) == ["cpu"]
    assert p.workers[0].torch_threads == 1
    assert "cgroup quota 1.5 CPUs" in render(p)


@pytest.mark.parametrize(
    ("affinity", "quota", "usable"), [(16, 0.5, 1), (16, 2.9, 2), (4, 8.0, 4), (3, None, 3)]
)
def test_usable_cores_are_the_tighter_of_affinity_and_quota(
    affinity: int, quota: float | None, usable: int
) -> None:
    assert Inventory(affinity_cores=affinity, cpu_quota=quota).usable_cores == usable


def test_gpu_settings_on_a_cpu_plan_are_ignored_with_a_warning() -> None:
    p = env_plan(TWO_CORES, SERVE_WORKERS_PER_DEVICE="2")
    assert len(p.workers) == 2
    assert p.warnings == ("SERVE_WORKERS_PER_DEVICE=2 is ignored: this plan uses no GPU",)


# -- GPU --------------------------------------------------------------------------


def test_four_80gb_gpus_get_one_worker_each_with_its_memory_less_the_context() -> None:
    p = env_plan(FOUR_H100)
    assert devices(p) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [w.gpu_uuid for w in p.workers] == [g.uuid for g in FOUR_H100.gpus]
    # (81059 free - 1024 context) / 81559 total, rounded down
    assert {w.gpu_memory_fraction for w in p.workers} == {0.981}
    assert {w.torch_threads for w in p.workers} == {4}  # 16 cores // 4 workers
    assert p.warnings == ()
    env = p.worker_env(2)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-00000002-fake"
    assert env["SERVE_WORKER_DEVICE"] == "cuda:2"
    assert env["SERVE_WORKER_GPU_MEMORY_FRACTION"] == "0.981"


def test_workers_per_device_split_each_gpu_and_interleave_the_slots() -> None:
    p = env_plan(FOUR_H100, SERVE_WORKERS_PER_DEVICE="2")
    assert devices(p) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"] * 2
    fraction = p.workers[0].gpu_memory_fraction
    assert fraction == 0.484  # (81059 / 2 - 1024) / 81559, rounded down
    for d in p.devices:
        assert d.workers == 2
        assert d.workers * d.memory_fraction * d.gpu.total_mb + d.workers * 1024 <= d.gpu.free_mb
    assert {w.torch_threads for w in p.workers} == {2}


def test_mixed_gpus_get_counts_and_fractions_by_their_memory() -> None:
    p = env_plan(MIXED, SERVE_GPU_MEMORY_PER_WORKER_MB="10000")
    small, large = p.devices
    assert (small.device, small.workers) == ("cuda:0", 2)  # 24064 free // 11024
    assert (large.device, large.workers) == ("cuda:1", 7)  # 81059 free // 11024
    assert small.memory_fraction != large.memory_fraction
    for d in p.devices:
        assert d.allocator_mb >= 10000
        assert d.workers * (d.allocator_mb + 1024) <= d.gpu.free_mb
    assert devices(p)[:5] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:1"]
    assert devices(p).count("cuda:1") == 7
    assert {w.torch_threads for w in p.workers} == {1}  # 16 cores // 9 workers
    assert p.warnings == ()


def test_mixed_gpus_with_the_default_count_get_one_worker_each_with_its_own_fraction() -> None:
    p = env_plan(MIXED)
    assert [(d.device, d.workers) for d in p.devices] == [("cuda:0", 1), ("cuda:1", 1)]
    assert [d.memory_fraction for d in p.devices] == [0.937, 0.981]


@pytest.mark.parametrize(
    ("chosen", "expected"),
    [
        ("cuda:1,cuda:3", ["cuda:1", "cuda:3"]),
        ("cuda:2", ["cuda:2"]),
        ("CUDA:3, cuda:0", ["cuda:3", "cuda:0"]),
    ],
)
def test_serve_devices_picks_a_subset_of_the_gpus(chosen: str, expected: list[str]) -> None:
    p = env_plan(FOUR_H100, SERVE_DEVICES=chosen)
    assert devices(p) == expected
    assert [w.gpu_uuid for w in p.workers] == [f"GPU-{int(d[5:]):08d}-fake" for d in expected]
    assert {w.torch_threads for w in p.workers} == {16 // len(expected)}


def test_serve_devices_cpu_ignores_the_gpus() -> None:
    p = env_plan(FOUR_H100, SERVE_DEVICES="cpu")
    assert devices(p) == ["cpu"] * 16
    assert p.worker_env(0)["CUDA_VISIBLE_DEVICES"] == ""


def test_serve_workers_spreads_over_the_gpus() -> None:
    p = env_plan(FOUR_H100, SERVE_WORKERS="6")
    assert [d.workers for d in p.devices] == [2, 2, 1, 1]
    fewer = env_plan(FOUR_H100, SERVE_WORKERS="1")
    assert devices(fewer) == ["cuda:0"]


def test_the_memory_fraction_override_applies_to_every_worker() -> None:
    p = env_plan(MIXED, SERVE_WORKERS_PER_DEVICE="3", SERVE_GPU_MEMORY_FRACTION="0.3")
    assert {w.gpu_memory_fraction for w in p.workers} == {0.3}


def test_slots_past_the_plan_reuse_the_planned_devices_in_turn() -> None:
    p = env_plan(FOUR_H100)
    assert p.worker(5).device == "cuda:1"
    assert p.worker_env(5)["SERVE_WORKER_SLOT"] == "5"


# -- request concurrency and timeouts ---------------------------------------------


def test_gthread_threads_cover_a_full_batch_and_the_probes() -> None:
    assert env_plan(TWO_CORES, SERVE_MAX_BATCH_SIZE="16").threads == 24
    low = env_plan(TWO_CORES, SERVE_THREADS="8")
    assert low.threads == 8
    assert any("SERVE_THREADS=8 is below max batch size + 8" in w for w in low.warnings)


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_connections_cover_a_running_batch_a_full_queue_the_probes_and_the_refused(worker_class: str) -> None:
    p = env_plan(TWO_CORES, SERVE_WORKER_CLASS=worker_class)
    # And room for the refusals held for their Retry-After under overload.
    assert p.worker_connections == 64 + 256 + 8 + 4000
    assert (
        env_plan(
            TWO_CORES, SERVE_WORKER_CLASS=worker_class, SERVE_WORKER_CONNECTIONS="100"
        ).worker_connections
        == 100
    )
    assert env_plan(TWO_CORES, SERVE_WORKER_CLASS="sync").worker_connections is None


def test_concurrency_settings_of_another_worker_class_are_ignored_with_a_warning() -> None:
    gevent = env_plan(TWO_CORES, SERVE_WORKER_CLASS="gevent", SERVE_THREADS="100")
    assert gevent.warnings == ("SERVE_THREADS=100 is ignored: only gthread workers have request threads",)
    sync = env_plan(TWO_CORES, SERVE_WORKER_CLASS="sync", SERVE_WORKER_CONNECTIONS="50")
    assert (
        sync.warnings[0]
        == "SERVE_WORKER_CONNECTIONS=50 is ignored: a sync worker holds one connection at a time"
    )


def test_sync_is_allowed_with_a_warning_and_a_timeout_that_covers_a_request() -> None:
    p = env_plan(TWO_CORES, SERVE_WORKER_CLASS="sync", SERVE_REQUEST_TIMEOUT_MS="90000")
    assert p.threads == 1  # more would make gunicorn switch to gthread
    assert any("never sees more than one request per batch" in w for w in p.warnings)
    assert p.timeout_s == 95
    assert p.graceful_timeout_s == 95


def test_graceful_timeout_follows_the_request_deadline() -> None:
    assert env_plan(TWO_CORES, SERVE_REQUEST_TIMEOUT_MS="2500").graceful_timeout_s == 3 + 5


# -- errors -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inventory", "variables", "message"),
    [
        (TWO_CORES, {"SERVE_DEVICES": "cuda"}, "SERVE_DEVICES=cuda asks for GPUs, but none is usable: NVML"),
        (
            FOUR_H100,
            {"SERVE_DEVICES": "cuda:1,cuda:7"},
            "SERVE_DEVICES=cuda:1,cuda:7 names cuda:7, but the GPUs",
        ),
        (
            FOUR_H100,
            {"SERVE_WORKERS_PER_DEVICE": "2", "SERVE_GPU_MEMORY_PER_WORKER_MB": "1000"},
            "SERVE_WORKERS_PER_DEVICE and SERVE_GPU_MEMORY_PER_WORKER_MB both set",
        ),
        (
            FOUR_H100,
            {"SERVE_WORKERS": "4", "SERVE_WORKERS_PER_DEVICE": "2"},
            "SERVE_WORKERS=4 cannot be combined with SERVE_WORKERS_PER_DEVICE",
        ),
        (
            MIXED,
            {"SERVE_GPU_MEMORY_PER_WORKER_MB": "30000"},
            "SERVE_GPU_MEMORY_PER_WORKER_MB=30000 fits no worker",
        ),
        (
            FOUR_H100,
            {"SERVE_WORKERS_PER_DEVICE": "3", "SERVE_GPU_MEMORY_FRACTION": "0.4"},
            "SERVE_GPU_MEMORY_FRACTION=0.4 for 3 workers on cuda:0 adds up to 1.20",
        ),
        (MIXED, {"SERVE_WORKERS_PER_DEVICE": "30"}, "30 workers on cuda:0"),
    ],
)
def test_impossible_plans_name_the_variable(
    inventory: Inventory, variables: dict[str, str], message: str
) -> None:
    with pytest.raises(SettingsError, match="^" + message.replace(".", r"\.").replace("(", r"\(")):
        env_plan(inventory, **variables)


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("SERVE_DEVICES", "gpu", "SERVE_DEVICES must be one of auto, cpu, cuda, or a list of distinct GPUs"),
        ("SERVE_DEVICES", "cuda:0,cuda:0", "SERVE_DEVICES must be one of auto, cpu, cuda"),
        ("SERVE_DEVICES", "cuda:0,cpu", "SERVE_DEVICES must be one of auto, cpu, cuda"),
        ("SERVE_WORKERS_PER_DEVICE", "0", "SERVE_WORKERS_PER_DEVICE must be an integer from 1 to 256"),
        ("SERVE_GPU_MEMORY_FRACTION", "1.5", "SERVE_GPU_MEMORY_FRACTION must be a number from 0.01 to 1"),
        ("SERVE_GPU_MEMORY_PER_WORKER_MB", "lots", "SERVE_GPU_MEMORY_PER_WORKER_MB must be an integer"),
        ("SERVE_WORKER_CONNECTIONS", "0", "SERVE_WORKER_CONNECTIONS must be an integer from 1"),
    ],
)
def test_bad_topology_settings_name_the_variable(variable: str, value: str, message: str) -> None:
    with pytest.raises(SettingsError, match="^" + message):
        Settings.from_env({variable: value})


# -- the table ----------------------------------------------------------------------


def test_the_table_shows_every_worker_device_decision_and_warning() -> None:
    table = render(env_plan(MIXED, SERVE_GPU_MEMORY_PER_WORKER_MB="10000", SERVE_TORCH_THREADS="2"))
    assert "Worker topology: 9 gthread workers on 16 usable cores" in table
    assert "NVIDIA GeForce RTX 4090" in table
    for heading in ("slot", "device", "torch threads", "GPU memory fraction", "allocator MiB each", "why"):
        assert heading in table
    assert "warning: 9 workers run 18 torch threads on 16 usable cores" in table
    assert render(env_plan(TWO_CORES)).endswith("warnings: none")


# -- the batch token budget against each worker's memory share ---------------------


def test_a_gpu_plan_shows_the_token_budget_and_what_it_needs_of_the_share() -> None:
    p = env_plan(FOUR_H100, SERVE_MAX_BATCH_TOKENS="8192", SERVE_TOKEN_MEMORY_KB="24")
    (row,) = [d for d in p.decisions if d.what == "batch token budget"]
    assert row.value == "8192 tokens, 192 MiB"  # 8192 x 24 KiB
    assert p.warnings == ()


def test_a_budget_larger_than_a_workers_share_is_warned_with_a_budget_that_fits() -> None:
    # Eight workers on a 24 GiB card leave each about 2 GiB; 16 Ki tokens at 256 KiB need 4 GiB.
    p = env_plan(
        MIXED,
        SERVE_DEVICES="cuda:0",
        SERVE_WORKERS_PER_DEVICE="8",
        SERVE_MAX_BATCH_TOKENS="16384",
        SERVE_TOKEN_MEMORY_KB="256",
    )
    (device,) = p.devices
    (warning,) = p.warnings
    assert "4096 MiB of activations" in warning
    assert f"{device.allocator_mb} MiB share on cuda:0" in warning
    fits = int(device.allocator_mb * 1024 / 256)
    assert f"below {fits}" in warning
    assert fits * 256 / 1024 <= device.allocator_mb


def test_without_a_memory_per_token_the_budget_is_shown_unchecked() -> None:
    p = env_plan(FOUR_H100)
    (row,) = [d for d in p.decisions if d.what == "batch token budget"]
    assert row.value == "8192 tokens" and "SERVE_TOKEN_MEMORY_KB" in row.why
    assert p.warnings == ()


def test_a_cpu_plan_has_no_gpu_share_to_check() -> None:
    p = env_plan(TWO_CORES, SERVE_TOKEN_MEMORY_KB="1000000", SERVE_MAX_BATCH_TOKENS="16777216")
    assert not [d for d in p.decisions if d.what == "batch token budget"]
    assert p.warnings == ()


# -- weights at the precision in use (the GPUs here are fakes: nothing touches CUDA) -----------


def test_a_gpu_plan_sizes_each_workers_weights_at_the_precision_in_use() -> None:
    from service.config.model_spec import Weights

    inventory = Inventory(affinity_cores=8, cpu_quota=None, gpus=(gpu(0, 8_192),))
    text = Weights(mb=1_300, bytes_per_number=4, reducible=True)
    decided = {d.what: d.value for d in plan(Settings(), inventory, text).decisions}
    assert decided["weights per worker"] == "650 MiB at float16"  # auto: float16 for a text model
    fp32 = plan(Settings(precision="float32"), inventory, text)
    assert {d.what: d.value for d in fp32.decisions}["weights per worker"] == "1300 MiB at float32"
    program = Weights(mb=1_300, bytes_per_number=4, reducible=False)
    assert "1300 MiB at float32" in {d.value for d in plan(Settings(), inventory, program).decisions}


def test_a_share_too_small_for_the_weights_is_warned_of() -> None:
    from service.config.model_spec import Weights

    inventory = Inventory(affinity_cores=8, cpu_quota=None, gpus=(gpu(0, 8_192),))
    big = Weights(mb=12_000, bytes_per_number=4, reducible=True)
    warned = plan(Settings(workers_per_device=2), inventory, big).warnings
    assert any("cannot hold the model's 6000 MiB of weights at float16" in w for w in warned)
    assert not plan(Settings(workers_per_device=2), inventory, Weights(100, 4, True)).warnings


def test_a_gpu_plan_sizes_each_workers_share_for_every_model_it_holds() -> None:
    # GPU planning is mocked: an inventory of one 8 GiB GPU, no device needed.
    from service.config.model_spec import Weights

    inventory = Inventory(affinity_cores=8, cpu_quota=None, gpus=(gpu(0, 8_192),))
    embed = Weights(mb=1_300, bytes_per_number=4, reducible=True)
    program = Weights(mb=400, bytes_per_number=4, reducible=False)
    both = plan(Settings(), inventory, [embed, program, None])  # None: a factory, unknown until loaded
    decided = {d.what: d for d in both.decisions}["weights per worker"]
    assert decided.value == "1050 MiB at float16/float32"  # 650 at float16 + 400 at float32
    assert "of each of the 2 models" in decided.why
    assert any("the weights of 1 of the 3 models are unknown" in w for w in both.warnings)
    # Two models that fit alone may not fit together.
    warned = plan(Settings(workers_per_device=2), inventory, [Weights(5_000, 4, True)] * 2).warnings
    assert any("cannot hold the models' 5000 MiB of weights" in w for w in warned)
    assert not plan(Settings(workers_per_device=2), inventory, [Weights(5_000, 4, True)]).warnings


def test_the_weights_of_a_directory_are_read_from_its_files(model_dirs: dict[str, object]) -> None:
    from pathlib import Path

    from service.config.model_spec import weights

    found = weights("minilm")
    assert found is not None and found.reducible and 80 < found.mb < 100 and found.bytes_per_number == 4
    rerank = weights(str(model_dirs["rerank"]))
    expected = sum(f.stat().st_size for f in Path(str(model_dirs["rerank"])).glob("*.safetensors")) / 2**20
    assert rerank is not None and rerank.mb == pytest.approx(expected)
    assert weights("package.module:factory") is None

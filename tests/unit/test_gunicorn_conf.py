"""gunicorn_conf.py's hooks, driven with stand-ins for gunicorn's arbiter and workers."""

from __future__ import annotations

import logging
import os
import runpy
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest

from service.topology import inventory
from service.topology.inventory import Gpu, Inventory
from tests.support.server import ROOT

CONF = str(ROOT / "gunicorn_conf.py")


@dataclass
class FakeWorker:
    age: int
    pid: int = 0


@dataclass
class FakeArbiter:
    WORKERS: dict[int, FakeWorker] = field(default_factory=dict)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("test.gunicorn"))

    def fork(self, conf: dict[str, Any], age: int) -> FakeWorker:
        worker = FakeWorker(age)
        conf["pre_fork"](self, worker)
        worker.pid = 1000 + age
        self.WORKERS[worker.pid] = worker
        return worker

    def reap(self, conf: dict[str, Any], worker: FakeWorker) -> None:
        del self.WORKERS[worker.pid]
        conf["child_exit"](self, worker)


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    # The hooks write the worker's environment; keep this process's own intact.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
    monkeypatch.setattr(os, "environ", env)
    return env


def test_the_config_reads_the_plan(environ: dict[str, str]) -> None:
    environ.update({"SERVE_WORKERS": "3", "SERVE_MAX_BATCH_SIZE": "16", "SERVE_WORKER_CLASS": "gevent"})
    conf = runpy.run_path(CONF)
    assert (conf["workers"], conf["worker_class"], conf["worker_connections"]) == (
        3,
        "service.host.gevent_worker.GeventWorker",
        16 + 64 + 8 + 4000,
    )
    assert conf["preload_app"] is False
    assert conf["control_socket_disable"] is True
    assert (conf["timeout"], conf["graceful_timeout"]) == (60, 35)


def test_a_replacement_worker_takes_its_predecessors_slot_and_environment(environ: dict[str, str]) -> None:
    environ.update(
        {"SERVE_WORKERS": "2", "SERVE_TORCH_THREADS": "1", "SERVE_WORKER_GPU_MEMORY_FRACTION": "0.5"}
    )
    conf = runpy.run_path(CONF)
    arbiter = FakeArbiter()
    first, second = arbiter.fork(conf, 1), arbiter.fork(conf, 2)
    assert (first.serve_slot, second.serve_slot) == (0, 1)  # type: ignore[attr-defined]

    arbiter.reap(conf, first)
    replacement = arbiter.fork(conf, 3)
    assert replacement.serve_slot == 0  # type: ignore[attr-defined]

    conf["post_fork"](arbiter, replacement)
    assert environ["SERVE_WORKER_SLOT"] == "0"
    assert environ["SERVE_WORKER_DEVICE"] == "cpu"
    assert environ["SERVE_TORCH_THREADS"] == environ["OMP_NUM_THREADS"] == "1"
    assert environ["CUDA_VISIBLE_DEVICES"] == ""
    assert "SERVE_WORKER_GPU_MEMORY_FRACTION" not in environ  # a CPU worker has none


def test_a_bad_setting_stops_gunicorn_with_a_message_naming_it(environ: dict[str, str]) -> None:
    environ["SERVE_DEVICES"] = "tpu"
    with pytest.raises(SystemExit, match=r"^gunicorn_conf\.py: SERVE_DEVICES must be one of auto, cpu, cuda"):
        runpy.run_path(CONF)


def test_the_master_imports_neither_torch_nor_numpy_to_plan_and_check() -> None:
    # Only _preload, on CPU plans, imports them (with one thread for every pool: service.host.preload).
    code = (
        f"import runpy, sys; conf = runpy.run_path({CONF!r}); conf['_check_model']();"
        "print('torch' in sys.modules, 'numpy' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False False"


def test_a_gpu_plan_builds_nothing_in_the_master() -> None:
    # GPU weights cannot pass through a fork, and CUDA must not start in the master: each
    # worker builds its own copy. The GPU is faked (none here); nothing runs on it.
    code = f"""
import logging, runpy, sys
from service.topology import inventory
from service.topology.inventory import Gpu, Inventory
inventory.read_inventory = lambda cuda_visible_devices=None: Inventory(
    affinity_cores=8, gpus=(Gpu(0, "GPU-0000", "H100", 81_559, 80_000),)
)
conf = runpy.run_path({CONF!r})
class Arbiter:
    log = logging.getLogger("test")
conf["_preload"](Arbiter())
print(conf["plan"].workers[0].device, "torch" in sys.modules)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "cuda:0 False"


def test_sharing_is_wanted_on_cpu_plans_with_it_on_and_the_model_is_taken_only_by_a_cpu_worker_of_its_spec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from service.config.settings import Settings
    from service.host import preload
    from service.models.precision import Outcome

    on, off = Settings(), Settings(share_weights=False)
    assert preload.wanted(on, ["cpu", "cpu"])
    assert not preload.wanted(off, ["cpu"])
    assert not preload.wanted(on, ["cpu", "cuda:0"])
    held = preload.Preloaded("minilm", object(), Outcome("auto", "float32"), 1.0)  # type: ignore[arg-type]
    monkeypatch.setattr(preload, "_held", {on.models[0]: held})
    assert preload.take(on, "cpu") is held
    assert preload.take(on, "cuda") is None
    assert preload.take(Settings(model="mlp"), "cpu") is None


def test_a_reload_plans_from_the_inventory_read_at_start(
    environ: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def machine(free_mb: int) -> Inventory:
        return Inventory(affinity_cores=8, gpus=(Gpu(0, "GPU-0000", "H100", 81_559, free_mb),))

    # By the time of a SIGHUP the old workers hold most of the GPU; NVML counts it as used.
    readings = iter([machine(80_000), machine(2_000)])
    monkeypatch.setattr(inventory, "_first", {})
    monkeypatch.setattr(inventory, "read_inventory", lambda cuda_visible_devices=None: next(readings))
    started = runpy.run_path(CONF)["plan"]
    reloaded = runpy.run_path(CONF)["plan"]  # gunicorn re-executes its config file on SIGHUP
    assert started.devices[0].memory_fraction == 0.968  # (80000 - 1024) / 81559, rounded down
    assert reloaded == started


def test_python_m_service_topology_prints_the_plan() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
    env["SERVE_WORKERS"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "service.topology"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.startswith("Worker topology: 1 gthread worker on ")
    assert "SERVE_WORKERS=1" in result.stdout
    env["SERVE_WORKERS"] = "many"
    bad = subprocess.run(
        [sys.executable, "-m", "service.topology"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: SERVE_WORKERS must be an integer")


def test_the_onednn_cache_follows_the_precision_planned_then_settled(environ: dict[str, str]) -> None:
    conf = runpy.run_path(CONF)
    settle = conf["_settle_onednn_cache"]
    names = settle.__globals__  # the module's own globals, which the hooks read
    cache = lambda: names["plan"].worker_env(0)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]  # noqa: E731

    # auto aims for bfloat16 on a processor with AMX: its kernels need the cache.
    names["cpu_flags"] = lambda: frozenset({"avx512_bf16", "amx_bf16"})
    settle()
    assert cache() == "1024"
    # The check kept float32 (under auto's floor): float32 runs as it always has.
    settle(["float32"])
    assert cache() == "0"
    settle(["bfloat16"])
    assert cache() == "1024"
    # No native bfloat16: float32, no cache.
    names["cpu_flags"] = lambda: frozenset({"avx512f", "avx512_vnni"})
    settle()
    assert cache() == "0"


def test_a_set_onednn_cache_is_kept_whatever_the_precision(environ: dict[str, str]) -> None:
    environ["SERVE_ONEDNN_CACHE"] = "64"
    conf = runpy.run_path(CONF)
    settle = conf["_settle_onednn_cache"]
    settle.__globals__["cpu_flags"] = lambda: frozenset({"amx_bf16"})
    settle(["float32"])
    assert settle.__globals__["plan"].worker_env(0)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"

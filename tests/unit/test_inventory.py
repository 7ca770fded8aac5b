"""Reading the machine: cgroup quotas on fake trees, GPU visibility, and this machine."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from service.topology import inventory
from service.topology.inventory import (
    Gpu,
    Inventory,
    cgroup_cpu_quota,
    read_gpus,
    read_inventory,
    visible_gpus,
)

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNT = "32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"


def fake_root(tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text(mountinfo)
    for name, text in files.items():
        path = tmp_path / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_cgroup_v2_quota_in_a_container(tmp_path: Path) -> None:
    root = fake_root(tmp_path, "0::/\n", V2_MOUNT, {"/sys/fs/cgroup/cpu.max": "150000 100000\n"})
    assert cgroup_cpu_quota(root) == 1.5


def test_cgroup_v2_without_a_limit(tmp_path: Path) -> None:
    root = fake_root(tmp_path, "0::/\n", V2_MOUNT, {"/sys/fs/cgroup/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root) is None


def test_cgroup_v2_takes_the_tightest_limit_up_the_tree(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        "0::/service.slice/app.scope\n",
        V2_MOUNT,
        {
            "/sys/fs/cgroup/service.slice/app.scope/cpu.max": "400000 100000\n",
            "/sys/fs/cgroup/service.slice/cpu.max": "200000 100000\n",
            "/sys/fs/cgroup/cpu.max": "max 100000\n",
        },
    )
    assert cgroup_cpu_quota(root) == 2.0


def test_cgroup_v1_quota_under_a_mounted_subtree(tmp_path: Path) -> None:
    # Without a cgroup namespace, the container sees the host's path to its cgroup,
    # and that same cgroup mounted as the root of its cpu hierarchy.
    root = fake_root(
        tmp_path,
        "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n",
        V1_MOUNT.format(root="/docker/abc"),
        {
            "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "250000\n",
            "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_cpu_quota(root) == 2.5


def test_cgroup_v1_unlimited_quota(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        "4:cpu,cpuacct:/\n",
        V1_MOUNT.format(root="/"),
        {
            "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
            "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_cpu_quota(root) is None


def test_no_cgroup_files_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path) is None


GPUS = tuple(Gpu(i, f"GPU-{i}aaa", "GPU", 1000, 900) for i in range(4))


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, ["GPU-0aaa", "GPU-1aaa", "GPU-2aaa", "GPU-3aaa"]),
        ("2,0", ["GPU-2aaa", "GPU-0aaa"]),
        ("GPU-3, 1", ["GPU-3aaa", "GPU-1aaa"]),
        ("1,7,2", ["GPU-1aaa"]),  # like CUDA, the list ends at the first unknown entry
        ("", []),
        ("-1", []),
    ],
)
def test_cuda_visible_devices_narrows_and_renumbers_the_gpus(
    visible: str | None, expected: list[str]
) -> None:
    chosen = visible_gpus(GPUS, visible)
    assert [g.uuid for g in chosen] == expected
    assert [g.index for g in chosen] == list(range(len(expected)))


class FakeNvml(types.ModuleType):
    """Stands in for pynvml: this machine has no NVIDIA driver, and the tests need two GPUs."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.shut_down = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return f"GPU-{handle}-uuid".encode()  # older releases return bytes

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(total=81559 << 20, free=(81000 - handle) << 20)


def test_gpus_are_read_through_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    gpus, note = read_gpus("1")
    assert note is None
    assert gpus == (Gpu(0, "GPU-1-uuid", "NVIDIA H100 80GB HBM3", 81559, 80999),)
    assert nvml.shut_down
    assert read_gpus("") == ((), "CUDA_VISIBLE_DEVICES hides every GPU")


def test_this_machine_reads_without_touching_cuda() -> None:
    inventory = read_inventory()
    assert inventory.affinity_cores == len(os.sched_getaffinity(0))
    assert 1 <= inventory.usable_cores <= inventory.affinity_cores
    if not inventory.gpus:
        assert inventory.gpu_note


def test_first_inventory_reads_the_machine_once_per_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str | None] = []

    def fake_read(cuda_visible_devices: str | None = None) -> Inventory:
        calls.append(cuda_visible_devices)
        return Inventory(affinity_cores=len(calls))

    monkeypatch.setattr(inventory, "_first", {})
    monkeypatch.setattr(inventory, "read_inventory", fake_read)
    first = inventory.first_inventory(None)
    assert inventory.first_inventory(None) is first  # what a SIGHUP reload gets
    assert calls == [None]
    narrowed = inventory.first_inventory("0")
    assert narrowed is not first and narrowed.affinity_cores == 2
    assert calls == [None, "0"]

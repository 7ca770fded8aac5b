"""What the machine offers the service: usable CPU cores and GPUs with their memory.

Runs in the gunicorn master, so it must never import torch or touch CUDA (a
master holding a CUDA context breaks every worker it forks). GPUs are read
through NVML, the driver's monitoring library, which creates no context.

Usable cores are the fewest of three limits: the cores the process may run on
(its CPU affinity, e.g. ``taskset`` or a cpuset), and the CPU time its cgroup
may use per period (``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us`` in v1), which is how containers are limited.
``os.cpu_count()`` knows neither.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20


@dataclass(frozen=True)
class Gpu:
    """One GPU the service may use, numbered as ``nvidia-smi`` numbers it (PCI bus order)."""

    index: int
    uuid: str
    name: str
    total_mb: int
    free_mb: int


@dataclass(frozen=True)
class Inventory:
    affinity_cores: int
    # CPUs' worth of time the cgroup allows per period (1.5 = one and a half cores); None: no limit.
    cpu_quota: float | None = None
    gpus: tuple[Gpu, ...] = ()
    # Why no GPU was found, when none was: shown with the plan.
    gpu_note: str | None = None

    @property
    def usable_cores(self) -> int:
        cores = self.affinity_cores
        if self.cpu_quota is not None:
            # 1.5 CPUs of quota cannot keep two busy threads busy; round down, but a
            # quota below one core still runs one thread (slowly).
            cores = min(cores, math.floor(self.cpu_quota))
        return max(1, cores)


# The inventories first_inventory() read, by CUDA_VISIBLE_DEVICES. Kept in this
# module, which a process imports once, because gunicorn re-executes its config
# file on every reload (SIGHUP) and would forget anything kept there.
_first: dict[str | None, Inventory] = {}


def first_inventory(cuda_visible_devices: str | None = None) -> Inventory:
    """The inventory this process read first; read now only if it never was.

    gunicorn plans from it on every reload: by then the running workers hold
    GPU memory that NVML counts as used, so a fresh reading would shrink each
    worker's share, or find no room at all, though the old workers are about
    to leave and give it back.
    """
    if cuda_visible_devices not in _first:
        _first[cuda_visible_devices] = read_inventory(cuda_visible_devices)
    return _first[cuda_visible_devices]


def read_inventory(cuda_visible_devices: str | None = None, root: Path = Path("/")) -> Inventory:
    """This machine's inventory. ``cuda_visible_devices`` is the master's ``CUDA_VISIBLE_DEVICES``."""
    gpus, note = read_gpus(cuda_visible_devices)
    return Inventory(
        affinity_cores=len(os.sched_getaffinity(0)),
        cpu_quota=cgroup_cpu_quota(root),
        gpus=gpus,
        gpu_note=note,
    )


# -- cgroups ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Mount:
    root: str  # the cgroup path mounted there
    point: Path
    version: int


def cgroup_cpu_quota(root: Path = Path("/")) -> float | None:
    """The tightest CPU quota on this process's cgroups (v1 and v2), in CPUs; None if unlimited.

    ``root`` is the filesystem root, so that tests can pass a fake tree.
    """
    try:
        memberships = (root / "proc/self/cgroup").read_text().splitlines()
        mounts = _cgroup_mounts((root / "proc/self/mountinfo").read_text())
    except OSError:
        return None
    quotas: list[float] = []
    for line in memberships:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            wanted = [m for m in mounts if m.version == 2]
        elif "cpu" in controllers.split(","):
            wanted = [m for m in mounts if m.version == 1]
        else:
            continue
        for mount in wanted:
            quotas += _quotas_along(root, mount, path)
    return min(quotas, default=None)


def _cgroup_mounts(mountinfo: str) -> list[_Mount]:
    mounts = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, after = left.split(), right.split()
        if not sep or len(fields) < 5 or len(after) < 3:
            continue
        fstype, super_options = after[0], after[2].split(",")
        if fstype == "cgroup2":
            mounts.append(_Mount(fields[3], Path(fields[4]), 2))
        elif fstype == "cgroup" and "cpu" in super_options:
            mounts.append(_Mount(fields[3], Path(fields[4]), 1))
    return mounts


def _quotas_along(root: Path, mount: _Mount, path: str) -> list[float]:
    """Quotas on the process's cgroup and each of its ancestors: a parent's limit applies too."""
    # Inside a container the cgroup path may be longer than what is mounted; the mount
    # root is then a prefix of it. With a cgroup namespace both are "/".
    relative = path[len(mount.root) :] if path.startswith(mount.root) else path
    base = root / str(mount.point).lstrip("/")
    directory = base / relative.lstrip("/")
    if not directory.is_dir():
        directory = base  # the process's own cgroup is not visible here; the mount's is
    quotas = []
    while True:
        quota = _read_quota(directory, mount.version)
        if quota is not None:
            quotas.append(quota)
        if directory == base or base not in directory.parents:
            return quotas
        directory = directory.parent


def _read_quota(directory: Path, version: int) -> float | None:
    try:
        if version == 2:
            limit, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
            if limit == "max":
                return None
            return int(limit) / int(period or "100000")
        limit = (directory / "cpu.cfs_quota_us").read_text().strip()
        period = (directory / "cpu.cfs_period_us").read_text().strip()
    except (OSError, ValueError):
        return None
    try:
        quota, length = int(limit), int(period)
    except ValueError:
        return None
    return quota / length if quota > 0 and length > 0 else None


# -- GPUs -------------------------------------------------------------------------


def read_gpus(cuda_visible_devices: str | None = None) -> tuple[tuple[Gpu, ...], str | None]:
    """The GPUs NVML sees, narrowed to ``CUDA_VISIBLE_DEVICES``; or none and why."""
    try:
        import pynvml
    except ImportError:
        return (), "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return (), f"NVML is unavailable: {exc}"
    try:
        found = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            found.append(
                Gpu(
                    index=index,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    total_mb=int(memory.total) // MIB,
                    free_mb=int(memory.free) // MIB,
                )
            )
    except pynvml.NVMLError as exc:
        return (), f"NVML failed to list the GPUs ({exc})"
    finally:
        pynvml.nvmlShutdown()
    gpus = visible_gpus(tuple(found), cuda_visible_devices)
    if not gpus:
        return (), "no GPU" if not found else "CUDA_VISIBLE_DEVICES hides every GPU"
    return gpus, None


def visible_gpus(gpus: tuple[Gpu, ...], cuda_visible_devices: str | None) -> tuple[Gpu, ...]:
    """The GPUs CUDA would show under ``CUDA_VISIBLE_DEVICES``, renumbered from 0 as CUDA does.

    Entries are indices or UUID prefixes; like CUDA, the list ends at the first
    entry that names no GPU. Indices count in NVML's (PCI bus) order; set
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or use UUIDs on machines with mixed GPUs.
    """
    if cuda_visible_devices is None:
        return gpus
    chosen: list[Gpu] = []
    for raw in cuda_visible_devices.split(","):
        entry = raw.strip()
        match = None
        if entry.isdigit() and int(entry) < len(gpus):
            match = gpus[int(entry)]
        elif entry.startswith("GPU-"):
            match = next((g for g in gpus if g.uuid.startswith(entry)), None)
        if match is None or match in chosen:
            break
        chosen.append(match)
    return tuple(
        Gpu(index=i, uuid=g.uuid, name=g.name, total_mb=g.total_mb, free_mb=g.free_mb)
        for i, g in enumerate(chosen)
    )


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes.
    return value.decode() if isinstance(value, bytes) else value

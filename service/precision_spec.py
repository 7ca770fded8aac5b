"""Which precisions a device allows: the rules of SERVE_PRECISION that need no torch and no numpy.

The gunicorn master refuses with them what the planned devices cannot run
(float16 on a CPU, int8 on a GPU...) before any worker starts; each worker
settles the rest with the model in hand (service.models.precision).
"""

from __future__ import annotations

from pathlib import Path

from service.errors import SettingsError

AUTO, FLOAT32, FLOAT16, BFLOAT16, INT8 = "auto", "float32", "float16", "bfloat16", "int8"
PRECISIONS = (AUTO, FLOAT32, FLOAT16, BFLOAT16, INT8)
# The tasks whose networks run reduced on a GPU by default, as TEI and Infinity serve them.
TEXT_TASKS = ("embeddings", "rerank", "classification", "fill-mask")
# A CPU's native bfloat16: without one of these, torch emulates it, tens of times slower.
BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16")


def resolve(
    requested: str, *, device: str, task: str, reducible: bool, cpu_flags: frozenset[str], name: str
) -> str:
    """The precision to run ``requested`` in on ``device``, or a SettingsError that names the reason."""
    cuda = device.startswith("cuda")
    if requested == AUTO:
        # float16 is what the peers serve text encoders in on a GPU; CPUs gain
        # nothing from it, and int8 moves outputs enough to be asked for.
        return FLOAT16 if cuda and reducible and task in TEXT_TASKS else FLOAT32
    if requested == FLOAT32:
        return FLOAT32
    prefix = f"SERVE_PRECISION={requested}"
    if not reducible:
        raise SettingsError(
            f"{prefix}: model {name!r} runs in float32 only: its network is a program (TorchScript or "
            "torch.export), a file or a factory's module that the service cannot convert; export it in "
            "the precision you want, or set SERVE_PRECISION=float32"
        )
    if requested == INT8 and cuda:
        raise SettingsError(
            f"{prefix} is not served on {device}: int8 here is torch's dynamic quantization, whose "
            "kernels run on CPUs only; on a GPU use float16 or bfloat16"
        )
    if requested == FLOAT16 and not cuda:
        raise SettingsError(
            f"{prefix} is not served on a CPU: CPUs have no float16 matrix arithmetic torch uses, so "
            "it runs slower than float32; on a CPU use int8 (or bfloat16 where the processor has "
            "avx512_bf16 or amx_bf16)"
        )
    if requested == BFLOAT16 and not cuda and not cpu_flags & set(BFLOAT16_FLAGS):
        raise SettingsError(
            f"{prefix} needs a processor with native bfloat16 ({' or '.join(BFLOAT16_FLAGS)} among "
            "its flags in /proc/cpuinfo); this one has neither, and without them bfloat16 runs tens "
            "of times slower than float32; use int8 on this CPU"
        )
    return requested


def check_device(requested: str, device: str) -> None:
    """Refuse (SettingsError) what ``device`` cannot run whatever the model: for the master, at start."""
    resolve(requested, device=device, task=TEXT_TASKS[0], reducible=True, cpu_flags=cpu_flags(), name="")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The processor's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()

"""Which precisions a device allows: the rules of SERVE_PRECISION that need no torch and no numpy.

The gunicorn master refuses with them what the planned devices cannot run
(float16 on a CPU, int8 on a GPU...) before any worker starts; each worker
settles the rest with the model in hand (service.models.precision).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from service.errors import SettingsError

AUTO, FLOAT32, FLOAT16, BFLOAT16, INT8 = "auto", "float32", "float16", "bfloat16", "int8"
PRECISIONS = (AUTO, FLOAT32, FLOAT16, BFLOAT16, INT8)
# The tasks whose networks ``auto`` runs reduced: float16 on a GPU, as TEI and
# Infinity serve them; bfloat16 on a CPU with native bfloat16 (auto_choice).
TEXT_TASKS = ("embeddings", "rerank", "classification", "fill-mask")
# A CPU's native bfloat16: without one of these, torch emulates it, tens of times slower.
BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16")
# Intel's AMX tiles: bfloat16 matrix products at several times float32's rate
# (MiniLM: 3.2x offline, 2.1x to 2.65x through the service; docs/bench-precision.md).
AMX_FLAG = "amx_bf16"
# oneDNN's own default primitive cache, what ONEDNN_PRIMITIVE_CACHE_CAPACITY reads when unset.
ONEDNN_DEFAULT_CACHE = 1024


@dataclass(frozen=True)
class AutoChoice:
    """What ``SERVE_PRECISION=auto`` aims for on a device, and why (/info's "reason", the start log).

    ``measure``: kept only if it measures faster than float32 at start (a CPU
    with avx512_bf16 and no AMX, where bfloat16 is sometimes slower).
    """

    precision: str
    reason: str
    # The reason in a word, for the metrics' serve_model_info{precision_reason}.
    code: str
    measure: bool = False


def auto_choice(
    *, device: str, task: str, reducible: bool, cpu_flags: frozenset[str], onednn_cache: int
) -> AutoChoice:
    """The precision ``auto`` aims for, before the exactness check (and, where asked, the speed check)."""
    if not reducible or task not in TEXT_TASKS:
        what = f"the {task} task is served" if reducible else "the model's network runs only"
        return AutoChoice(FLOAT32, f"auto: float32, {what} in float32", "float32_only")
    if device.startswith("cuda"):
        # float16 is what the peers serve text encoders in on a GPU.
        return AutoChoice(FLOAT16, "auto: float16 on a GPU", "gpu")
    if not cpu_flags & set(BFLOAT16_FLAGS):
        return AutoChoice(
            FLOAT32,
            "auto: float32, the processor has no native bfloat16 (avx512_bf16 or amx_bf16)",
            "no_bfloat16",
        )
    if onednn_cache <= 0:
        # bfloat16's matrix products are oneDNN primitives: with no cache, each
        # call builds its kernels again and bfloat16 runs slower than float32.
        return AutoChoice(
            FLOAT32,
            "auto: float32, the oneDNN primitive cache is off (SERVE_ONEDNN_CACHE=0), which bfloat16 needs",
            "onednn_cache_off",
        )
    if AMX_FLAG in cpu_flags:
        return AutoChoice(BFLOAT16, "auto: bfloat16, the processor has amx_bf16", "amx_bf16")
    return AutoChoice(
        BFLOAT16,
        "auto: bfloat16 if it measures faster, the processor has avx512_bf16 and no AMX",
        "avx512_bf16_faster",
        measure=True,
    )


def resolve(
    requested: str,
    *,
    device: str,
    task: str,
    reducible: bool,
    cpu_flags: frozenset[str],
    name: str,
    onednn_cache: int = ONEDNN_DEFAULT_CACHE,
) -> str:
    """The precision to run ``requested`` in on ``device``, or a SettingsError that names the reason."""
    cuda = device.startswith("cuda")
    if requested == AUTO:
        # int8 moves outputs enough to be asked for; see auto_choice for the rest.
        choice = auto_choice(
            device=device, task=task, reducible=reducible, cpu_flags=cpu_flags, onednn_cache=onednn_cache
        )
        return choice.precision
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


def onednn_cache_capacity(environ: Mapping[str, str] = os.environ) -> int:
    """The oneDNN primitive cache this process has: what oneDNN itself reads when it first builds one.

    The plan sets ONEDNN_PRIMITIVE_CACHE_CAPACITY in each worker's environment
    (service.topology); a process without a plan has oneDNN's default.
    """
    try:
        return max(0, int(environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_DEFAULT_CACHE)))
    except ValueError:
        return ONEDNN_DEFAULT_CACHE

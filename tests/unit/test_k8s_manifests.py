"""deploy/k8s/: rendered from the settings, in step with the renderer, valid for Kubernetes 1.30+."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scripts.deploy import render_k8s
from scripts.deploy.render_k8s import (
    K8S_DIR,
    MEMORY_BASE_MIB,
    MEMORY_PER_GPU_WORKER_MIB,
    MEMORY_PER_SHARING_WORKER_MIB,
    MEMORY_PER_WORKER_MIB,
    MEMORY_SHARED_MIB,
    Options,
    grace_period_s,
    manifests,
    notes,
    pod_plan,
    render,
)
from service.config.settings import Settings
from service.errors import SettingsError
from tests.support.prometheus import PROMTOOL, RULE_FILES, SKIP_PROMTOOL, promtool

VALIDATE = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
# Every Kubernetes minor version from 1.30 to the newest whose schemas kubernetes-validate ships.
FIRST_VERSION = (1, 30)


def schema_versions() -> list[str]:
    from kubernetes_validate.utils import all_versions

    return [v for v in all_versions() if tuple(int(p) for p in v.split(".")[:2]) >= FIRST_VERSION]


def committed(directory: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(directory.glob("*.yaml"))}


def rendered(options: Options, output: str, env: dict[str, str] | None = None) -> dict[str, str]:
    env = env or {}
    settings = Settings.from_env(env)
    docs = manifests(settings, options, env)
    return render(docs, render_k8s.command_line(options, env, output), notes(settings, options))


def validate(paths: list[Path]) -> None:
    """kubernetes-validate, strict (no unknown fields), for each version; a warning fails too."""
    assert VALIDATE is not None, "kubernetes-validate is in requirements-dev.lock"
    versions = schema_versions()
    assert versions and versions[0] == "1.30.0", versions
    for version in versions:
        result = subprocess.run(
            [VALIDATE, "--strict", "--kubernetes-version", version, *map(str, paths)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, output
        assert "WARN" not in output and "ERROR" not in output, output
        assert output.count("INFO") == len(paths), output


def deployment(docs: dict[str, dict[str, object]]) -> dict:
    return docs["deployment.yaml"]


def container(docs: dict[str, dict[str, object]]) -> dict:
    return deployment(docs)["spec"]["template"]["spec"]["containers"][0]


def test_committed_manifests_are_the_renderers_output() -> None:
    assert committed(K8S_DIR) == rendered(Options(), "deploy/k8s")
    assert committed(K8S_DIR / "gpu") == rendered(Options(cpus=4, gpus=1), "deploy/k8s/gpu")


def test_committed_manifests_validate_strictly_for_kubernetes_1_30_and_later() -> None:
    validate(sorted(K8S_DIR.glob("*.yaml")) + sorted((K8S_DIR / "gpu").glob("*.yaml")))


def test_manifests_rendered_with_other_settings_validate(tmp_path: Path) -> None:
    env = {"SERVE_REQUEST_TIMEOUT_MS": "12000", "SERVE_MAX_BATCH_SIZE": "32"}
    for name, text in rendered(Options(cpus=8, gpus=2, max_replicas=4), str(tmp_path), env).items():
        (tmp_path / name).write_text(text)
    validate(sorted(tmp_path.glob("*.yaml")))


@pytest.mark.parametrize("timeout_ms", [30_000, 2_500, 120_000])
def test_grace_period_covers_prestop_and_gunicorns_graceful_timeout(timeout_ms: int) -> None:
    settings = Settings(request_timeout_ms=timeout_ms)
    docs = manifests(settings, Options(), {"SERVE_REQUEST_TIMEOUT_MS": str(timeout_ms)})
    pod = deployment(docs)["spec"]["template"]["spec"]
    prestop = container(docs)["lifecycle"]["preStop"]["sleep"]["seconds"]
    # gunicorn's graceful timeout, as gunicorn_conf.py plans it: the request timeout + 5 s.
    graceful = math.ceil(timeout_ms / 1000) + 5
    assert pod_plan(settings, Options()).graceful_timeout_s == graceful
    assert pod["terminationGracePeriodSeconds"] >= prestop + graceful + 1
    assert pod["terminationGracePeriodSeconds"] == grace_period_s(settings, Options())
    # The pod runs with the request timeout the grace period was derived from.
    assert {"name": "SERVE_REQUEST_TIMEOUT_MS", "value": str(timeout_ms)} in container(docs)["env"]


def test_probes_cover_the_service_lifecycle() -> None:
    docs = manifests(Settings(), Options(), {})
    serve = container(docs)
    assert serve["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert serve["livenessProbe"]["httpGet"]["path"] == "/healthz"
    startup = serve["startupProbe"]
    assert startup["httpGet"]["path"] == "/readyz"
    # The model load may take at least as long as gunicorn allows a worker to boot.
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= pod_plan(Settings(), Options()).timeout_s


@pytest.mark.parametrize("cpus", [1, 2, 6])
def test_cpu_resources_match_the_planned_topology(cpus: int) -> None:
    docs = manifests(Settings(), Options(cpus=cpus), {})
    resources = container(docs)["resources"]
    assert resources["requests"]["cpu"] == resources["limits"]["cpu"] == str(cpus)
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    plan = pod_plan(Settings(), Options(cpus=cpus))
    # The pod's quota is exactly the cores its workers' torch threads use.
    assert sum(worker.torch_threads for worker in plan.workers) == cpus
    assert "nvidia.com/gpu" not in resources["limits"]


def memory(docs: dict[str, dict[str, object]]) -> int:
    resources = container(docs)["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    return int(resources["limits"]["memory"].removesuffix("Mi"))


@pytest.mark.parametrize("cpus", [1, 2, 6])
def test_cpu_workers_that_share_the_model_hold_it_once(cpus: int) -> None:
    workers = len(pod_plan(Settings(), Options(cpus=cpus)).workers)
    shared = memory(manifests(Settings(), Options(cpus=cpus), {}))
    assert shared == MEMORY_BASE_MIB + MEMORY_SHARED_MIB + workers * MEMORY_PER_SHARING_WORKER_MIB
    # Each worker builds its own: its copy in each worker, none held once.
    env = {"SERVE_SHARE_WEIGHTS": "off"}
    own = memory(manifests(Settings.from_env(env), Options(cpus=cpus), env))
    assert own == MEMORY_BASE_MIB + workers * MEMORY_PER_WORKER_MIB
    assert (shared < own) == (workers > 1)


def test_memory_options_and_the_header_that_explains_it() -> None:
    options = Options(memory_per_worker_mib=700, memory_shared_mib=900)
    assert memory(manifests(Settings(), options, {})) == MEMORY_BASE_MIB + 900 + 2 * 700
    header = rendered(options, "out")["deployment.yaml"].splitlines()[2]
    assert header == (
        f"# memory {MEMORY_BASE_MIB + 900 + 1400} MiB = {MEMORY_BASE_MIB} MiB + 900 MiB held once"
        " (the model the workers share) + 700 MiB per worker x 2; why: scripts/deploy/render_k8s.py, MEMORY_*"
    )
    # GPU workers each build their own model: nothing is held once.
    gpu = Options(cpus=4, gpus=2)
    assert memory(manifests(Settings(), gpu, {})) == MEMORY_BASE_MIB + 2 * MEMORY_PER_GPU_WORKER_MIB
    with pytest.raises(SettingsError, match="--memory-shared-mib"):
        manifests(Settings(), Options(memory_shared_mib=-1), {})


def test_gpu_variant_requests_gpus_and_plans_a_worker_on_each() -> None:
    options = Options(cpus=4, gpus=2)
    docs = manifests(Settings(), options, {})
    serve = container(docs)
    assert serve["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert {"name": "SERVE_DEVICES", "value": "cuda"} in serve["env"]
    assert serve["image"].endswith("-cuda")
    devices = [worker.device for worker in pod_plan(Settings(devices="cuda"), options).workers]
    assert sorted(devices) == ["cuda:0", "cuda:1"]


def test_settings_the_manifests_own_are_refused() -> None:
    with pytest.raises(SettingsError, match="SERVE_BIND"):
        manifests(Settings(), Options(), {"SERVE_BIND": "0.0.0.0:9000"})
    with pytest.raises(SettingsError, match="min-replicas"):
        manifests(Settings(), Options(min_replicas=5, max_replicas=3), {})


def test_hpa_scales_on_the_metric_the_adapter_serves_from_a_recording_rule() -> None:
    docs = manifests(Settings(), Options(), {})
    hpa_metric = docs["hpa.yaml"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    rule = yaml.safe_load(docs["prometheus-adapter.yaml"]["data"]["config.yaml"])["rules"][0]
    series = rule["seriesQuery"].partition("{")[0]
    # The adapter's renaming, done as prometheus-adapter does it (a Go regexp with $1).
    served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert served == hpa_metric
    records = {
        r["record"]
        for path in RULE_FILES
        for g in yaml.safe_load(path.read_text())["groups"]
        for r in g["rules"]
        if "record" in r
    }
    assert series in records


@pytest.mark.skipif(PROMTOOL is None, reason=SKIP_PROMTOOL)
def test_adapter_query_parses(tmp_path: Path) -> None:
    docs = manifests(Settings(), Options(), {})
    rule = yaml.safe_load(docs["prometheus-adapter.yaml"]["data"]["config.yaml"])["rules"][0]
    # What prometheus-adapter sends for one pod of one namespace.
    query = (
        rule["metricsQuery"]
        .replace("<<.GroupBy>>", "pod")
        .replace("<<.Series>>", rule["seriesQuery"].partition("{")[0])
        .replace("<<.LabelMatchers>>", 'namespace="ml",pod=~"serve-1|serve-2"')
    )
    path = tmp_path / "adapter.yaml"
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "adapter", "rules": [{"record": "q", "expr": query}]}]})
    )
    result = promtool("check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_command_line_renders_with_the_environments_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SERVE_REQUEST_TIMEOUT_MS", "8000")
    assert render_k8s.main(["--cpus", "3", "-o", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(committed(K8S_DIR))
    text = (tmp_path / "deployment.yaml").read_text()
    # The header names the command that makes the same files again.
    assert text.splitlines()[1].startswith(
        "#   SERVE_REQUEST_TIMEOUT_MS=8000 python scripts/deploy/render_k8s.py --cpus 3 -o"
    )
    pod = yaml.safe_load(text)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 10 + (8 + 5) + 5
    monkeypatch.setenv("SERVE_MAX_BATCH_SIZE", "lots")
    assert render_k8s.main(["-o", str(tmp_path)]) == 2
    assert "SERVE_MAX_BATCH_SIZE must be an integer" in capsys.readouterr().err

from __future__ import annotations

import math

import pytest

from service.config.settings import Settings
from service.errors import SettingsError


def test_defaults_with_an_empty_environment() -> None:
    settings = Settings.from_env({})
    assert settings == Settings()
    assert settings.model == "minilm"
    assert settings.max_batch_size == 64
    assert settings.max_batch_delay_ms == 0
    # Counted in items: sixteen requests of the most items (OpenAI's 2,048 inputs) a request may hold.
    assert settings.queue_limit == 32_768
    assert settings.max_items_per_request == 2048
    assert settings.documents_limit == 1000  # Cohere's limit on a rerank's documents
    assert settings.max_body_bytes == 8 << 20


def test_a_lower_item_limit_bounds_the_documents_too() -> None:
    assert Settings(max_items_per_request=64).documents_limit == 64
    assert Settings(max_documents_per_request=10).documents_limit == 10


def test_values_are_parsed_and_typed() -> None:
    settings = Settings.from_env(
        {
            "SERVE_MODEL": "mlp",
            "SERVE_MAX_BATCH_SIZE": " 32 ",
            "SERVE_MAX_BATCH_DELAY_MS": "2.5",
            "SERVE_WORKER_CLASS": "GEVENT",
            "SERVE_ITEM_SHAPE": "3,32,32",
            "SERVE_MAX_QUEUE": "10",
            "UNRELATED": "x",
        }
    )
    assert (settings.model, settings.max_batch_size, settings.max_batch_delay_ms) == ("mlp", 32, 2.5)
    assert settings.worker_class == "gevent"
    assert settings.item_shape == (3, 32, 32)
    assert settings.queue_limit == 10


def test_the_stall_limit_follows_the_request_timeout_unless_set() -> None:
    assert Settings().stall_limit_s == 60
    assert Settings(request_timeout_ms=100).stall_limit_s == 10  # a short deadline is not a hang
    assert Settings.from_env({"SERVE_STALL_TIMEOUT_MS": "1500"}).stall_limit_s == 1.5
    with pytest.raises(SettingsError, match="SERVE_STALL_TIMEOUT_MS must be an integer from 100 to"):
        Settings.from_env({"SERVE_STALL_TIMEOUT_MS": "50"})


def test_the_latency_budget_follows_the_request_timeout_unless_set() -> None:
    assert Settings().latency_budget_s == 2.0  # a fifteenth of the default 30 s
    assert Settings(request_timeout_ms=3000).latency_budget_s == 0.5  # at least half a second
    assert Settings(request_timeout_ms=400).latency_budget_s == 0.4  # never past the timeout
    assert Settings.from_env({"SERVE_LATENCY_BUDGET_MS": "1500"}).latency_budget_s == 1.5
    assert Settings.from_env({"SERVE_LATENCY_BUDGET_MS": "0"}).latency_budget_s == math.inf  # off
    with pytest.raises(SettingsError, match="SERVE_LATENCY_BUDGET_MS must be an integer from 0 to"):
        Settings.from_env({"SERVE_LATENCY_BUDGET_MS": "2s"})
    with pytest.raises(
        SettingsError,
        match=r"SERVE_LATENCY_BUDGET_MS must not exceed SERVE_REQUEST_TIMEOUT_MS \(1000\), got 2000",
    ):
        Settings.from_env({"SERVE_LATENCY_BUDGET_MS": "2000", "SERVE_REQUEST_TIMEOUT_MS": "1000"})


@pytest.mark.parametrize(("value", "expected"), [("on", True), ("1", True), ("OFF", False), ("no", False)])
def test_switches_take_on_and_off_and_their_usual_spellings(value: str, expected: bool) -> None:
    assert Settings.from_env({"SERVE_BALANCE_CONNECTIONS": value}).balance_connections is expected
    assert Settings().balance_connections is True
    assert Settings.from_env({"SERVE_HOLD_REFUSED": value}).hold_refused is expected
    assert Settings().hold_refused is True


def test_an_empty_value_means_the_default() -> None:
    assert Settings.from_env({"SERVE_MAX_BATCH_SIZE": ""}).max_batch_size == 64


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("SERVE_MAX_BATCH_SIZE", "abc", "SERVE_MAX_BATCH_SIZE must be an integer from 1 to 4096, got 'abc'"),
        ("SERVE_MAX_BATCH_SIZE", "0", "SERVE_MAX_BATCH_SIZE must be an integer from 1 to 4096, got '0'"),
        ("SERVE_MAX_BATCH_DELAY_MS", "nan", "SERVE_MAX_BATCH_DELAY_MS must be a number from 0 to 10000"),
        ("SERVE_MAX_BATCH_DELAY_MS", "-1", "SERVE_MAX_BATCH_DELAY_MS must be a number"),
        ("SERVE_WORKER_CLASS", "eventlet", "SERVE_WORKER_CLASS must be one of gthread, gevent, sync"),
        ("SERVE_ITEM_SHAPE", "3,x", "SERVE_ITEM_SHAPE must be a comma-separated list of positive integers"),
        ("SERVE_BIND", "8000", "SERVE_BIND must be HOST:PORT or unix:PATH, got '8000'"),
        ("SERVE_MAX_BODY_BYTES", "10", "SERVE_MAX_BODY_BYTES must be an integer from 1024"),
        ("SERVE_BALANCE_CONNECTIONS", "maybe", "SERVE_BALANCE_CONNECTIONS must be on or off"),
    ],
)
def test_bad_values_name_the_variable_the_value_and_what_is_allowed(
    variable: str, value: str, message: str
) -> None:
    with pytest.raises(SettingsError, match="^" + message.replace("(", r"\(").replace(".", r"\.")):
        Settings.from_env({variable: value})


def test_settings_are_immutable() -> None:
    settings = Settings()
    with pytest.raises(AttributeError):
        settings.model = "mlp"  # type: ignore[misc]


def test_forwarded_allow_ips_takes_addresses_networks_or_a_star() -> None:
    assert Settings().forwarded_allow_ips == ("127.0.0.1", "::1")
    parsed = Settings.from_env({"SERVE_FORWARDED_ALLOW_IPS": " 10.0.0.0/8, 192.168.1.7 ,::1"})
    assert parsed.forwarded_allow_ips == ("10.0.0.0/8", "192.168.1.7", "::1")
    assert Settings.from_env({"SERVE_FORWARDED_ALLOW_IPS": "*"}).forwarded_allow_ips == ("*",)


@pytest.mark.parametrize("value", ["nginx.local", "10.0.0.1/8", "*,10.0.0.1", ","])
def test_forwarded_allow_ips_refuses_what_gunicorn_cannot_parse(value: str) -> None:
    with pytest.raises(SettingsError, match=r"^SERVE_FORWARDED_ALLOW_IPS must"):
        Settings.from_env({"SERVE_FORWARDED_ALLOW_IPS": value})


@pytest.mark.parametrize(
    ("variable", "message"),
    [
        ("SERVE_MAX_BATCHSIZE", "SERVE_MAX_BATCHSIZE is not a setting; did you mean SERVE_MAX_BATCH_SIZE?"),
        ("SERVE_WORKER", "SERVE_WORKER is not a setting; did you mean SERVE_WORKERS?"),
        (
            "SERVE_REQUEST_TIMEOUT",
            "SERVE_REQUEST_TIMEOUT is not a setting; did you mean SERVE_REQUEST_TIMEOUT_MS?",
        ),
        ("SERVE_XYZZY", "SERVE_XYZZY is not a setting; docs/settings.md lists them"),
    ],
)
def test_an_unknown_serve_variable_is_refused_naming_the_closest_setting(variable: str, message: str) -> None:
    with pytest.raises(SettingsError, match="^" + message.replace("?", r"\?") + "$"):
        Settings.from_env({variable: "8", "SERVE_MODEL": "mlp"})


def test_an_unknown_variable_is_refused_even_when_empty() -> None:
    with pytest.raises(SettingsError, match=r"^SERVE_MAX_BATCHSIZE is not a setting"):
        Settings.from_env({"SERVE_MAX_BATCHSIZE": ""})


def test_every_serve_variable_the_launcher_sets_for_a_worker_is_a_setting() -> None:
    from service.topology.inventory import Gpu, Inventory
    from service.topology.plan import plan

    machine = Inventory(affinity_cores=4, gpus=(Gpu(0, "GPU-0000", "H100", 81_559, 80_000),))
    env = {k: v for k, v in plan(Settings(), machine).worker_env(0).items() if v is not None}
    assert {k for k in env if k.startswith("SERVE_")} >= {"SERVE_WORKER_SLOT", "SERVE_WORKER_DEVICE"}
    worker = Settings.from_env(env)
    assert (worker.worker_slot, worker.worker_device) == (0, "cuda:0")
    assert worker.worker_gpu_memory_fraction is not None

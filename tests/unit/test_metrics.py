"""In-process tests of the metrics: per-app registries, request and batch figures, shed reasons, models."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from flask.testing import FlaskClient
from prometheus_client import values

from service.config.settings import Settings
from service.errors import DeadlineExceeded, Overloaded, SettingsError
from service.host import multiproc
from service.http.access import Access
from service.http.arrival import MODEL_ENVIRON_KEY
from service.http.shapes import answer_error
from service.runtime import EXTENSION
from service.telemetry.metrics import EXTENSION as METRICS
from service.telemetry.metrics import REJECTION_REASONS, TIMEOUT_REASONS, Metrics
from tests.support.metrics import Scrape
from tests.support.models import EchoModel

VECTOR = [0.1 * i for i in range(16)]
ECHO = Settings(model="tests.support.models:echo")


def scrape(client: FlaskClient) -> Scrape:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.content_type.startswith("text/plain")
    return Scrape.parse(response.get_data())


def test_each_worker_reports_its_resident_memory(client: FlaskClient) -> None:
    assert client.post("/predict/batched", json={"inputs": [VECTOR]}).status_code == 200
    (labels,) = scrape(client).series("serve_worker_resident_memory_bytes")
    assert labels == {"slot": "0", "device": "cpu"}
    rss = scrape(client).total("serve_worker_resident_memory_bytes")
    # This test process holds torch and a model: far more than a few MiB, far less than 64 GiB.
    assert 16 << 20 < rss < 64 << 30


def test_request_counters_and_durations_match_what_was_sent(client: FlaskClient) -> None:
    for _ in range(3):
        assert client.post("/predict/naive", json={"inputs": [VECTOR]}).status_code == 200
    for _ in range(4):
        assert client.post("/predict/batched", json={"inputs": [VECTOR, VECTOR]}).status_code == 200
    assert client.post("/predict", json={"inputs": [VECTOR] * 3}).status_code == 200
    assert client.post("/predict/batched", data=b"{nope", content_type="application/json").status_code == 400
    for path in ("/nope", "/predict/nope"):
        assert client.get(path).status_code == 404
    assert client.get("/predict/batched").status_code == 405

    s = scrape(client)
    requests = "serve_http_requests_total"
    assert s.total(requests, route="/predict/naive", code="200") == 3
    assert s.total(requests, route="/predict/batched", code="200") == 4
    assert s.total(requests, route="/predict", code="200") == 1
    assert s.total(requests, route="/predict/batched", code="400") == 1
    # Paths that match no rule share one label value, whatever the path.
    assert s.total(requests, route="unmatched", code="404") == 2
    assert s.total(requests, route="unmatched", code="405") == 1
    assert {labels["route"] for labels in s.series(requests)} == {
        "/predict/naive",
        "/predict/batched",
        "/predict",
        "unmatched",
    }
    assert s.total("serve_http_request_duration_seconds_count", route="/predict/batched") == 5
    assert s.total("serve_http_request_duration_seconds_count", route="/predict/naive") == 3
    # The naive route runs no batches; the batched routes ran 5 (one per request, sent one by one).
    assert s.total("serve_batches_total") == 5
    # The one model's batching series carry its name, as its info does.
    (info,) = s.series("serve_model_info")
    assert {labels["model"] for labels in s.series("serve_batches_total")} == {info["model"]} == {"mlp"}
    assert s.total("serve_inferred_items_total") == 4 * 2 + 3
    assert s.total("serve_batch_queue_wait_seconds_count") == 5
    assert s.total("serve_batch_model_duration_seconds_count") == 5
    # This scrape is in flight while it renders; nothing else is.
    assert s.total("serve_http_requests_in_flight") == 1
    assert s.total("serve_batch_queue_depth") == 0


def test_batch_size_histogram_agrees_with_the_counters(client: FlaskClient) -> None:
    sizes = [1, 3, 8, 2, 5]
    for size in sizes:
        client.post("/predict/batched", json={"inputs": [VECTOR] * size})
    s = scrape(client)
    assert s.total("serve_batch_size_items_count") == s.total("serve_batches_total") == len(sizes)
    assert s.total("serve_batch_size_items_sum") == s.total("serve_inferred_items_total") == sum(sizes)
    assert s.total("serve_batch_size_items_bucket", le="4.0") == 3  # 1, 3 and 2 items
    assert s.total("serve_batch_size_items_bucket", le="+Inf") == len(sizes)


def test_each_app_keeps_its_own_registry(make_client: Callable[[Settings], FlaskClient]) -> None:
    small = Settings(model="mlp", mlp_width=16, mlp_depth=1)
    first, second = make_client(small), make_client(small)
    first.post("/predict/naive", json={"inputs": [VECTOR]})
    assert scrape(first).total("serve_http_requests_total", route="/predict/naive") == 1
    assert scrape(second).total("serve_http_requests_total", route="/predict/naive") == 0


def test_worker_info_and_load_time_appear_once_the_model_loads(client: FlaskClient) -> None:
    s = scrape(client)
    metrics: Metrics = client.application.extensions[METRICS]
    # Outside gunicorn there is no pid label: one process, one series.
    assert s.series("serve_worker_info") == [{"slot": metrics.slot, "device": "cpu"}]
    assert s.total("serve_worker_info") == 1
    assert s.total("serve_model_load_seconds") > 0
    assert s.series("serve_gpu_memory_allocated_bytes") == []  # CPU only: no GPU series at all


class Held:
    """An echo-model client whose model holds every batch until the test opens its gate."""

    def __init__(self, client: FlaskClient) -> None:
        self.client = client
        self.runtime = client.application.extensions[EXTENSION]
        self.model: EchoModel = self.runtime.model._inner
        self.model.gate.clear()
        self.threads: list[threading.Thread] = []

    def post(self, items: list[str], headers: dict[str, str] | None = None) -> list[int]:
        """POST in a new thread; the returned list receives the status."""
        status: list[int] = []

        def call() -> None:
            response = self.client.application.test_client().post(
                "/predict/batched", json={"inputs": items}, headers=headers or {}
            )
            status.append(response.status_code)

        thread = threading.Thread(target=call)
        thread.start()
        self.threads.append(thread)
        return status

    def wait_for_depth(self, depth: int) -> None:
        for _ in range(2000):
            if self.runtime.batcher.depth == depth:
                return
            threading.Event().wait(0.005)  # request threads offer no event to wait on
        raise AssertionError(f"queue depth stayed {self.runtime.batcher.depth}, expected {depth}")

    def release(self) -> None:
        self.model.gate.set()
        while self.threads:
            self.threads.pop().join(10)


@pytest.fixture
def held(make_client: Callable[[Settings], FlaskClient]) -> Iterator[Callable[[Settings], Held]]:
    made: list[Held] = []

    def make(settings: Settings) -> Held:
        made.append(Held(make_client(settings)))
        return made[-1]

    yield make
    for each in made:
        each.release()


def test_queue_depth_and_in_flight_gauges_follow_held_requests(held: Callable[[Settings], Held]) -> None:
    echo = held(ECHO)
    statuses = [echo.post(["first"])]
    assert echo.model.entered.wait(10)
    statuses += [echo.post([text]) for text in ("second", "third")]
    echo.wait_for_depth(2)

    busy = scrape(echo.client)
    assert busy.total("serve_batch_queue_depth") == 2
    assert busy.total("serve_http_requests_in_flight") == 3 + 1  # three held, and this scrape
    echo.release()
    assert statuses == [[200], [200], [200]]

    done = scrape(echo.client)
    assert done.total("serve_batch_queue_depth") == 0
    assert done.total("serve_http_requests_in_flight") == 1
    assert done.total("serve_inferred_items_total") == 3
    assert done.total("serve_batch_size_items_count") == done.total("serve_batches_total") == 2


def test_shed_requests_are_counted_by_reason(held: Callable[[Settings], Held]) -> None:
    echo = held(ECHO.replace(max_queue=1))
    in_batch = echo.post(["first"], {"X-Request-Timeout-Ms": "300"})
    assert echo.model.entered.wait(10)
    in_queue = echo.post(["second"], {"X-Request-Timeout-Ms": "100"})
    echo.wait_for_depth(1)
    assert echo.client.post("/predict/batched", json={"inputs": ["third"]}).status_code == 503
    for thread in echo.threads:
        thread.join(10)  # both time out with the gate still shut
    assert in_batch == [504] and in_queue == [504]

    s = scrape(echo.client)
    assert s.total("serve_rejected_requests_total", reason="queue_full") == 1
    assert s.total("serve_rejected_requests_total") == 1
    assert s.total("serve_timed_out_requests_total", reason="expired_in_queue") == 1
    assert s.total("serve_timed_out_requests_total", reason="expired_in_batch") == 1
    assert s.total("serve_http_requests_total", route="/predict/batched", code="504") == 2
    assert s.total("serve_http_requests_total", route="/predict/batched", code="503") == 1


def test_a_worker_that_is_not_ready_counts_its_refusals(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(Settings(model="no_such_module:factory"))
    assert client.post("/predict", json={"inputs": ["x"]}).status_code == 503
    assert scrape(client).total("serve_rejected_requests_total", reason="not_ready") == 1


def test_gpu_memory_is_reported_per_worker_and_device() -> None:
    # No GPU here: the allocator's figures come from a stand-in reader.
    readings = iter([(100, 200), (150, 300), (120, 300)])
    read_from: list[str] = []

    def reader(device: str) -> tuple[int, int]:
        read_from.append(device)
        return next(readings)

    # gunicorn_conf.py shows a worker planned on cuda:2 that GPU alone, as "cuda".
    metrics = Metrics(Settings(worker_slot=3, worker_device="cuda:2"), gpu_memory=reader)
    metrics.on_model_loaded("cuda", 2.5)
    metrics.on_batch(4, 2, [0.001, 0.002], 0.01)
    s = Scrape.parse(metrics.render())
    assert read_from == ["cuda"] * 3
    assert s.series("serve_gpu_memory_allocated_bytes") == [{"slot": "3", "device": "cuda:2"}]
    assert s.series("serve_worker_info") == [{"slot": "3", "device": "cuda:2"}]
    assert s.total("serve_gpu_memory_allocated_bytes") == 120  # refreshed by the scrape itself
    assert s.total("serve_gpu_memory_reserved_bytes") == 300
    assert s.total("serve_model_load_seconds") == 2.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has no GPU")
def test_gpu_memory_gauges_read_torchs_allocator() -> None:
    metrics = Metrics(Settings())
    block = torch.ones(1 << 20, device="cuda")  # 4 MiB
    metrics.on_model_loaded("cuda", 1.0)
    s = Scrape.parse(metrics.render())
    assert s.total("serve_gpu_memory_allocated_bytes") >= block.numel() * 4
    assert s.total("serve_gpu_memory_reserved_bytes") >= s.total("serve_gpu_memory_allocated_bytes")


@pytest.fixture
def multiproc_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    # Where prometheus_client's multiprocess values write, as under gunicorn.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    yield tmp_path
    values.close_all_multiprocess_files()


def test_multiprocess_counters_keep_dead_workers_and_gauges_drop_them(
    multiproc_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers simulated in one process: each writes its own files, as a pid of its own would."""
    settings = Settings(prometheus_multiproc_dir=str(multiproc_dir))
    workers: dict[int, Metrics] = {}
    for pid in (101, 102):
        monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(lambda pid=pid: pid))
        metrics = workers[pid] = Metrics(settings.replace(worker_slot=pid - 101))
        metrics.request_started()
        metrics.observe_request("/predict", 200, 0.004)
        metrics.on_batch(3, 2, [0.001, 0.002], 0.003)
        metrics.on_queue_depth(2)
        metrics.on_model_loaded("cpu", 0.5)
    # Each has a request in flight, so its request updates wait for its next
    # flush (service.telemetry.tally); the one that renders flushes its own.
    workers[102].flush()

    alive = Scrape.parse(workers[101].render())
    assert alive.total("serve_http_requests_total", route="/predict", code="200") == 2
    assert alive.total("serve_inferred_items_total") == alive.total("serve_batch_size_items_sum") == 6
    assert alive.total("serve_http_requests_in_flight") == 2
    assert alive.total("serve_batch_queue_depth") == 4
    assert sorted((s["pid"], s["slot"]) for s in alive.series("serve_worker_info")) == [
        ("101", "0"),
        ("102", "1"),
    ]

    multiproc.mark_dead(str(multiproc_dir), 102)
    after = Scrape.parse(workers[101].render())
    assert after.total("serve_http_requests_total", route="/predict", code="200") == 2
    assert after.total("serve_batches_total") == after.total("serve_batch_size_items_count") == 2
    assert after.total("serve_http_requests_in_flight") == 1
    assert after.total("serve_batch_queue_depth") == 2
    assert [s["pid"] for s in after.series("serve_worker_info")] == ["101"]


def test_a_multiproc_dir_set_too_late_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(values, "ValueClass", values.MutexValue)
    with pytest.raises(SettingsError, match=r"PROMETHEUS_MULTIPROC_DIR=.*before the process starts"):
        Metrics(Settings(prometheus_multiproc_dir=str(tmp_path)))


def test_a_multiproc_dir_that_is_not_a_directory_is_refused(
    multiproc_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    missing = multiproc_dir / "missing"
    with pytest.raises(SettingsError, match=f"PROMETHEUS_MULTIPROC_DIR='{missing}' is not a directory"):
        Metrics(Settings(prometheus_multiproc_dir=str(missing)))


# -- several models in one worker (Metrics.for_model) ------------------------------------


def test_each_models_observer_writes_its_own_series() -> None:
    metrics = Metrics(Settings(worker_slot=1))
    embed, rerank = metrics.for_model("embed"), metrics.for_model("rerank")
    embed.on_model_info("embed", "embeddings")
    rerank.on_model_info("rerank", "rerank", "int8")
    embed.on_model_loaded("cpu", 1.5)
    rerank.on_model_loaded("cpu", 2.5)
    embed.on_batch(4, 2, [0.001, 0.002], 0.01)
    embed.on_batch(2, 1, [0.003], 0.02)
    rerank.on_batch(8, 1, [0.5], 0.2)
    embed.on_queue_depth(3)
    rerank.on_queue_depth(1)
    rerank.on_sub_batches(real_tokens=10, padded_tokens=16, sub_batches=2)
    rerank.on_precision({"top1_agreement": 1.0})
    s = Scrape.parse(metrics.render())

    assert s.total("serve_batches_total", model="embed") == 2
    assert s.total("serve_batches_total", model="rerank") == 1
    assert s.total("serve_inferred_items_total", model="embed") == 6
    assert s.total("serve_batch_size_items_sum", model="rerank") == 8
    assert s.total("serve_batch_queue_wait_seconds_count", model="embed") == 3
    assert s.total("serve_batch_model_duration_seconds_sum", model="rerank") == 0.2
    assert s.total("serve_batch_queue_depth", model="embed") == 3
    assert s.total("serve_batch_queue_depth", model="rerank") == 1
    assert s.total("serve_batch_tokens_total", model="rerank", kind="padded") == 16
    assert s.total("serve_batch_tokens_total", model="embed") == 0
    assert s.total("serve_batch_sub_batches_count", model="rerank") == 1
    assert s.total("serve_model_load_seconds", model="rerank") == 2.5
    assert s.series("serve_model_exactness") == [{"slot": "1", "model": "rerank", "figure": "top1_agreement"}]
    assert sorted(s.series("serve_model_info"), key=lambda labels: labels["model"]) == [
        {
            "slot": "1",
            "model": "embed",
            "name": "embed",
            "task": "embeddings",
            "precision": "float32",
            "precision_reason": "asked",
        },
        {
            "slot": "1",
            "model": "rerank",
            "name": "rerank",
            "task": "rerank",
            "precision": "int8",
            "precision_reason": "asked",
        },
    ]
    # Every batching series is a model's; the worker's own figures are no model's.
    for name in ("serve_batches_total", "serve_batch_size_items_count", "serve_batch_queue_depth"):
        assert models(s.series(name)) == {"embed", "rerank"}, name
    assert s.series("serve_worker_info") == [{"slot": "1", "device": "cpu"}]
    assert "model" not in s.series("serve_worker_resident_memory_bytes")[0]


def models(series: Iterable[dict[str, str]]) -> set[str]:
    return {labels["model"] for labels in series}


def test_each_models_shedding_series_start_at_zero() -> None:
    """rate() over a model's refusals works before its first: every reason is there from the start."""
    metrics = Metrics(Settings())
    metrics.for_model("embed")
    s = Scrape.parse(metrics.render())
    for name, reasons in (
        ("serve_rejected_requests_total", REJECTION_REASONS),
        ("serve_timed_out_requests_total", TIMEOUT_REASONS),
    ):
        # The model's, and those of requests refused before their model was known ("").
        assert sorted((labels["model"], labels["reason"]) for labels in s.series(name)) == sorted(
            (model, reason) for model in ("", "embed") for reason in reasons
        )
        assert s.total(name) == 0


def test_an_observer_made_without_a_name_takes_the_models() -> None:
    metrics = Metrics(Settings())
    observer = metrics.for_model()
    assert observer.model is None
    # In the order today's runtime calls them: the load before the name.
    observer.on_model_loaded("cpu", 0.75)
    observer.on_model_info("minilm", "embeddings")
    observer.on_batch(3, 1, [0.001], 0.004)
    # A later name changes nothing: the first one labels every series.
    observer.on_model_info("other", "embeddings")
    s = Scrape.parse(metrics.render())
    assert observer.model == "minilm"
    assert models(s.series("serve_batches_total")) == {"minilm"}
    assert s.series("serve_model_load_seconds") == [{"slot": "0", "model": "minilm"}]
    assert s.total("serve_model_load_seconds") == 0.75
    assert {(labels["model"], labels["name"]) for labels in s.series("serve_model_info")} == {
        ("minilm", "minilm"),
        ("minilm", "other"),
    }
    assert {"minilm", ""} <= models(s.series("serve_rejected_requests_total"))


def test_metrics_itself_observes_as_one_unnamed_model() -> None:
    """A runtime still given observer=metrics: its model's name labels the series, as for_model(None)'s."""
    metrics = Metrics(Settings())
    metrics.on_model_info("echo", "generic")
    metrics.on_queue_depth(2)
    metrics.on_batch(1, 1, [0.001], 0.002)
    s = Scrape.parse(metrics.render())
    assert s.total("serve_batch_queue_depth", model="echo") == 2
    assert models(s.series("serve_batches_total")) == {"echo"}


def test_a_batch_before_any_name_counts_under_no_model() -> None:
    observer = Metrics(Settings()).for_model()
    observer.on_batch(1, 1, [0.001], 0.002)
    assert observer.model == ""


def answering(model: str | None, status: str = "200 OK") -> Callable[..., Iterable[bytes]]:
    """A WSGI app that routes every request to ``model`` (None: to no model), as the protocol routes do."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if model is not None:
            environ[MODEL_ENVIRON_KEY] = model
        start_response(status, [("Content-Type", "text/plain")])
        return [b"ok"]

    return app


def call(app: Callable[..., Iterable[bytes]], path: str) -> None:
    environ = {"REQUEST_METHOD": "POST", "PATH_INFO": path, "REMOTE_ADDR": "127.0.0.1"}
    list(app(environ, lambda status, headers, exc_info=None: None))


def test_request_series_carry_the_model_the_request_was_routed_to() -> None:
    metrics = Metrics(Settings())
    for _ in range(2):
        call(Access(answering("embed"), metrics), "/v1/embeddings")
    call(Access(answering("rerank", "503 Service Unavailable"), metrics), "/v1/rerank")
    call(Access(answering(None), metrics), "/healthz")
    s = Scrape.parse(metrics.render())
    requests = "serve_http_requests_total"
    assert s.total(requests, route="unmatched", code="200", model="embed") == 2
    assert s.total(requests, code="503", model="rerank") == 1
    # Never routed to a model: the label is there, empty (which Prometheus stores as none).
    assert s.total(requests, model="") == 1
    assert models(s.series(requests)) == {"embed", "rerank", ""}
    assert s.total("serve_http_request_duration_seconds_count", model="embed") == 2
    assert models(s.series("serve_http_request_duration_seconds_count")) == {"embed", "rerank", ""}


def test_shed_requests_are_counted_under_their_model() -> None:
    settings = Settings(hold_refused=False)
    metrics = Metrics(settings)
    full = Overloaded("the queue is full", reason="queue_full")
    answer_error(full, "/v1/embeddings", {MODEL_ENVIRON_KEY: "embed"}, settings, metrics)
    answer_error(full, "/predict", {}, settings, metrics)  # refused before its model was known
    late = DeadlineExceeded("expired", reason="expired_in_queue")
    answer_error(late, "/v1/rerank", {MODEL_ENVIRON_KEY: "rerank"}, settings, metrics)
    s = Scrape.parse(metrics.render())
    assert s.total("serve_rejected_requests_total", model="embed", reason="queue_full") == 1
    assert s.total("serve_rejected_requests_total", model="", reason="queue_full") == 1
    assert s.total("serve_rejected_requests_total") == 2
    assert s.total("serve_timed_out_requests_total", model="rerank", reason="expired_in_queue") == 1

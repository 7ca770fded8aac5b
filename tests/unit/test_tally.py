"""The request threads' metric updates, recorded and written a batch at a time (service.telemetry.tally)."""

from __future__ import annotations

import math
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from service.telemetry.metrics import SECONDS_BUCKETS
from service.telemetry.tally import Tally, observe_all

# On bucket bounds, between them, past the last finite one, below the first, and NaN.
VALUES = [0.0005, 0.0007, 0.001, 0.004, 0.25, 0.2500001, 30.0, 31.0, 1e9, -1.0, 0.0, math.nan] * 3


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample but the creation times, which differ between two registries built apart."""
    out = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if not sample.name.endswith("_created"):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def histogram(registry: CollectorRegistry, labelled: bool = False) -> Histogram:
    labels = ("route",) if labelled else ()
    return Histogram("h_seconds", "h", labels, buckets=SECONDS_BUCKETS, registry=registry)


def test_observe_all_writes_what_observe_would_for_each_value() -> None:
    # It reads prometheus_client's own fields: a version that changes them fails here.
    one_by_one, at_once = CollectorRegistry(), CollectorRegistry()
    single = histogram(one_by_one)
    for value in VALUES:
        single.observe(value)
    observe_all(histogram(at_once), VALUES)
    expected, got = samples(one_by_one), samples(at_once)
    assert math.isnan(expected.pop(("h_seconds_sum", ()))) and math.isnan(got.pop(("h_seconds_sum", ())))
    assert got == expected
    assert got[("h_seconds_count", ())] == len(VALUES) - 3  # NaN lands in no bucket, as with observe()


def test_observe_all_on_a_labelled_child() -> None:
    one_by_one, at_once = CollectorRegistry(), CollectorRegistry()
    values = [v for v in VALUES if not math.isnan(v)]
    child = histogram(one_by_one, labelled=True).labels("/predict")
    for value in values:
        child.observe(value)
    observe_all(histogram(at_once, labelled=True).labels("/predict"), values)
    assert samples(at_once) == samples(one_by_one)


def test_updates_wait_while_a_request_is_in_flight_and_the_last_one_out_writes_them() -> None:
    registry = CollectorRegistry()
    requests = Counter("r_total", "r", registry=registry)
    in_flight = Gauge("f", "f", registry=registry)
    duration = histogram(registry)
    tally = Tally(every_s=3600, in_flight=in_flight)  # no periodic flush within the test
    tally.enter()
    assert registry.get_sample_value("f") == 1  # the first one into an idle worker shows at once
    tally.enter()
    for _ in range(2):
        tally.inc(requests)
        tally.observe(duration, 0.004)
        tally.settle()
    assert registry.get_sample_value("r_total") == 0
    assert registry.get_sample_value("f") == 1
    tally.leave()
    assert registry.get_sample_value("r_total") == 0  # one is still in flight
    tally.leave()
    assert registry.get_sample_value("r_total") == 2
    assert registry.get_sample_value("h_seconds_count") == 2
    assert registry.get_sample_value("h_seconds_bucket", {"le": "0.005"}) == 2
    assert registry.get_sample_value("f") == 0


def test_an_update_with_nothing_in_flight_is_written_at_once() -> None:
    registry = CollectorRegistry()
    refused = Counter("refused_total", "r", registry=registry)
    tally = Tally(every_s=3600)
    tally.inc(refused)
    tally.settle()
    assert registry.get_sample_value("refused_total") == 1


def test_a_deferred_update_goes_with_the_next_flush_or_the_flusher() -> None:
    registry = CollectorRegistry()
    waits = Counter("waits_total", "w", registry=registry)
    tally = Tally(every_s=3600)
    tally.inc(waits)
    tally.defer()  # the door's wait, just before its request enters
    assert registry.get_sample_value("waits_total") == 0
    tally.enter()  # the first one in flushes it
    assert registry.get_sample_value("waits_total") == 1
    tally.leave()
    # With no request to follow it, the flusher writes it.
    soon = Tally(every_s=0.02)
    soon.inc(waits)
    soon.defer()
    deadline = time.monotonic() + 5
    while registry.get_sample_value("waits_total") != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert registry.get_sample_value("waits_total") == 2


def test_of_a_gauges_values_the_last_one_recorded_is_written() -> None:
    registry = CollectorRegistry()
    depth = Gauge("depth", "d", registry=registry)
    tally = Tally(every_s=3600)
    tally.enter()
    for value in (1, 2, 3, 1):
        tally.set(depth, value)
        tally.settle()
    assert registry.get_sample_value("depth") == 0
    tally.leave()
    assert registry.get_sample_value("depth") == 1
    tally.set(depth, 0)
    tally.settle()
    assert registry.get_sample_value("depth") == 0


def test_a_flush_shows_what_is_in_flight() -> None:
    registry = CollectorRegistry()
    in_flight = Gauge("f", "f", registry=registry)
    tally = Tally(every_s=3600, in_flight=in_flight)
    tally.enter()
    tally.enter()
    tally.flush()  # as a scrape does before it renders
    assert registry.get_sample_value("f") == 2


def test_a_worker_that_is_never_idle_still_writes_its_updates() -> None:
    registry = CollectorRegistry()
    requests = Counter("r_total", "r", registry=registry)
    tally = Tally(every_s=0.02)
    tally.enter()  # never leaves
    tally.inc(requests, 5)
    tally.settle()
    deadline = time.monotonic() + 5
    while registry.get_sample_value("r_total") != 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert registry.get_sample_value("r_total") == 5


def test_threads_recording_and_flushing_at_once_lose_nothing() -> None:
    registry = CollectorRegistry()
    requests = Counter("r_total", "r", registry=registry)
    in_flight = Gauge("f", "f", registry=registry)
    duration = histogram(registry)
    tally = Tally(every_s=0.001, in_flight=in_flight)  # the periodic flush races the threads too
    threads, each = 8, 2000

    def work() -> None:
        for i in range(each):
            tally.enter()
            tally.inc(requests)
            tally.observe(duration, 0.001 * (i % 7))
            tally.leave()

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    tally.flush()
    assert registry.get_sample_value("r_total") == threads * each
    assert registry.get_sample_value("h_seconds_count") == threads * each
    assert registry.get_sample_value("f") == 0

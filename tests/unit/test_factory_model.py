"""A factory model gets what the built-in models get: length-aware sub-batches, its task, its metrics."""

from __future__ import annotations

from collections.abc import Callable

from flask.testing import FlaskClient

from service.config.settings import Settings
from tests.support.metrics import Scrape

TEXTS = ["one", "two words", "a text of five words", "and one of six words here"]


def test_a_factory_that_reports_item_sizes_gets_sub_batches_and_token_counts(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(Settings(model="tests.support.models:sized_echo"))
    response = client.post("/predict/batched", json={"inputs": TEXTS})
    assert response.status_code == 200
    assert response.json["outputs"] == [[float(len(text))] for text in TEXTS]  # type: ignore[index]
    scrape = Scrape.parse(client.get("/metrics").get_data())
    real = scrape.total("serve_batch_tokens_total", kind="real")
    assert real == sum(len(text.split()) for text in TEXTS) == 14
    assert scrape.total("serve_batch_tokens_total", kind="padded") >= real
    assert scrape.total("serve_batch_sub_batches_count") >= 1


def test_a_factory_without_item_sizes_batches_as_is(make_client: Callable[[Settings], FlaskClient]) -> None:
    client = make_client(Settings(model="tests.support.models:echo"))
    assert client.post("/predict/batched", json={"inputs": TEXTS}).status_code == 200
    scrape = Scrape.parse(client.get("/metrics").get_data())
    assert scrape.total("serve_batch_tokens_total", kind="real") == 0
    assert scrape.total("serve_batch_sub_batches_count") == 0


def test_a_factory_models_task_shows(make_client: Callable[[Settings], FlaskClient]) -> None:
    client = make_client(Settings(model="tests.support.models:sized_echo"))
    assert client.get("/info").json["model"]["task"] == "generic"  # type: ignore[index]
    scrape = Scrape.parse(client.get("/metrics").get_data())
    assert scrape.series("serve_model_info") == [
        {
            "slot": "0",
            "model": "sized-echo",
            "name": "sized-echo",
            "task": "generic",
            "precision": "float32",
            "precision_reason": "float32_only",  # auto: a factory's network is not converted
        }
    ]


def test_a_factory_with_an_unknown_task_fails_to_load(make_client: Callable[[Settings], FlaskClient]) -> None:
    client = make_client(Settings(model="tests.support.models:bad_task"))
    assert client.get("/readyz").status_code == 503

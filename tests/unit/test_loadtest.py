"""The load test's parts that need no running Locust: metrics readings, the panel's steps, the shapes."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
from flask.testing import FlaskClient

from scripts.load.loadtest import retrieval
from scripts.load.loadtest.panel import WHOLE_RUN, Panel
from scripts.load.loadtest.scenarios import ARTICLE_LOAD, INDEXING_LOAD, RETRIEVAL_LOAD, STEP_LOAD, turn
from scripts.load.loadtest.service_metrics import BATCHER_ROW, NOT_APPLICABLE, Reading, RouteCounts, rows
from scripts.load.loadtest.workload import (
    Workload,
    WorkloadError,
    check_texts_per_request,
    embeddings_failure,
    read_corpus,
)


def test_a_reading_holds_the_service_counters_and_leaves_out_scrapes_and_probes(client: FlaskClient) -> None:
    item = [0.5] * 16
    before = Reading.parse(client.get("/metrics").get_data(as_text=True))
    for _ in range(3):
        assert client.post("/predict/batched", json={"inputs": [item, item]}).status_code == 200
    assert client.post("/predict/naive", json={"inputs": [item]}).status_code == 200
    assert client.post("/predict/naive", json={"inputs": "nope"}).status_code == 422
    assert client.get("/info").status_code == 200
    after = Reading.parse(client.get("/metrics").get_data(as_text=True))

    growth = after - before
    assert set(growth.routes) == {"/predict/batched", "/predict/naive"}
    assert growth.routes["/predict/batched"].by_code == {"200": 3.0}
    assert growth.routes["/predict/naive"].by_code == {"200": 1.0, "422": 1.0}
    assert growth.items == 6  # the naive route runs no batches
    assert 1 <= growth.batches <= 3
    assert growth.queue_wait_count == 3


def test_a_reading_sums_the_series_of_every_model() -> None:
    text = """\
serve_http_requests_total{code="200",model="embed",route="/v1/embeddings"} 5.0
serve_http_requests_total{code="200",model="small",route="/v1/embeddings"} 2.0
serve_http_requests_total{code="503",model="",route="/v1/embeddings"} 1.0
serve_http_request_duration_seconds_count{model="embed",route="/v1/embeddings"} 5.0
serve_http_request_duration_seconds_count{model="small",route="/v1/embeddings"} 2.0
serve_http_request_duration_seconds_count{model="",route="/v1/embeddings"} 1.0
serve_inferred_items_total{model="embed"} 10.0
serve_inferred_items_total{model="small"} 4.0
serve_rejected_requests_total{model="embed",reason="queue_full"} 2.0
serve_rejected_requests_total{model="",reason="queue_full"} 1.0
serve_batch_queue_depth{model="embed"} 3.0
serve_batch_queue_depth{model="small"} 1.0
"""
    reading = Reading.parse(text)
    assert reading.routes["/v1/embeddings"].by_code == {"200": 7.0, "503": 1.0}
    assert reading.routes["/v1/embeddings"].latency_count == 8
    assert reading.items == 14
    assert reading.rejected == {"queue_full": 3.0}
    assert reading.queue_depth == 4


def test_rows_give_per_route_figures_and_the_batcher_s() -> None:
    growth = Reading(
        routes={
            "/predict/batched": RouteCounts(
                {"200": 90.0, "503": 8.0, "504": 2.0}, latency_sum=5.0, latency_count=100.0
            ),
            "/predict/naive": RouteCounts({"200": 40.0}, latency_sum=8.0, latency_count=40.0),
            "/predict": RouteCounts({}, 0.0, 0.0),  # a route with no load this time: no row
        },
        items=90.0,
        batches=30.0,
        queue_wait_sum=0.9,
        queue_wait_count=90.0,
        model_sum=0.6,
        model_count=30.0,
        rejected={"queue_full": 8.0},
    )
    table = {row["route"]: row for row in rows("8 BatchedUser", growth, seconds=10.0)}

    assert list(table) == ["/predict/batched", "/predict/naive", BATCHER_ROW]
    batched = table["/predict/batched"]
    assert (batched["requests"], batched["rps"], batched["mean_latency_ms"]) == (100, 10.0, 50.0)
    assert (batched["shed"], batched["timed_out"], batched["mean_batch_size"]) == (8, 2, NOT_APPLICABLE)
    batcher = table[BATCHER_ROW]
    assert (batcher["batches"], batcher["mean_batch_size"], batcher["queue_full"]) == (30, 3.0, 8)
    assert batcher["items_per_s"] == 9.0  # texts answered a second, whatever the requests carried
    assert batched["items_per_s"] == NOT_APPLICABLE
    assert (batcher["mean_queue_wait_ms"], batcher["mean_model_ms"]) == (10.0, 20.0)
    assert batcher["requests"] == NOT_APPLICABLE
    assert all(row["users"] == "8 BatchedUser" for row in table.values())


def _reading(requests: float, batches: float, items: float) -> Reading:
    return Reading(
        routes={"/predict/batched": RouteCounts({"200": requests}, requests * 0.01, requests)},
        items=items,
        batches=batches,
    )


def test_the_panel_keeps_each_step_apart_and_drops_intervals_that_straddle_two() -> None:
    panel = Panel(SimpleNamespace(host="http://127.0.0.1:1", runner=None))
    panel.add(0.0, _reading(0, 0, 0), {"BatchedUser": 1, "NaiveUser": 0})
    panel.add(1.0, _reading(10, 10, 10), {"BatchedUser": 1})
    panel.add(2.0, _reading(100, 20, 100), {"BatchedUser": 8})  # changed: this second is nobody's
    panel.add(3.0, _reading(200, 30, 200), {"BatchedUser": 8})

    table = {(row["users"], row["route"]): row for row in panel.rows()}
    assert [key[0] for key in table] == [WHOLE_RUN, WHOLE_RUN, "1 BatchedUser", "1 BatchedUser"] + [
        "8 BatchedUser"
    ] * 2
    assert table[("1 BatchedUser", BATCHER_ROW)]["mean_batch_size"] == 1.0
    assert table[("8 BatchedUser", BATCHER_ROW)]["mean_batch_size"] == 10.0
    assert table[("8 BatchedUser", "/predict/batched")]["requests"] == 100
    assert table[(WHOLE_RUN, "/predict/batched")]["requests"] == 200
    assert table[(WHOLE_RUN, "/predict/batched")]["rps"] == round(200 / 3, 1)


def test_the_panel_report_table_is_added_to_locust_s_report_once() -> None:
    panel = Panel(SimpleNamespace(host="http://127.0.0.1:1", runner=None))
    panel.add(0.0, _reading(0, 0, 0), {"BatchedUser": 4})
    panel.add(1.0, _reading(8, 2, 8), {"BatchedUser": 4})
    report = panel.add_to_report(panel.add_to_report("<html><body><div id='root'></div></body></html>"))
    assert report.count('id="service-batching"') == 1
    assert report.index('id="service-batching"') < report.index("</body>")
    assert "<td>4 BatchedUser</td>" in report
    assert panel.csv_text().splitlines()[0].startswith("Users,Route,Requests")


def test_a_service_that_cannot_be_read_shows_why_in_the_first_row() -> None:
    panel = Panel(SimpleNamespace(host="http://127.0.0.1:1", runner=None))
    panel.scrape()
    [row] = panel.rows()
    assert row["users"] == "error"
    assert row["route"].startswith("GET http://127.0.0.1:1/metrics failed")


@pytest.mark.parametrize(
    ("elapsed", "running", "expected"),
    [
        (0.0, {}, (1, 1.0, "BatchedUser")),
        (9.9, {"BatchedUser": 1}, (1, 1.0, "BatchedUser")),
        (10.0, {"BatchedUser": 1}, (0, 100.0, "NaiveUser")),  # the previous turn's users stop first
        (11.0, {"BatchedUser": 0}, (1, 1.0, "NaiveUser")),
        (20.0, {"NaiveUser": 1}, (0, 100.0, "BatchedUser")),
        (21.0, {}, (8, 8.0, "BatchedUser")),
        (75.0, {}, (64, 64.0, "NaiveUser")),
        (80.0, {"NaiveUser": 64}, None),
    ],
)
def test_step_load_gives_each_route_a_turn_at_each_count(
    elapsed: float, running: dict[str, int], expected: Any
) -> None:
    assert turn(STEP_LOAD, ["NaiveUser", "BatchedUser"], running, elapsed, step_seconds=10.0) == expected


def test_with_one_class_picked_the_scenario_walks_its_counts_alone() -> None:
    assert turn(ARTICLE_LOAD, ["BatchedUser"], {"BatchedUser": 5}, 7.0, step_seconds=3.0) == (
        20,
        20.0,
        "BatchedUser",
    )
    assert turn(ARTICLE_LOAD, ["BatchedUser"], {"BatchedUser": 20}, 9.0, step_seconds=3.0) is None
    assert ARTICLE_LOAD.think_time == (1.0, 3.0)
    assert STEP_LOAD.think_time == (0.0, 0.0)


def test_indexing_load_walks_a_few_jobs_without_think_time() -> None:
    assert turn(INDEXING_LOAD, ["IndexingUser"], {"IndexingUser": 2}, 7.0, step_seconds=3.0) == (
        4,
        4.0,
        "IndexingUser",
    )
    assert turn(INDEXING_LOAD, ["IndexingUser"], {"IndexingUser": 8}, 12.0, step_seconds=3.0) is None
    assert INDEXING_LOAD.think_time == (0.0, 0.0)


def test_retrieval_load_walks_1_8_32_searches_without_think_time() -> None:
    assert turn(RETRIEVAL_LOAD, ["RetrievalUser"], {"RetrievalUser": 1}, 3.0, step_seconds=3.0) == (
        8,
        8.0,
        "RetrievalUser",
    )
    assert turn(RETRIEVAL_LOAD, ["RetrievalUser"], {"RetrievalUser": 8}, 6.0, step_seconds=3.0) == (
        32,
        32.0,
        "RetrievalUser",
    )
    assert turn(RETRIEVAL_LOAD, ["RetrievalUser"], {"RetrievalUser": 32}, 9.0, step_seconds=3.0) is None
    assert RETRIEVAL_LOAD.think_time == (0.0, 0.0)


def test_a_step_must_last_some_time() -> None:
    with pytest.raises(ValueError, match="LOCUST_STEP_SECONDS"):
        turn(STEP_LOAD, ["BatchedUser"], {}, 1.0, step_seconds=2.5)


def test_text_models_get_corpus_texts_and_others_sample_items() -> None:
    texts = tuple(read_corpus())
    assert len(texts) > 100
    assert len({len(text) for text in texts}) > 50, "the corpus mixes lengths"
    rng = random.Random(0)
    text_body = Workload({"item_kind": "text", "item_shape": None}, texts).body(3, rng)
    assert len(text_body["inputs"]) == 3
    assert all(text in texts for text in text_body["inputs"])
    vector_body = Workload({"item_kind": "vector", "item_shape": [4]}, texts).body(2, rng)
    assert [len(item) for item in vector_body["inputs"]] == [4, 4]
    assert Workload({"item_kind": "text", "item_shape": None}, texts).request(2, rng).keys() == {"json"}


def test_image_models_get_jpeg_uploads() -> None:
    images = Workload({"item_kind": "image", "item_shape": [3, 224, 224]}, ())
    rng = random.Random(0)
    one = images.request(1, rng)
    assert one["headers"] == {"Content-Type": "image/jpeg"}
    assert one["data"][:3] == b"\xff\xd8\xff"  # a JPEG's start
    several = images.request(3, rng)
    assert [(name, part[2]) for name, part in several["files"]] == [("image", "image/jpeg")] * 3
    assert len({part[1] for _, part in several["files"]}) == 3, "different images"


def test_an_indexing_job_sends_consecutive_corpus_lines_to_the_embeddings_api() -> None:
    texts = ("a", "b", "c", "d", "e")
    workload = Workload({"name": "all-MiniLM-L6-v2", "item_kind": "text", "item_shape": [384]}, texts)
    rng = random.Random(0)
    for _ in range(20):
        passage = workload.passage(3, rng)
        start = texts.index(passage[0])
        assert passage == [texts[(start + i) % len(texts)] for i in range(3)], "in order, round the end"
    assert sorted(workload.passage(7, rng)[:5]) == list(texts), "more texts than lines: all, then again"
    sent = workload.embeddings_request(4, rng)
    assert sent.keys() == {"json"}
    assert sent["json"]["model"] == "all-MiniLM-L6-v2"
    assert len(sent["json"]["input"]) == 4


def test_texts_per_request_must_be_at_least_one() -> None:
    assert check_texts_per_request(32) == 32
    with pytest.raises(ValueError, match=r"LOCUST_TEXTS_PER_REQUEST\) must be at least 1 text, got 0"):
        check_texts_per_request(0)


@pytest.mark.parametrize(
    ("status", "answer", "expected"),
    [
        (200, {"data": [{}, {}, {}]}, None),
        (200, {"data": [{}, {}]}, "2 embeddings for 3 texts"),
        (200, None, '200 without a list of embeddings in its "data"'),
        (400, {"error": {"message": '"input" holds 100 items'}}, '400: "input" holds 100 items'),
        (
            404,
            {"error": {"message": "model 'mlp' takes vector items"}},
            "404: model 'mlp' takes vector items",
        ),
        (503, {"error": {"message": "the service is overloaded"}}, None),  # Locust fails it by its status
        (504, None, None),
    ],
)
def test_an_embeddings_answer_fails_on_a_missing_embedding_or_says_what_a_4xx_said(
    status: int, answer: Any, expected: str | None
) -> None:
    assert embeddings_failure(status, answer, sent=3) == expected


def _listing(*models: tuple[str, str]) -> dict[str, Any]:
    """``GET /v1/models``'s answer for (id, task) pairs, in order."""
    entries = [{"id": name, "object": "model", "task": task, "aliases": []} for name, task in models]
    return {"object": "list", "data": entries}


def test_a_retrieval_user_takes_the_first_embedder_and_the_first_reranker() -> None:
    listing = _listing(
        ("classify", "classification"),
        ("rerank", "rerank"),
        ("embed", "embeddings"),
        ("small", "embeddings"),
        ("rerank-2", "rerank"),
    )
    assert retrieval.pick_models(listing, "http://h") == retrieval.RetrievalModels(
        embed="embed", rerank="rerank"
    )


@pytest.mark.parametrize(
    ("listing", "missing"),
    [
        (_listing(("embed", "embeddings")), "serves no rerank model (it serves embed (embeddings))"),
        (_listing(("rerank", "rerank")), "serves no embeddings model (it serves rerank (rerank))"),
        (_listing(), "serves no embeddings and no rerank model (it serves none)"),
    ],
)
def test_a_service_without_both_models_fails_the_retrieval_user_saying_what_it_serves(
    listing: dict[str, Any], missing: str
) -> None:
    with pytest.raises(WorkloadError) as caught:
        retrieval.pick_models(listing, "http://127.0.0.1:8000")
    assert f"the service at http://127.0.0.1:8000 {missing}" in str(caught.value)
    assert "SERVE_MODEL='embed=minilm,rerank=" in str(caught.value), "says how to serve both"


def test_a_models_answer_without_a_list_is_refused() -> None:
    with pytest.raises(WorkloadError, match='without a list of models in its "data"'):
        retrieval.pick_models({"error": "nope"}, "http://h")


def test_a_query_s_candidates_are_the_lines_after_it_and_never_the_query() -> None:
    texts = ("a", "b", "c", "d", "e")
    rng = random.Random(0)
    for _ in range(20):
        query, candidates = retrieval.query_and_candidates(texts, 3, rng)
        start = texts.index(query)
        assert candidates == [texts[(start + 1 + i) % len(texts)] for i in range(3)], "round the end"
        assert query not in candidates
    sent = retrieval.rerank_request("rerank", "q", ["x", "y"])
    assert sent == {"json": {"model": "rerank", "query": "q", "documents": ["x", "y"]}}
    assert retrieval.embed_request("embed", "q") == {"json": {"model": "embed", "input": ["q"]}}


def test_documents_per_query_must_be_at_least_one() -> None:
    assert retrieval.check_documents_per_query(16) == 16
    with pytest.raises(ValueError, match=r"LOCUST_DOCUMENTS_PER_QUERY\) must be at least 1 document, got 0"):
        retrieval.check_documents_per_query(0)


@pytest.mark.parametrize(
    ("status", "answer", "expected"),
    [
        (200, {"results": [{}, {}, {}]}, None),
        (200, {"results": [{}]}, "1 results for 3 documents"),
        (200, None, '200 without a list of "results"'),
        (400, {"message": '"documents" holds 2000 items'}, '400: "documents" holds 2000 items'),
        (404, {"message": "model 'embed' serves embeddings, not rerank"}, "404: model 'embed' serves"),
        (503, {"message": "the service is overloaded"}, None),  # Locust fails it by its status
        (504, None, None),
    ],
)
def test_a_rerank_answer_fails_on_a_missing_result_or_says_what_a_4xx_said(
    status: int, answer: Any, expected: str | None
) -> None:
    failure = retrieval.rerank_failure(status, answer, sent=3)
    if expected is None:
        assert failure is None
    else:
        assert failure is not None and failure.startswith(expected)

"""Load test both routes with Locust: naive vs batched, side by side.

The dashboard, against a service already running (``bash scripts/serve``):

    bash scripts/load/dashboard     # installs Locust into .venv, prints the URL to open

then pick NaiveUser and/or BatchedUser and a shape: StepLoad (1, 8, 32, 64 users per
route, no think time), ArticleLoad (1, 5, 20 users per route, 1-3 s think time), or
Default (the user count you type, --wait-min/--wait-max think time). IndexingUser is a
batched client, an indexing job: --texts-per-request texts (32) in every request to
POST /v1/embeddings, no think time; IndexingLoad runs 1, 2, 4, 8 of them. RetrievalUser
is a search against a service of an embedder and a reranker: it embeds one query with
POST /v1/embeddings, then reranks --documents-per-query candidates (16) with
POST /v2/rerank; RetrievalLoad runs 1, 8, 32 of them, no think time. The "Batching"
tab shows the service's own figures from its /metrics: requests, latency, 503s and 504s
per route, and the batcher's items a second, mean batch size, queue wait and model time,
by user count.

Headless, with Locust's CSV and HTML report (plus PREFIX_batching.csv, and the batching
table in the report):

    .venv/bin/locust -f locustfile.py --host http://127.0.0.1:8000 --headless \
        --shape StepLoad --csv reports/step --html reports/step.html NaiveUser BatchedUser
    .venv/bin/locust -f locustfile.py --host http://127.0.0.1:8000 --headless \
        --shape IndexingLoad --csv reports/indexing IndexingUser
    .venv/bin/locust -f locustfile.py --host http://127.0.0.1:8000 --headless \
        --shape RetrievalLoad --csv reports/retrieval RetrievalUser

Users send texts drawn from scripts/fixtures/corpus/mixed.txt (real prose of mixed length) when the
model takes text; JPEG uploads (the raw body for one image, multipart for several) when it
takes images; else items that fit it (service.models.base.sample_item). They learn the
served model from GET /info once, outside the request statistics; RetrievalUser learns its
two from GET /v1/models, and stops with the reason if the service lacks either.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from locust import HttpUser, constant, events, task
from locust.runners import WorkerRunner

from scripts.load.loadtest import retrieval, scenarios, shapes
from scripts.load.loadtest.panel import DEFAULT_INTERVAL_S, Panel
from scripts.load.loadtest.workload import (
    DEFAULT_TEXTS_PER_REQUEST,
    check_texts_per_request,
    embeddings_failure,
    read_corpus,
    workload_for,
)

logger = logging.getLogger(__name__)


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument(
        "--wait-min",
        type=float,
        default=1.0,
        env_var="LOCUST_WAIT_MIN",
        help="least seconds between a user's requests, without a shape (shapes set their own)",
    )
    parser.add_argument(
        "--wait-max",
        type=float,
        default=3.0,
        env_var="LOCUST_WAIT_MAX",
        help="most seconds between a user's requests, without a shape; 0 and 0 saturate the service",
    )
    parser.add_argument("--items-per-request", type=int, default=1, help="items in each request")
    parser.add_argument(
        "--texts-per-request",
        type=int,
        default=DEFAULT_TEXTS_PER_REQUEST,
        env_var="LOCUST_TEXTS_PER_REQUEST",
        help="texts in each IndexingUser request: consecutive lines of the corpus",
    )
    parser.add_argument(
        "--documents-per-query",
        type=int,
        default=retrieval.DEFAULT_DOCUMENTS_PER_QUERY,
        env_var="LOCUST_DOCUMENTS_PER_QUERY",
        help="candidates each RetrievalUser query reranks: the corpus lines after the query's",
    )
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=scenarios.DEFAULT_STEP_SECONDS,
        env_var="LOCUST_STEP_SECONDS",
        help="how long each shape (StepLoad, ArticleLoad, IndexingLoad, RetrievalLoad) holds a user count",
    )
    parser.add_argument(
        "--shape",
        choices=[shape.__name__ for shape in shapes.SHAPES],
        default=None,
        env_var="LOCUST_SHAPE",
        include_in_web_ui=False,
        help="run this load shape (headless; in the web UI, pick it in the class picker)",
    )
    parser.add_argument(
        "--metrics-interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        env_var="LOCUST_METRICS_INTERVAL",
        include_in_web_ui=False,
        help="seconds between readings of the service's /metrics for the batching figures",
    )


@events.init.add_listener
def _init(environment: Any, runner: Any, web_ui: Any, **_: Any) -> None:
    options = environment.parsed_options
    _offer_scenarios(environment, runner, getattr(options, "shape", None))
    if isinstance(runner, WorkerRunner):
        return  # the master reads the service's figures
    panel = Panel(environment, interval=getattr(options, "metrics_interval", DEFAULT_INTERVAL_S))
    environment.events.test_start.add_listener(panel.on_test_start)
    environment.events.test_stopping.add_listener(panel.on_test_stopping)
    environment.events.test_stop.add_listener(panel.on_test_stop)
    environment.events.quit.add_listener(lambda **_: panel.write_files(options))
    if web_ui is not None:
        panel.attach(web_ui)


def _offer_scenarios(environment: Any, runner: Any, chosen: str | None) -> None:
    """The shapes go into the class picker, and run only when picked or named by --shape."""
    offered = {shape.__name__: shape() for shape in shapes.SHAPES}
    if environment.available_shape_classes is not None:
        environment.available_shape_classes.update(offered)
    if chosen is not None:
        environment.shape_class = offered[chosen]
        environment.shape_class.runner = runner


def think_time(environment: Any) -> float:
    """Seconds a user waits between requests: the shape's think time, else --wait-min to --wait-max."""
    shape = environment.shape_class
    if isinstance(shape, shapes.ScenarioShape):
        low, high = shape.scenario.think_time
    else:
        options = environment.parsed_options
        low = options.wait_min if options else 1.0
        high = options.wait_max if options else 3.0
    return random.uniform(low, max(low, high))


class ModelUser(HttpUser):
    abstract = True
    route = "/predict"

    def wait_time(self) -> float:
        return think_time(self.environment)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.items = options.items_per_request if options else 1
        self.workload = workload_for(self.host)
        self.rng = random.Random()

    @task
    def predict(self) -> None:
        sent = self.workload.request(self.items, self.rng)
        with self.client.post(self.route, name=self.route, catch_response=True, **sent) as response:
            if response.status_code == 200 and len(response.json()["outputs"]) != self.items:
                response.failure(f"{len(response.json()['outputs'])} outputs for {self.items} inputs")


class NaiveUser(ModelUser):
    """Calls the naive route: the model runs in the request's own thread."""

    route = "/predict/naive"


class BatchedUser(ModelUser):
    """Calls the batched route: concurrent requests share a model call."""

    route = "/predict/batched"


class IndexingUser(HttpUser):
    """A batched client, as an indexing job is: many texts a request to OpenAI's embeddings API.

    Each request carries ``--texts-per-request`` consecutive lines of the corpus, and the
    next goes as soon as the answer comes: a job has no one to wait for. The request's
    name says how many texts it carries, so that its requests a second convert to texts.
    """

    route = "/v1/embeddings"
    wait_time = constant(0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.texts = check_texts_per_request(
            options.texts_per_request if options else DEFAULT_TEXTS_PER_REQUEST
        )
        self.request_name = f"{self.route} ({self.texts} texts)"
        self.workload = workload_for(self.host)
        self.rng = random.Random()

    @task
    def embed(self) -> None:
        sent = self.workload.embeddings_request(self.texts, self.rng)
        with self.client.post(self.route, name=self.request_name, catch_response=True, **sent) as response:
            failure = embeddings_failure(response.status_code, _json(response), self.texts)
            if failure is not None:
                response.failure(failure)


class RetrievalUser(HttpUser):
    """A search against an embedder and a reranker in one service: embed the query, rerank its candidates.

    Each iteration embeds one corpus line with ``POST /v1/embeddings``, then reranks the
    ``--documents-per-query`` lines after it with ``POST /v2/rerank``, as a retrieval
    pipeline does once its vector index has answered; a query whose embedding failed goes
    no further. The two requests' names keep the steps apart in the statistics. Between
    iterations it waits the shape's think time (none in RetrievalLoad), or --wait-min to
    --wait-max without a shape.
    """

    embed_route = "/v1/embeddings"
    rerank_route = "/v2/rerank"

    def wait_time(self) -> float:
        return think_time(self.environment)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.documents = retrieval.check_documents_per_query(
            options.documents_per_query if options else retrieval.DEFAULT_DOCUMENTS_PER_QUERY
        )
        self.models = retrieval.models_for(self.host)
        self.embed_name = f"{self.embed_route} (query)"
        self.rerank_name = f"{self.rerank_route} ({self.documents} documents)"
        self.texts = read_corpus()
        self.rng = random.Random()

    @task
    def search(self) -> None:
        query, candidates = retrieval.query_and_candidates(self.texts, self.documents, self.rng)
        sent = retrieval.embed_request(self.models.embed, query)
        embed = self.client.post(self.embed_route, name=self.embed_name, catch_response=True, **sent)
        with embed as response:
            failure = embeddings_failure(response.status_code, _json(response), 1)
            if failure is not None:
                response.failure(failure)
            embedded = failure is None and response.status_code == 200
        if not embedded:
            return  # without the query's vector the index finds no candidates to rerank
        sent = retrieval.rerank_request(self.models.rerank, query, candidates)
        rerank = self.client.post(self.rerank_route, name=self.rerank_name, catch_response=True, **sent)
        with rerank as response:
            failure = retrieval.rerank_failure(response.status_code, _json(response), len(candidates))
            if failure is not None:
                response.failure(failure)


def _json(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return None

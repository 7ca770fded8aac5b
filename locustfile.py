"""Load test both routes with Locust: naive vs batched, side by side.

    .venv/bin/locust -f locustfile.py --host http://127.0.0.1:8000 --class-picker
    # then open http://127.0.0.1:8089, pick NaiveUser or BatchedUser (or both), start

Headless, closed loop (no think time), 32 users for a minute:

    .venv/bin/locust -f locustfile.py --host http://127.0.0.1:8000 --headless \
        -u 32 -r 32 -t 60s --wait-min 0 --wait-max 0 BatchedUser

Each user reads GET /info once and sends items that fit the served model, varied at random
(service.models.base.sample_item, as the benchmark and soak scripts use): sentences for text
models, numbers of the right shape for vector and tensor models. Between requests a user waits a
random 1-3 s by default, like shoppers at a self-checkout; --wait-min/--wait-max change that
(0 and 0 saturate the service).
"""

from __future__ import annotations

import random
from typing import Any

from locust import HttpUser, events, task

from service.models.base import sample_item


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument("--wait-min", type=float, default=1.0, help="least seconds between a user's requests")
    parser.add_argument("--wait-max", type=float, default=3.0, help="most seconds between a user's requests")
    parser.add_argument("--items-per-request", type=int, default=1, help="items in each request")


def sample_items(info: dict[str, Any], count: int) -> list[Any]:
    rng = random.Random()
    return [sample_item(info["model"], rng) for _ in range(count)]


class ModelUser(HttpUser):
    abstract = True
    route = "/predict"

    def wait_time(self) -> float:
        options = self.environment.parsed_options
        low = options.wait_min if options else 1.0
        high = options.wait_max if options else 3.0
        return random.uniform(low, max(low, high))

    def on_start(self) -> None:
        options = self.environment.parsed_options
        count = options.items_per_request if options else 1
        info = self.client.get("/info", name="/info").json()
        self.body = {"inputs": sample_items(info, count)}

    @task
    def predict(self) -> None:
        with self.client.post(self.route, json=self.body, name=self.route, catch_response=True) as response:
            if response.status_code == 200 and len(response.json()["outputs"]) != len(self.body["inputs"]):
                response.failure("wrong number of outputs")


class NaiveUser(ModelUser):
    """Calls the naive route: the model runs in the request's own thread."""

    route = "/predict/naive"


class BatchedUser(ModelUser):
    """Calls the batched route: concurrent requests share a model call."""

    route = "/predict/batched"

"""The dashboard's load shapes, for Locust's class picker and for ``--shape`` (see ``scenarios``).

These classes live outside locustfile.py on purpose: Locust runs the first shape it finds
in a locustfile whatever the command line says, which would turn a plain
``--headless -u 32`` run into a shape run. locustfile.py registers them instead.
"""

from __future__ import annotations

from typing import Any, ClassVar

from locust import LoadTestShape, User

from scripts.load.loadtest.scenarios import (
    ARTICLE_LOAD,
    DEFAULT_STEP_SECONDS,
    INDEXING_LOAD,
    RETRIEVAL_LOAD,
    STEP_LOAD,
    Scenario,
    turn,
)


class ScenarioShape(LoadTestShape):
    abstract: ClassVar[bool] = True
    scenario: ClassVar[Scenario]

    def tick(self) -> tuple[int, float, list[type[User]]] | None:
        runner: Any = self.runner
        by_name = {user_class.__name__: user_class for user_class in runner.user_classes}
        options = runner.environment.parsed_options
        step_seconds = float(getattr(options, "step_seconds", DEFAULT_STEP_SECONDS))
        now = turn(self.scenario, list(by_name), runner.user_classes_count, self.get_run_time(), step_seconds)
        if now is None:
            return None
        users, rate, name = now
        return users, rate, [by_name[name]]


class StepLoad(ScenarioShape):
    """1, 8, 32 and 64 users on each route in turn, no think time: throughput and latency as load grows."""

    scenario = STEP_LOAD


class ArticleLoad(ScenarioShape):
    """1, 5 and 20 users on each route in turn, who wait 1-3 s between requests, as the article measured."""

    scenario = ARTICLE_LOAD


class IndexingLoad(ScenarioShape):
    """1, 2, 4 and 8 users on each route in turn, no think time: a few indexing jobs (IndexingUser)."""

    scenario = INDEXING_LOAD


class RetrievalLoad(ScenarioShape):
    """1, 8 and 32 users on each route in turn, no think time: searches on two models (RetrievalUser)."""

    scenario = RETRIEVAL_LOAD


SHAPES: tuple[type[ScenarioShape], ...] = (StepLoad, ArticleLoad, IndexingLoad, RetrievalLoad)

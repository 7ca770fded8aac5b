"""The load shapes offered in the dashboard's class picker, and each one's think time.

A shape walks up a staircase of user counts and, at each count, gives every picked user
class (route) a turn of its own, in name order: with BatchedUser and NaiveUser picked,
StepLoad runs 1 BatchedUser, then 1 NaiveUser, then 8 of each in turn, and so on. The
routes take turns rather than run together because they share the service's cores: run at
once, the naive route's request threads crowd out the batch thread, and neither route's
figures say what it would do alone. Every turn lasts ``--step-seconds``
(``LOCUST_STEP_SECONDS``).

These classes live outside locustfile.py on purpose: Locust runs the first shape it
finds in a locustfile whatever the command line says, which would turn a plain
``--headless -u 32`` run into a shape run. locustfile.py registers them instead, for the
class picker and for ``--shape``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from locust import LoadTestShape, User

DEFAULT_STEP_SECONDS = 20.0
# Locust warns that faster spawning can misbehave; 100 a second still starts 128 users in ~1 s.
MAX_SPAWN_RATE = 100.0


class Scenario(LoadTestShape):
    """A staircase of user counts; at each, every picked user class runs alone for a step."""

    abstract: ClassVar[bool] = True
    steps: ClassVar[tuple[int, ...]] = ()
    think_time: ClassVar[tuple[float, float]] = (0.0, 0.0)  # seconds between a user's requests

    def tick(self) -> tuple[int, float, list[type[User]]] | None:
        classes = sorted(self.runner.user_classes, key=lambda user_class: user_class.__name__)
        turn = int(self.get_run_time() // step_seconds(self.runner.environment.parsed_options))
        level, which = divmod(turn, max(1, len(classes)))
        if level >= len(self.steps) or not classes:
            return None
        users, user_class = self.steps[level], classes[which]
        # Locust gives a new class only to users it starts, so the previous turn's users
        # stop first; the turn's class starts at the next tick, a second later.
        running = self.runner.user_classes_count
        if any(count > 0 for name, count in running.items() if name != user_class.__name__):
            return 0, MAX_SPAWN_RATE, [user_class]
        # The whole step at once (up to Locust's comfortable rate), so that it soon runs at its count.
        return users, min(float(users), MAX_SPAWN_RATE), [user_class]


class StepLoad(Scenario):
    """1, 8, 32 and 64 users on each route in turn, no think time: throughput and latency as load grows."""

    steps = (1, 8, 32, 64)
    think_time = (0.0, 0.0)


class ArticleLoad(Scenario):
    """1, 5 and 20 users on each route in turn, who wait 1-3 s between requests, as the article measured."""

    steps = (1, 5, 20)
    think_time = (1.0, 3.0)


SCENARIOS: tuple[type[Scenario], ...] = (StepLoad, ArticleLoad)


def step_seconds(options: Any) -> float:
    value = float(getattr(options, "step_seconds", DEFAULT_STEP_SECONDS))
    if value <= 0:
        raise ValueError(
            f"--step-seconds (LOCUST_STEP_SECONDS) must be a number of seconds above 0, got {value}"
        )
    return value

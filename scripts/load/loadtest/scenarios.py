"""The scenarios behind the dashboard's load shapes: user counts, turns and think time (pure).

A scenario walks up a staircase of user counts and, at each count, gives every picked user
class (route) a turn of its own, in name order: with BatchedUser and NaiveUser picked,
StepLoad runs 1 BatchedUser, then 1 NaiveUser, then 8 of each in turn, and so on. The
routes take turns rather than run together because they share the service's cores: run at
once, the naive route's request threads crowd out the batch thread, and neither route's
figures say what it would do alone. Every turn lasts ``--step-seconds``
(``LOCUST_STEP_SECONDS``). ``scripts.load.loadtest.shapes`` wraps these for Locust.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEFAULT_STEP_SECONDS = 20.0
# Locust's shape runner ticks once a second, and a turn spends its first tick stopping
# the previous turn's users: shorter turns would skip whole turns.
MIN_STEP_SECONDS = 3.0
# Locust warns that faster spawning can misbehave; 100 a second still starts 128 users in ~1 s.
MAX_SPAWN_RATE = 100.0


@dataclass(frozen=True)
class Scenario:
    steps: tuple[int, ...]  # users per turn
    think_time: tuple[float, float]  # seconds between a user's requests: (least, most)


STEP_LOAD = Scenario(steps=(1, 8, 32, 64), think_time=(0.0, 0.0))
ARTICLE_LOAD = Scenario(steps=(1, 5, 20), think_time=(1.0, 3.0))
# Indexing jobs are few, each with many texts in every request: 8 jobs of 32 texts keep
# 256 texts in flight, four times StepLoad's 64 one-text users.
INDEXING_LOAD = Scenario(steps=(1, 2, 4, 8), think_time=(0.0, 0.0))
# Searches, each a query embedded and its candidates reranked: a lone user shows the
# two models' latency unloaded, 8 and 32 how their turns on the cores hold up.
RETRIEVAL_LOAD = Scenario(steps=(1, 8, 32), think_time=(0.0, 0.0))


def turn(
    scenario: Scenario,
    classes: Sequence[str],
    running: Mapping[str, int],
    elapsed: float,
    step_seconds: float,
) -> tuple[int, float, str] | None:
    """(users, spawn rate, user class) ``elapsed`` seconds into the run, or None once it is over.

    ``classes`` are the picked user classes, ``running`` how many users of each run now.
    """
    if step_seconds < MIN_STEP_SECONDS:
        raise ValueError(
            f"--step-seconds (LOCUST_STEP_SECONDS) must be at least {MIN_STEP_SECONDS:g} seconds, "
            f"got {step_seconds:g}"
        )
    ordered = sorted(classes)
    if not ordered:
        return None
    level, which = divmod(int(elapsed // step_seconds), len(ordered))
    if level >= len(scenario.steps):
        return None
    users, user_class = scenario.steps[level], ordered[which]
    # Locust gives a new class only to users it starts, so the previous turn's users
    # stop first; the turn's class starts at the next tick, a second later.
    if any(count > 0 for name, count in running.items() if name != user_class):
        return 0, MAX_SPAWN_RATE, user_class
    # The whole step at once (up to Locust's comfortable rate), so that it soon runs at its count.
    return users, min(float(users), MAX_SPAWN_RATE), user_class

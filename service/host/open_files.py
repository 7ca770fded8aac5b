"""The open-file limit a worker's connections need, raised to it as the service starts.

Each connection a worker holds is a descriptor, and the plan lets a worker hold
thousands (service.topology.plan.SHED_HEADROOM: refusals held for their
Retry-After). Many hosts start processes with a soft limit of 1,024 and a hard
limit far above it; a worker past its soft limit fails to accept with EMFILE, and
its clients wait unaccepted. So the gunicorn master raises its soft limit, which
its workers inherit, to what the connections need, as far as the hard limit
allows, and says so where that is not far enough.
"""

from __future__ import annotations

import resource

# Descriptors a worker holds besides its connections: the listen sockets, the
# logs, the model's files, the metrics files, pipes, the batch thread's.
SPARE = 256


def needed(connections: int) -> int:
    """Descriptors a worker holding ``connections`` connections needs."""
    return connections + SPARE


def target(soft: int, hard: int, want: int) -> int | None:
    """The soft limit to set for ``want`` descriptors, or None to leave it. Pure.

    Never lowered, never past the hard limit (which only root could raise).
    """
    infinite = resource.RLIM_INFINITY
    if soft == infinite or soft >= want:
        return None
    ceiling = want if hard == infinite else min(want, hard)
    return ceiling if ceiling > soft else None


def raise_for(connections: int) -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE toward what ``connections`` need: (its limit now, needed)."""
    want = needed(connections)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = target(soft, hard, want)
    if new is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    return soft, want

"""This process's id without a system call.

``os.getpid()`` is a system call on every call (glibc stopped caching it), and
the request path asks for it on every metric write (prometheus_client checks
whether the process forked since it opened its file) and every access line (the
writer thread is the process's own). A fork hook keeps the answer here up to
date, so a forked gunicorn worker gets its own id from its first line on.
"""

from __future__ import annotations

import os

_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


def current_pid() -> int:
    """What ``os.getpid()`` answers, read from memory."""
    return _pid[0]

"""gunicorn's gthread worker, accepting only its share of the connections (service.host.balance).

``gunicorn_conf.py`` names this class as the worker class wherever the plan says
gthread, and hands each worker its ``Balance`` in ``post_fork``. Without one it
is gthread unchanged.
"""

from __future__ import annotations

import selectors
from typing import Any

from gunicorn.workers.gthread import ThreadWorker

from service.host.balance import Balance


class BalancedThreadWorker(ThreadWorker):  # type: ignore[misc]  # gunicorn ships no type hints
    balance: Balance | None = None
    nr_conns: int  # gthread's count of the connections it holds open
    poller: selectors.BaseSelector
    _configured_connections: int

    # gthread's event loop accepts while ``nr_conns < worker_connections`` and
    # re-reads both on every turn, so this property is where a worker that holds
    # more than its share stops accepting: it answers "no room" until the
    # others have caught up. The configured limit still applies on top.
    @property
    def worker_connections(self) -> int:
        if self.balance is None or self.balance.may_accept(self.nr_conns):
            return self._configured_connections
        return min(self.nr_conns, self._configured_connections)

    @worker_connections.setter
    def worker_connections(self, value: int) -> None:
        self._configured_connections = value

    def run(self) -> None:
        if self.balance is not None:
            self.poller.register(self.balance.wakeup_fd, selectors.EVENT_READ, self._woken)
        super().run()

    def accept(self, listener: Any) -> None:
        before = self.nr_conns
        super().accept(listener)
        if self.balance is not None and self.nr_conns != before:
            self.balance.accepted(self.nr_conns)

    def _woken(self, _fd: Any) -> None:
        if self.balance is not None:  # registered only with one
            self.balance.woken()

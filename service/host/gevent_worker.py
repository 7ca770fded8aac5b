"""gunicorn's gevent worker, with ``subprocess`` left native.

gunicorn's gevent worker monkey-patches everything, ``subprocess`` included.
gevent's ``subprocess`` can only watch its children from the main thread's
hub, and the model loads in a native OS thread (service.runtime): a library
that starts a process while it is imported there fails with "child watchers
are only available on the default loop". One such import is common:
``ctypes.util.find_library`` runs ``ldconfig``, and trio calls it at import,
which httpx's transport imports whenever trio is installed, and transformers
imports httpx. The service never starts a process from a request greenlet,
so a native ``subprocess`` costs the event loop nothing.

It also holds a refused client's connection for the Retry-After it was told
before reading its next request (service.host.hold): the connection's greenlet
waits, which holds no thread.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import gevent
from gevent import monkey
from gevent.local import local
from gevent.socket import wait_read
from gunicorn.workers.ggevent import GeventWorker as _GeventWorker

from service.host.hold import peek
from service.host.worker import StampedApp


class GeventWorker(_GeventWorker):  # type: ignore[misc]  # gunicorn ships no type hints
    sockets: list[Any]
    wsgi: Any
    alive: bool
    _requests: (
        Any  # one per connection's greenlet: the hold its last answer asked for, and whether it was held
    )

    def patch(self) -> None:
        monkey.patch_all(subprocess=False)
        # As gunicorn's own patch(): the listening sockets, re-made as gevent sockets.
        self.sockets = [
            socket.socket(s.FAMILY, socket.SOCK_STREAM, fileno=s.sock.detach()) for s in self.sockets
        ]

    def load_wsgi(self) -> None:
        super().load_wsgi()
        self._requests = local()
        self.wsgi = StampedApp(self.wsgi, self._requests)

    def handle_request(self, listener_name: Any, req: Any, sock: Any, addr: Any) -> None:
        requests = self._requests
        requests.at, requests.next_at = getattr(requests, "next_at", None), None
        requests.hold_s = 0.0
        try:
            super().handle_request(listener_name, req, sock, addr)  # raises to close the connection
        finally:
            requests.at = None
            requests.returning = False
        if requests.hold_s > 0 and self.alive:
            began = time.monotonic()
            if wait_out(sock, requests.hold_s):
                requests.next_at = began  # its resend arrived when the hold began, at the latest
            requests.returning = True  # for the request it reads next


def wait_out(sock: Any, seconds: float) -> bool:
    """Leave ``sock`` unread for ``seconds``, or until its client hangs up; whether it sent more meanwhile."""
    end = time.monotonic() + seconds
    try:
        wait_read(sock.fileno(), timeout=seconds)
    except TimeoutError:
        return False
    if peek(sock) != "sent":
        return False  # hung up: the caller reads the end and closes
    # Its resend waits in the socket; the rest of the hold needs no watching.
    gevent.sleep(max(0.0, end - time.monotonic()))
    return True

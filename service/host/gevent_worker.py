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
"""

from __future__ import annotations

import socket
from typing import Any

from gevent import monkey
from gunicorn.workers.ggevent import GeventWorker as _GeventWorker


class GeventWorker(_GeventWorker):  # type: ignore[misc]  # gunicorn ships no type hints
    sockets: list[Any]

    def patch(self) -> None:
        monkey.patch_all(subprocess=False)
        # As gunicorn's own patch(): the listening sockets, re-made as gevent sockets.
        self.sockets = [
            socket.socket(s.FAMILY, socket.SOCK_STREAM, fileno=s.sock.detach()) for s in self.sockets
        ]

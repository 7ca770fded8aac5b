# design:
# - gunicorn's Response.write sends the status line and headers with one
#   sendall and the body with another: two system calls, two TCP segments and,
#   in a threaded worker, two points where the request thread lets go of the
#   GIL and must queue for it again. Most answers here are one small JSON body,
#   so the headers can wait for it and go in the same sendall.
# - Only a first write of at most JOIN_MAX_BYTES is joined: joining copies the
#   body once, which is nothing beside a system call for a small JSON answer and
#   is not worth it for a large one.
# - Only the first write of a response that is not chunked is joined; anything
#   else (chunked bodies, files, HEAD, a body cut to Content-Length) takes
#   gunicorn's own path, and headers held back are written whatever the write
#   did, so no response can lose them.
# - gunicorn builds its Response itself (gunicorn.http.wsgi.create); the WSGI
#   wrapper in front of the app (service.host.worker.StampedApp) gets it as the
#   owner of start_response and switches its class to the subclass below. Any
#   other start_response (a test client, another server) is left as it is.
"""Send a response's headers and its first body bytes in one system call."""

from __future__ import annotations

import email.utils
import time
from typing import Any

from gunicorn import util
from gunicorn.http.wsgi import Response

# A JSON answer of a dozen embeddings; past this the headers go on their own.
JOIN_MAX_BYTES = 64 << 10
# The hook that frames body bytes (gunicorn 27): without it a held header could
# follow the body, so a gunicorn that lacks it keeps its own two writes.
_CAN_HOLD = callable(getattr(Response, "_emit_body", None))


class OneWriteResponse(Response):  # type: ignore[misc]  # gunicorn ships no type hints
    """gunicorn's Response, with the headers held back to go out with the first body bytes."""

    _holding = False
    _held: bytes | None = None
    headers_sent: bool  # gunicorn's
    chunked: bool  # gunicorn's

    def write(self, arg: Any) -> None:
        if (
            self.headers_sent
            or self.chunked
            or not isinstance(arg, bytes)
            or not 0 < len(arg) <= JOIN_MAX_BYTES
        ):
            super().write(arg)
            return
        self._holding = True
        try:
            super().write(arg)
        finally:
            self._holding = False
            held, self._held = self._held, None
            if held is not None:  # the write sent no body (HEAD, a body cut to nothing)
                util.write(self.sock, held)

    def default_headers(self) -> list[str]:
        """gunicorn's first header lines, with the Date line made once a second (http_date)."""
        if self.upgrade:
            connection = "upgrade"
        elif self.should_close():
            connection = "close"
        else:
            connection = "keep-alive"
        major, minor = self.req.version
        headers = [
            f"HTTP/{major}.{minor} {self.status}\r\n",
            f"Server: {self.version}\r\n",
            f"Date: {http_date()}\r\n",
            f"Connection: {connection}\r\n",
        ]
        if self.chunked:
            headers.append("Transfer-Encoding: chunked\r\n")
        return headers

    def send_headers(self) -> None:
        if not self._holding or self.headers_sent:
            super().send_headers()
            return
        tosend = self.default_headers()
        tosend.extend(["%s: %s\r\n" % (k, v) for k, v in self.headers])  # noqa: UP031 - as gunicorn writes them
        self._held = ("%s\r\n" % "".join(tosend)).encode("latin-1")  # noqa: UP031
        self.headers_sent = True

    def _emit_body(self, data: bytes) -> None:
        held, self._held = self._held, None
        if held is None:
            super()._emit_body(data)
        else:
            send_all(self.sock, held + data)


def send_all(sock: Any, data: bytes) -> None:
    """``sock.sendall(data)``, tried first as one ``send``, which takes a small answer whole.

    gevent's sendall asks the kernel for the socket's send buffer size
    (a getsockopt) and slices the data through a Python loop on every call,
    before its first send: about 10 us of a small answer's 0.36 ms under gevent
    (docs/bench-request-path.md). A send that took only part leaves the rest to
    sendall, which waits for room as before.
    """
    sent = sock.send(data)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


_date: tuple[int, str] = (0, "")  # the second it is for, and the header's value


def http_date() -> str:
    """The Date header's value now (RFC 9110's IMF-fixdate), formatted once a second.

    gunicorn formats it for every response through email.utils (3% of a gevent
    worker's samples on a small answer); the value changes once a second. The
    refusals the event loop writes itself (service.host.worker) take it too.
    """
    global _date  # noqa: PLW0603
    now = int(time.time())
    second, value = _date
    if second != now:
        value = email.utils.formatdate(now, usegmt=True)
        _date = (now, value)  # one tuple: a thread reading it sees the old pair or the new one
    return value


def one_write(start_response: Any) -> None:
    """Make the gunicorn Response behind ``start_response`` send its headers with its first body bytes."""
    owner = getattr(start_response, "__self__", None)
    if _CAN_HOLD and type(owner) is Response:
        owner.__class__ = OneWriteResponse

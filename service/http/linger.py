# design:
# - Runs in the request's thread (gthread) or greenlet (gevent), outermost
#   around the app. The drain runs in the answer's close(), which gunicorn
#   calls once the answer is written: the client can already read it while
#   the rest of its body is read here.
# - Bounded in bytes (Settings.linger_bytes) and in time (SERVE_LINGER_MS):
#   each read waits at most for the time left, on the connection's socket
#   (gunicorn's environ["gunicorn.socket"]; its timeout is put back after), so
#   a slow sender holds a thread no longer than that. Under gevent the socket
#   is gevent's and the wait yields to the other greenlets.
# - Past either bound the server closes the connection with the body unread,
#   as it did before: a client still sending may then see a reset.

"""Read the rest of a refused request's body before the connection closes, as nginx's lingering close does.

A request refused before its body is read (413 for a Content-Length over
SERVE_MAX_BODY_BYTES, 401 before the body, the door's 503) is answered while
its client may still be sending. Were the connection closed then, the bytes
still arriving would make the kernel reset it, and a client that sends its
whole body before it reads the answer (Python's urllib, and ``requests`` for
some bodies) would see a broken pipe instead of the status and the JSON error
that names the setting to change. So an answer of 400 or more to a request
with a body reads and discards what is left of it, up to a bound in bytes and
in time; a body that was read already costs one empty read.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from service.http.access import WsgiApp
from service.http.arrival import HOLD_ENVIRON_KEY
from service.http.resend import REFUSED_DIGEST_ENVIRON_KEY, digester

log = logging.getLogger(__name__)

_CHUNK = 64 << 10


class Linger:
    """WSGI middleware: after an error answer, the request body's rest is read (bounded) before the close."""

    def __init__(self, app: WsgiApp, max_bytes: int, max_s: float) -> None:
        self._app = app
        self._max_bytes = max_bytes
        self._max_s = max_s

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if self._max_s <= 0 or not has_body(environ):
            return self._app(environ, start_response)
        status = ""

        def start(given: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            nonlocal status
            status = given
            return start_response(given, headers, exc_info)

        answer = self._app(environ, start)
        if status[:1] not in ("4", "5"):
            return answer
        declared = environ.get("CONTENT_LENGTH")
        if declared and declared.isdigit() and int(declared) > self._max_bytes:
            return answer  # it cannot be read to its end within the bound: close at once
        return _Lingering(answer, environ, self._max_bytes, self._max_s)


def has_body(environ: dict[str, Any]) -> bool:
    """Whether the request declares a body: a Content-Length above 0, or chunked."""
    length = environ.get("CONTENT_LENGTH")
    if length and length != "0":
        return True
    return "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()


def discard_body(environ: dict[str, Any], max_bytes: int, max_s: float) -> bool:
    """Read and drop the rest of the request body; whether it was read to its end within the bounds.

    A refused request whose connection is held, and whose body nothing read
    before, leaves the digest of what was drained, read to its end, for its
    connection to tell a resend from a new request (service.http.resend).
    """
    stream = environ.get("wsgi.input")
    if stream is None:
        return True
    held = HOLD_ENVIRON_KEY in environ and REFUSED_DIGEST_ENVIRON_KEY not in environ
    whole = digester() if held else None
    drained = _drain(environ, stream, max_bytes, max_s, whole)
    if drained and whole is not None:
        environ[REFUSED_DIGEST_ENVIRON_KEY] = whole.digest()
    return drained


def _drain(
    environ: dict[str, Any], stream: Any, max_bytes: int, max_s: float, whole: hashlib.blake2b | None
) -> bool:
    sock = environ.get("gunicorn.socket")
    deadline = time.monotonic() + max_s
    prior = sock.gettimeout() if sock is not None else None
    left = max_bytes
    try:
        while left > 0:
            if sock is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                sock.settimeout(remaining)
            chunk = stream.read(min(_CHUNK, left))
            if not chunk:
                return True
            if whole is not None:
                whole.update(chunk)
            left -= len(chunk)
        return not stream.read(1)
    except TimeoutError:  # socket.timeout, gevent's included
        log.debug("a refused request's body was still arriving after %.1f s; closing", max_s)
        return False
    except Exception:  # a client gone, or a malformed chunk: the server closes the connection
        log.debug("the refused request's body could not be read to its end", exc_info=True)
        return False
    finally:
        if sock is not None:
            with contextlib.suppress(OSError):  # closed under us
                sock.settimeout(prior)


class _Lingering:
    """An answer whose close() also reads the rest of its request's body."""

    def __init__(
        self, answer: Iterable[bytes], environ: dict[str, Any], max_bytes: int, max_s: float
    ) -> None:
        self._answer = answer
        self._environ = environ
        self._max_bytes = max_bytes
        self._max_s = max_s

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._answer)

    def close(self) -> None:
        try:
            close = getattr(self._answer, "close", None)
            if close is not None:
                close()
        finally:
            discard_body(self._environ, self._max_bytes, self._max_s)

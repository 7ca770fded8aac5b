"""An HTTP/1.1 request read whole from a buffer where it is plain enough to skip the full parser. Pure.

Under overload the gthread worker's event loop checks kept-alive requests at
the door itself (service.host.worker), from bytes it peeked at on the socket,
and answers a refusal there: no request thread, no gunicorn parser, no WSGI
environ. That is worth it only for the common case, so this reads only what
needs no judgement: one request, its line, headers and ``Content-Length``
body all in the buffer. Anything else (chunked bodies, ``Expect``,
``Connection: close``, HTTP/1.0, escaped paths, folded or odd header lines,
control characters or a lone CR or LF, header names with underscores, which
gunicorn drops) is None, and the request goes the usual way, where gunicorn's
parser and its rules apply: the two must never disagree on where a request ends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Heads longer than this, or with more header lines, go the usual way (gunicorn's
# own limits then apply: 4,094 bytes a request line, 100 headers).
MAX_HEAD_BYTES = 4096
MAX_HEADERS = 100
# Longer digit strings are no sane header number (and int() refuses past 4,300 digits).
MAX_NUMBER_DIGITS = 15
# A control character, or a CR or LF that is not part of a CRLF: gunicorn answers
# 400 and closes; left to it, so that the two never disagree on where a request ends.
_NOT_PLAIN_BYTES = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)|(?<!\r)\n")
_TOKEN = frozenset(b"!#$%&'*+-.^`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
# Headers whose presence means more than a plain request: left to gunicorn.
_NOT_PLAIN = frozenset({"TRANSFER_ENCODING", "EXPECT", "UPGRADE"})


@dataclass(frozen=True, slots=True)
class RequestHead:
    # The WSGI environ's keys the line and headers give: REQUEST_METHOD,
    # PATH_INFO, QUERY_STRING, CONTENT_LENGTH, CONTENT_TYPE and HTTP_*.
    environ: dict[str, str]
    body: bytes
    # The request's bytes in the buffer, head and body.
    size: int


def read_head(data: bytes) -> RequestHead | None:
    """The request at the start of ``data``, if it is whole and plain; None otherwise."""
    end = data.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES)
    lines = data[:end].split(b"\r\n") if end >= 0 and not _NOT_PLAIN_BYTES.search(data, 0, end) else []
    environ = _request_line(lines[0]) if 1 <= len(lines) <= MAX_HEADERS + 1 else None
    if environ is None or not _add_headers(environ, lines[1:]):
        return None
    if "close" in environ.get("HTTP_CONNECTION", "").lower():
        return None  # the answer must close the connection: gunicorn's way
    length = header_number(environ.get("CONTENT_LENGTH", "0"))
    if length is None:
        return None
    start = end + 4
    size = start + length
    if len(data) < size:
        return None  # the body is not all here yet
    return RequestHead(environ, data[start:size], size)


def header_number(raw: str | None) -> int | None:
    """A header's whole number, or None when it is not one of at most MAX_NUMBER_DIGITS ASCII digits."""
    if raw and raw.isascii() and raw.isdigit() and len(raw) <= MAX_NUMBER_DIGITS:
        return int(raw)
    return None


def _request_line(line: bytes) -> dict[str, str] | None:
    parts = line.split(b" ")
    if len(parts) != 3 or parts[2] != b"HTTP/1.1" or not parts[0] or not _TOKEN.issuperset(parts[0]):
        return None
    target = parts[1]
    # Only an origin-form target with nothing escaped: PATH_INFO is then the path as sent.
    if not target.startswith(b"/") or b"%" in target or b"#" in target or not target.isascii():
        return None
    path, _, query = target.decode("ascii").partition("?")
    return {"REQUEST_METHOD": parts[0].decode("ascii"), "PATH_INFO": path, "QUERY_STRING": query}


def _add_headers(environ: dict[str, str], lines: list[bytes]) -> bool:
    """Add the header ``lines`` to ``environ`` as WSGI names them; False where one is not plain."""
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or not _TOKEN.issuperset(name) or b"_" in name:
            return False
        key = name.decode("ascii").upper().replace("-", "_")
        if key in _NOT_PLAIN:
            return False
        text = value.strip(b" \t").decode("latin-1")
        if key not in ("CONTENT_LENGTH", "CONTENT_TYPE"):
            key = "HTTP_" + key
        if key not in environ:
            environ[key] = text
        elif key in ("CONTENT_LENGTH", "CONTENT_TYPE", "HTTP_HOST"):
            return False  # repeated where only one may be
        else:
            environ[key] += "," + text
    return True

"""HTTP/1.1 responses read off a raw, kept-alive socket, for tests that need the connection itself."""

from __future__ import annotations

import socket


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response's head and body, read by its Content-Length so the connection stays usable.

    Fails the test if the server closes the connection before the whole answer is in.
    """
    data = b""
    while b"\r\n\r\n" not in data:
        data += _received(sock, data)
    head, _, body = data.partition(b"\r\n\r\n")
    fields = (line.partition(b":") for line in head.split(b"\r\n")[1:])
    length = next(int(value) for name, _, value in fields if name.strip().lower() == b"content-length")
    while len(body) < length:
        body += _received(sock, head + body)
    return head, body


def _received(sock: socket.socket, so_far: bytes) -> bytes:
    chunk = sock.recv(65536)
    assert chunk, f"the server closed the connection before its answer was complete: {so_far!r}"
    return chunk

"""service.host.one_write: gunicorn's own request parser and Response, over a real socket pair."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from gunicorn.config import Config
from gunicorn.http import wsgi
from gunicorn.http.parser import RequestParser

from service.host.one_write import JOIN_MAX_BYTES, OneWriteResponse, one_write

Pair = tuple[socket.socket, socket.socket]


class Recording:
    """A socket that keeps the bytes of each send and sendall, and passes them on."""

    def __init__(self, sock: socket.socket, send_at_most: int | None = None) -> None:
        self._sock = sock
        self.sent: list[bytes] = []
        self._send_at_most = send_at_most  # a send that takes only this much: a full send buffer

    def send(self, data: bytes) -> int:
        taken = self._sock.send(data[: self._send_at_most])
        self.sent.append(bytes(data[:taken]))
        return taken

    def sendall(self, data: bytes) -> None:
        self.sent.append(bytes(data))
        self._sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


@pytest.fixture
def pair() -> Iterator[Pair]:
    server, client = socket.socketpair()
    yield server, client
    server.close()
    client.close()


def respond(
    pair: Pair,
    request: bytes,
    headers: list[tuple[str, str]],
    body: list[bytes],
    send_at_most: int | None = None,
) -> tuple[Recording, bytes]:
    """Parse ``request`` as gunicorn does, answer it through a joined Response; what was sent, and read."""
    server, client = pair
    client.sendall(request)
    cfg = Config()
    req = next(iter(RequestParser(cfg, server, ("127.0.0.1", 5000))))
    sock = Recording(server, send_at_most)
    resp, _ = wsgi.create(req, sock, ("127.0.0.1", 5000), ("127.0.0.1", 8000), cfg)
    one_write(resp.start_response)
    assert type(resp) is OneWriteResponse
    resp.start_response("200 OK", headers)
    for chunk in body:
        resp.write(chunk)
    resp.close()
    client.settimeout(2)
    received = b""
    while sum(len(s) for s in sock.sent) > len(received):
        received += client.recv(65536)
    return sock, received


@pytest.mark.parametrize(
    ("send_at_most", "writes"), [(None, 1), (10, 2)], ids=["one write", "a send that takes part"]
)
def test_headers_and_a_body_go_in_one_write_or_a_send_and_the_rest(
    pair: Pair, send_at_most: int | None, writes: int
) -> None:
    body = b'{"outputs": [[0.5]]}'
    sock, received = respond(
        pair,
        b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
        [body],
        send_at_most=send_at_most,  # 10: a full send buffer, so sendall sends the rest
    )
    assert len(sock.sent) == writes
    if send_at_most is not None:
        assert len(sock.sent[0]) == send_at_most  # the send's part, then the rest
    head, _, rest = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Length: 20" in head
    assert rest == body


def test_a_body_in_parts_sends_the_first_with_the_headers_and_the_rest_after(
    pair: Pair,
) -> None:
    sock, received = respond(
        pair,
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        [("Content-Length", "10")],
        [b"hello", b"world"],
    )
    assert [s.endswith(b"hello") for s in sock.sent] == [True, False]
    assert sock.sent[1] == b"world"
    assert received.endswith(b"\r\n\r\nhelloworld")


def test_a_large_body_goes_after_its_headers_rather_than_be_copied(pair: Pair) -> None:
    body = b"x" * (JOIN_MAX_BYTES + 1)
    sock, received = respond(
        pair, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", [("Content-Length", str(len(body)))], [body]
    )
    assert len(sock.sent) == 2 and sock.sent[0].endswith(b"\r\n\r\n") and sock.sent[1] == body
    assert received.endswith(b"\r\n\r\n" + body)


def test_a_head_request_gets_its_headers_and_no_body(pair: Pair) -> None:
    sock, received = respond(
        pair, b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n", [("Content-Length", "5")], [b"hello"]
    )
    assert len(sock.sent) == 1
    assert received.startswith(b"HTTP/1.1 200 OK\r\n")
    assert received.endswith(b"Content-Length: 5\r\n\r\n")


def test_a_body_longer_than_its_content_length_is_cut_and_the_headers_still_go(
    pair: Pair,
) -> None:
    _, received = respond(pair, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", [("Content-Length", "2")], [b"hello"])
    assert received.endswith(b"Content-Length: 2\r\n\r\nhe")


def test_a_chunked_body_takes_gunicorns_own_path(pair: Pair) -> None:
    sock, received = respond(pair, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", [], [b"hello", b"world"])
    assert sock.sent[0].endswith(b"\r\n\r\n")  # the headers alone, as gunicorn sends them
    assert b"Transfer-Encoding: chunked" in sock.sent[0]
    assert received.endswith(b"5\r\nhello\r\n5\r\nworld\r\n0\r\n\r\n")


def test_no_body_at_all_sends_the_headers_at_close(pair: Pair) -> None:
    sock, received = respond(pair, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", [("Content-Length", "0")], [])
    assert len(sock.sent) == 1
    assert received.endswith(b"Content-Length: 0\r\n\r\n")


def test_a_start_response_not_of_gunicorn_is_left_alone() -> None:
    class OtherServersResponse:
        def start_response(self, status: str, headers: list[tuple[str, str]]) -> None:
            pass

    other = OtherServersResponse()
    one_write(other.start_response)  # a test client's or another server's: nothing to switch
    one_write(lambda status, headers: None)
    assert type(other) is OtherServersResponse


def test_a_gunicorn_without_the_body_hook_keeps_its_own_two_writes(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("service.host.one_write._CAN_HOLD", False)
    server, client = pair
    client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    cfg = Config()
    req = next(iter(RequestParser(cfg, server, ("127.0.0.1", 5000))))
    resp, _ = wsgi.create(req, server, ("127.0.0.1", 5000), ("127.0.0.1", 8000), cfg)
    one_write(resp.start_response)
    assert type(resp) is wsgi.Response


@pytest.mark.parametrize(
    ("request_head", "headers"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", [("Content-Length", "5")]),  # keep-alive
        (b"GET / HTTP/1.0\r\n\r\n", [("Content-Length", "5")]),  # close
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", []),  # chunked
    ],
)
def test_the_first_header_lines_are_gunicorns_own_with_the_date_made_once_a_second(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, request_head: bytes, headers: list[tuple[str, str]]
) -> None:
    server, client = pair
    client.sendall(request_head)
    cfg = Config()
    req = next(iter(RequestParser(cfg, server, ("127.0.0.1", 5000))))
    resp, _ = wsgi.create(req, server, ("127.0.0.1", 5000), ("127.0.0.1", 8000), cfg)
    one_write(resp.start_response)
    resp.start_response("200 OK", headers)
    for now in (1_700_000_000.2, 1_700_000_000.9, 1_700_000_001.0, 1_700_000_000.5):
        monkeypatch.setattr(time, "time", lambda now=now: now)  # gunicorn's clock too
        assert resp.default_headers() == wsgi.Response.default_headers(resp)

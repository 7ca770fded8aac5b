"""Requests plain enough for the event loop to check without gunicorn's parser, and those left to it."""

from __future__ import annotations

import pytest

from service.http.request_head import MAX_HEAD_BYTES, MAX_HEADERS, read_head

BODY = b'{"inputs": ["a"]}'


def request(head: bytes, body: bytes = BODY) -> bytes:
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def test_a_whole_request_gives_its_environ_body_and_size() -> None:
    data = request(
        b"POST /embed?model=minilm HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"X-Request-Start: t=1.5\r\nX-Request-ID:  abc \r\n"
    )
    head = read_head(data + b"GET /next HTTP/1.1\r\n")  # the next request's start stays unread
    assert head is not None
    assert head.environ == {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/embed",
        "QUERY_STRING": "model=minilm",
        "HTTP_HOST": "test",
        "CONTENT_TYPE": "application/json",
        "HTTP_X_REQUEST_START": "t=1.5",
        "HTTP_X_REQUEST_ID": "abc",
        "CONTENT_LENGTH": str(len(BODY)),
    }
    assert head.body == BODY
    assert head.size == len(data)


def test_tabs_in_values_and_a_hundred_headers_are_plain() -> None:
    head = read_head(request(b"POST /p HTTP/1.1\r\nX-A: a\tb\r\n" + b"X-B: b\r\n" * (MAX_HEADERS - 2)))
    assert head is not None and head.environ["HTTP_X_A"] == "a\tb"


def test_repeated_headers_are_joined_as_wsgi_joins_them() -> None:
    head = read_head(request(b"POST /p HTTP/1.1\r\nAccept: a\r\nAccept: b\r\n"))
    assert head is not None and head.environ["HTTP_ACCEPT"] == "a,b"


def test_a_request_without_a_body_is_whole_at_its_blank_line() -> None:
    head = read_head(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (
        head is not None and head.body == b"" and head.size == len(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    )


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"POST /p HTTP/1.1\r\nHost: x\r\n", id="head not all in"),
        pytest.param(request(b"POST /p HTTP/1.1\r\n")[:-3], id="body not all in"),
        pytest.param(request(b"POST /p HTTP/1.0\r\n"), id="HTTP/1.0"),
        pytest.param(request(b"POST http://h/p HTTP/1.1\r\n"), id="absolute form"),
        pytest.param(request(b"POST /a%20b HTTP/1.1\r\n"), id="escaped path"),
        pytest.param(request(b"POST /p  HTTP/1.1\r\n"), id="odd request line"),
        pytest.param(request(b"POST /p HTTP/1.1\r\nTransfer-Encoding: chunked\r\n"), id="chunked"),
        pytest.param(request(b"POST /p HTTP/1.1\r\nExpect: 100-continue\r\n"), id="expect"),
        pytest.param(request(b"POST /p HTTP/1.1\r\nConnection: close\r\n"), id="connection close"),
        pytest.param(request(b"POST /p HTTP/1.1\r\nUpgrade: h2c\r\n"), id="upgrade"),
        pytest.param(request(b"POST /p HTTP/1.1\r\nX_Forwarded: a\r\n"), id="underscore in a name"),
        pytest.param(request(b"POST /p HTTP/1.1\r\nBad Name: a\r\n"), id="space in a name"),
        pytest.param(request(b"POST /p HTTP/1.1\r\nX-A: a\r\n folded\r\n"), id="folded line"),
        pytest.param(request(b"POST /p HTTP/1.1\r\nContent-Length: 3\r\n"), id="two lengths"),
        pytest.param(b"POST /p HTTP/1.1\r\nContent-Length: -1\r\n\r\n", id="negative length"),
        pytest.param(b"POST /p HTTP/1.1\r\nX-Long: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n", id="long head"),
        pytest.param(request(b"POST /p HTTP/1.1\r\nX-A: a\nContent-Length: 5\r\n"), id="bare LF"),
        pytest.param(request(b"POST /p HTTP/1.1\r\nX-A: a\rb\r\n"), id="bare CR"),
        pytest.param(request(b"POST /p HTTP/1.1\r\nX-A: a\x00b\r\n"), id="NUL in a value"),
        pytest.param(request(b"POST /p HTTP/1.1\r\nX-A: a\x7fb\r\n"), id="DEL in a value"),
        pytest.param(request(b"POST /p\x01 HTTP/1.1\r\n"), id="control in the path"),
        pytest.param(b"POST /p HTTP/1.1\r\nContent-Length: " + b"0" * 5000 + b"\r\n\r\n", id="5000 digits"),
        pytest.param(
            request(b"POST /p HTTP/1.1\r\n" + b"X-A: a\r\n" * (MAX_HEADERS + 1)), id="too many headers"
        ),
    ],
)
def test_anything_not_whole_and_plain_is_left_to_gunicorns_parser(data: bytes) -> None:
    assert read_head(data) is None

"""The kernel's view of when a request's bytes arrived (service.host.tcp_info), on real sockets."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from service.host.tcp_info import since_last_data
from service.host.worker import kernel_arrival

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="TCP_INFO's layout is Linux's")


def test_the_wait_in_the_accept_queue_is_seen() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()) as client:
        client.sendall(b"POST / HTTP/1.1\r\n\r\n")
        time.sleep(0.3)  # unaccepted meanwhile
        conn, _ = listener.accept()
        with conn:
            since = since_last_data(conn)
            assert since is not None and 0.25 <= since <= 2.0
            # The worker stamped it only now; the kernel's time is the earlier.
            now = time.monotonic()
            assert kernel_arrival(now, conn) <= now - 0.25  # type: ignore[operator]
            client.sendall(b"next")
            time.sleep(0.05)
            assert since_last_data(conn) <= 0.2  # type: ignore[operator]
            # An earlier stamp of the worker's stands.
            assert kernel_arrival(now - 10, conn) == now - 10


def test_a_socket_that_is_not_tcp_says_nothing() -> None:
    left, right = socket.socketpair()
    with left, right:
        assert since_last_data(left) is None
        assert kernel_arrival(12.5, left) == 12.5
        assert kernel_arrival(None, left) is None

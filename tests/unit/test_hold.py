"""HeldConnections, the gthread worker's parking for refused clients' connections: pure, times passed in."""

from __future__ import annotations

import socket

from service.host.hold import HeldConnections, peek


def test_connections_come_back_in_the_order_their_holds_end_with_when_each_began() -> None:
    held: HeldConnections[str] = HeldConnections()
    assert held.seconds_to_next(0.0) is None
    held.hold("a", now=10.0, seconds=2.0)
    held.hold("b", now=10.5, seconds=1.0)
    held.hold("c", now=11.0, seconds=2.0)
    assert len(held) == 3
    assert held.seconds_to_next(10.5) == 1.0  # b's, the first to end
    assert held.due(11.0) == []
    assert held.due(12.0) == [("b", 10.5), ("a", 10.0)]  # b's ended at 11.5, a's at 12
    assert held.seconds_to_next(14.0) == 0.0  # overdue: release at once
    assert held.due(14.0) == [("c", 11.0)]
    assert len(held) == 0


def test_a_stopping_worker_lets_every_hold_go_at_once() -> None:
    held: HeldConnections[int] = HeldConnections()
    for i in range(3):
        held.hold(i, now=0.0, seconds=5.0 + i)
    assert [item for item, _ in held.due(0.1, everything=True)] == [0, 1, 2]


def test_peek_tells_a_resend_from_a_hang_up_without_reading_either() -> None:
    server, client = socket.socketpair()
    with server, client:
        assert peek(server) is None  # nothing yet
        client.sendall(b"POST /predict HTTP/1.1\r\n")
        assert peek(server) == "sent"
        assert server.recv(4, socket.MSG_PEEK) == b"POST"  # still there for the parser
    quiet, hanging = socket.socketpair()
    with quiet:
        hanging.close()
        assert peek(quiet) == "closed"

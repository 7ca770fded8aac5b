"""HeldConnections, the gthread worker's parking for refused clients' connections: pure, times passed in."""

from __future__ import annotations

import socket

from service.host.hold import HeldConnections, peek


def test_connections_come_back_in_the_order_their_holds_end() -> None:
    held: HeldConnections[str] = HeldConnections()
    assert held.seconds_to_next(0.0) is None
    held.hold("a", now=10.0, seconds=2.0)
    held.hold("b", now=10.5, seconds=1.0)
    held.hold("c", now=11.0, seconds=2.0)
    assert len(held) == 3
    assert held.seconds_to_next(10.5) == 1.0  # b's, the first to end
    assert held.due(11.0) == []
    assert held.due(12.0) == ["b", "a"]  # b's ended at 11.5, a's at 12
    assert held.seconds_to_next(14.0) == 0.0  # overdue: release at once
    assert held.due(14.0) == ["c"]
    assert len(held) == 0


def test_a_stopping_worker_lets_every_hold_go_at_once() -> None:
    held: HeldConnections[int] = HeldConnections()
    for i in range(3):
        held.hold(i, now=0.0, seconds=5.0 + i)
    assert held.due(0.1, everything=True) == [0, 1, 2]


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


def test_a_client_refused_again_keeps_its_place_among_the_held() -> None:
    held: HeldConnections[str] = HeldConnections()
    held.ready(held.hold("new", now=5.0, seconds=1.0))
    held.ready(held.hold("again", now=5.5, seconds=1.0, first=1.0))  # first held at 1.0, refused again since
    assert held.let_in(lambda item, before: True) == ["again", "new"]


def test_held_requests_are_let_in_first_held_first_while_they_fit() -> None:
    held: HeldConnections[str] = HeldConnections()
    keys = {name: held.hold(name, now=10.0 + i / 10, seconds=1.0) for i, name in enumerate("abcd")}
    for name in "adc":  # b's client has sent nothing yet
        held.ready(keys[name])
    asked: list[tuple[str, int]] = []

    def fits(item: str, before: int) -> bool:
        asked.append((item, before))
        return before < 2  # room for two

    assert held.let_in(fits) == ["a", "c"]
    assert asked == [("a", 0), ("c", 1), ("d", 2)]  # d did not fit, and nothing after it was asked
    # What was let in is not let go again when its hold would have ended.
    assert held.due(20.0) == ["b", "d"]
    assert len(held) == 0 and held.seconds_to_next(20.0) is None


def test_none_is_let_in_ahead_of_one_held_longer_that_does_not_fit() -> None:
    held: HeldConnections[str] = HeldConnections()
    held.ready(held.hold("old", now=0.0, seconds=1.0))
    held.ready(held.hold("young", now=0.4, seconds=1.0))
    assert held.let_in(lambda item, _: item == "young") == []
    assert len(held) == 2


def test_what_ended_its_hold_or_was_let_go_is_not_let_in() -> None:
    held: HeldConnections[int] = HeldConnections()
    keys = [held.hold(i, now=0.0, seconds=1.0 + i) for i in range(3)]
    for key in keys:
        held.ready(key)
    held.let_go(keys[1])
    held.let_go(keys[1])  # twice: ignored
    assert held.due(1.5) == [0]
    assert held.let_in(lambda item, _: True) == [2]
    assert len(held) == 0 and held.seconds_to_next(0.0) is None and held.due(10.0) == []
    held.ready(keys[2])  # too late: ignored
    assert held.let_in(lambda item, _: True) == []

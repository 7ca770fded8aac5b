"""HeldConnections, the gthread worker's parking for refused clients' connections: pure, times passed in."""

from __future__ import annotations

import socket

from service.host.hold import HeldConnections, let_in, peek


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


def test_a_client_refused_again_keeps_its_place_among_the_held() -> None:
    held: HeldConnections[str] = HeldConnections()
    held.hold("new", now=5.0, seconds=1.0)
    held.hold("again", now=5.5, seconds=1.0, first=1.0)  # first held at 1.0, refused again since
    assert [item for _, item in held.longest_held()] == ["again", "new"]


def test_held_requests_are_let_in_longest_held_first_while_they_fit() -> None:
    held: HeldConnections[str] = HeldConnections()
    sent = {"a": 10.0, "b": None, "c": 10.2, "d": 10.3}  # b's client has sent nothing yet
    for i, name in enumerate(sent):
        held.hold(name, now=10.0 + i / 10, seconds=1.0)
    asked: list[tuple[float, int]] = []

    def fits(waited: float, before: int) -> bool:
        asked.append((round(waited, 3), before))
        return before < 2  # room for two

    let = let_in(held, 10.5, sent.get, fits)
    assert let == [("a", 10.0), ("c", 10.2)]
    assert asked == [(0.5, 0), (0.3, 1), (0.2, 2)]  # d did not fit, and nothing after it was asked
    assert [item for _, item in held.longest_held()] == ["b", "d"]
    # What was let in is not let go again when its hold would have ended.
    assert [item for item, _ in held.due(20.0)] == ["b", "d"]
    assert len(held) == 0 and held.seconds_to_next(20.0) is None


def test_none_is_let_in_ahead_of_one_held_longer_that_does_not_fit() -> None:
    held: HeldConnections[str] = HeldConnections()
    held.hold("old", now=0.0, seconds=1.0)
    held.hold("young", now=0.4, seconds=1.0)
    # The old one has waited too long for the room there is; the young one would fit.
    assert let_in(held, 0.5, {"old": 0.0, "young": 0.4}.get, lambda waited, _: waited < 0.2) == []
    assert len(held) == 2


def test_an_item_let_go_early_leaves_nothing_behind() -> None:
    held: HeldConnections[int] = HeldConnections()
    keys = [held.hold(i, now=0.0, seconds=1.0 + i) for i in range(3)]
    held.let_go(keys[0])
    held.let_go(keys[0])  # twice: ignored
    assert held.seconds_to_next(0.0) == 2.0  # the first still held
    for key in keys[1:]:
        held.let_go(key)
    assert len(held) == 0 and held.seconds_to_next(0.0) is None and held.due(10.0) == []

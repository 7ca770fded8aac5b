"""When a request arrived: nginx's X-Request-Start, bounded, and the worker's own stamp."""

from __future__ import annotations

import pytest

from service.http.arrival import MAX_PROXY_WAIT_S, proxy_wait, settle_wait

NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    "header",
    ["t=1799999998.500", "1799999998.5", "t=1799999998500", "t=1799999998500000", " t=1799999998.5 "],
)
def test_the_proxy_stamp_is_read_in_seconds_milliseconds_or_microseconds(header: str) -> None:
    assert proxy_wait(header, NOW) == pytest.approx(1.5)


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "t=",
        "t=abc",
        "t=nan",
        "t=inf",
        "t=-inf",
        "t=" + "9" * 40,
        f"t={NOW + 5}",
        f"t={NOW - 86_400}",
    ],
)
def test_a_missing_garbled_future_or_absurd_stamp_counts_as_no_wait(header: str | None) -> None:
    assert proxy_wait(header, NOW) == 0.0


def test_a_stamp_up_to_the_bound_is_trusted() -> None:
    assert proxy_wait(f"t={NOW - MAX_PROXY_WAIT_S + 1}", NOW) == pytest.approx(MAX_PROXY_WAIT_S - 1)


def test_the_longer_view_of_the_wait_wins() -> None:
    assert settle_wait(10.0, now=12.0, proxy_waited=0.5) == pytest.approx(2.0)
    assert settle_wait(10.0, now=12.0, proxy_waited=3.0) == pytest.approx(3.0)


def test_without_a_worker_stamp_only_the_proxy_counts() -> None:
    assert settle_wait(None, now=12.0, proxy_waited=0.0) == 0.0
    assert settle_wait("garbage", now=12.0, proxy_waited=0.25) == pytest.approx(0.25)


def test_a_stamp_from_the_future_never_counts_as_negative() -> None:
    assert settle_wait(13.0, now=12.0, proxy_waited=0.0) == 0.0

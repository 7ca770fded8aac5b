"""How long ago the kernel received a connection's last bytes: the wait no stamp of the worker sees.

A request can wait before the worker first sees it: in the listen socket's
accept queue while the workers are busy, or readable in the worker's poller
while its event loop is behind. The worker's own stamp starts only after that,
and the door would take a request that waited seconds there for a fresh one.
At five times capacity the accept queue filled to its 2,048 connections, and
requests admitted from it were answered 20 to 30 s after they were sent
(docs/overload.md). Linux's ``TCP_INFO`` says, for a connected socket, how many
milliseconds ago its last data arrived: for a request read at once, its send
time within a few milliseconds (a body spread over several packets: its last
packet's, so never earlier than it truly arrived). One ``getsockopt`` a request.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

# struct tcp_info (linux/tcp.h): eight one-byte fields, then 32-bit ones;
# tcpi_last_data_recv is the twelfth of those, in milliseconds.
_LAST_DATA_RECV = struct.Struct("=I")
_LAST_DATA_RECV_OFFSET = 8 + 11 * 4
_TCP_INFO = getattr(socket, "TCP_INFO", None)  # Linux only
_SIZE = 104


def since_last_data(sock: Any) -> float | None:
    """Seconds since ``sock``'s last data arrived, as the kernel counts them; None where it cannot say.

    None on a system without ``TCP_INFO`` and on a socket that is not TCP
    (a Unix socket behind a proxy on the same host).
    """
    if _TCP_INFO is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _SIZE)
    except (OSError, AttributeError, ValueError):
        return None
    if len(raw) < _LAST_DATA_RECV_OFFSET + _LAST_DATA_RECV.size:
        return None
    (milliseconds,) = _LAST_DATA_RECV.unpack_from(raw, _LAST_DATA_RECV_OFFSET)
    return float(milliseconds) / 1000

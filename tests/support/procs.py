"""What Linux's /proc says about a process's connections (its workers and memory: scripts.common.procs)."""

from __future__ import annotations

import os
from pathlib import Path

_ESTABLISHED = "01"


def established_connections(pid: int, port: int) -> int:
    """How many TCP connections to local ``port`` the process holds open."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == _ESTABLISHED and fields[9] in inodes:
                count += 1
    return count

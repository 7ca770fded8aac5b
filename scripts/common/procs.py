"""What Linux's /proc says about gunicorn's processes: its workers and their memory."""

from __future__ import annotations

import os
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The pids of a process's children (gunicorn's workers, for the master)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it exited meanwhile
        # The command name, in parentheses, may hold spaces; the parent pid follows it.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return sorted(found)


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process, or None once it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_split_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU a process has used: (0, 0) once it has exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0, 0.0
    # After the parenthesised command name: state, ppid, ... utime and stime are the 12th and 13th.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) / _CLOCK_TICKS, int(fields[12]) / _CLOCK_TICKS


def voluntary_switches(pid: int) -> int:
    """Times any thread of a process gave up its CPU to wait (a lock, the GIL, a socket) so far.

    Summed over the threads alive now: one that has exited takes its count with it.
    """
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0
    for task in tasks:
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
        except OSError:
            continue  # the thread exited meanwhile
    return total

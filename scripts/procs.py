"""What Linux's /proc says about gunicorn's processes: its workers and their memory."""

from __future__ import annotations

from pathlib import Path


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

"""The allocator every worker runs on: jemalloc where the host has it (``SERVE_ALLOCATOR``).

Why: glibc's heap keeps the pages of the largest calls a worker has run. In
bfloat16, where a call's activations are padded to a few shapes, a worker on
glibc steps up by tens of MiB whenever it meets a batch of many long texts, and
sits 40 to 90 MiB above the same worker on jemalloc, which stayed flat from its
first seconds at the same rate (docs/memory.md).

An allocator is chosen when a process starts (``LD_PRELOAD``), before its first
``malloc``. So the gunicorn master that finds jemalloc on the host but not in
its own memory executes itself again with it preloaded, before it opens a socket
or builds the model: the same pid, arguments and descriptors, whoever started it
(``scripts/serve``, plain gunicorn, the image, a Kubernetes pod). Its workers
inherit it through ``fork``. ``decide`` is the pure rule; ``execute`` acts on it.
"""

from __future__ import annotations

import ctypes.util
import functools
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from service.errors import SettingsError

_NAME = "jemalloc"
# Debian's and Ubuntu's package; Alpine's, Fedora's and Homebrew's are named alike.
_PACKAGE_HINT = "libjemalloc2 on Debian and Ubuntu, jemalloc on Fedora and Alpine"


@dataclass(frozen=True)
class Decision:
    """What the master does about its allocator: run on (``preload`` None) or execute again."""

    preload: str | None
    # What /info and the start log say, and why.
    reason: str
    warn: bool = False


def decide(setting: str, loaded: str | None, found: str | None, ld_preload: str) -> Decision:
    """The allocator rule, from what it reads: pure, for the tests.

    ``loaded``: the jemalloc mapped in this process (None: glibc's malloc);
    ``found``: the library the host has (None: none); ``ld_preload``: the
    variable as this process got it, to tell a library that failed to load
    (already named there) from one never tried, so the master executes itself
    again at most once.
    """
    if loaded is not None:
        return Decision(None, f"jemalloc ({loaded})")
    if setting == "system":
        return Decision(None, "system: glibc's malloc (SERVE_ALLOCATOR=system)")
    if found is None:
        missing = f"jemalloc is not installed ({_PACKAGE_HINT})"
        if setting == "jemalloc":
            raise SettingsError(f"SERVE_ALLOCATOR=jemalloc, but {missing}")
        return Decision(
            None,
            f"system: {missing}; a worker's memory may step up with its largest calls (docs/memory.md)",
            warn=True,
        )
    if found in ld_preload.split():
        failed = f"LD_PRELOAD names {found} but it did not load"
        if setting == "jemalloc":
            raise SettingsError(f"SERVE_ALLOCATOR=jemalloc, but {failed}")
        return Decision(None, f"system: {failed}", warn=True)
    return Decision(found, f"preloading {found}: the master executes itself again")


def loaded(maps: str = "/proc/self/maps") -> str | None:
    """The path of the jemalloc this process runs on, or None (glibc's malloc, or no /proc)."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                path = line.rsplit(" ", 1)[-1].strip()
                if f"lib{_NAME}" in os.path.basename(path):
                    return path
    except OSError:
        return None
    return None


@functools.cache
def in_use() -> str:
    """ "jemalloc" or "system": what /info reports for this worker (read once: it cannot change)."""
    return _NAME if loaded() is not None else "system"


def find() -> str | None:
    """The host's jemalloc as the loader finds it (``libjemalloc.so.2``), or None."""
    return ctypes.util.find_library(_NAME)


def choose(setting: str, environ: Mapping[str, str]) -> Decision:
    """``decide`` for this process, from its memory map, the host and its environment."""
    mapped = loaded()
    # find() runs the loader's cache lookup (ldconfig): only where it can change the decision.
    found = find() if mapped is None and setting != "system" else None
    return decide(setting, mapped, found, environ.get("LD_PRELOAD", ""))


def execute(library: str, environ: Mapping[str, str]) -> None:
    """Execute this process again with ``library`` preloaded; does not return."""
    env = dict(environ)
    env["LD_PRELOAD"] = f"{library} {environ.get('LD_PRELOAD', '')}".strip()
    # What was written so far reaches its file before the process image is replaced.
    sys.stdout.flush()
    sys.stderr.flush()
    # orig_argv keeps the interpreter's own options and -m; the interpreter is this one.
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)  # noqa: S606 (this very process)

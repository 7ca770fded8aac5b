"""The allocator rule (service.host.allocator): jemalloc where the host has it, at most one re-execution."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.errors import SettingsError
from service.host import allocator

JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


def test_a_master_on_glibc_with_jemalloc_on_the_host_preloads_it() -> None:
    decision = allocator.decide("auto", loaded=None, found="libjemalloc.so.2", ld_preload="")
    assert decision.preload == "libjemalloc.so.2"
    assert not decision.warn


def test_explicit_jemalloc_preloads_it_too() -> None:
    decision = allocator.decide("jemalloc", loaded=None, found="libjemalloc.so.2", ld_preload="libfoo.so")
    assert decision.preload == "libjemalloc.so.2"


def test_a_master_already_on_jemalloc_runs_on_and_names_the_library() -> None:
    decision = allocator.decide("auto", JEMALLOC, found="libjemalloc.so.2", ld_preload="libjemalloc.so.2")
    assert decision.preload is None
    assert decision.reason == f"jemalloc ({JEMALLOC})"


def test_system_never_preloads() -> None:
    decision = allocator.decide("system", loaded=None, found="libjemalloc.so.2", ld_preload="")
    assert decision.preload is None
    assert "SERVE_ALLOCATOR=system" in decision.reason
    assert not decision.warn


def test_without_the_library_auto_warns_and_names_the_package() -> None:
    decision = allocator.decide("auto", loaded=None, found=None, ld_preload="")
    assert decision.preload is None
    assert decision.warn
    assert "libjemalloc2" in decision.reason


def test_without_the_library_an_explicit_jemalloc_stops_the_service() -> None:
    missing = r"^SERVE_ALLOCATOR=jemalloc, but jemalloc is not installed \(libjemalloc2"
    with pytest.raises(SettingsError, match=missing):
        allocator.decide("jemalloc", loaded=None, found=None, ld_preload="")


def test_a_library_that_failed_to_load_is_not_tried_again() -> None:
    # LD_PRELOAD already names it, yet it is not mapped: executing again would loop.
    decision = allocator.decide("auto", loaded=None, found="libjemalloc.so.2", ld_preload="libjemalloc.so.2")
    assert decision.preload is None
    assert decision.warn
    assert "did not load" in decision.reason
    with pytest.raises(SettingsError, match="did not load"):
        allocator.decide("jemalloc", loaded=None, found="libjemalloc.so.2", ld_preload="libjemalloc.so.2")


def test_loaded_reads_the_memory_map(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0000000000-7f0000001000 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        f"7f0000002000-7f0000003000 r-xp 00001000 08:01 2 {JEMALLOC}\n"
        "7ffd00000000-7ffd00001000 rw-p 00000000 00:00 0 [stack]\n"
    )
    assert allocator.loaded(str(maps)) == JEMALLOC
    maps.write_text("7f0000000000-7f0000001000 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert allocator.loaded(str(maps)) is None
    assert allocator.loaded(str(tmp_path / "absent")) is None

"""The lock files pin every dependency exactly, and the install commands use them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^=\s;]+)$")


def pins(name: str) -> dict[str, str]:
    found = {}
    for raw in (ROOT / name).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-r "):
            continue
        match = PIN.match(line)
        assert match, f"{name}: {line!r} is not an exact name==version pin"
        found[re.sub(r"[-_.]+", "-", match[1]).lower()] = match[2]
    return found


@pytest.mark.parametrize(
    ("direct", "lock"),
    [("requirements.txt", "requirements.lock"), ("requirements-dev.txt", "requirements-dev.lock")],
)
def test_every_direct_pin_is_in_its_lock_at_the_same_version(direct: str, lock: str) -> None:
    locked = pins(lock)
    for package, version in pins(direct).items():
        assert locked.get(package) == version, (
            f"{package}=={version} from {direct} is {locked.get(package)} in {lock}"
        )


def test_the_dev_lock_holds_the_runtime_lock() -> None:
    runtime, dev = pins("requirements.lock"), pins("requirements-dev.lock")
    assert {p: v for p, v in dev.items() if p in runtime} == runtime


def test_the_install_commands_use_the_locks_and_check_them() -> None:
    assert "pip install -q -r requirements.lock" in (ROOT / "scripts/serve").read_text()
    test = (ROOT / "scripts/test").read_text()
    assert "pip install -q -r requirements-dev.lock" in test
    assert "pip check" in test

"""The GPU check's report: checks with their verdicts, sections, and the time each step took.

A run on a short rental of a GPU host must leave a report whatever happens, so
the report is rewritten to its file after every step, a step that raises
becomes a failed check and the next one runs, and a step that would not end
before the run's deadline is not started and is reported as not verified.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None  # None: could not be verified here, and the detail says why
    detail: str


def format_report(
    title: str,
    sections: Sequence[tuple[str, str]],
    checks: Sequence[Check],
    timings: Sequence[tuple[str, float]] = (),
) -> str:
    """The report as markdown: the sections in order, the time each step took, every check's verdict."""
    verdict = {True: "pass", False: "FAIL", None: "not verified"}
    lines = [f"# {title}", ""]
    for heading, body in sections:
        lines += [f"## {heading}", "", body.rstrip(), ""]
    if timings:
        lines += ["## Time", "", "| step | seconds |", "| --- | ---: |"]
        lines += [f"| {name} | {seconds:.0f} |" for name, seconds in timings]
        lines.append("")
    lines += ["## Checks", "", "| check | result | detail |", "| --- | --- | --- |"]
    # A pipe or a line break in a detail would split the table's row.
    lines += [
        f"| {c.name} | {verdict[c.ok]} | {c.detail.replace('|', '/').replace(chr(10), ' ')} |" for c in checks
    ]
    return "\n".join(lines) + "\n"


@dataclass
class Report:
    """What a run has found so far, rewritten to ``out`` as it grows; ``deadline`` on time.monotonic()."""

    title: str
    out: Path | None = None
    deadline: float | None = None
    sections: list[tuple[str, str]] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    timings: list[tuple[str, float]] = field(default_factory=list)

    def left(self) -> float | None:
        """Seconds left before the deadline; None without one."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def add(self, heading: str, body: str) -> None:
        self.sections.append((heading, body))
        self.save()

    def extend(self, checks: list[Check]) -> None:
        self.checks.extend(checks)
        self.save()

    def failed(self) -> bool:
        return any(c.ok is False for c in self.checks)

    def text(self) -> str:
        return format_report(self.title, self.sections, self.checks, self.timings)

    def save(self) -> None:
        if self.out is not None:
            self.out.write_text(self.text())

    def step(self, name: str, need_s: float, run: Callable[[], T]) -> T | None:
        """``run()``, unless less than ``need_s`` is left; an exception it raises becomes a failed check.

        None when the step did not run or raised; the report says which.
        """
        left = self.left()
        if left is not None and left < need_s:
            detail = f"not reached: {max(0.0, left):.0f} s left, the step takes up to {need_s:.0f} s"
            self.extend([Check(name, None, detail)])
            return None
        began = time.monotonic()
        try:
            return run()
        except Exception as exc:  # one step's failure is reported, and the next step runs
            traceback.print_exc()  # the log keeps the whole trace, the report its first line
            first_line = (str(exc).splitlines() or [""])[0]
            self.extend([Check(name, False, f"stopped: {type(exc).__name__}: {first_line}")])
            return None
        finally:
            self.timings.append((name, time.monotonic() - began))
            self.save()

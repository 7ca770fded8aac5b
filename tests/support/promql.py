"""Just enough PromQL for the tests: Grafana's variables filled in, and the metric names a query reads.

promtool (or Prometheus) does the parsing proper; this only lists the names,
which Prometheus 2.42 offers no command to do.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# Grafana fills these in before a query reaches Prometheus.
_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b")
_VARIABLE = re.compile(r"\$\{?(\w+)\}?")

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_LABEL_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)\s*\{([^{}]*)\}")
_BY = re.compile(r"\bby\s*\(([^()]*)\)")
_IDENTIFIER = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")
# Operators and modifiers, and the number literals Inf and NaN.
_KEYWORDS = frozenset(
    [
        "and",
        "or",
        "unless",
        "atan2",
        "bool",
        "offset",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "inf",
        "nan",
    ]
)


def from_grafana(expr: str, interval: str = "1m", variables: Mapping[str, str] | None = None) -> str:
    """``expr`` as Grafana sends it: intervals set to ``interval``, each variable to its value in
    ``variables`` (a dashboard's ``all_values``: what "All" sends), else to one that matches any value."""
    chosen = variables or {}
    return _VARIABLE.sub(lambda m: chosen.get(m.group(1), ".+"), _INTERVALS.sub(interval, expr))


def all_values(dashboard: Mapping[str, Any]) -> dict[str, str]:
    """What each of a Grafana dashboard's variables sends when "All" is chosen, where it says."""
    variables = dashboard.get("templating", {}).get("list", [])
    return {v["name"]: v["allValue"] for v in variables if v.get("includeAll") and "allValue" in v}


def selectors(expr: str) -> list[tuple[str, str]]:
    """Each ``name{matchers}`` in ``expr``: the name, and the text between the braces."""
    return _SELECTOR.findall(_STRING.sub(lambda m: m.group(0).replace("{", "(").replace("}", ")"), expr))


def groupings(expr: str) -> list[set[str]]:
    """The labels of each ``by (...)`` in ``expr``."""
    return [{label.strip() for label in labels.split(",") if label.strip()} for labels in _BY.findall(expr)]


def metric_names(expr: str) -> set[str]:
    """The metric (and recorded series) names ``expr`` selects."""
    text = _STRING.sub('""', expr)
    text = _LABEL_MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _LABEL_LISTS.sub(" ", text)
    return {name for name in _IDENTIFIER.findall(text) if name.lower() not in _KEYWORDS}

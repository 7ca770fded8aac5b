"""Just enough PromQL for the tests: Grafana's variables filled in, and the metric names a query reads.

promtool (or Prometheus) does the parsing proper; this only lists the names,
which Prometheus 2.42 offers no command to do.
"""

from __future__ import annotations

import re

# Grafana fills these in before a query reaches Prometheus.
_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b")
_VARIABLE = re.compile(r"\$\{?(\w+)\}?")

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_LABEL_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
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


def from_grafana(expr: str, interval: str = "1m") -> str:
    """``expr`` as Grafana sends it: intervals set to ``interval``, every variable matching anything."""
    return _VARIABLE.sub(".+", _INTERVALS.sub(interval, expr))


def metric_names(expr: str) -> set[str]:
    """The metric (and recorded series) names ``expr`` selects."""
    text = _STRING.sub('""', expr)
    text = _LABEL_MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _LABEL_LISTS.sub(" ", text)
    return {name for name in _IDENTIFIER.findall(text) if name.lower() not in _KEYWORDS}

"""The recording and alert rules in deploy/prometheus/, checked and unit-tested by promtool itself."""

from __future__ import annotations

import pytest
import yaml

from tests.support.prometheus import PROMTOOL, RULE_FILES, RULE_TESTS, SKIP_PROMTOOL, promtool

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason=SKIP_PROMTOOL)

ALERTS = (
    "ServeScrapeDown",
    "ServeHigh5xxRate",
    "ServeShedding",
    "ServeLatencyObjective",
    "ServeWorkersNotReady",
    "ServeBatchThreadFailed",
    "ServeWorkerRestarts",
    "ServeWorkerMemoryGrowing",
)


def rules(kind: str) -> list[dict[str, object]]:
    found = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            found += [rule for rule in group["rules"] if kind in rule]
    return found


def test_rule_files_pass_promtool_check() -> None:
    result = promtool("check", "rules", *RULE_FILES)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("test_file", RULE_TESTS, ids=lambda p: p.name)
def test_rule_unit_tests_pass(test_file: object) -> None:
    result = promtool("test", "rules", test_file)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_wait_a_severity_and_advice() -> None:
    alerts = rules("alert")
    assert sorted(rule["alert"] for rule in alerts) == sorted(ALERTS)
    for rule in alerts:
        assert rule.get("for"), f"{rule['alert']} has no 'for'"
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], rule["alert"]


def test_every_alert_fires_and_stays_quiet_in_the_unit_tests() -> None:
    """Each alert has a test time where it fires and one where it does not."""
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", ()):
                (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    assert firing == set(ALERTS)
    assert quiet == set(ALERTS)


def test_every_recording_rule_is_unit_tested() -> None:
    tested = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            tested |= {check["expr"] for check in case.get("promql_expr_test", ())}
    assert {rule["record"] for rule in rules("record")} <= tested

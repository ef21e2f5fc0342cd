"""The alert and recording rules the chart ships (charts/specserve/files/rules.yaml), checked with
Debian's promtool: syntax, unit tests with a firing and a silent case for every alert, and names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from monitoring.promql import REPO, RULES_FILE, RUNBOOK, promql_metric_names, promtool

from specserve_engine import metric_names

pytestmark = pytest.mark.prometheus

RULES_TEST = Path(__file__).with_name("rules_test.yaml")
RUNBOOK_PREFIX = "https://github.com/specserve/specserve/blob/main/docs/runbook.md#"


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES_FILE.read_text())["groups"] for rule in group["rules"]]


def _alerts() -> list[dict]:
    return [rule for rule in _rules() if "alert" in rule]


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", RULES_FILE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", RULES_TEST)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_catch_a_wrong_threshold(tmp_path: Path) -> None:
    """The unit tests are sharp: the MAL alert with a floor of 1 instead of 2 fails them."""
    broken = RULES_FILE.read_text().replace("          < 2\n", "          < 1\n")
    assert broken != RULES_FILE.read_text()
    chart_files = tmp_path / "charts" / "specserve" / "files"
    chart_files.mkdir(parents=True)
    (chart_files / "rules.yaml").write_text(broken)
    tests_dir = tmp_path / "tests" / "monitoring"
    tests_dir.mkdir(parents=True)
    (tests_dir / "rules_test.yaml").write_text(RULES_TEST.read_text())
    result = promtool("test", "rules", tests_dir / "rules_test.yaml")
    assert result.returncode != 0
    assert "SpecserveLowMeanAcceptedLength" in result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    cases = [
        case
        for test in yaml.safe_load(RULES_TEST.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    ]
    for alert in _alerts():
        name = alert["alert"]
        mine = [case for case in cases if case["alertname"] == name]
        assert any(case.get("exp_alerts") for case in mine), f"{name}: no case where it fires"
        assert any(not case.get("exp_alerts") for case in mine), f"{name}: no case where it stays silent"


def test_recording_rules_are_exactly_the_contracted_names() -> None:
    recorded = [rule["record"] for rule in _rules() if "record" in rule]
    assert sorted(recorded) == sorted(metric_names.RECORDING_RULES)


def test_rules_use_only_known_metric_names() -> None:
    known = metric_names.known_series()
    for rule in _rules():
        unknown = promql_metric_names(rule["expr"]) - known
        assert not unknown, f"{rule.get('alert') or rule.get('record')}: unknown metrics {sorted(unknown)}"


def test_alerts_carry_severity_summary_description_and_a_runbook_section() -> None:
    runbook = RUNBOOK.read_text()
    anchors = {
        re.sub(r"[^a-z0-9-]", "", h.strip().lower().replace(" ", "-"))
        for h in re.findall(r"^## (.+)$", runbook, re.M)
    }
    names = [alert["alert"] for alert in _alerts()]
    assert len(names) == len(set(names)) >= 7
    for alert in _alerts():
        name = alert["alert"]
        assert name.startswith("Specserve"), name
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}, name
        annotations = alert["annotations"]
        assert annotations["summary"] and annotations["description"], name
        url = annotations["runbook_url"]
        assert url == RUNBOOK_PREFIX + name.lower(), name
        assert name.lower() in anchors, f"docs/runbook.md has no section `## {name}`"


def test_metric_name_extraction() -> None:
    expr = (
        "1 + sum by (namespace, bucket)"
        ' (rate(specserve_spec_accepted_tokens_total{bucket="1e3"}[5m] offset 1m))'
        " / on (namespace) group_left (service) (max(vllm:generation_tokens_total) > bool 0.5e3)"
        " or absent(up) unless histogram_quantile(0.9, sum by (le) (rate(x_bucket[$__rate_interval])))"
    )
    assert promql_metric_names(expr) == {
        "specserve_spec_accepted_tokens_total",
        "vllm:generation_tokens_total",
        "up",
        "x_bucket",
    }


def test_rules_file_lives_inside_the_chart() -> None:
    # helm's .Files only reads files inside the chart: the rules must not move out of it.
    assert RULES_FILE.is_relative_to(REPO / "charts" / "specserve")

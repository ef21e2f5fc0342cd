"""The Grafana dashboards the chart ships (charts/specserve/files/dashboards/*.json): well formed, every
query parses in Prometheus (promtool) and names only known metrics, and every query returns data from a
real Prometheus holding a synthetic fleet that exports exactly what specserve, vLLM and DCGM export."""

from __future__ import annotations

import json
import re
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from monitoring.promql import DASHBOARDS, promql_metric_names, promtool

from specserve_engine import metric_names
from specserve_operator.local.prometheus import PrometheusProcess
from specserve_testing.prometheus import backfill_openmetrics

pytestmark = pytest.mark.prometheus

VARIABLES = ("namespace", "deployment", "model")
# What the synthetic fleet below holds, for the variables; the parse check uses regexes instead.
VALUES = {"namespace": "ml", "deployment": "llama", "model": "m", "__rate_interval": "2m"}


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target, annotation and variable query."""
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            yield f"annotation {annotation['name']!r}", annotation["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"])
            assert match, f"variable {variable['name']}: expected label_values(selector, label)"
            yield f"variable {variable['name']}", match.group(1)


def _substitute(expr: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_well_formed(path: Path) -> None:
    dashboard = _load(path)
    assert dashboard["id"] is None and dashboard["uid"] and dashboard["title"]
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names[0] == "datasource" and set(VARIABLES) <= set(names)
    ids = [panel["id"] for panel in _panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel.get("description"), f"{panel['title']}: no description"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert "[5m]" not in target["expr"], f"{panel['title']}: use $__rate_interval"


def test_dashboard_uids_and_titles_are_unique() -> None:
    dashboards = [_load(p) for p in DASHBOARDS]
    assert len(dashboards) >= 2
    assert len({d["uid"] for d in dashboards}) == len(dashboards)
    assert len({d["title"] for d in dashboards}) == len(dashboards)


def test_deployment_dashboard_has_the_issue_panels() -> None:
    panels = {p["title"]: p for p in _panels(_load(DASHBOARDS[0].with_name("deployment.json")))}
    assert panels["Mean accepted length per batch bucket"]["type"] == "heatmap"
    for title in (
        "Acceptance per draft position",
        "K in force and recommended per batch bucket",
        "Speculation on/off per pod",
        "Drafter in use",
        "Tokens per engine second, with and without speculation",
        "GPU utilisation",
        "Time per output token",
        "Requests running and waiting",
    ):
        assert title in panels
    annotations = _load(DASHBOARDS[0].with_name("deployment.json"))["annotations"]["list"]
    assert any("specserve_operator_decisions_total" in a.get("expr", "") for a in annotations)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_names_only_known_metrics(path: Path) -> None:
    known = metric_names.known_series()
    for where, expr in _queries(_load(path)):
        names = promql_metric_names(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        assert names <= known, f"{where}: unknown metrics {sorted(names - known)}"


def test_every_query_parses_in_prometheus(tmp_path: Path) -> None:
    """Each query, its variables replaced as Grafana does, becomes a recording rule for `promtool check
    rules`, which parses it with Prometheus' own parser."""
    regexes = dict.fromkeys(VARIABLES, ".*") | {"__rate_interval": "1m"}
    groups = []
    where_by_rule = {}
    for path in DASHBOARDS:
        rules = []
        for i, (where, expr) in enumerate(_queries(_load(path))):
            record = f"dashboard_check:{path.stem}_{i}"
            where_by_rule[record] = f"{path.name}: {where}"
            rules.append({"record": record, "expr": _substitute(expr, regexes)})
        groups.append({"name": path.stem, "rules": rules})
    rules_file = tmp_path / "dashboards.rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": groups}))
    result = promtool("check", "rules", rules_file)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(where_by_rule)} rules found" in result.stdout


# --- every query returns data from a real Prometheus -----------------------------------------------
STEP_S = 15
SPAN_S = 30 * 60


def _synthetic_fleet(end: int) -> str:
    """OpenMetrics text: 30 minutes of one deployment with two pods, as exported by specserve's engine
    plugin and sidecar, the operator, vLLM and DCGM."""
    target = {"namespace": "ml", "service": "llama"}
    pods = ("llama-0", "llama-1")
    series: list[tuple[str, dict[str, str], float, float]] = []  # name, labels, start value, slope per s

    def add(name: str, labels: dict[str, str], slope: float = 1.0, start: float = 0.0) -> None:
        series.append((name, labels, start, slope))

    for pod in pods:
        own = target | {"pod": pod}
        engine = own | {"model_name": "m"}
        for bucket in ("1", "64"):
            for speculating in ("true", "false"):
                labels = engine | {"bucket": bucket, "speculating": speculating}
                add(metric_names.ENGINE_STEPS.series[0], labels, 20)
                add(metric_names.ENGINE_STEP_SECONDS.series[0], labels, 0.5)
                add(metric_names.ENGINE_GENERATED_TOKENS.series[0], labels, 40)
            spec = engine | {"bucket": bucket, "drafter": "eagle3"}
            add(metric_names.SPEC_DRAFTS.series[0], spec, 10)
            add(metric_names.SPEC_DRAFT_TOKENS.series[0], spec, 40)
            add(metric_names.SPEC_ACCEPTED_TOKENS.series[0], spec, 25)
            for position in ("0", "1"):
                add(metric_names.SPEC_DRAFT_TOKENS_PER_POSITION.series[0], spec | {"position": position}, 10)
                add(
                    metric_names.SPEC_ACCEPTED_TOKENS_PER_POSITION.series[0], spec | {"position": position}, 7
                )
            add(metric_names.SIDECAR_K.name, own | {"bucket": bucket}, 0, 4 if bucket == "1" else 0)
        mode = "on" if pod == "llama-0" else "off"
        info = own | {"drafter": "eagle3", "mode": mode, "policy_version": "3"}
        add(metric_names.SIDECAR_POLICY_INFO.name, info, 0, 1)
        add(metric_names.SIDECAR_SWITCHES.series[0], own | {"kind": "k", "result": "applied"}, 0.01)
        _histogram(add, metric_names.SIDECAR_DRAFT_SECONDS.name, own | {"drafter": "eagle3"}, 50)
        _histogram(add, metric_names.VLLM_TPOT_SECONDS, engine, 5)
        add(metric_names.VLLM_GENERATION_TOKENS, engine, 160)
        add(metric_names.VLLM_REQUESTS_RUNNING, engine, 0, 6)
        add(metric_names.VLLM_REQUESTS_WAITING, engine, 0, 1)
        add(metric_names.VLLM_SPEC_DRAFTS, engine, 10)
        add(metric_names.VLLM_SPEC_DRAFT_TOKENS, engine, 40)
        add(metric_names.VLLM_SPEC_ACCEPTED_TOKENS, engine, 25)
        for gpu in ("0", "1"):
            add(metric_names.DCGM_GPU_UTIL, {"namespace": "ml", "pod": pod, "gpu": gpu}, 0, 70)
    operator = {"namespace": "ml", "name": "llama", "action": "disable"}
    add(metric_names.OPERATOR_DECISIONS.series[0], operator, 0.02)
    _histogram(add, metric_names.OPERATOR_TICK_SECONDS.name, {"pod": "specserve-0"}, 0.1)
    recommendation = {"namespace": "ml", "name": "llama", "mode": "advise", "drafter": "eagle3"}
    for bucket, k in (("1", 4), ("64", 0)):
        add(metric_names.OPERATOR_RECOMMENDED_K.name, recommendation | {"bucket": bucket}, 0, k)
    add(metric_names.OPERATOR_PREDICTED_GAIN.name, recommendation, 0, 1.4)

    lines = []
    for name, labels, start, slope in series:
        rendered = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for t in range(end - SPAN_S, end + 1, STEP_S):
            lines.append(f"{name}{{{rendered}}} {start + slope * (t - end + SPAN_S):g} {t}")
    return "\n".join(lines) + "\n# EOF\n"


def _histogram(add: Callable[..., None], name: str, labels: dict[str, str], per_s: float) -> None:
    for le, share in (("0.001", 0.1), ("0.01", 0.6), ("0.1", 0.95), ("+Inf", 1.0)):
        add(f"{name}_bucket", labels | {"le": le}, per_s * share)
    add(f"{name}_sum", labels, per_s * 0.005)
    add(f"{name}_count", labels, per_s)


@pytest.fixture(scope="module")
def fleet_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PrometheusProcess, int]]:
    end = int(time.time()) - 60
    data_dir = tmp_path_factory.mktemp("prometheus") / "data"
    backfill_openmetrics(_synthetic_fleet(end), data_dir)
    prometheus = PrometheusProcess(data_dir=data_dir).start()
    try:
        yield prometheus, end
    finally:
        prometheus.stop()


def _query(prometheus: PrometheusProcess, expr: str, at: int) -> list[dict]:
    url = f"{prometheus.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr, "time": at})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_returns_data_from_a_fleet(
    fleet_prometheus: tuple[PrometheusProcess, int], path: Path
) -> None:
    prometheus, end = fleet_prometheus
    empty = []
    for where, expr in _queries(_load(path)):
        if not _query(prometheus, _substitute(expr, VALUES), end):
            empty.append(where)
    assert not empty, f"queries without data: {empty}"


def test_the_fleet_check_is_sharp(fleet_prometheus: tuple[PrometheusProcess, int]) -> None:
    """A query with a label value the exporters never use finds nothing."""
    prometheus, end = fleet_prometheus
    assert _query(prometheus, 'specserve_engine_steps_total{speculating="true"}', end)
    assert not _query(prometheus, 'specserve_engine_steps_total{speculating="yes"}', end)

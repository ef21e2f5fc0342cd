"""A drafter whose sidecar calls fail is demoted at once: the sidecar counts its errors
(specserve_sidecar_drafter_errors_total), the reader reads their increase per pod and drafter, and the
demotion step demotes a drafter with errors and no accepted draft in the window."""

from __future__ import annotations

import shutil
import time

import pytest

from specserve_engine import metric_names
from specserve_operator.tuner import core, observations
from specserve_operator.tuner.reader import PrometheusReader, spec_query

NS = "ml"
PODS = ("pod-a", "pod-b")


def _errors(pod: str, drafter: str, n: float) -> observations.Row:
    return (observations.DRAFTER_ERRORS, {"namespace": NS, "pod": pod, "drafter": drafter}, n)


def _fleet(spec_factory, rows_for, bucket_load, drafter: str, alphas) -> tuple[core.ResourceView, list]:
    spec = spec_factory()
    view = core.ResourceView(NS, "llm", spec, PODS)
    prior = view.prior(spec.drafters[0])
    loads = {
        "4": bucket_load(batch=3, steps_spec=2000, step_s_spec=prior.step_s(3, 3), k=3),
        "64": bucket_load(batch=50, steps_plain=2000, step_s_plain=prior.step_s(50, 0)),
    }
    return view, [r for pod in PODS for r in rows_for(NS, pod, drafter, loads, alphas=alphas)]


def test_a_failing_drafter_in_force_is_demoted_at_once(spec_factory, rows_for, bucket_load) -> None:
    # The drafter raises on every call: the steps run, nothing is drafted, nothing accepted.
    view, rows = _fleet(spec_factory, rows_for, bucket_load, "draft", alphas=(0.0,) * 8)
    rows = [r for r in rows if r[0] not in (observations.ACCEPTED_POS, observations.PROPOSED_POS)]
    rows = [
        (k, lab, 0.0 if k in (observations.DRAFTS, observations.DRAFT_TOKENS) else v) for k, lab, v in rows
    ]
    rows += [_errors(pod, "draft", 500.0) for pod in PODS]
    snap = observations.build_snapshot(rows, 300.0)
    state = core.ResourceState.initial(view.spec)
    d = core.decide(view, snap, state, core.FleetCosts([view], snap), 0.0)
    assert "draft" in d.demoted and d.drafter == "ngram"
    assert "demoted draft: 1000 failed draft calls" in d.reason
    assert core.DRAFTER_ERRORS in d.warnings


def test_a_drafter_with_errors_but_accepted_drafts_is_not_demoted(
    spec_factory, rows_for, bucket_load
) -> None:
    """A few failed calls among good ones: the drafter works, the MAL floor judges it as usual."""
    view, rows = _fleet(spec_factory, rows_for, bucket_load, "draft", alphas=(0.8,) * 8)
    rows += [_errors("pod-a", "draft", 3.0)]
    snap = observations.build_snapshot(rows, 300.0)
    d = core.decide(view, snap, core.ResourceState.initial(view.spec), core.FleetCosts([view], snap), 0.0)
    assert d.demoted == () and d.drafter == "draft" and core.DRAFTER_ERRORS not in d.warnings


def test_demotions_step_on_its_own(spec_factory) -> None:
    spec = spec_factory()
    drafters = {d.name: d for d in spec.drafters}
    accs = core.measured_acceptance(drafters, [])
    failing = {"ngram": "4 failed draft calls and no accepted draft in the window"}
    out = core.demotions(drafters, accs, {}, {}, spec.speculation, now=10.0, failing=failing)
    assert out.demoted == {"ngram": 10.0} and out.notes == [
        "demoted ngram: 4 failed draft calls and no accepted draft in the window"
    ]
    # Reconsidered after the demotion's time to live, like any other.
    later = core.demotions(drafters, accs, out.demoted, {}, spec.speculation, now=10.0 + core.DEMOTION_TTL_S)
    assert later.demoted == {}


def test_a_drafter_its_sidecar_reports_failed_is_demoted_though_no_error_was_counted(
    spec_factory, rows_for, bucket_load
) -> None:
    """Ten failures between two scrapes, then the sidecar stops calling the drafter: the error counter's
    increase can read 0, but the policy-info metric says the drafter failed."""
    view, rows = _fleet(spec_factory, rows_for, bucket_load, "draft", alphas=(0.8,) * 8)
    rows = [r for r in rows if r[0] != observations.POLICY_INFO]
    for pod in PODS:
        labels = {"namespace": NS, "pod": pod, "drafter": "draft", "mode": "on", "policy_version": "1"}
        rows.append((observations.POLICY_INFO, {**labels, "drafter_status": "failed"}, 1.0))
    snap = observations.build_snapshot(rows, 300.0)
    d = core.decide(view, snap, core.ResourceState.initial(view.spec), core.FleetCosts([view], snap), 0.0)
    assert "draft" in d.demoted and d.drafter == "ngram"
    assert "demoted draft: its sidecar on pod pod-a reports it failed" in d.reason


def test_the_reader_asks_for_the_sidecars_error_counter() -> None:
    assert metric_names.SIDECAR_DRAFTER_ERRORS.series[0] in spec_query(300, 60)


@pytest.mark.prometheus
@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (scripts/setup.sh)")
def test_errors_per_pod_and_drafter_from_a_real_prometheus(prometheus_factory) -> None:
    end = time.time() - 5
    series = metric_names.SIDECAR_DRAFTER_ERRORS.series[0]
    lines = [f"# TYPE {metric_names.SIDECAR_DRAFTER_ERRORS.name} counter"]
    for i in range(41):
        t = end - 600 + i * 15
        lines.append(f'{series}{{namespace="{NS}",pod="pod-a",drafter="draft"}} {40.0 * i} {t:.3f}')
    prom = prometheus_factory(openmetrics="\n".join(lines) + "\n# EOF\n")
    obs = PrometheusReader(prom.url, window_s=300).read().pods[(NS, "pod-a")]
    # 1600 over 600 s: the 300 s window sees half.
    assert obs.drafter_errors["draft"] == pytest.approx(800, rel=0.05)

"""The reader, the observation builder and a decision on what a real engine pod exported: the /metrics of a
real vLLM engine (the sidecar proposer) and its real sidecar, scraped before and after a short load under
n-gram then suffix drafting (tests/tuner/data, recorded by scripts/record_engine_metrics.py). The other
controller tests build their rows from the controller's own formulas; these rows come from the engine."""

from __future__ import annotations

import json
import re
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve_engine import metric_names
from specserve_operator.api.models import SpeculativeServingSpec, SpeculativeServingStatus
from specserve_operator.tuner import core
from specserve_operator.tuner.loop import ResourceTick
from specserve_operator.tuner.reader import PrometheusReader, fleet_queries
from specserve_operator.tuner.report import status_patch

DATA = Path(__file__).resolve().parent / "data"
RECORDING = json.loads((DATA / "recording.json").read_text())
NS, POD = "ml", "engine-0"
HISTORY_S, STEP_S = 600.0, 15.0
# Exported only when they happen (a drafter error) or by someone else's exporter (DCGM).
NOT_ALWAYS_EXPORTED = {metric_names.SIDECAR_DRAFTER_ERRORS.series[0], metric_names.DCGM_GPU_UTIL}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(name: str) -> tuple[Samples, dict[str, str]]:
    """The recorded samples of the series the controller may read, and each series' family type."""
    samples: Samples = {}
    types: dict[str, str] = {}
    known = metric_names.known_series()
    for family in text_string_to_metric_families((DATA / name).read_text()):
        for s in family.samples:
            if s.name in known and family.type in ("counter", "gauge"):
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
                types[s.name] = family.type
    return samples, types


def _queried_series() -> set[str]:
    text = " ".join(fleet_queries(300, 60))
    return set(re.findall(r"(?:increase\(|\(\s*)([A-Za-z_:][\w:]*)(?:\[|\s*\))", text))


def recorded_openmetrics() -> str:
    """The two scrapes as 10 minutes of history of one pod: counters rising linearly from the first scrape
    (a series it lacks: 0, not yet created) to the second, gauges at their last value."""
    end = time.time() - 5
    n = int(HISTORY_S // STEP_S)
    lines: list[str] = []
    for prefix in ("engine", "sidecar"):
        start, _ = _samples(f"{prefix}_start.prom")
        last, types = _samples(f"{prefix}_end.prom")
        families: dict[str, list[str]] = {}
        for (name, labels), value in sorted(last.items()):
            counter = types[name] == "counter"
            family = name.removesuffix("_total") if counter else name
            lab = ",".join(
                f'{k}="{v}"' for k, v in sorted({**dict(labels), "namespace": NS, "pod": POD}.items())
            )
            first = start.get((name, labels), 0.0) if counter else value
            out = families.setdefault(f"{family} {types[name]}", [])
            for i in range(n + 1):
                at = end - HISTORY_S + i * STEP_S
                out.append(f"{name}{{{lab}}} {first + (value - first) * i / n:.6f} {at:.3f}")
        for header, samples in families.items():
            lines.append(f"# TYPE {header}")
            lines.extend(samples)
    return "\n".join([*lines, "# EOF"]) + "\n"


def test_the_real_engine_and_sidecar_export_every_series_the_reader_asks_for() -> None:
    exported = set()
    for name in ("engine_end.prom", "sidecar_end.prom"):
        exported |= {series for series, _ in _samples(name)[0]}
    assert _queried_series() - NOT_ALWAYS_EXPORTED <= exported
    assert metric_names.SPEC_DRAFT_TOKENS_PER_POSITION.series[0] in _queried_series()  # the regex reads them


@pytest.mark.prometheus
@pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="prometheus and promtool are not installed (scripts/setup.sh installs them)",
)
def test_a_decision_from_a_real_engines_metrics_through_a_real_prometheus(prometheus_factory) -> None:
    prom = prometheus_factory(openmetrics=recorded_openmetrics())
    snap = PrometheusReader(prom.url, window_s=300).read()
    assert snap.dropped == {}  # a real engine's counters are consistent
    obs = snap.pods[(NS, POD)]
    # The sidecar's policy info: suffix put in force by the recording's second policy.
    assert (obs.drafter, obs.mode, obs.policy_version) == ("suffix", "on", 3)
    assert set(obs.by_drafter) == {"ngram", "suffix"}
    # Each of the two was also scored in the shadow while the other was in force.
    assert set(obs.shadow) == {"ngram", "suffix"}
    assert all(s.proposed_pos.get(0, 0) > 0 for s in obs.shadow.values())
    # The window sees half of the recorded increase (linear over 600 s, 300 s window).
    end, _ = _samples("engine_end.prom")
    steps = sum(v for (name, _), v in end.items() if name == metric_names.ENGINE_STEPS.series[0])
    seen = sum(b.steps_plain + b.steps_spec for b in obs.buckets.values())
    assert seen == pytest.approx(steps / 2, rel=0.05)
    for drafter, buckets in obs.by_drafter.items():
        pooled = buckets["*"]
        assert pooled.proposed_pos[0] > 0 and 0 < pooled.accepted_pos[0] <= pooled.proposed_pos[0], drafter
    assert obs.fallback is not None and obs.fallback.drafts == pytest.approx(
        sum(b.drafts for b in obs.buckets.values()), rel=0.01
    )
    assert 1.0 < obs.mal < 1.0 + 4

    spec = SpeculativeServingSpec.model_validate(
        {
            "model": {"name": RECORDING["served_model_name"], "source": "pvc://models/tiny-target"},
            "engine": {"image": "engine:test", "gpu": {"count": 1, "product": "NVIDIA-H100"}},
            "drafters": [
                {"name": name, "method": name, "maxSpeculativeTokens": 4, "placement": "sidecar"}
                for name in ("suffix", "ngram")
            ],
            "speculation": {"batchBuckets": RECORDING["buckets"]},
        }
    )
    view = core.ResourceView(NS, "tiny", spec, (POD,))
    state = core.ResourceState.initial(spec)
    d = core.decide(view, snap, state, core.FleetCosts([view], snap), time.time())
    assert d.action != "noData" and d.push
    assert set(d.scores) == {"ngram", "suffix"}  # both measured on the engine's traffic
    patch = status_patch(ResourceTick(d), view, {}, datetime.now(UTC))
    SpeculativeServingStatus.model_validate(json.loads(json.dumps(patch, allow_nan=False)))
    assert 0.0 < patch["fleet"]["acceptanceRate"] <= 1.0

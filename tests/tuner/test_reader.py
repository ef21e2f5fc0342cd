"""The reader against a real Prometheus (Debian's package) holding backfilled fleet history, and against
a Prometheus that is down, slow or answers garbage."""

from __future__ import annotations

import gc
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import REGISTRY

from specserve_engine import metric_names
from specserve_operator.tuner import core, observations
from specserve_operator.tuner import reader as reader_module
from specserve_operator.tuner.policy import expected_tokens
from specserve_operator.tuner.reader import MetricsUnavailable, PrometheusReader, fleet_queries
from specserve_testing.prometheus import openmetrics_phases

pytestmark = pytest.mark.prometheus
needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="prometheus and promtool are not installed (scripts/setup.sh installs them)",
)
NS = "ml"


@pytest.fixture
def fleet_history(rows_for, bucket_load, openmetrics_of):
    """Two pods' last ten minutes: bucket 4 speculating with K=3, bucket 64 plain."""
    loads = {
        "4": bucket_load(batch=3, steps_spec=6000, step_s_spec=0.02, k=3),
        "64": bucket_load(batch=50, steps_plain=3000, step_s_plain=0.03),
    }
    rows = rows_for(NS, "pod-a", "draft", loads, alphas=(0.8, 0.75, 0.5), running=3)
    rows += rows_for(NS, "pod-b", "draft", loads, alphas=(0.8, 0.75, 0.5), running=50)
    end = time.time() - 5
    return rows, openmetrics_of(rows, end - 600, end)


@needs_prometheus
def test_reader_gets_the_whole_fleet_in_four_queries(prometheus_factory, fleet_history) -> None:
    _, text = fleet_history
    prom = prometheus_factory(openmetrics=text)
    reader = PrometheusReader(prom.url, window_s=300)
    snap = reader.read()
    assert reader.queries == len(fleet_queries(300, 60)) == 4
    assert set(snap.pods) == {(NS, "pod-a"), (NS, "pod-b")}
    a = snap.pods[(NS, "pod-a")]
    assert a.drafter == "draft" and a.mode == "on" and a.policy_version == 1
    assert a.running == pytest.approx(3)
    # Counters rose linearly over 600 s; the 300 s window sees half (increase() extrapolates to it).
    spec4, plain64 = a.buckets["4"], a.buckets["64"]
    assert spec4.steps_spec == pytest.approx(3000, rel=0.1)
    assert spec4.seconds_spec / spec4.steps_spec == pytest.approx(0.02, rel=0.02)
    assert spec4.steps_by_k == {3: pytest.approx(spec4.steps_spec)}  # the K the steps verified
    assert plain64.tokens_plain / plain64.steps_plain == pytest.approx(50, rel=0.02)
    assert spec4.draft_tokens / spec4.drafts == pytest.approx(3, rel=0.02)
    assert a.mal == pytest.approx(expected_tokens((0.8, 0.75, 0.5), 3), rel=0.02)
    pooled = a.by_drafter["draft"]["*"]
    assert pooled.accepted_pos[1] / pooled.proposed_pos[1] == pytest.approx(0.6, rel=0.02)


@needs_prometheus
def test_decision_from_a_real_prometheus(prometheus_factory, fleet_history, spec_factory) -> None:
    """The same PromQL the chart's recording rules are built on, evaluated by Prometheus, into a decision."""
    _, text = fleet_history
    prom = prometheus_factory(openmetrics=text)
    spec = spec_factory()
    view = core.ResourceView(NS, "llm", spec, ("pod-a", "pod-b"))
    snap = PrometheusReader(prom.url, window_s=300).read()
    d = core.decide(view, snap, core.ResourceState.initial(spec), core.FleetCosts([view], snap), time.time())
    assert d.action != "noData"
    assert d.k_by_bucket["4"] > 0
    assert d.mean_accepted_length == pytest.approx(expected_tokens((0.8, 0.75, 0.5), 3), rel=0.02)


def _shadow_rows(
    pod: str, drafter: str, drafts: float, alpha: float, k: int, rate: float = 1.0
) -> list[observations.Row]:
    rows: list[observations.Row] = [
        (observations.SHADOW_ROWS, {"namespace": NS, "pod": pod, "drafter": drafter}, drafts / rate)
    ]
    for pos in range(k):
        labels = {"namespace": NS, "pod": pod, "drafter": drafter, "position": str(pos)}
        rows.append((observations.SHADOW_ACCEPTED_POS, labels, drafts * alpha ** (pos + 1)))
        rows.append((observations.SHADOW_PROPOSED_POS, labels, drafts))
    return rows


@pytest.fixture
def mix_change(rows_for, bucket_load):
    """One pod at batch 1 for ten minutes: code-like traffic (α 0.9 for the draft model in force, 0.8 for
    n-gram's shadow drafts), then prose-like for the last 60 s (α 0.3 and 0.05: n-gram finds next to nothing
    to copy in prose, and proposes for a quarter of the rows, where it proposed for 80 % in code)."""

    def phase(span_s: float, alpha: float, shadow_alpha: float, rate: float) -> list[observations.Row]:
        load = bucket_load(batch=1, steps_spec=20 * span_s, step_s_spec=0.02, k=4)
        rows = rows_for(NS, "pod-a", "draft", {"1": load}, alphas=(alpha,) * 4, running=1)
        return rows + _shadow_rows("pod-a", "ngram", 2 * span_s, shadow_alpha, 4, rate)

    end = time.time() - 5
    return openmetrics_phases(
        [(phase(540, 0.9, 0.8, 0.8), end - 600, end - 60), (phase(60, 0.3, 0.05, 0.25), end - 60, end)]
    )


@needs_prometheus
def test_acceptance_follows_a_mix_change_within_its_window(
    prometheus_factory, mix_change, spec_factory
) -> None:
    """Per-position counts, live and shadow, are read over the acceptance window (a fifth of the metrics
    window): a minute after the traffic turned prose-like, acceptance is the prose traffic's, where the
    metrics window still mixes four minutes of code into it; with one window the tuner would speculate on."""
    prom = prometheus_factory(openmetrics=mix_change)
    spec = spec_factory(replicas=1)
    view = core.ResourceView(NS, "llm", spec, ("pod-a",))
    drafters = {d.name: d for d in spec.drafters}
    two = PrometheusReader(prom.url, window_s=300)
    assert two.short_window_s == 60
    snap = two.read()
    obs = snap.pods[(NS, "pod-a")]
    pooled, shadow = obs.by_drafter["draft"]["*"], obs.shadow["ngram"]
    assert pooled.accepted_pos[0] / pooled.proposed_pos[0] == pytest.approx(0.3, rel=0.02)
    assert shadow.accepted_pos[0] / shadow.proposed_pos[0] == pytest.approx(0.05, rel=0.02)
    assert obs.mal == pytest.approx(1 + (4 * 3.0951 + 0.4251) / 5, rel=0.03)  # the totals: 300 s, mixed
    accs = core.measured_acceptance(drafters, [obs])
    assert (accs["draft"].source, accs["ngram"].source) == ("measured", "shadow")
    assert accs["draft"].alphas[0] == pytest.approx(0.3, rel=0.02)
    assert accs["ngram"].alphas[0] == pytest.approx(0.05, rel=0.02)
    assert accs["ngram"].proposal_rate == pytest.approx(0.25, rel=0.02)  # its rows, over the same window
    now = time.time()
    decided = core.decide(view, snap, core.ResourceState.initial(spec), core.FleetCosts([view], snap), now)
    one = PrometheusReader(prom.url, window_s=300, acceptance_window_s=300).read()
    stale = core.decide(view, one, core.ResourceState.initial(spec), core.FleetCosts([view], one), now)
    assert stale.k_by_bucket["1"] > 0 and decided.k_by_bucket["1"] == 0, (stale.reason, decided.reason)


@needs_prometheus
def test_the_batch_mix_now_is_read_over_the_acceptance_window(
    prometheus_factory, rows_for, bucket_load
) -> None:
    """Steps per bucket come over both windows: the metrics window's for step times, the acceptance
    window's for the batch mix that weighs the drafters' scores. Batch 1 for nine minutes, then batch
    12 for the last one: the long window is mostly batch 1, the short one batch 12 alone."""

    def phase(bucket: str, batch: float, span_s: float) -> list[observations.Row]:
        load = bucket_load(batch=batch, steps_spec=20 * span_s, step_s_spec=0.02, k=4)
        return rows_for(NS, "pod-a", "draft", {bucket: load}, alphas=(0.8,) * 4, running=batch)

    end = time.time() - 5
    prom = prometheus_factory(
        openmetrics=openmetrics_phases(
            [(phase("1", 1, 540), end - 600, end - 60), (phase("16", 12, 60), end - 60, end)]
        )
    )
    obs = PrometheusReader(prom.url, window_s=300).read().pods[(NS, "pod-a")]
    assert obs.buckets["1"].steps_spec > 3 * obs.buckets["16"].steps_spec
    assert obs.recent_steps["16"] == pytest.approx(20 * 60, rel=0.3)
    assert obs.recent_steps.get("1", 0.0) < 0.1 * obs.recent_steps["16"]


@needs_prometheus
def test_few_drafts_in_the_acceptance_window_fall_back_to_the_long_one(
    prometheus_factory, rows_for, bucket_load, openmetrics_of, spec_factory
) -> None:
    """Where the acceptance window holds fewer than MIN_DRAFTS per position (little traffic), acceptance
    comes from the metrics window's totals (an i.i.d. α), not from a handful of drafts."""
    load = bucket_load(batch=1, steps_spec=300, step_s_spec=0.02, k=2)  # a draft every 2 s
    rows = rows_for(NS, "p", "draft", {"1": load}, alphas=(0.5, 0.5))
    end = time.time() - 5
    prom = prometheus_factory(openmetrics=openmetrics_of(rows, end - 600, end))
    obs = PrometheusReader(prom.url, window_s=300).read().pods[(NS, "p")]
    assert obs.by_drafter["draft"]["*"].proposed_pos[0] == pytest.approx(30, rel=0.1)
    accs = core.measured_acceptance({d.name: d for d in spec_factory().drafters}, [obs])
    assert accs["draft"].source == "totals"
    assert accs["draft"].tokens(2) == pytest.approx(1.75, rel=0.03)


@needs_prometheus
def test_missing_plugin_falls_back_to_vllm_counters(prometheus_factory) -> None:
    end = time.time() - 5
    lines = []
    for name, total in (("num_drafts", 1000), ("num_draft_tokens", 3000), ("num_accepted_tokens", 1500)):
        lines.append(f"# TYPE vllm:spec_decode_{name} counter")
        for i in range(41):
            t = end - 600 + i * 15
            lines.append(
                f'vllm:spec_decode_{name}_total{{namespace="{NS}",pod="p"}} {total * i / 40} {t:.3f}'
            )
    prom = prometheus_factory(openmetrics="\n".join(lines) + "\n# EOF\n")
    obs = PrometheusReader(prom.url, window_s=300).read().pods[(NS, "p")]
    assert obs.fallback is not None and obs.mal == pytest.approx(2.5, rel=0.02)


# ---- faults -----------------------------------------------------------------------------------------


class _Stub(BaseHTTPRequestHandler):
    delay_s = 0.0
    body = b""
    status = 200

    def do_GET(self) -> None:
        time.sleep(self.delay_s)
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stub_prometheus() -> Iterator:
    servers = []

    def start(body: bytes, delay_s: float = 0.0, status: int = 200) -> str:
        handler = type("Handler", (_Stub,), {"body": body, "delay_s": delay_s, "status": status})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_down() -> None:
    with pytest.raises(MetricsUnavailable) as err:
        PrometheusReader(f"http://127.0.0.1:{_closed_port()}", timeout_s=1).read()
    assert err.value.reason == "PrometheusDown"


def test_prometheus_slow(stub_prometheus) -> None:
    url = stub_prometheus(b'{"status":"success","data":{"resultType":"vector","result":[]}}', delay_s=2.0)
    started = time.monotonic()
    with pytest.raises(MetricsUnavailable) as err:
        PrometheusReader(url, timeout_s=0.3).read()
    assert err.value.reason == "PrometheusSlow"
    assert time.monotonic() - started < 1.9  # gave up at the timeout, no retries inside the tick


@pytest.mark.parametrize(
    "body",
    [
        b"<html>502 Bad Gateway</html>",
        b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{"m":"steps"},"value":[0,"x"]}]}}',
        b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{"pod":"p"},"value":[0,"1"]}]}}',
        b'{"status":"success","data":{"resultType":"scalar","result":[0,"1"]}}',
        b'{"status":"success"}',
        # a label that is not a string, a sample without a value, a value that is not [time, "number"]
        b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{"m":"steps","pod":7},"value":[0,"1"]}]}}',
        b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{"m":"steps"}}]}}',
        b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{"m":"steps"},"value":[0,1]}]}}',
        b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{"m":"steps"},"value":[0,"1",2]}]}}',
        b"[]",
    ],
)
def test_prometheus_garbage(stub_prometheus, body: bytes) -> None:
    with pytest.raises(MetricsUnavailable) as err:
        PrometheusReader(stub_prometheus(body), timeout_s=1).read()
    assert err.value.reason == "PrometheusGarbage"


@needs_prometheus
def test_a_query_prometheus_refuses_is_named_with_its_error(prometheus_factory) -> None:
    """The real Prometheus answers a query it cannot run with HTTP 400 and its errorType and error."""
    reader = PrometheusReader(prometheus_factory(openmetrics="# EOF\n").url, timeout_s=2)
    with pytest.raises(MetricsUnavailable) as err:
        list(reader.query("sum by (pod) ("))
    assert err.value.reason == "PrometheusError"
    assert "HTTP 400, bad_data: " in str(err.value)


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (503, b"Service Unavailable"),  # a proxy in front of Prometheus
        (200, b'{"status":"error","errorType":"timeout","error":"query timed out in expression evaluation"}'),
    ],
)
def test_an_error_answer_is_a_prometheus_error(stub_prometheus, status: int, body: bytes) -> None:
    with pytest.raises(MetricsUnavailable) as err:
        PrometheusReader(stub_prometheus(body, status=status), timeout_s=1).read()
    assert err.value.reason == "PrometheusError"
    assert f"HTTP {status}" in str(err.value)


def test_rows_rejected_at_the_boundary_are_counted(stub_prometheus) -> None:
    labels = '"namespace":"ml","pod":"p","bucket":"4","speculating":"false"'
    result = [
        f'{{"metric":{{"m":"steps",{labels}}},"value":[0,"+Inf"]}}',
        f'{{"metric":{{"m":"step_seconds",{labels}}},"value":[0,"-3"]}}',
        f'{{"metric":{{"m":"tokens",{labels}}},"value":[0,"12"]}}',
    ]
    body = '{"status":"success","data":{"resultType":"vector","result":[' + ",".join(result) + "]}}"
    before = {r: _dropped(r) for r in (observations.DROP_NON_FINITE, observations.DROP_NEGATIVE)}
    snap = PrometheusReader(stub_prometheus(body.encode()), timeout_s=1).read()
    # Each of the four queries got the same answer.
    assert snap.dropped == {observations.DROP_NON_FINITE: 4, observations.DROP_NEGATIVE: 4}
    assert {r: _dropped(r) - n for r, n in before.items()} == snap.dropped


def _dropped(reason: str) -> float:
    return REGISTRY.get_sample_value(metric_names.OPERATOR_DROPPED_ROWS.series[0], {"reason": reason}) or 0.0


def test_an_answers_samples_are_not_tracked_by_the_garbage_collector() -> None:
    """Hundreds of thousands of them live through a large fleet's read: tracked, every collection in the
    tick walked them (docs/policy.md, "How well it does (simulated)", the scale tick)."""
    raw = b'{"metric":{"m":"steps"},"value":[0,"1"]}'
    body = b'{"status":"success","data":{"resultType":"vector","result":[' + raw + b"]}}"
    (sample,) = reader_module._ANSWER.decode(body).data.result
    assert not any(gc.is_tracked(x) for x in (sample, sample.metric, sample.value))


def test_the_reader_leaves_the_garbage_collector_alone(stub_prometheus) -> None:
    """The reader runs in a worker thread: switching the collector off there switches it off for the
    whole operator while the read lasts."""
    seen: list[bool] = []

    class Handler(_Stub):
        body = b'{"status":"success","data":{"resultType":"vector","result":[]}}'

        def do_GET(self) -> None:
            seen.append(gc.isenabled())  # same process: the collector's state while the reader waits
            super().do_GET()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        PrometheusReader(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=2).read()
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [True] * len(fleet_queries(300, 60))


def test_the_operator_tunes_the_collector_once_at_start_up() -> None:
    """Instead, the operator's start-up freezes what it made and collects generation 0 less often (in a
    child process: the setting is process-wide). The collector stays on."""
    script = (
        "import gc; from specserve_operator.tuner.loop import tune_garbage_collector, GC_GEN0_THRESHOLD; "
        "tune_garbage_collector(); "
        "print(gc.isenabled(), gc.get_threshold()[0] == GC_GEN0_THRESHOLD, gc.get_freeze_count() > 0)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "True"]

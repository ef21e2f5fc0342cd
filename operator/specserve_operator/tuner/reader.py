"""Reading the whole fleet from Prometheus: four PromQL queries per tick, however many pods there are.

Each query joins several series with `label_replace(..., "m", KIND, "", "")` and `or`, so one HTTP
round trip returns, for instance, the step count, step seconds and tokens of every pod and bucket;
the `m` label tells the rows apart (observations.build_snapshot folds them). Names come from
specserve_engine.metric_names, the single source shared with the plugin, the dashboards and the rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgspec
import requests
from prometheus_client import Counter

from specserve_engine import metric_names
from specserve_operator.tuner import observations

POD = "namespace, pod"
DROPPED_ROWS = Counter(
    metric_names.OPERATOR_DROPPED_ROWS.name,
    metric_names.OPERATOR_DROPPED_ROWS.help,
    list(metric_names.OPERATOR_DROPPED_ROWS.labels),
)


def _window(window_s: float) -> str:
    return f"{max(1, math.ceil(window_s))}s"


def _tagged(kind: str, expr: str) -> str:
    return f'label_replace({expr}, "m", "{kind}", "", "")'


def _increase(series: str, by: str, window: str) -> str:
    return f"sum by ({by}) (increase({series}[{window}]))"


def engine_query(window_s: float, acceptance_window_s: float) -> str:
    """Steps, step seconds and output tokens per pod, bucket, speculating-or-not, drafter (empty for
    plain steps) and K (the drafts' length the steps verified); and steps per pod and bucket over the
    short window: the batch mix now, which weighs the drafters' scores (docs/policy.md, "Comparing
    drafters")."""
    w, by = _window(window_s), f"{POD}, bucket, speculating, drafter, k"
    steps = metric_names.ENGINE_STEPS.series[0]
    parts = [
        _tagged(observations.STEPS, _increase(steps, by, w)),
        _tagged(observations.STEP_SECONDS, _increase(metric_names.ENGINE_STEP_SECONDS.series[0], by, w)),
        _tagged(observations.TOKENS, _increase(metric_names.ENGINE_GENERATED_TOKENS.series[0], by, w)),
        _tagged(observations.RECENT_STEPS, _increase(steps, f"{POD}, bucket", _window(acceptance_window_s))),
    ]
    return " or ".join(parts)


def spec_query(window_s: float, acceptance_window_s: float) -> str:
    """Drafts, draft tokens and accepted tokens per pod, bucket and drafter; accepted and proposed per
    position per pod and drafter (pooled over buckets: acceptance is a property of traffic, not load);
    failed draft calls per pod and drafter (the sidecar's count of drafter errors); the sidecar's shadow
    drafts per pod, drafter and position, and the rows it shadow-drafted for per pod and drafter (the
    base of a shadow drafter's proposal rate). The per-position counts, live and shadow, cover the short
    acceptance window (observations.acceptance_window_of): they are what the tuner reads acceptance
    from, and acceptance follows the traffic mix within seconds."""
    w, short = _window(window_s), _window(acceptance_window_s)
    by, by_pos, by_drafter = f"{POD}, bucket, drafter", f"{POD}, drafter, position", f"{POD}, drafter"
    parts = [
        _tagged(observations.DRAFTS, _increase(metric_names.SPEC_DRAFTS.series[0], by, w)),
        _tagged(observations.DRAFT_TOKENS, _increase(metric_names.SPEC_DRAFT_TOKENS.series[0], by, w)),
        _tagged(observations.ACCEPTED, _increase(metric_names.SPEC_ACCEPTED_TOKENS.series[0], by, w)),
        _tagged(
            observations.ACCEPTED_POS,
            _increase(metric_names.SPEC_ACCEPTED_TOKENS_PER_POSITION.series[0], by_pos, short),
        ),
        _tagged(
            observations.PROPOSED_POS,
            _increase(metric_names.SPEC_DRAFT_TOKENS_PER_POSITION.series[0], by_pos, short),
        ),
        _tagged(
            observations.DRAFTER_ERRORS,
            _increase(metric_names.SIDECAR_DRAFTER_ERRORS.series[0], by_drafter, w),
        ),
        _tagged(
            observations.SHADOW_ACCEPTED_POS,
            _increase(metric_names.SIDECAR_SHADOW_ACCEPTED.series[0], by_pos, short),
        ),
        _tagged(
            observations.SHADOW_PROPOSED_POS,
            _increase(metric_names.SIDECAR_SHADOW_PROPOSED.series[0], by_pos, short),
        ),
        _tagged(
            observations.SHADOW_ROWS,
            _increase(metric_names.SIDECAR_SHADOW_ROWS.series[0], by_drafter, short),
        ),
    ]
    return " or ".join(parts)


def state_query() -> str:
    """The policy each sidecar has in force, requests running, GPU utilisation (DCGM, where present)."""
    parts = [
        _tagged(
            observations.POLICY_INFO,
            f"max by ({POD}, drafter, mode, policy_version, drafter_status) "
            f"({metric_names.SIDECAR_POLICY_INFO.name})",
        ),
        _tagged(observations.RUNNING, f"sum by ({POD}) ({metric_names.VLLM_REQUESTS_RUNNING})"),
        _tagged(observations.GPU_UTIL, f"avg by ({POD}) ({metric_names.DCGM_GPU_UTIL})"),
    ]
    return " or ".join(parts)


def fallback_query(window_s: float) -> str:
    """vLLM's own spec-decode counters (no buckets): the fallback for pods without the plugin."""
    w = _window(window_s)
    parts = [
        _tagged(observations.VLLM_DRAFTS, _increase(metric_names.VLLM_SPEC_DRAFTS, POD, w)),
        _tagged(observations.VLLM_DRAFT_TOKENS, _increase(metric_names.VLLM_SPEC_DRAFT_TOKENS, POD, w)),
        _tagged(observations.VLLM_ACCEPTED, _increase(metric_names.VLLM_SPEC_ACCEPTED_TOKENS, POD, w)),
    ]
    return " or ".join(parts)


def fleet_queries(window_s: float, acceptance_window_s: float) -> list[str]:
    return [
        engine_query(window_s, acceptance_window_s),
        spec_query(window_s, acceptance_window_s),
        state_query(),
        fallback_query(window_s),
    ]


class MetricsUnavailable(Exception):
    """Prometheus did not answer, answered too slowly, or answered something that is not a vector.
    `reason` is a condition reason (CamelCase); the message says what happened."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# Not tracked by the garbage collector (gc=False: they hold only strings and numbers, so no cycles): a
# large fleet's answer is hundreds of thousands of samples alive at once, and tracked they made every
# collection during the tick walk them.
class _Value(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    time: float
    text: str  # the value as Prometheus writes it: "1.5", "NaN", "+Inf"


class _Sample(msgspec.Struct, gc=False):
    metric: dict[str, str]
    value: _Value


class _Data(msgspec.Struct, rename="camel"):
    result_type: str
    result: list[_Sample]


class _Answer(msgspec.Struct, rename="camel"):
    status: str = ""
    data: _Data | None = None
    error_type: str = "error"
    error: str = ""


# Typed decoding: a large fleet's answer is hundreds of thousands of samples, and decoding them straight
# into structs checks their shape in C, where json.loads and a check per sample took a third longer.
_ANSWER = msgspec.json.Decoder(_Answer)


def _vector_of(url: str, response: requests.Response) -> list[_Sample]:
    """The samples of a query's answer; an error answer, or one that is not an instant vector, raises
    MetricsUnavailable."""
    try:
        answer = _ANSWER.decode(response.content)
    except msgspec.DecodeError as exc:  # not JSON, not UTF-8, or JSON of another shape
        if response.status_code != 200:
            raise MetricsUnavailable("PrometheusError", f"{url}: HTTP {response.status_code}") from exc
        raise MetricsUnavailable("PrometheusGarbage", f"{url}: not an instant vector: {exc}"[:500]) from exc
    if response.status_code != 200 or answer.status != "success":
        # Prometheus's own answer to a bad or failed query: its errorType and error say what went wrong.
        what = f"{answer.error_type}: {answer.error}"
        raise MetricsUnavailable("PrometheusError", f"{url}: HTTP {response.status_code}, {what}"[:500])
    if answer.data is None or answer.data.result_type != "vector":
        kind = answer.data.result_type if answer.data is not None else "no data"
        raise MetricsUnavailable("PrometheusGarbage", f"{url}: expected a vector, got {kind}")
    return answer.data.result


def parse_vector(result: list[_Sample]) -> Iterator[observations.Row]:
    """Rows from an instant vector's samples, one at a time; a value that is not a number, or a sample
    without its kind, raises MetricsUnavailable.

    Each row is folded as it is made and the decoded labels are used in place, so that no second copy of
    the answer lives on for the garbage collector to walk again."""
    for sample in result:
        labels = sample.metric
        try:
            value = float(sample.value.text)
        except ValueError:
            raise MetricsUnavailable("PrometheusGarbage", f"malformed sample {str(sample)[:200]}") from None
        kind = labels.pop("m", None)
        if kind is None:
            raise MetricsUnavailable("PrometheusGarbage", f"sample without a kind: {str(sample)[:200]}")
        yield kind, labels, value


@dataclass
class PrometheusReader:
    """Reads one Prometheus; `queries` counts the HTTP queries made (the batching guarantee is tested).
    Step counters and draft totals cover `window_s`, per-position acceptance `acceptance_window_s`
    (by default observations.acceptance_window_of(window_s)). `evaluation_time`, where given, is the
    time (Unix seconds) each query is evaluated at instead of now: a replay over stored data."""

    url: str
    window_s: float = 300.0
    acceptance_window_s: float | None = None
    timeout_s: float = 5.0
    headers: dict[str, str] | None = None
    evaluation_time: Callable[[], float] | None = None
    queries: int = 0
    _session: requests.Session | None = field(default=None, init=False, repr=False)

    @property
    def short_window_s(self) -> float:
        return self.acceptance_window_s or observations.acceptance_window_of(self.window_s)

    def query(self, promql: str) -> Iterator[observations.Row]:
        self.queries += 1
        if self._session is None:
            # A plain session mounts adapters without retries: the controller backs off between ticks.
            self._session = requests.Session()
        params = {"query": promql}
        if self.evaluation_time is not None:
            params["time"] = f"{self.evaluation_time():.3f}"
        try:
            response = self._session.get(
                f"{self.url.rstrip('/')}/api/v1/query",
                params=params,
                headers=self.headers,
                timeout=self.timeout_s,
            )
        except requests.RequestException as exc:
            # Without retries urllib3 reports a read timeout as a connection error: look at the text.
            if isinstance(exc, requests.Timeout) or "timed out" in str(exc).lower():
                slow = f"{self.url}: no answer within {self.timeout_s:g}s"
                raise MetricsUnavailable("PrometheusSlow", slow) from exc
            raise MetricsUnavailable("PrometheusDown", f"{self.url}: {type(exc).__name__}: {exc}") from exc
        return parse_vector(_vector_of(self.url, response))

    def read(self) -> observations.FleetSnapshot:
        """One snapshot of the whole fleet behind this Prometheus."""
        snapshot = observations.build_snapshot(self._rows(), self.window_s)
        for reason, n in snapshot.dropped.items():
            DROPPED_ROWS.labels(reason).inc(n)
        return snapshot

    def _rows(self) -> Iterator[observations.Row]:
        # One answer at a time, folded as it is parsed (see parse_vector).
        for promql in fleet_queries(self.window_s, self.short_window_s):
            yield from self.query(promql)

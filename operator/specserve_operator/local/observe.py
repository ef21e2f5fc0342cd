"""What the local fleet reads while it runs, for the live view and the report: a few fleet-wide PromQL
queries (grouped by pod, as the controller reads them) plus each sidecar's state over its control API."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from specserve_engine import metric_names
from specserve_engine.api import SidecarState
from specserve_engine.client import SidecarClient, SidecarError
from specserve_operator.local.prometheus import scrape_config
from specserve_operator.local.samples import PodSample

Vector = list[tuple[dict[str, str], float]]


class PrometheusQueryError(RuntimeError):
    pass


async def instant_query(
    session: aiohttp.ClientSession, base_url: str, expr: str, at: float | None = None
) -> Vector:
    """One PromQL instant query; NaN and infinite values are dropped."""
    params = {"query": expr}
    if at is not None:
        params["time"] = f"{at:.3f}"
    try:
        async with session.get(
            f"{base_url}/api/v1/query", params=params, timeout=aiohttp.ClientTimeout(total=5)
        ) as resp:
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise PrometheusQueryError(f"{expr}: {exc!r}") from exc
    if body.get("status") != "success":
        raise PrometheusQueryError(f"{expr}: {body.get('error', body)}")
    out: Vector = []
    for item in body["data"]["result"]:
        value = float(item["value"][1])
        if math.isfinite(value):
            out.append((item["metric"], value))
    return out


def _ratio(num: str, den: str, by: str, window: str, ns: str) -> str:
    sel = f'{{namespace="{ns}"}}'
    return f"sum by ({by}) (increase({num}{sel}[{window}])) / sum by ({by}) (increase({den}{sel}[{window}]))"


def mal_expr(by: str, window: str, namespace: str) -> str:
    """MAL = 1 + Δaccepted / Δdrafts, from the plugin's per-bucket counters, or vLLM's own without them."""
    own = _ratio(
        f"{metric_names.SPEC_ACCEPTED_TOKENS.name}_total",
        f"{metric_names.SPEC_DRAFTS.name}_total",
        by,
        window,
        namespace,
    )
    if "bucket" in by:
        return f"1 + ({own})"
    vllm = _ratio(
        metric_names.VLLM_SPEC_ACCEPTED_TOKENS, metric_names.VLLM_SPEC_DRAFTS, by, window, namespace
    )
    return f"1 + (({own}) or ({vllm}))"


def batch_expr(namespace: str) -> str:
    return f'sum by (pod) ({metric_names.VLLM_REQUESTS_RUNNING}{{namespace="{namespace}"}})'


def tokens_expr(namespace: str, window: str = "10s") -> str:
    return f'sum by (pod) (rate({metric_names.VLLM_GENERATION_TOKENS}{{namespace="{namespace}"}}[{window}]))'


def steps_by_bucket_expr(window: str, namespace: str) -> str:
    steps = f"{metric_names.ENGINE_STEPS.name}_total"
    return f'sum by (bucket) (increase({steps}{{namespace="{namespace}"}}[{window}]))'


def by_label(vector: Vector, label: str) -> dict[str, float]:
    return {labels.get(label, ""): value for labels, value in vector}


@dataclass
class FleetObserver:
    prometheus_url: str
    namespace: str
    sidecars: Mapping[str, SidecarClient]  # pod -> client
    bucket_bounds: tuple[int, ...]
    mal_window: str = "20s"

    async def pods(self, session: aiohttp.ClientSession) -> tuple[PodSample, ...]:
        """One sample of every pod (missing data stays None)."""
        queries = (
            batch_expr(self.namespace),
            tokens_expr(self.namespace),
            mal_expr("pod", self.mal_window, self.namespace),
        )
        results = await asyncio.gather(
            *(instant_query(session, self.prometheus_url, q) for q in queries), return_exceptions=True
        )
        batch, tokens, mal = (by_label(r, "pod") if not isinstance(r, BaseException) else {} for r in results)
        states = await asyncio.gather(*(self._state(c) for c in self.sidecars.values()))
        out = []
        for pod, state in zip(self.sidecars, states, strict=True):
            out.append(
                PodSample(
                    pod=pod,
                    batch_size=batch.get(pod),
                    tokens_per_s=tokens.get(pod),
                    mal=mal.get(pod),
                    drafter=state.drafter if state else None,
                    mode=state.mode if state else None,
                    k_by_bucket=dict(state.k_by_bucket) if state else {},
                    policy_version=state.policy_version if state else None,
                    bucket_bounds=self.bucket_bounds,
                )
            )
        return tuple(out)

    async def _state(self, client: SidecarClient) -> SidecarState | None:
        try:
            return await client.state()
        except SidecarError:
            return None

    async def per_bucket(
        self, session: aiohttp.ClientSession, start: float, end: float
    ) -> tuple[dict[str, float], dict[str, float]]:
        """(MAL per bucket, engine steps per bucket) over [start, end] (Unix seconds), fleet-wide."""
        window = f"{max(1, math.ceil(end - start))}s"
        mal, steps = await asyncio.gather(
            instant_query(session, self.prometheus_url, mal_expr("bucket", window, self.namespace), at=end),
            instant_query(session, self.prometheus_url, steps_by_bucket_expr(window, self.namespace), at=end),
        )
        return by_label(mal, "bucket"), by_label(steps, "bucket")


def scrape_jobs(
    namespace: str, targets: Sequence[tuple[str, str, str]], interval_s: float = 1.0
) -> list[dict]:
    """Prometheus scrape jobs for (pod, container, host:port) targets, labelled as a pod's would be by a
    ServiceMonitor (namespace, pod, container), so the controller's queries work unchanged."""
    return [
        scrape_config(
            f"{pod}-{container}",
            [address],
            interval_s,
            {"namespace": namespace, "pod": pod, "container": container},
        )
        for pod, container, address in targets
    ]

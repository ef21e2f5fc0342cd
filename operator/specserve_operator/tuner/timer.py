"""The controller inside the operator: a kopf timer per SpeculativeServing, all sharing one
FleetController (one fleet read per Prometheus per tick, not one per resource or pod).

The timer fires every SPECSERVE_CONTROLLER_TICK_S seconds; a resource is evaluated when its
`speculation.evaluationInterval` has passed. Ready engine pods and their addresses come from a kopf
index over the pods the operator manages; the sidecar token from the resource's Secret.
"""

from __future__ import annotations

import base64
import os
import time
from typing import Any

import aiohttp
import kopf
from pydantic import ValidationError

from specserve_operator.api.models import GROUP, PLURAL, VERSION, parse_spec
from specserve_operator.kube import KubeApi, KubeError, owner_uids
from specserve_operator.render import children as render
from specserve_operator.tuner import core
from specserve_operator.tuner.loop import FleetController, ResourceTick
from specserve_operator.tuner.report import status_patch

DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
TICK_S = float(os.environ.get("SPECSERVE_CONTROLLER_TICK_S", "5"))  # fixed when the module is imported
ENGINE_POD_LABELS = {
    "app.kubernetes.io/managed-by": "specserve-operator",
    "app.kubernetes.io/component": "engine",
}


@kopf.on.startup()
async def start_controller(memo: kopf.Memo, **_: Any) -> None:
    memo.controller_http = aiohttp.ClientSession()
    url = os.environ.get("SPECSERVE_PROMETHEUS_URL") or DEFAULT_PROMETHEUS_URL
    window_s = float(os.environ.get("SPECSERVE_METRICS_WINDOW_S", "300"))
    memo.controller = FleetController(url, memo.controller_http, window_s=window_s)
    memo.controller_last = {}
    memo.controller_tokens = {}


@kopf.on.cleanup()
async def stop_controller(memo: kopf.Memo, **_: Any) -> None:
    http = getattr(memo, "controller_http", None)
    if http is not None:
        await http.close()


@kopf.index("", "v1", "pods", labels=ENGINE_POD_LABELS)
def engine_pods(
    namespace: str, name: str, labels: kopf.Labels, status: kopf.Status, **_: Any
) -> dict[tuple[str, str], tuple[str, str]] | None:
    """(namespace, resource) → (pod, sidecar URL), for ready pods with an address."""
    resource = labels.get(render.SERVING_LABEL)
    ip = status.get("podIP")
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    if not resource or not ip or not ready:
        return None
    return {(namespace, resource): (name, f"http://{ip}:{render.SIDECAR_PORT}")}


async def _token(memo: kopf.Memo, namespace: str, name: str, uid: str) -> str | None:
    key = (namespace, name)
    if key not in memo.controller_tokens:
        kube: KubeApi = memo.kube
        try:
            secret = await kube.get("v1", "Secret", namespace, render.names(name)["secret"]) or {}
        except KubeError as exc:
            if exc.status != 403:
                raise
            return None  # no Secret access in this namespace (docs/install.md): no sidecar to push to
        if uid not in owner_uids(secret):
            return None  # someone else's Secret: its token is not the resource's (docs/architecture.md)
        raw = (secret.get("data") or {}).get(render.TOKEN_KEY)
        plain = (secret.get("stringData") or {}).get(
            render.TOKEN_KEY
        )  # API servers convert it; fakes may not
        if raw is None and plain is None:
            return None  # not made yet; ask again next tick
        memo.controller_tokens[key] = plain if raw is None else base64.b64decode(raw).decode()
    return memo.controller_tokens[key]


@kopf.timer(GROUP, VERSION, PLURAL, interval=TICK_S, initial_delay=TICK_S)
async def evaluate(
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    name: str,
    namespace: str,
    patch: kopf.Patch,
    memo: kopf.Memo,
    engine_pods: kopf.Index,
    **_: Any,
) -> None:
    try:
        parsed = parse_spec(dict(spec))
    except ValidationError:
        return  # the deploy handler reports an invalid spec; nothing to control
    key = (namespace, name)
    now = time.monotonic()
    if now - memo.controller_last.get(key, -1e18) < parsed.speculation.evaluation_interval_seconds:
        return
    memo.controller_last[key] = now
    pods = sorted(engine_pods.get(key, ()))
    view = core.ResourceView(namespace, name, parsed, tuple(p for p, _ in pods))
    controller: FleetController = memo.controller
    token = await _token(memo, namespace, name, body.metadata.uid)
    tick = await controller.tick(view, dict(pods), token, dict(status))
    _report(body, tick, status)
    if tick.decision is not None and tick.decision.rollout_drafter:
        await _rollout(memo, body, view, tick.decision.rollout_drafter)
    patch.status.update(status_patch(tick, view, dict(status), None))


def _report(body: kopf.Body, tick: ResourceTick, status: kopf.Status) -> None:
    """A Kubernetes Event per decision that changed something, and per metrics outage that starts."""
    if tick.metrics_error is not None:
        was = next((c for c in status.get("conditions") or [] if c.get("type") == "MetricsAvailable"), {})
        if was.get("status") != "False":
            kopf.warn(body, reason="MetricsUnavailable", message=str(tick.metrics_error)[:1000])
        return
    d = tick.decision
    if d is not None and (d.changed or d.action == "noData"):
        message = f"{d.action}: {d.reason}"[:1000]
        action = f"{d.action[:1].upper()}{d.action[1:]}"
        if d.action == "noData":
            kopf.warn(body, reason="NoDecision", message=message)
        elif tick.advice:
            # What auto would do, with the recommended table and gain (nothing was pushed).
            table = ", ".join(f"{b}:{k}" for b, k in d.k_by_bucket.items())
            gain = "unmeasured" if tick.predicted_gain is None else f"{tick.predicted_gain:.2f}x"
            message = f"recommend drafter {d.drafter}, K {table}, predicted gain {gain}; {d.reason}"
            kopf.info(body, reason=f"Advise{action}", message=message[:1000])
        else:
            kopf.info(body, reason=f"Policy{action}", message=message)
    for pod, error in tick.unreachable.items():
        kopf.warn(body, reason="SidecarUnreachable", message=f"{pod}: {error}"[:1000])


async def _rollout(memo: kopf.Memo, body: kopf.Body, view: core.ResourceView, drafter: str) -> None:
    """A drafter the running engines cannot switch to live: the sidecar ConfigMap and the Deployment are
    re-rendered (the operator's render path) with that drafter as the engine's, and applied; the Deployment's
    surge rollout (maxSurge 1, maxUnavailable 0) brings new pods up, each ready (its engine healthy)
    before an old one goes; a new pod's sidecar warms its drafter (warmupRequests) while the engine
    already serves."""
    spec = render.with_active_drafter(view.spec, drafter)
    children = [render.build_deployment(view.name, view.namespace, spec, memo.options)]
    if render.has_sidecar(spec):
        children.insert(0, render.build_config_map(view.name, view.namespace, spec))
    kopf.append_owner_reference(children, owner=body)
    try:
        for child in children:
            await memo.kube.apply(child)
    except KubeError as exc:
        kopf.warn(body, reason="RolloutFailed", message=f"drafter {drafter}: {exc}"[:1000])
        return
    kopf.info(body, reason="Rollout", message=f"surge rollout to drafter {drafter}")

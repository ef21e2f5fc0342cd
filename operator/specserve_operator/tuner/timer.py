"""The controller inside the operator: a kopf timer per SpeculativeServing, all sharing one
FleetController (one fleet read per Prometheus per tick, not one per resource or pod).

The timer fires every SPECSERVE_CONTROLLER_TICK_S seconds; a resource is evaluated when its
`speculation.evaluationInterval` has passed. Ready engine pods and their addresses come from a kopf
index over the pods the operator manages; the sidecar token from the resource's Secret (read again
after a 401 and every TOKEN_TTL_S, made again when it is gone). One resource's failure gives it
DecisionFailed=True and a Warning Event, and never stops the others' ticks; a deleted resource is
forgotten.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf
from pydantic import ValidationError

from specserve_operator import status as resource_status
from specserve_operator.api.models import GROUP, PLURAL, VERSION, parse_spec
from specserve_operator.kube import KubeApi, KubeError, OwnershipConflict, owner_uids
from specserve_operator.reconciler import control_secret
from specserve_operator.render import children as render
from specserve_operator.tuner import core
from specserve_operator.tuner.loop import FleetController, ResourceTick, tune_garbage_collector
from specserve_operator.tuner.report import status_patch

DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
TICK_S = float(os.environ.get("SPECSERVE_CONTROLLER_TICK_S", "5"))  # fixed when the module is imported
# A cached control token is read again this often (a 401 reads it at once): a deleted Secret is made
# again within this time. One GET per resource per period.
TOKEN_TTL_S = 60.0
DECISION_FAILED = "DecisionFailed"

log = logging.getLogger("specserve.tuner")
ENGINE_POD_LABELS = {
    "app.kubernetes.io/managed-by": "specserve-operator",
    "app.kubernetes.io/component": "engine",
}


@kopf.on.startup()
async def start_controller(memo: kopf.Memo, **_: Any) -> None:
    tune_garbage_collector()
    memo.controller_http = aiohttp.ClientSession()
    url = os.environ.get("SPECSERVE_PROMETHEUS_URL") or DEFAULT_PROMETHEUS_URL
    window_s = float(os.environ.get("SPECSERVE_METRICS_WINDOW_S", "300"))
    memo.controller = FleetController(url, memo.controller_http, window_s=window_s)
    memo.controller_last = {}
    memo.controller_tokens = {}
    memo.controller_warned = {}


@kopf.on.cleanup()
async def stop_controller(memo: kopf.Memo, **_: Any) -> None:
    http = getattr(memo, "controller_http", None)
    if http is not None:
        await http.close()


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
async def forget_resource(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """A deleted resource leaves nothing behind in the controller: state, pushed policies, token,
    metric series (a resource made again under the name starts afresh, see also FleetController)."""
    key = (namespace, name)
    memo.controller.forget(key)
    for cache in (memo.controller_last, memo.controller_tokens, memo.controller_warned):
        cache.pop(key, None)


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


@dataclass(frozen=True)
class _CachedToken:
    uid: str  # the resource's: one made again under the same name has a Secret of its own
    token: str
    read_at: float


async def _token(memo: kopf.Memo, body: kopf.Body, status: kopf.Status, *, fresh: bool = False) -> str | None:
    """The resource's control token, read again after TOKEN_TTL_S or when `fresh` (a sidecar answered
    401: the Secret was rotated). The Secret of a deployed resource, when gone, is made again with a new
    token (docs/runbook.md, "Rotating the control token"); the sidecars take it up from their mounted
    file. A resource the reconcile has not deployed (a conflict, an invalid spec) gets nothing made."""
    namespace, name, uid = body.metadata.namespace, body.metadata.name, body.metadata.uid
    key = (namespace, name)
    cached: _CachedToken | None = memo.controller_tokens.get(key)
    now = time.monotonic()
    if not fresh and cached is not None and cached.uid == uid and now - cached.read_at < TOKEN_TTL_S:
        return cached.token
    kube: KubeApi = memo.kube
    try:
        secret = await kube.get("v1", "Secret", namespace, render.names(name)["secret"])
        if secret is None:
            if not resource_status.is_true(status.get("conditions"), resource_status.DEPLOYED):
                return None
            secret, created = await kube.create_if_absent(control_secret(body))
            if created:
                kopf.warn(
                    body,
                    reason="ControlTokenRecreated",
                    message=f"Secret {render.names(name)['secret']} was missing: made again with a new token",
                )
    except OwnershipConflict:
        return None  # someone else's Secret: its token is not the resource's (docs/architecture.md)
    except KubeError as exc:
        if exc.status != 403:
            raise
        return None  # no Secret access in this namespace (docs/install.md): no sidecar to push to
    if uid not in owner_uids(secret):
        return None  # someone else's Secret: its token is not the resource's (docs/architecture.md)
    raw = (secret.get("data") or {}).get(render.TOKEN_KEY)
    plain = (secret.get("stringData") or {}).get(render.TOKEN_KEY)  # API servers convert it; fakes may not
    if raw is None and plain is None:
        return None  # not made yet; ask again next tick
    token = plain if raw is None else base64.b64decode(raw).decode()
    memo.controller_tokens[key] = _CachedToken(uid, token, now)
    return token


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
    if body.metadata.deletion_timestamp:
        return  # its children are being deleted: nothing to tune, no Secret to make again
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
    try:
        token = await _token(memo, body, status) if render.has_sidecar(parsed) else None
        tick = await controller.tick(
            view,
            dict(pods),
            token,
            dict(status),
            uid=body.metadata.uid,
            refresh_token=lambda: _token(memo, body, status, fresh=True),
        )
        update = status_patch(tick, view, dict(status), None) if tick.error is None else {}
    except Exception as exc:  # one resource's failure (the Kubernetes API, a bug) never stops the others
        log.exception("evaluating %s/%s failed", namespace, name)
        tick = ResourceTick(None, error=f"{type(exc).__name__}: {exc}")
    _report_pods(body, tick)
    if tick.error is not None:
        _report_failure(body, tick.error, status, patch)
        return
    _report(body, tick, memo)
    if tick.decision is not None and tick.decision.rollout_drafter:
        await _rollout(memo, body, view, tick.decision.rollout_drafter)
    patch.status.update(update)
    if resource_status.get_condition(status.get("conditions"), DECISION_FAILED) is not None:
        patch.status["conditions"] = resource_status.merge_conditions(
            patch.status["conditions"], [resource_status.condition(DECISION_FAILED, False, "Decided")]
        )


def _report_failure(body: kopf.Body, error: str, status: kopf.Status, patch: kopf.Patch) -> None:
    """DecisionFailed=True with the error, and a Warning Event when the error is new; every pod keeps
    (or is given back) the policy last applied to it."""
    was = resource_status.get_condition(status.get("conditions"), DECISION_FAILED) or {}
    message = f"{error}; the pods keep the policy in force"[:1000]
    if (was.get("status"), was.get("message")) != ("True", message):
        kopf.warn(body, reason=DECISION_FAILED, message=message)
    patch.status["conditions"] = resource_status.merge_conditions(
        status.get("conditions"),
        [resource_status.condition(DECISION_FAILED, True, "Exception", message)],
    )


def _report(body: kopf.Body, tick: ResourceTick, memo: kopf.Memo) -> None:
    """A Kubernetes Event per decision that changed something; a Warning Event when a metrics outage
    starts, and when a warning about the resource appears or changes (not every interval)."""
    key = (body.metadata.namespace, body.metadata.name)
    warned: dict[str, str] = memo.controller_warned.setdefault(key, {})
    warnings = {}
    if tick.metrics_error is not None:
        warnings["MetricsUnavailable"] = str(tick.metrics_error)
    d = tick.decision
    if d is not None:
        # An unknown GPU, a failing drafter, ...; missing metrics keep the Event they always had.
        missing = (core.METRICS_MISSING, core.PARTIAL_DATA)
        warnings |= {reason: m for reason, m in d.warnings.items() if reason not in missing}
        if d.action == "noData":
            warnings["NoDecision"] = f"{d.action}: {d.reason}"
    for reason, message in warnings.items():
        if warned.get(reason) != message:
            kopf.warn(body, reason=reason, message=message[:1000])
    warned.clear()
    warned.update(warnings)
    if d is not None and d.changed:
        message = f"{d.action}: {d.reason}"[:1000]
        action = f"{d.action[:1].upper()}{d.action[1:]}"
        if tick.advice:
            # What auto would do, with the recommended table and gain (nothing was pushed).
            table = ", ".join(f"{b}:{k}" for b, k in d.k_by_bucket.items())
            gain = "unmeasured" if tick.predicted_gain is None else f"{tick.predicted_gain:.2f}x"
            message = f"recommend drafter {d.drafter}, K {table}, predicted gain {gain}; {d.reason}"
            kopf.info(body, reason=f"Advise{action}", message=message[:1000])
        else:
            kopf.info(body, reason=f"Policy{action}", message=message)


def _report_pods(body: kopf.Body, tick: ResourceTick) -> None:
    """A Warning Event per pod that did not take its policy, and per pod that had lost it."""
    for pod, error in tick.unreachable.items():
        kopf.warn(body, reason="SidecarUnreachable", message=f"{pod}: {error}"[:1000])
    for pod, ran in tick.restored.items():
        kopf.warn(body, reason="PolicyRestored", message=f"{pod}: {ran}; given its policy again"[:1000])


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

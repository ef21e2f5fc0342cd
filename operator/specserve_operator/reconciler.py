"""kopf handlers that deploy a SpeculativeServing: thin glue between kopf, the renderers and kube.py.

create / update / resume all run one idempotent `reconcile`: validate, render, create-or-patch every child
(adopted with an owner reference), write status. A restarted operator re-runs it on resume and finds its
children by name, so it creates no duplicates. An invalid resource gets Invalid=True and a Warning Event
naming the field, and nothing is created or changed. Deployment events keep phase and Ready current.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import kopf
from pydantic import ValidationError

from specserve_operator import status as st
from specserve_operator.api.models import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    describe_error,
    name_error,
    parse_spec,
)
from specserve_operator.kube import KubeApi, KubeError, connection_from_environment
from specserve_operator.render import children as render

CHILD_LABELS = {"app.kubernetes.io/managed-by": "specserve-operator"}
RETRY_DELAY_S = 15


def render_options_from_env(env: dict[str, str] | None = None) -> render.RenderOptions:
    """Operator-wide rendering settings from the operator's environment (set by the Helm chart)."""
    env = dict(os.environ) if env is None else env
    labels = {}
    for pair in filter(None, env.get("SPECSERVE_SERVICEMONITOR_LABELS", "").split(",")):
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"SPECSERVE_SERVICEMONITOR_LABELS: {pair!r} is not key=value")
        labels[key.strip()] = value.strip()
    defaults = render.RenderOptions()
    return render.RenderOptions(
        s3_image=env.get("SPECSERVE_S3_IMAGE", defaults.s3_image),
        hf_token_secret=env.get("SPECSERVE_HF_TOKEN_SECRET") or None,
        s3_credentials_secret=env.get("SPECSERVE_S3_CREDENTIALS_SECRET") or None,
        service_monitor_labels=labels,
        scrape_interval=env.get("SPECSERVE_SCRAPE_INTERVAL", defaults.scrape_interval),
    )


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf connects the way the operator's own client does (kube.connection_from_environment)."""
    connection = connection_from_environment()
    return kopf.ConnectionInfo(
        server=connection.server,
        token=connection.bearer(),
        ca_path=connection.ca_path,
        certificate_path=connection.cert_path,
        private_key_path=connection.key_path,
        insecure=connection.insecure,
        scheme="Bearer" if connection.bearer() else None,
    )


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Progress in annotations, not status: the status schema is strict and holds only our fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.posting.level = logging.INFO
    memo.kube = KubeApi(connection_from_environment())
    memo.options = render_options_from_env()


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    kube = getattr(memo, "kube", None)
    if kube is not None:
        await kube.close()


@kopf.on.probe(id="kubernetes")
async def kubernetes_reachable(memo: kopf.Memo, **_: Any) -> bool:
    """Liveness: the API server answers (the probe endpoint fails when this raises)."""
    kube: KubeApi = memo.kube
    await kube.has_resource(f"{GROUP}/{VERSION}", PLURAL)
    return True


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile(
    body: kopf.Body,
    spec: kopf.Spec,
    name: str,
    namespace: str,
    meta: kopf.Meta,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: logging.Logger,
    **_: Any,
) -> None:
    generation = meta.get("generation")
    old_conditions = status.get("conditions")
    problem = name_error(name)
    if problem is None:
        try:
            parsed = parse_spec(dict(spec))
        except ValidationError as exc:
            problem = describe_error(exc)
    if problem is not None:
        kopf.warn(body, reason="Invalid", message=problem)
        patch.status["phase"] = "Failed"
        patch.status["observedGeneration"] = generation
        patch.status["conditions"] = st.merge_conditions(
            old_conditions, [st.condition(st.INVALID, True, "InvalidSpec", problem, generation=generation)]
        )
        return

    kube: KubeApi = memo.kube
    options: render.RenderOptions = memo.options
    try:
        monitor_api = await kube.has_resource("monitoring.coreos.com/v1", "servicemonitors")
        # Pods run the controller's active drafter, so a reconcile never undoes its rollout.
        running = render.with_active_drafter(parsed, status.get("activeDrafter"))
        children = render.build_children(
            name, namespace, running, options=options, service_monitor_available=monitor_api
        )
        kopf.append_owner_reference(children, owner=body)
        if render.has_sidecar(running):
            secret = render.build_secret(name, namespace, render.new_control_token())
            kopf.append_owner_reference(secret, owner=body)
            await kube.create_if_absent(secret)  # the token is made once and never rotated
        applied = {}
        for child in children:
            applied[child["kind"]] = await kube.apply(child)
        if monitor_api and not any(c["kind"] == "ServiceMonitor" for c in children):
            await kube.delete(
                "monitoring.coreos.com/v1", "ServiceMonitor", namespace, render.names(name)["service_monitor"]
            )
    except KubeError as exc:
        message = f"applying children failed: {exc}"
        kopf.warn(body, reason="ApplyFailed", message=message)
        conditions = st.merge_conditions(
            old_conditions,
            [
                st.condition(st.INVALID, False, "ValidSpec", generation=generation),
                st.condition(st.DEPLOYED, False, "ApplyFailed", message, generation=generation),
            ],
        )
        # kopf drops a failing handler's patch, so the condition is written here, then the handler retries
        with contextlib.suppress(KubeError):
            await kube.patch_status(API_VERSION, KIND, namespace, name, {"conditions": conditions})
        raise kopf.TemporaryError(message, delay=RETRY_DELAY_S) from exc

    kinds = ", ".join(applied)
    deployment_status = applied["Deployment"].get("status")
    patch.status["observedGeneration"] = generation
    patch.status["phase"] = st.deployment_phase(parsed.replicas, deployment_status)
    patch.status["replicas"] = int((deployment_status or {}).get("replicas") or 0)
    patch.status["readyReplicas"] = int((deployment_status or {}).get("readyReplicas") or 0)
    patch.status["selector"] = render.label_selector_string(name)
    patch.status["conditions"] = st.merge_conditions(
        old_conditions,
        [
            st.condition(st.INVALID, False, "ValidSpec", generation=generation),
            st.condition(st.DEPLOYED, True, "Applied", f"applied {kinds}", generation=generation),
            *st.deployment_conditions(parsed.replicas, deployment_status, generation),
        ],
    )
    kopf.info(body, reason="Deployed", message=f"applied {kinds}")
    logger.info("applied %s", kinds)


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def delete_children(name: str, namespace: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Delete the children now (a cluster's garbage collector would too, through the owner references;
    doing it here keeps deletion prompt and works where no collector runs)."""
    kube: KubeApi = memo.kube
    names = render.names(name)
    for api_version, kind, key in (
        ("apps/v1", "Deployment", "deployment"),
        ("v1", "Service", "service"),
        ("policy/v1", "PodDisruptionBudget", "pdb"),
        ("v1", "ConfigMap", "config_map"),
        ("v1", "Secret", "secret"),
    ):
        await kube.delete(api_version, kind, namespace, names[key])
    if await kube.has_resource("monitoring.coreos.com/v1", "servicemonitors"):
        await kube.delete("monitoring.coreos.com/v1", "ServiceMonitor", namespace, names["service_monitor"])


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
async def deployment_changed(
    body: kopf.Body, type: str | None, namespace: str, memo: kopf.Memo, **_: Any
) -> None:
    """Mirror the Deployment's progress into the owner's phase, replicas and Ready condition."""
    owner = next(
        (r for r in body.metadata.get("ownerReferences", []) if r.get("apiVersion") == API_VERSION),
        None,
    )
    if owner is None or type == "DELETED":
        return
    kube: KubeApi = memo.kube
    parent = await kube.get(API_VERSION, KIND, namespace, owner["name"])
    if parent is None or parent.get("metadata", {}).get("deletionTimestamp"):
        return
    parent_status = parent.get("status") or {}
    if st.is_true(parent_status.get("conditions"), st.INVALID):
        return
    desired = int(body.get("spec", {}).get("replicas") or 0)
    deployment_status = body.get("status") or {}
    generation = parent_status.get("observedGeneration")
    new_status = {
        "phase": st.deployment_phase(desired, deployment_status),
        "replicas": int(deployment_status.get("replicas") or 0),
        "readyReplicas": int(deployment_status.get("readyReplicas") or 0),
        "conditions": st.merge_conditions(
            parent_status.get("conditions"), st.deployment_conditions(desired, deployment_status, generation)
        ),
    }
    if all(parent_status.get(k) == v for k, v in new_status.items()):
        return
    await kube.patch_status(API_VERSION, KIND, namespace, owner["name"], new_status)

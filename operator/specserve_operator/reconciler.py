"""kopf handlers that deploy a SpeculativeServing: thin glue between kopf, the renderers and kube.py.

create / update / resume all run one idempotent `reconcile`: validate, render, create-or-patch every child
(with an owner reference), write status. A restarted operator re-runs it on resume and finds its
children by name, so it creates no duplicates. An invalid resource gets Invalid=True and a Warning Event
naming the field, and nothing is created or changed. A child's name taken by an object the resource does
not own gives Conflict=True and a Warning Event naming that object, and nothing is created, changed or
deleted (docs/runbook.md); the reconcile retries until the name is free. Deployment events keep phase
and Ready current.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, NoReturn

import kopf
from pydantic import ValidationError

from specserve_operator import status as resource_status
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
from specserve_operator.kube import KubeApi, KubeError, OwnershipConflict, connection_from_environment
from specserve_operator.render import children as render

CHILD_LABELS = {"app.kubernetes.io/managed-by": "specserve-operator"}
RETRY_DELAY_S = 15
# A conflict lasts until a person moves the other object away: look again now and then.
CONFLICT_RETRY_S = 60
SECRETS_HINT = "add this namespace to the chart's operator.secretNamespaces, see docs/install.md"


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
        engine_image=env.get("SPECSERVE_ENGINE_IMAGE") or None,
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


def control_secret(body: kopf.Body) -> dict[str, Any]:
    """The resource's control-token Secret with a new token, owned by the resource (created only where
    none exists: by the reconcile, and by the tuner when it finds the Secret gone)."""
    meta = body.metadata
    secret = render.build_secret(meta.name, meta.namespace, render.new_control_token())
    kopf.append_owner_reference(secret, owner=body)
    return secret


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
            render.engine_image(parsed, memo.options)
        except ValidationError as exc:
            problem = describe_error(exc)
        except ValueError as exc:
            problem = str(exc)
    if problem is not None:
        kopf.warn(body, reason="Invalid", message=problem)
        patch.status["phase"] = "Failed"
        patch.status["observedGeneration"] = generation
        patch.status["conditions"] = resource_status.merge_conditions(
            old_conditions,
            [
                resource_status.condition(
                    resource_status.INVALID, True, "InvalidSpec", problem, generation=generation
                )
            ],
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
        secrets = [control_secret(body)] if render.has_sidecar(running) else []
        # All or nothing: a pod whose Secret or ConfigMap is someone else's must not start.
        conflicts = await kube.ownership_conflicts(secrets + children)
        applied = {}
        if not conflicts:
            for secret in secrets:
                await kube.create_if_absent(secret)  # an existing token stays (rotation: docs/runbook.md)
            for child in children:
                applied[child["kind"]] = await kube.apply(child)
            if monitor_api and not any(c["kind"] == "ServiceMonitor" for c in children):
                # a ServiceMonitor of this name that is not ours is not ours to remove either
                with contextlib.suppress(OwnershipConflict):
                    await kube.delete(
                        "monitoring.coreos.com/v1",
                        "ServiceMonitor",
                        namespace,
                        render.names(name)["service_monitor"],
                        owner_uid=meta["uid"],
                    )
    except OwnershipConflict as exc:  # made between the check and the write
        conflicts = [exc]
    except KubeError as exc:
        message = f"applying children failed: {exc}"
        if exc.status == 403 and "secrets" in exc.message:
            message += f" (Secrets are granted per namespace: {SECRETS_HINT})"
        kopf.warn(body, reason="ApplyFailed", message=message)
        conditions = resource_status.merge_conditions(
            old_conditions,
            [
                resource_status.condition(resource_status.INVALID, False, "ValidSpec", generation=generation),
                resource_status.condition(
                    resource_status.DEPLOYED, False, "ApplyFailed", message, generation=generation
                ),
            ],
        )
        # kopf drops a failing handler's patch, so the condition is written here, then the handler retries
        with contextlib.suppress(KubeError):
            await kube.patch_status(API_VERSION, KIND, namespace, name, {"conditions": conditions})
        raise kopf.TemporaryError(message, delay=RETRY_DELAY_S) from exc
    if conflicts:
        await _report_conflicts(body, kube, namespace, name, old_conditions, generation, conflicts)

    kinds = ", ".join(applied)
    deployment_status = applied["Deployment"].get("status")
    patch.status["observedGeneration"] = generation
    patch.status["phase"] = resource_status.deployment_phase(parsed.replicas, deployment_status)
    patch.status["replicas"] = int((deployment_status or {}).get("replicas") or 0)
    patch.status["readyReplicas"] = int((deployment_status or {}).get("readyReplicas") or 0)
    patch.status["selector"] = render.label_selector_string(name)
    patch.status["conditions"] = resource_status.merge_conditions(
        old_conditions,
        [
            resource_status.condition(resource_status.INVALID, False, "ValidSpec", generation=generation),
            resource_status.condition(resource_status.CONFLICT, False, "NoConflict", generation=generation),
            resource_status.condition(
                resource_status.DEPLOYED, True, "Applied", f"applied {kinds}", generation=generation
            ),
            *resource_status.deployment_conditions(parsed.replicas, deployment_status, generation),
        ],
    )
    kopf.info(body, reason="Deployed", message=f"applied {kinds}")
    logger.info("applied %s", kinds)


async def _report_conflicts(
    body: kopf.Body,
    kube: KubeApi,
    namespace: str,
    name: str,
    old_conditions: Any,
    generation: int | None,
    conflicts: list[OwnershipConflict],
) -> NoReturn:
    """Conflict=True naming each foreign object, a Warning Event per object when that changes, and a
    retry later (nothing was written to any child)."""
    message = "; ".join(c.message for c in conflicts) + ". Nothing was changed (see docs/runbook.md)."
    was = resource_status.get_condition(old_conditions, resource_status.CONFLICT)
    if not (was and was.get("status") == "True" and was.get("message") == message):
        for conflict in conflicts:
            kopf.warn(body, reason="Conflict", message=f"{conflict.message}: the operator leaves it alone")
    conditions = resource_status.merge_conditions(
        old_conditions,
        [
            resource_status.condition(resource_status.INVALID, False, "ValidSpec", generation=generation),
            resource_status.condition(
                resource_status.CONFLICT, True, "ForeignObject", message, generation=generation
            ),
            resource_status.condition(
                resource_status.DEPLOYED, False, "Conflict", message, generation=generation
            ),
        ],
    )
    # kopf drops a failing handler's patch, so the conditions are written here
    with contextlib.suppress(KubeError):
        await kube.patch_status(API_VERSION, KIND, namespace, name, {"conditions": conditions})
    raise kopf.TemporaryError(message, delay=CONFLICT_RETRY_S)


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def delete_children(name: str, namespace: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Delete the children this resource owns now (a cluster's garbage collector would too, through the
    owner references; doing it here keeps deletion prompt and works where no collector runs). A
    same-named object it does not own stays, with a Warning Event."""
    kube: KubeApi = memo.kube
    names = render.names(name)
    children = [
        ("apps/v1", "Deployment", names["deployment"]),
        ("v1", "Service", names["service"]),
        ("policy/v1", "PodDisruptionBudget", names["pdb"]),
        ("v1", "ConfigMap", names["config_map"]),
        ("v1", "Secret", names["secret"]),
    ]
    if await kube.has_resource("monitoring.coreos.com/v1", "servicemonitors"):
        children.append(("monitoring.coreos.com/v1", "ServiceMonitor", names["service_monitor"]))
    for api_version, kind, child in children:
        try:
            await kube.delete(api_version, kind, namespace, child, owner_uid=body.metadata.uid)
        except OwnershipConflict as exc:
            kopf.warn(body, reason="Conflict", message=f"{exc.message}: left in place")
        except KubeError as exc:
            # No Secret access here (docs/install.md): the operator cannot have made a Secret either.
            if not (kind == "Secret" and exc.status == 403):
                raise


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
async def deployment_changed(
    body: kopf.Body, type: str | None, namespace: str, memo: kopf.Memo, **_: Any
) -> None:
    """Mirror the Deployment's progress into the owner's phase, replicas and Ready condition."""
    owner = next(
        (
            r
            for r in body.metadata.get("ownerReferences", [])
            if r.get("apiVersion") == API_VERSION and r.get("kind") == KIND
        ),
        None,
    )
    if owner is None or type == "DELETED":
        return
    kube: KubeApi = memo.kube
    parent = await kube.get(API_VERSION, KIND, namespace, owner["name"])
    if parent is None or parent.get("metadata", {}).get("deletionTimestamp"):
        return
    if parent.get("metadata", {}).get("uid") != owner.get("uid"):
        return  # a same-named Deployment of an earlier resource, or one that only claims to be ours
    parent_status = parent.get("status") or {}
    if resource_status.is_true(parent_status.get("conditions"), resource_status.INVALID):
        return
    desired = int(body.get("spec", {}).get("replicas") or 0)
    deployment_status = body.get("status") or {}
    generation = parent_status.get("observedGeneration")
    new_status = {
        "phase": resource_status.deployment_phase(desired, deployment_status),
        "replicas": int(deployment_status.get("replicas") or 0),
        "readyReplicas": int(deployment_status.get("readyReplicas") or 0),
        "conditions": resource_status.merge_conditions(
            parent_status.get("conditions"),
            resource_status.deployment_conditions(desired, deployment_status, generation),
        ),
    }
    if all(parent_status.get(k) == v for k, v in new_status.items()):
        return
    await kube.patch_status(API_VERSION, KIND, namespace, owner["name"], new_status)

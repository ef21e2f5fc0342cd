"""The operator's Kubernetes API I/O: get, create-or-patch (server-side apply), delete, discovery.

A small aiohttp client rather than a generated one: the operator needs five verbs on a handful of kinds,
all as plain dicts (what the pure renderers produce). Credentials come from the pod's service account
in the cluster, else from the kubeconfig (KUBECONFIG or ~/.kube/config), as kopf itself does.

Ownership (docs/architecture.md): the operator writes and deletes only objects whose ownerReferences name
its resource's uid. `apply`, `create_if_absent` and `delete` read the object first and raise
OwnershipConflict, changing nothing, where a same-named object belongs to someone else; the uid they
checked rides along as a precondition, so an object replaced in between is not touched either.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

FIELD_MANAGER = "specserve-operator"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

# kind -> plural, for the kinds the operator touches.
PLURALS: dict[str, str] = {
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Service": "services",
    "Deployment": "deployments",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "ServiceMonitor": "servicemonitors",
    "Pod": "pods",
    "Event": "events",
    "SpeculativeServing": "speculativeservings",
}


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def owner_uids(obj: Mapping[str, Any]) -> set[str]:
    return {ref.get("uid", "") for ref in (obj.get("metadata") or {}).get("ownerReferences") or []}


def controller_uid(body: Mapping[str, Any]) -> str:
    """The uid of the owner `body` is written for (its controller ownerReference)."""
    refs = (body.get("metadata") or {}).get("ownerReferences") or []
    uid = next((ref.get("uid") for ref in refs if ref.get("controller")), None)
    if not uid:
        raise ValueError(f"{body.get('kind')} {body['metadata'].get('name')}: no controller ownerReference")
    return uid


def describe_owners(obj: Mapping[str, Any]) -> str:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    if not refs:
        return "it has no owner reference"
    return "it is owned by " + ", ".join(f"{ref.get('kind')} {ref.get('name')}" for ref in refs)


class OwnershipConflict(KubeError):
    """A same-named object that another owner (or nobody) holds: the operator leaves it alone."""

    def __init__(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        self.kind = str(obj.get("kind") or "object")
        self.name = str(meta.get("name"))
        self.namespace = meta.get("namespace")
        super().__init__(
            409, f"{self.kind} {self.name} exists and is not owned by this resource ({describe_owners(obj)})"
        )


@dataclass(frozen=True)
class Connection:
    server: str
    token: str | None = None
    token_path: Path | None = None  # re-read per request: service-account tokens rotate
    ca_path: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    insecure: bool = False

    def bearer(self) -> str | None:
        if self.token_path is not None:
            return self.token_path.read_text().strip()
        return self.token


def connection_from_environment() -> Connection:
    """In the cluster: the service account. Outside: the kubeconfig's current context."""
    import kubernetes.config
    from kubernetes.client import Configuration

    if (SERVICE_ACCOUNT_DIR / "token").exists():
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        return Connection(
            server=f"https://{host}:{port}",
            token_path=SERVICE_ACCOUNT_DIR / "token",
            ca_path=str(SERVICE_ACCOUNT_DIR / "ca.crt"),
        )
    config = Configuration()
    # Read KUBECONFIG now: the library's default location is fixed when it is first imported.
    kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=config)
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    token = header.split(" ", 1)[-1] if header else None
    return Connection(
        server=config.host,
        token=token,
        ca_path=config.ssl_ca_cert,
        cert_path=config.cert_file,
        key_path=config.key_file,
        insecure=not config.verify_ssl,
    )


def object_path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    plural = PLURALS[kind]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace is not None:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    return base + (f"/{name}" if name else "")


@dataclass
class KubeApi:
    connection: Connection
    _session: aiohttp.ClientSession | None = field(default=None, init=False, repr=False)

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl_context: ssl.SSLContext | bool = not self.connection.insecure
            if not self.connection.insecure and self.connection.server.startswith("https"):
                context = ssl.create_default_context(cafile=self.connection.ca_path)
                if self.connection.cert_path and self.connection.key_path:
                    context.load_cert_chain(self.connection.cert_path, self.connection.key_path)
                ssl_context = context
            self._session = aiohttp.ClientSession(
                base_url=self.connection.server,
                connector=aiohttp.TCPConnector(ssl=ssl_context),
                timeout=aiohttp.ClientTimeout(total=30),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        token = self.connection.bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        session = await self._http()
        async with session.request(method, path, data=data, headers=headers, params=params) as response:
            text = await response.text()
            if response.status >= 400:
                try:
                    message = json.loads(text).get("message", text)
                except ValueError:
                    message = text
                raise KubeError(response.status, str(message)[:500])
            return json.loads(text) if text else {}

    async def get(
        self, api_version: str, kind: str, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        try:
            return await self._request("GET", object_path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, api_version: str, kind: str, namespace: str | None) -> list[dict[str, Any]]:
        return (await self._request("GET", object_path(api_version, kind, namespace))).get("items", [])

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        return await self._request(
            "POST", object_path(body["apiVersion"], body["kind"], meta.get("namespace")), body=body
        )

    async def apply(self, body: dict[str, Any]) -> dict[str, Any]:
        """Create `body`, or patch the object its owner already owns to exactly `body` (server-side
        apply: fields dropped from `body` are removed). The owner is `body`'s controller ownerReference;
        a same-named object it does not own raises OwnershipConflict and is left as it is."""
        existing, created = await self.create_if_absent(body)
        if created:
            return existing
        meta = body["metadata"]
        # The uid create_if_absent checked is a precondition: an object re-made since is not patched.
        guarded = {**body, "metadata": {**meta, "uid": existing["metadata"]["uid"]}}
        return await self._request(
            "PATCH",
            object_path(body["apiVersion"], body["kind"], meta.get("namespace"), meta["name"]),
            body=guarded,
            content_type="application/apply-patch+yaml",
            # Forcing takes fields over from other managers, only ever on an object this owner holds.
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
        )

    async def create_if_absent(self, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """The existing object its owner (`body`'s controller ownerReference) holds, or a new one from
        `body`; True when it was created now. Another's object raises OwnershipConflict."""
        meta = body["metadata"]
        uid = controller_uid(body)
        existing = await self.get(body["apiVersion"], body["kind"], meta.get("namespace"), meta["name"])
        if existing is None:
            try:
                return await self.create(body), True
            except KubeError as exc:
                if exc.status != 409:  # another operator replica won the race: theirs stands
                    raise
            existing = await self.get(body["apiVersion"], body["kind"], meta.get("namespace"), meta["name"])
            if existing is None:
                raise KubeError(409, f"{body['kind']} {meta['name']} conflicted and then vanished")
        if uid not in owner_uids(existing):
            raise OwnershipConflict(existing)
        return existing, False

    async def ownership_conflicts(self, bodies: list[dict[str, Any]]) -> list[OwnershipConflict]:
        """One conflict per existing same-named object that `bodies`' owner does not hold (read only)."""
        conflicts = []
        for body in bodies:
            meta = body["metadata"]
            existing = await self.get(body["apiVersion"], body["kind"], meta.get("namespace"), meta["name"])
            if existing is not None and controller_uid(body) not in owner_uids(existing):
                conflicts.append(OwnershipConflict({"kind": body["kind"], **existing}))
        return conflicts

    async def patch_status(
        self, api_version: str, kind: str, namespace: str | None, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch the status subresource."""
        return await self._request(
            "PATCH",
            object_path(api_version, kind, namespace, name) + "/status",
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    async def delete(
        self, api_version: str, kind: str, namespace: str | None, name: str, *, owner_uid: str
    ) -> bool:
        """Delete the object if `owner_uid` owns it; False when there is none. Another's object raises
        OwnershipConflict and stays."""
        existing = await self.get(api_version, kind, namespace, name)
        if existing is None:
            return False
        if owner_uid not in owner_uids(existing):
            raise OwnershipConflict(existing)
        options = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "preconditions": {"uid": existing["metadata"]["uid"]},
        }
        try:
            await self._request("DELETE", object_path(api_version, kind, namespace, name), body=options)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def has_resource(self, group_version: str, plural: str) -> bool:
        """Whether the API server serves this resource (e.g. monitoring.coreos.com/v1 servicemonitors)."""
        try:
            listing = await self._request("GET", f"/apis/{group_version}")
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in listing.get("resources", []))

"""Model sources (hf://, pvc://, s3://, image://) as paths inside the engine pod, and what puts the files
there.

- `pvc://claim/sub/path`: the claim is mounted read-only at /models/pvc/<claim>; nothing is copied.
- `hf://org/repo`: an init container in the engine image runs `hf download` into the pod's model cache
  (an emptyDir at /models/fetched); HF_TOKEN comes from an optional Secret.
- `s3://bucket/key`: an init container (an aws-cli image) runs `aws s3 sync` into the same cache, with
  credentials from an optional Secret.
- `image://name`: a folder baked into the engine image at /models/image/<name> (the CPU engine image's
  tiny models, docs/quickstart-kind.md); nothing is mounted or copied.

Every container sees the same paths, so vLLM, the sidecar and the drafters all load local directories.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

MODELS_ROOT = "/models"
FETCH_ROOT = f"{MODELS_ROOT}/fetched"
PVC_ROOT = f"{MODELS_ROOT}/pvc"
IMAGE_ROOT = f"{MODELS_ROOT}/image"
CACHE_VOLUME = "model-cache"


@dataclass(frozen=True)
class ResolvedSource:
    uri: str
    scheme: str  # hf | pvc | s3 | image
    path: str  # the directory inside the pod
    location: str  # hf: org/repo; pvc: claim name; s3: s3://bucket/key; image: the folder's name


def resolve_source(uri: str) -> ResolvedSource:
    scheme, sep, rest = uri.partition("://")
    rest = rest.strip("/")
    if not sep or not rest:
        raise ValueError(
            f"{uri!r} is not a model source (hf://org/repo, pvc://claim/path, s3://bucket/key, image://name)"
        )
    if scheme == "hf":
        return ResolvedSource(uri, "hf", f"{FETCH_ROOT}/hf/{rest}", rest)
    if scheme == "pvc":
        claim = rest.split("/", 1)[0]
        return ResolvedSource(uri, "pvc", f"{PVC_ROOT}/{rest}", claim)
    if scheme == "s3":
        return ResolvedSource(uri, "s3", f"{FETCH_ROOT}/s3/{rest}", f"s3://{rest}")
    if scheme == "image":
        return ResolvedSource(uri, "image", f"{IMAGE_ROOT}/{rest}", rest)
    raise ValueError(f"{uri!r}: unknown scheme {scheme!r} (hf, pvc, s3, image)")


def pvc_volume_name(claim: str) -> str:
    return "model-pvc-" + re.sub(r"[^a-z0-9-]", "-", claim)[:50]


def source_volumes(sources: list[ResolvedSource]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's model volumes and the mounts every container that loads weights needs."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if any(s.scheme in ("hf", "s3") for s in sources):
        volumes.append({"name": CACHE_VOLUME, "emptyDir": {}})
        mounts.append({"name": CACHE_VOLUME, "mountPath": FETCH_ROOT})
    for claim in sorted({s.location for s in sources if s.scheme == "pvc"}):
        name = pvc_volume_name(claim)
        volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": name, "mountPath": f"{PVC_ROOT}/{claim}", "readOnly": True})
    return volumes, mounts


def fetch_init_containers(
    sources: list[ResolvedSource],
    *,
    engine_image: str,
    s3_image: str,
    hf_token_secret: str | None,
    s3_credentials_secret: str | None,
    security_context: dict[str, Any],
) -> list[dict[str, Any]]:
    """Init containers that download hf:// and s3:// sources before the engine starts."""
    cache_mount = [{"name": CACHE_VOLUME, "mountPath": FETCH_ROOT}]
    containers: list[dict[str, Any]] = []
    unique = {s.uri: s for s in sources}
    hf = [s for s in unique.values() if s.scheme == "hf"]
    if hf:
        script = "set -e\n" + "\n".join(
            f"hf download {shlex.quote(s.location)} --local-dir {shlex.quote(s.path)}" for s in hf
        )
        env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": f"{FETCH_ROOT}/.hf-home"}]
        if hf_token_secret:
            env.append(
                {
                    "name": "HF_TOKEN",
                    "valueFrom": {
                        "secretKeyRef": {"name": hf_token_secret, "key": "token", "optional": True}
                    },
                }
            )
        containers.append(
            {
                "name": "fetch-hf",
                "image": engine_image,
                "command": ["sh", "-c", script],
                "env": env,
                "volumeMounts": cache_mount,
                "securityContext": security_context,
            }
        )
    s3 = [s for s in unique.values() if s.scheme == "s3"]
    if s3:
        script = "set -e\n" + "\n".join(
            f"aws s3 sync {shlex.quote(s.location)} {shlex.quote(s.path)}" for s in s3
        )
        container: dict[str, Any] = {
            "name": "fetch-s3",
            "image": s3_image,
            "command": ["sh", "-c", script],
            "env": [{"name": "HOME", "value": "/tmp"}],
            "volumeMounts": cache_mount,
            "securityContext": security_context,
        }
        if s3_credentials_secret:
            container["envFrom"] = [{"secretRef": {"name": s3_credentials_secret, "optional": True}}]
        containers.append(container)
    return containers

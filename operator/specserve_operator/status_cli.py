"""`specserve status [NAME] [-n NS]`: what specserve is doing, per SpeculativeServing.

Against a cluster (the kubeconfig's current context, as kubectl) it reads the resources and their Events;
with `--local` it reads a local fleet's status file (specserve_operator.local.status_file). Also installed
as the kubectl plugin `kubectl-specserve`, so `kubectl specserve status` works the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from specserve_operator.api.models import API_VERSION, KIND
from specserve_operator.kube import KubeApi, KubeError, connection_from_environment
from specserve_operator.local.status_file import latest_status, read_status
from specserve_operator.overview import decisions_from_events, render_plain, render_rich, summarize

DEFAULT_LOCAL_RUNS = Path("reports") / "local-fleet"


class StatusError(Exception):
    """Nothing to show: the resource, the cluster or the status file is not there."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status", help="show what specserve is doing per SpeculativeServing", description=__doc__
    )
    parser.add_argument("name", nargs="?", help="one SpeculativeServing (default: every one)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("-n", "--namespace", help="its namespace (default: the kubeconfig context's)")
    where.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    parser.add_argument(
        "-o", "--output", choices=("table", "json", "yaml"), default="table", help="default: %(default)s"
    )
    parser.add_argument(
        "--local",
        nargs="?",
        type=Path,
        const=DEFAULT_LOCAL_RUNS,
        metavar="RUN",
        help="a local fleet instead of a cluster: its run folder, its status.json, or the folder of runs "
        f"(the newest is shown; default: {DEFAULT_LOCAL_RUNS})",
    )
    parser.set_defaults(func=run)


def context_namespace() -> str:
    """The kubeconfig current context's namespace, as kubectl would use it."""
    import kubernetes.config

    try:
        _, active = kubernetes.config.list_kube_config_contexts(config_file=os.environ.get("KUBECONFIG"))
    except (kubernetes.config.ConfigException, OSError):
        return "default"
    return (active or {}).get("context", {}).get("namespace") or "default"


async def cluster_summaries(name: str | None, namespace: str | None) -> list[dict[str, Any]]:
    """Summaries of the resources in `namespace` (None: every namespace), or of the one named."""
    kube = KubeApi(connection_from_environment())
    try:
        if name is not None:
            resource = await kube.get(API_VERSION, KIND, namespace, name)
            if resource is None:
                raise StatusError(f"SpeculativeServing {namespace}/{name} not found")
            resources = [resource]
        else:
            resources = await kube.list(API_VERSION, KIND, namespace)
        events = await kube.list("v1", "Event", namespace)
    except KubeError as exc:
        raise StatusError(f"the cluster refused: {exc.status} {exc.message}") from None
    finally:
        await kube.close()
    out = []
    for resource in sorted(resources, key=lambda r: (r["metadata"]["namespace"], r["metadata"]["name"])):
        meta = resource["metadata"]
        mine = [e for e in events if (e.get("involvedObject") or {}).get("namespace") == meta["namespace"]]
        out.append(summarize(resource, decisions_from_events(mine, meta["name"])))
    return out


def local_summaries(where: Path, name: str | None) -> list[dict[str, Any]]:
    path = where
    if where.is_dir() and not (where / "status.json").exists():
        found = latest_status(where)
        if found is None:
            raise StatusError(
                f"{where}: no local fleet run with a status.json (specserve local up makes one)"
            )
        path = found
    if not path.exists():
        raise StatusError(f"{path}: no such file or folder")
    document = read_status(path)
    if name is not None and document["metadata"]["name"] != name:
        raise StatusError(f"{path}: holds {document['metadata']['name']}, not {name}")
    return [summarize(document, document.get("decisions") or [])]


def render(summaries: list[dict[str, Any]], output: str, one: bool, console: Console) -> None:
    data: Any = summaries[0] if one and summaries else summaries
    if output == "json":
        console.file.write(json.dumps(data, indent=2, default=str) + "\n")
    elif output == "yaml":
        console.file.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    elif console.is_terminal:
        render_rich(summaries, console)
    else:
        console.file.write(render_plain(summaries))


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    console = console or Console()
    try:
        if args.local is not None:
            summaries = local_summaries(args.local, args.name)
        else:
            namespace = None if args.all_namespaces else (args.namespace or context_namespace())
            summaries = asyncio.run(cluster_summaries(args.name, namespace))
    except StatusError as exc:
        Console(stderr=True).print(f"[bold red]error:[/bold red] {exc}")
        return 1
    render(summaries, args.output, args.name is not None, console)
    return 0


def kubectl_main(argv: Sequence[str] | None = None) -> int:
    """The kubectl plugin (`kubectl specserve status ...`): only the read-only status command."""
    parser = argparse.ArgumentParser(prog="kubectl specserve", description="specserve for kubectl")
    add_parser(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(kubectl_main())

"""`specserve operator`: run the kopf operator in-process with specserve's handler modules."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import random
from collections.abc import Sequence

import kopf
import prometheus_client

# Every module whose import registers kopf handlers. Another part adds its module here with one line.
HANDLER_MODULES: tuple[str, ...] = ("specserve_operator.reconciler", "specserve_operator.tuner.timer")
DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"
METRICS_PORT_ENV = "SPECSERVE_OPERATOR_METRICS_PORT"
DEFAULT_METRICS_PORT = 9095


def load_handlers(modules: Sequence[str] = HANDLER_MODULES) -> None:
    for module in modules:
        importlib.import_module(module)


async def run_operator(
    *,
    namespaces: Sequence[str] = (),
    standalone: bool = False,
    peering_name: str | None = None,
    priority: int | None = None,
    liveness_endpoint: str | None = None,
    settings: kopf.OperatorSettings | None = None,
    stop_flag: asyncio.Event | None = None,
) -> None:
    """Run until `stop_flag` is set (or forever). Without namespaces the operator is cluster-wide.

    For more than one replica, give each a different priority (the default is random): the highest one
    works and the others stand by (kopf peering). With `peering_name` the peering object (a
    ClusterKopfPeering, or a KopfPeering per namespace) must exist; without it kopf uses its "default"
    peering object where there is one and runs alone where there is none."""
    load_handlers()
    await kopf.operator(
        registry=kopf.get_default_registry(),
        settings=settings,
        standalone=standalone or None,
        peering_name=None if standalone else peering_name,
        priority=priority if priority is not None else random.randint(1, 32767),
        namespaces=list(namespaces),
        clusterwide=not namespaces,
        liveness_endpoint=liveness_endpoint,
        stop_flag=stop_flag,
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("operator", help="run the operator (kopf) against the current cluster")
    parser.add_argument("-n", "--namespace", action="append", default=[], help="watch only this namespace")
    parser.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    parser.add_argument("--peering", default=None, help="peering object name (then it must exist)")
    parser.add_argument("--priority", type=int, default=None, help="peering priority (default: random)")
    parser.add_argument("--liveness", default=DEFAULT_LIVENESS, help="liveness endpoint URL ('' = none)")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get(METRICS_PORT_ENV, DEFAULT_METRICS_PORT)),
        help=f"serve the operator's /metrics on this port (0 = off; env {METRICS_PORT_ENV})",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(message)s"
    )
    if args.metrics_port:
        # The tuner's decision and tick metrics live in the default registry.
        prometheus_client.start_http_server(args.metrics_port)
    asyncio.run(
        run_operator(
            namespaces=args.namespace,
            standalone=args.standalone,
            peering_name=args.peering,
            priority=args.priority,
            liveness_endpoint=args.liveness or None,
        )
    )
    return 0

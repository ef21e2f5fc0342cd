"""The local fleet's status file: how `specserve status --local` sees a running (or finished) fleet.

After every controller tick the fleet writes `status.json` into its run folder: the resource as a cluster
would hold it (metadata, spec, and the status the operator would write, from the same
`tuner.report.status_patch`) plus the controller's decisions with their reasons. Written to a temporary
file and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from specserve_operator.api.models import API_VERSION, KIND, SpeculativeServingSpec
from specserve_operator.tuner.core import ResourceView
from specserve_operator.tuner.loop import ResourceTick
from specserve_operator.tuner.report import status_patch

STATUS_FILE = "status.json"
# The run folder's other files that `specserve local replay` reads: the pods' addresses, Prometheus's data.
FLEET_FILE = "fleet.json"
PROMETHEUS_DATA_DIR = "prometheus-data"
DECISIONS_KEPT = 50


def status_document(
    namespace: str,
    name: str,
    spec: SpeculativeServingSpec,
    status: Mapping[str, Any],
    decisions: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec.to_wire(),
        "status": dict(status),
        "decisions": [dict(d) for d in decisions],
    }


def record_tick(
    run_dir: Path,
    status: dict[str, Any],
    decisions: list[dict[str, Any]],
    view: ResourceView,
    tick: ResourceTick,
    now: datetime,
) -> Path:
    """Apply one tick to `status` (as the operator patches the resource's) and to `decisions` (those that
    changed something, with their reasons), then write the status file."""
    status.update(status_patch(tick, view, status, now))
    d = tick.decision
    if d is not None and (d.changed or d.action != "hold"):
        action = f"advise:{d.action}" if tick.advice else d.action
        decisions.append({"time": now.isoformat(timespec="seconds"), "action": action, "reason": d.reason})
    del decisions[:-DECISIONS_KEPT]
    return write_status(run_dir, status_document(view.namespace, view.name, view.spec, status, decisions))


def write_status(run_dir: Path, document: Mapping[str, Any]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / STATUS_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(document, indent=1, default=str))
    os.replace(tmp, path)
    return path


def read_status(path: Path) -> dict[str, Any]:
    """A status file, or a run folder holding one."""
    file = path / STATUS_FILE if path.is_dir() else path
    return json.loads(file.read_text())


def latest_status(out_dir: Path) -> Path | None:
    """The newest status file of any run under `out_dir` (the `--out` of `specserve local up`)."""
    files = sorted(out_dir.glob(f"*/{STATUS_FILE}"), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None

"""What `specserve status` shows of one SpeculativeServing, as plain data, and its two renderings.

Pure: `summarize` takes the resource as the API server (or the local fleet's status file) holds it, plus
the controller's decisions (the resource's Events in a cluster, the fleet's own record locally); the
renderers take summaries. Rich tables where a terminal is attached, plain text otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from specserve_engine.buckets import DEFAULT_BUCKETS, bucket_labels

# Event reasons the controller gives its decisions (tuner/timer.py): Policy<Action>, Advise<Action>, ...
DECISION_EVENT_PREFIXES = ("Policy", "Advise", "Rollout", "NoDecision")
DECISIONS_SHOWN = 5


def _event_time(event: Mapping[str, Any]) -> str:
    return str(
        event.get("lastTimestamp")
        or event.get("eventTime")
        or event.get("firstTimestamp")
        or (event.get("metadata") or {}).get("creationTimestamp")
        or ""
    )


def decisions_from_events(events: Iterable[Mapping[str, Any]], name: str) -> list[dict[str, str]]:
    """The controller's decisions about resource `name`, oldest first, from Kubernetes Events."""
    out = []
    for event in events:
        involved = event.get("involvedObject") or {}
        reason = str(event.get("reason") or "")
        if involved.get("kind") != "SpeculativeServing" or involved.get("name") != name:
            continue
        if not reason.startswith(DECISION_EVENT_PREFIXES):
            continue
        out.append({"time": _event_time(event), "action": reason, "reason": str(event.get("message") or "")})
    return sorted(out, key=lambda d: d["time"])


def summarize(
    resource: Mapping[str, Any], decisions: Sequence[Mapping[str, Any]] = (), limit: int = DECISIONS_SHOWN
) -> dict[str, Any]:
    """One resource's view: phase, conditions, what is in force, what is recommended, pods, decisions."""
    meta = resource.get("metadata") or {}
    spec = resource.get("spec") or {}
    status = resource.get("status") or {}
    speculation = spec.get("speculation") or {}
    fleet = status.get("fleet") or {}
    recommendation = status.get("recommendation")
    in_force = status.get("kByBucket") or {}
    recommended = (recommendation or {}).get("kByBucket") or {}
    bounds = speculation.get("batchBuckets") or list(DEFAULT_BUCKETS)
    measured = fleet.get("mal") or {}
    labels = [b for b in bucket_labels(bounds) if b in in_force or b in recommended or b in measured]
    version = status.get("policyVersion")
    pods = []
    for pod in status.get("pods") or []:
        reported = pod.get("policyVersion")
        pods.append(
            {
                "name": pod.get("name"),
                "drafter": pod.get("drafter"),
                "policyVersion": reported,
                "matches": None if reported is None or version is None else reported == version,
                "speculating": pod.get("speculating"),
                "batchSize": pod.get("batchSize"),
                "mal": pod.get("mal"),
            }
        )
    shown = [dict(d) for d in decisions][-limit:] if limit else []
    last = status.get("lastDecision")
    if not shown and last:
        shown = [{k: last.get(k, "") for k in ("time", "action", "reason")}]
    return {
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "phase": status.get("phase"),
        "mode": speculation.get("mode", "auto"),
        "replicas": spec.get("replicas", 1),
        "readyReplicas": status.get("readyReplicas"),
        "conditions": [
            {k: c.get(k) for k in ("type", "status", "reason", "message")}
            for c in status.get("conditions") or []
        ],
        "drafter": status.get("activeDrafter"),
        "policyVersion": version,
        "meanAcceptedLength": fleet.get("meanAcceptedLength"),
        "acceptanceRate": fleet.get("acceptanceRate"),
        "cliffBatchSize": status.get("cliffBatchSize"),
        "predictedGain": (recommendation or {}).get("predictedGain"),
        "buckets": [
            {
                "bucket": label,
                "k": in_force.get(label),
                "recommendedK": recommended.get(label),
                "mal": measured.get(label),
            }
            for label in labels
        ],
        "recommendation": recommendation,
        "pods": pods,
        "decisions": shown,
    }


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _match(matches: bool | None) -> str:
    return "-" if matches is None else ("yes" if matches else "NO")


def _headline(s: Mapping[str, Any]) -> list[str]:
    ready = f"{_num(s['readyReplicas'])}/{s['replicas']} ready"
    lines = [f"{s['namespace']}/{s['name']}  phase {s['phase'] or '-'}  mode {s['mode']}  {ready}"]
    lines.append(f"drafter in force: {s['drafter'] or '-'}  policy version {_num(s['policyVersion'])}")
    gain = s["predictedGain"]
    cliff = s["cliffBatchSize"]
    lines.append(
        f"MAL {_num(s['meanAcceptedLength'])}  acceptance {_num(s['acceptanceRate'])}  predicted gain "
        f"{'-' if gain is None else f'{gain:.2f}x'}  cliff {'-' if cliff is None else f'at batch {cliff}'}"
    )
    rec = s["recommendation"]
    if rec:
        lines.append(
            f"recommendation ({rec.get('mode')}): drafter {rec.get('drafter')}, {rec.get('action')}: "
            f"{rec.get('reason', '')}"
        )
    return lines


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def _tables(s: Mapping[str, Any]) -> list[tuple[str, list[list[str]]]]:
    """(title, rows with a header row first) for the conditions, buckets, pods and decisions."""
    return [
        (
            "conditions",
            [["TYPE", "STATUS", "REASON", "MESSAGE"]]
            + [[c["type"], c["status"], c["reason"] or "", c["message"] or ""] for c in s["conditions"]],
        ),
        (
            "buckets (K in force and recommended per batch-size bucket)",
            [["BUCKET", "K", "RECOMMENDED", "MAL"]]
            + [[b["bucket"], _num(b["k"]), _num(b["recommendedK"]), _num(b["mal"])] for b in s["buckets"]],
        ),
        (
            "pods",
            [["POD", "DRAFTER", "POLICY", "MATCHES", "SPECULATING", "BATCH", "MAL"]]
            + [
                [
                    p["name"],
                    p["drafter"] or "-",
                    _num(p["policyVersion"]),
                    _match(p["matches"]),
                    _num(p["speculating"]),
                    _num(p["batchSize"], 1),
                    _num(p["mal"]),
                ]
                for p in s["pods"]
            ],
        ),
        (
            "last decisions",
            [["TIME", "ACTION", "REASON"]] + [[d["time"], d["action"], d["reason"]] for d in s["decisions"]],
        ),
    ]


def render_plain(summaries: Sequence[Mapping[str, Any]]) -> str:
    """Plain text, for pipes and logs."""
    blocks = []
    for s in summaries:
        lines = _headline(s)
        for title, rows in _tables(s):
            if len(rows) == 1:
                lines.append(f"{title}: none")
                continue
            lines.append(f"{title}:")
            lines += ["  " + line for line in _columns(rows)]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n" if blocks else "no SpeculativeServing found\n"


def render_rich(summaries: Sequence[Mapping[str, Any]], console: Console) -> None:
    """Rich tables, one panel per resource, for a terminal."""
    if not summaries:
        console.print("no SpeculativeServing found")
        return
    for s in summaries:
        parts: list[Any] = [Text(line) for line in _headline(s)]
        for title, rows in _tables(s):
            if len(rows) == 1:
                continue
            table = Table(title=title, title_justify="left", expand=False)
            for header in rows[0]:
                table.add_column(header)
            for row in rows[1:]:
                style = "bold red" if "NO" in row and title == "pods" else None
                table.add_row(*row, style=style)
            parts.append(table)
        console.print(Panel(Group(*parts), title=f"{s['namespace']}/{s['name']}", expand=False))

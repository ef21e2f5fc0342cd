"""The live terminal view (rich): per pod batch size, MAL, K table, drafter, speculating or not, tokens
per second; the last decisions with their reasons; progress through the traffic pattern."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from specserve_operator.local.loadgen import LoadProgress
from specserve_operator.local.samples import DecisionRecord, FleetSample, PodSample
from specserve_operator.local.traffic import TrafficPattern


@dataclass
class ViewState:
    title: str
    stage: str = "starting"  # what the fleet is doing now, in words
    sample: FleetSample | None = None
    progress: LoadProgress | None = None
    pattern: TrafficPattern | None = None
    decisions: list[DecisionRecord] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # start-up steps, warnings


def _fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _k_table(pod: PodSample) -> Text:
    text = Text()
    if pod.mode is None:
        return Text("?", style="dim")
    current = pod.k_now
    for i, (bucket, k) in enumerate(pod.k_by_bucket.items()):
        if i:
            text.append(" ")
        style = "bold" if pod.mode == "on" and k > 0 else "dim"
        text.append(f"{bucket}:{k}", style=style)
    if pod.mode == "off":
        text.append("  (mode off)", style="yellow")
    text.append(f"  → K={current}", style="green" if current else "red")
    return text


def pods_table(pods: Sequence[PodSample]) -> Table:
    table = Table(expand=True, title="pods", title_justify="left")
    for col, justify in (
        ("pod", "left"),
        ("batch", "right"),
        ("tokens/s", "right"),
        ("MAL", "right"),
        ("drafter", "left"),
        ("speculating", "center"),
        ("K per bucket (bucket:K)", "left"),
        ("policy", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for pod in pods:
        spec = pod.speculating
        table.add_row(
            pod.pod,
            _fmt(pod.batch_size),
            _fmt(pod.tokens_per_s),
            _fmt(pod.mal, 2),
            pod.drafter or "[red]unreachable[/red]",
            "?" if spec is None else ("[green]yes[/green]" if spec else "[red]no[/red]"),
            _k_table(pod),
            "–" if pod.policy_version is None else f"v{pod.policy_version}",
        )
    return table


def decisions_table(decisions: Sequence[DecisionRecord], limit: int = 6) -> Table:
    table = Table(expand=True, title="last decisions", title_justify="left")
    table.add_column("run")
    table.add_column("t", justify="right")
    table.add_column("pod")
    table.add_column("action")
    table.add_column("reason", ratio=1)
    for d in list(decisions)[-limit:]:
        table.add_row(d.run, f"{d.t_s:.0f}s", d.pod, d.action, d.reason)
    return table


def progress_line(progress: LoadProgress | None, pattern: TrafficPattern | None) -> RenderableType:
    if progress is None or pattern is None:
        return Text("no traffic yet", style="dim")
    bar = ProgressBar(total=max(progress.total_s, 1e-9), completed=progress.elapsed_s, width=40)
    phases = Text()
    current = pattern.phase_at(progress.elapsed_s)
    for at in pattern.boundaries():
        style = "bold reverse" if current and current.index == at.index else "dim"
        phases.append(f" {at.phase.name}×{at.phase.concurrency} ({at.phase.duration_s:g}s) ", style=style)
    grid = Table.grid(padding=(0, 1))
    grid.add_row(
        Text(f"run: {progress.run}", style="bold"),
        bar,
        Text(f"{progress.elapsed_s:.0f}/{progress.total_s:.0f}s"),
        Text(
            f"clients {progress.concurrency}  in flight {progress.in_flight}  done {progress.completed}  "
            f"failed {progress.failed}  tokens {progress.tokens}"
        ),
    )
    return Group(grid, phases)


def render(state: ViewState) -> RenderableType:
    parts: list[RenderableType] = [
        Text(state.stage, style="bold cyan"),
        progress_line(state.progress, state.pattern),
    ]
    if state.sample is not None:
        parts.append(pods_table(state.sample.pods))
    parts.append(decisions_table(state.decisions))
    if state.messages:
        parts.append(Text("\n".join(state.messages[-4:]), style="dim"))
    return Panel(Group(*parts), title=state.title, border_style="blue")

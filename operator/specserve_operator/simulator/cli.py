"""`specserve simulate`: run the fleet simulator on a trace and print each policy's results."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TextIO

from specserve_operator.simulator.fleet import POLICIES, TRUTHS, FleetSim, SimConfig, measured_cpu_config
from specserve_operator.simulator.traces import load_trace


def run(args: argparse.Namespace) -> dict:
    trace = load_trace(args.trace)
    policies = tuple(args.policy or POLICIES)
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise SystemExit(f"--policy: unknown {', '.join(unknown)} (known: {', '.join(POLICIES)})")
    common = {"pods": args.pods, "gpu": args.gpu, "quantum_s": args.quantum, "policies": policies}
    if args.truth == "measured-cpu":
        cfg = measured_cpu_config(args.measured, **common)
    else:
        cfg = SimConfig(model=args.model, **common)
    started = time.perf_counter()
    sim = FleetSim(cfg, trace)
    results = sim.run()
    return {
        "trace": trace.name,
        "truth": cfg.truth,
        "duration_s": trace.duration_s,
        "wall_s": round(time.perf_counter() - started, 1),
        "policies": {name: r.summary(trace.duration_s) for name, r in results.items()},
    }


def print_table(report: dict, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    print(
        f"trace {report['trace']} ({report['duration_s'] / 3600:.1f} h, truth {report['truth']}, "
        f"simulated in {report['wall_s']} s)",
        file=out,
    )
    print(
        f"{'policy':<14}{'TPOT mean ms':>14}{'TPOT p95 ms':>13}{'wait p95 ms':>13}{'switches':>10}",
        file=out,
    )
    for name, s in report["policies"].items():
        print(
            f"{name:<14}{s['tpot_mean_ms'] or 0:>14.3f}{s['tpot_p95_ms'] or 0:>13.3f}"
            f"{s['wait_p95_ms'] or 0:>13.1f}{s['switches']:>10}",
            file=out,
        )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate", help="simulate a fleet under a load trace with each speculation policy side by side"
    )
    parser.add_argument(
        "--trace", required=True, type=Path, help="CSV with columns t_s,rate_rps,code_fraction"
    )
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--gpu", default="NVIDIA-H200", help="NVIDIA-H200 or NVIDIA-H100")
    parser.add_argument("--model", default="llama-3.1-8b-instruct", help="served model name (size in it)")
    parser.add_argument("--quantum", type=float, default=1.0, help="simulated seconds per batch update")
    parser.add_argument(
        "--truth", choices=TRUTHS, default="gpu", help="the simulated hardware and traffic (docs/policy.md)"
    )
    parser.add_argument(
        "--measured", type=Path, help="the measured-cpu recording (default: benchmarks/truths/)"
    )
    parser.add_argument("--policy", action="append", help=f"one of {', '.join(POLICIES)} (repeatable)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        report = run(args)
    except (OSError, ValueError) as exc:
        print(f"specserve simulate: {exc}", file=sys.stderr)
        return 2
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0

"""`specserve local up RESOURCE.yaml`: the local fleet from the command line (docs/local-fleet.md)."""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.markup import escape

from specserve_operator.local.errors import LocalFleetError
from specserve_operator.local.fleet import (
    DEFAULT_MODELS_DIR,
    FleetRuntime,
    Session,
    UpOptions,
    install_signal_handlers,
    prepare,
    run_session,
)
from specserve_operator.local.plan import FleetPlan
from specserve_operator.local.prometheus import PrometheusError
from specserve_operator.local.replay import (
    RecordedRun,
    StoredPrometheus,
    format_tick,
    load_run,
    replay,
    replay_range,
    tick_times,
)
from specserve_operator.local.replay import __doc__ as replay_doc
from specserve_operator.local.report import (
    RUN_BEST_STATIC,
    RUN_OFF,
    RUN_STATIC,
    load_report_input,
    write_report,
)
from specserve_operator.local.traffic import TrafficPatternError, parse_pattern
from specserve_operator.local.view import ViewState, render

# Quiet, then busy well past the cliff measured on a 2-core machine, then quiet again (docs/local-fleet.md).
DEFAULT_TRAFFIC = "quiet:60s:1,busy:90s:16,quiet:60s:1"
COMPARISON_RUNS = (RUN_OFF, RUN_STATIC, RUN_BEST_STATIC)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    local = subparsers.add_parser("local", help="run a SpeculativeServing on this machine, no cluster")
    sub = local.add_subparsers(dest="local_command", required=True, metavar="COMMAND")
    up = sub.add_parser(
        "up",
        help="start engines, sidecars, Prometheus and the controller; send traffic; write a report",
        description=__doc__,
    )
    up.add_argument(
        "manifest", type=Path, help="a SpeculativeServing manifest, e.g. examples/local-fleet.yaml"
    )
    up.add_argument(
        "--traffic",
        default=DEFAULT_TRAFFIC,
        help="phases NAME:DURATION:CONCURRENCY[:CODE_FRACTION], comma-separated (default: %(default)s)",
    )
    up.add_argument(
        "--compare",
        default=",".join(COMPARISON_RUNS),
        help="comparison runs after the controller's run, comma-separated: off (plain decoding on a stock "
        "vLLM per replica), static (the first drafter at its maximum K), best-static (the best static "
        "table for this traffic, from a sweep on the same pods); or none (default: %(default)s)",
    )
    up.add_argument(
        "--sweep-point",
        type=float,
        default=8.0,
        help="seconds each candidate runs each traffic shape in the best-static sweep (default: %(default)s)",
    )
    up.add_argument(
        "--sweep-rounds",
        type=int,
        default=2,
        help="rounds of the best-static sweep, interleaved; each candidate counts at the median of its "
        "rounds (default: %(default)s)",
    )
    up.add_argument(
        "--compare-scale",
        type=float,
        default=0.5,
        help="duration of the comparison runs relative to the pattern (default: %(default)s)",
    )
    up.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    up.add_argument("--replicas", type=int, default=None, help="override spec.replicas")
    up.add_argument(
        "--out",
        type=Path,
        default=Path("reports") / "local-fleet",
        help="parent folder of the run folders (default: %(default)s)",
    )
    up.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR, help="where model sources resolve")
    up.add_argument("--prometheus-port", type=int, default=None, help="default: a free port")
    up.add_argument(
        "--controller-window",
        type=float,
        default=60.0,
        help="seconds of metrics each controller decision looks at (default: %(default)s)",
    )
    up.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache per engine (default: %(default)s)")
    up.add_argument("--no-live", action="store_true", help="plain log lines instead of the live view")
    up.set_defaults(func=up_command)
    report = sub.add_parser("report", help="re-render a run's report from its data.json")
    report.add_argument("run_dir", type=Path, help="a run folder written by `specserve local up`")
    report.set_defaults(func=report_command)
    replay = sub.add_parser(
        "replay",
        help="drive the controller again over a run's stored Prometheus data, tick by tick",
        description=replay_doc,
    )
    replay.add_argument("run_dir", type=Path, help="a run folder written by `specserve local up`")
    replay.add_argument(
        "--from",
        dest="start",
        default=None,
        help="first tick, ISO 8601 (default: the first recorded decision)",
    )
    replay.add_argument(
        "--to", dest="end", default=None, help="last tick, ISO 8601 (default: where the run's data ends)"
    )
    replay.add_argument(
        "--controller-window",
        type=float,
        default=60.0,
        help="the run's --controller-window (default: %(default)s)",
    )
    replay.add_argument("--every-tick", action="store_true", help="a line for every tick, holds included")
    replay.set_defaults(func=replay_command)


def report_command(args: argparse.Namespace) -> int:
    data_json = args.run_dir / "report" / "data.json"
    if not data_json.exists():
        Console(stderr=True).print(f"[bold red]error:[/bold red] {data_json}: no such file")
        return 2
    md = write_report(data_json.parent, load_report_input(data_json))
    print(md)
    return 0


def replay_command(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        if args.controller_window < 5 or not math.isfinite(args.controller_window):
            raise LocalFleetError("--controller-window: must be at least 5 seconds")
        run = load_run(args.run_dir)
        first, last = replay_range(run, args.start, args.end)
        times = tick_times(first, last, run.interval_s)
        with StoredPrometheus(run.data_dir) as prometheus:
            counts = asyncio.run(_replay(run, prometheus.url, times, args))
    except LocalFleetError as exc:
        console.print(f"[bold red]error:[/bold red] {escape(exc.message)}")
        if exc.hint:
            console.print(f"[yellow]hint:[/yellow] {escape(exc.hint)}")
        return 2
    except PrometheusError as exc:
        console.print(f"[bold red]error:[/bold red] {escape(str(exc))}")
        return 2
    ticks, shown, recorded, same = counts
    print(
        f"replayed {ticks} ticks, {shown} shown; the run recorded {recorded} decisions in that span, "
        f"{same} with the action replayed"
    )
    return 0


async def _replay(
    run: RecordedRun, url: str, times: list[float], args: argparse.Namespace
) -> tuple[int, ...]:
    ticks = shown = recorded = same = 0
    async for tick in replay(run, url, times, args.controller_window):
        ticks += 1
        if tick.recorded is not None:
            recorded += 1
            same += tick.recorded.action == tick.action
        if args.every_tick or tick.notable:
            shown += 1
            print(format_tick(tick), flush=True)
    return ticks, shown, recorded, same


def options_from_args(args: argparse.Namespace) -> UpOptions:
    try:
        pattern = parse_pattern(args.traffic)
    except TrafficPatternError as exc:
        raise LocalFleetError(f"--traffic: {exc}", hint=f"e.g. --traffic {DEFAULT_TRAFFIC}") from None
    compare = tuple(c for c in args.compare.split(",") if c and c != "none")
    for c in compare:
        if c not in COMPARISON_RUNS:
            runs = ", ".join(COMPARISON_RUNS)
            raise LocalFleetError(f"--compare: unknown run {c!r}", hint=f"use {runs} or none")
    if args.sweep_point <= 0 or not math.isfinite(args.sweep_point):
        raise LocalFleetError("--sweep-point: must be a positive number of seconds")
    if args.sweep_rounds < 1:
        raise LocalFleetError("--sweep-rounds: must be at least 1")
    if args.compare_scale <= 0:
        raise LocalFleetError("--compare-scale: must be > 0")
    if args.controller_window < 5:
        raise LocalFleetError(
            "--controller-window: must be at least 5 seconds (Prometheus scrapes every second)"
        )
    if args.max_tokens < 1:
        raise LocalFleetError("--max-tokens: must be at least 1")
    if args.replicas is not None and args.replicas < 1:
        raise LocalFleetError("--replicas: must be at least 1")
    return UpOptions(
        manifest=args.manifest,
        pattern=pattern,
        out_dir=args.out,
        models_dir=args.models_dir,
        replicas=args.replicas,
        compare=compare,
        compare_scale=args.compare_scale,
        max_tokens=args.max_tokens,
        prometheus_port=args.prometheus_port,
        kv_cache_gib=args.kv_cache_gib,
        window_s=args.controller_window,
        sweep_point_s=args.sweep_point,
        sweep_rounds=args.sweep_rounds,
    )


def up_command(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        opts = options_from_args(args)
        plan, run_dir = prepare(opts)
    except LocalFleetError as exc:
        console.print(f"[bold red]error:[/bold red] {exc.message}")
        if exc.hint:
            console.print(f"[yellow]hint:[/yellow] {exc.hint}")
        return 2
    live = console.is_terminal and not args.no_live
    try:
        report = asyncio.run(_up(opts, plan, console, live))
    except LocalFleetError as exc:
        console.print(f"[bold red]error:[/bold red] {exc.message}")
        if exc.hint:
            console.print(f"[yellow]hint:[/yellow] {exc.hint}")
        console.print(f"logs: {run_dir}")
        return 1
    except asyncio.CancelledError:
        console.print(f"stopped (Ctrl-C); every process was stopped. Logs and a partial report: {run_dir}")
        return 130
    console.print(f"[bold green]report:[/bold green] {report}")
    return 0


async def _up(opts: UpOptions, plan: FleetPlan, console: Console, live: bool) -> Path:
    state = ViewState(title=f"specserve local fleet: {plan.namespace}/{plan.name}")
    rt = FleetRuntime()
    last_print = [0.0, 0]

    def plain() -> None:
        # Without a terminal: new messages at once, a one-line status every 10 seconds.
        while last_print[1] < len(state.messages):
            console.print(state.messages[last_print[1]], markup=False)
            last_print[1] += 1
        now = time.monotonic()
        if state.progress and state.sample and now - last_print[0] >= 10:
            last_print[0] = now
            pods = "  ".join(
                f"{p.pod}: batch {p.batch_size or 0:.0f} K={p.k_now} {p.drafter} MAL "
                f"{'–' if p.mal is None else f'{p.mal:.2f}'}"
                for p in state.sample.pods
            )
            console.print(
                f"[{state.progress.run} {state.progress.elapsed_s:.0f}/{state.progress.total_s:.0f}s "
                f"{state.progress.phase}] {pods}",
                markup=False,
            )

    viewer = Live(render(state), console=console, refresh_per_second=2, transient=False) if live else None
    session = Session(
        opts, plan, state, on_change=(lambda: viewer.update(render(state))) if viewer else plain
    )
    task = asyncio.current_task()
    assert task is not None
    install_signal_handlers(task)
    try:
        if viewer:
            viewer.start()
        return await run_session(session, rt)
    finally:
        if viewer:
            viewer.stop()
        console.print("stopping engines, sidecars and Prometheus …")
        await asyncio.to_thread(rt.stop)

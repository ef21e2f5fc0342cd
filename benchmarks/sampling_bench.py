"""Lossless under sampling, per drafter and placement: samples from real engines on the tiny models
against the target's own distribution at the drafted positions (tests/specserve_testing/sampling_checks.py
holds the design and the power calculation; docs/engine-pod.md, "Lossless under sampling", the scope).

    .venv/bin/python benchmarks/sampling_bench.py [--out benchmarks/results/engine.json]

Three phases, one after the other (all engines at once would not fit in a small machine's memory): the
plain engine (the control) with vLLM's n-gram, suffix and draft-model drafters; the speculator heads
(EAGLE-3, EAGLE, Medusa, MTP); the sidecar-hosted drafters behind one engine's custom_class proposer.
Merges the key `sampling_lossless` into the results file (its other keys are engine_bench.py's) and
prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from specserve_engine.client import SidecarClient
from specserve_engine.draft_protocol import DEADLINE_ENV
from specserve_engine.launch import EngineSpec, start_engines, start_sidecar

REPO = Path(__file__).resolve().parents[1]
# The engines and the check are the tests' own (tests/specserve_testing).
sys.path.insert(0, str(REPO / "tests"))
from specserve_testing.engines import (  # noqa: E402
    DRAFT_MODEL,
    DTYPE,
    ENGINE_START_TIMEOUT_S,
    HEADS,
    NGRAM,
    SUFFIX,
    TARGET,
    RunningEngine,
    engine_spec,
    running_engines,
    target_of,
)
from specserve_testing.sampling_checks import (  # noqa: E402
    ALPHA,
    DETECTABLE_TV,
    MAX_TOKENS,
    OBSERVATIONS,
    POWER,
    PROMPTS,
    SamplingRun,
    sampling_run,
)
from specserve_testing.sampling_stats import BINS, SETTINGS  # noqa: E402
from specserve_testing.sidecar_pod import (  # noqa: E402
    BUCKETS,
    ENGINE_DRAFTER,
    MAX_NUM_SEQS,
    SIDECAR_DRAFTERS,
    full_k_policy,
    sidecar_config,
)

KEY = "sampling_lossless"


async def each_setting(engine: RunningEngine, label: str, target: Path = TARGET) -> list[SamplingRun]:
    runs = []
    for setting in SETTINGS:
        t0 = time.perf_counter()
        runs.append(await sampling_run(engine, setting, label, target))
        print(f"{runs[-1].row()}  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return runs


async def colocated(workdir: Path) -> list[SamplingRun]:
    """Phase 1: the control and vLLM's own drafters."""
    wanted = {"plain": None, "ngram": NGRAM, "suffix": SUFFIX, "draft-model": DRAFT_MODEL}
    specs = [engine_spec(n, d, workdir / n) for n, d in wanted.items()]
    runs = []
    with running_engines(specs, workdir / "logs") as engines:
        for name, engine in engines.items():
            label = "plain (control)" if engine.drafter is None else f"{name} (colocated)"
            runs += await each_setting(engine, label)
    return runs


async def heads(workdir: Path) -> list[SamplingRun]:
    """Phase 2: the speculator heads, each against the target it serves (MTP's is the MiMo package)."""
    specs = [engine_spec(n, d, workdir / n, model=target_of(d)) for n, d in HEADS.items()]
    runs = []
    with running_engines(specs, workdir / "logs") as engines:
        for name, engine in engines.items():
            runs += await each_setting(engine, f"{name} (colocated)", target_of(engine.drafter))
    return runs


async def sidecar_hosted(workdir: Path) -> list[SamplingRun]:
    """Phase 3: every sidecar drafter, switched in turn, behind the engine's custom_class proposer."""
    runtime = workdir / "run"
    config = sidecar_config(runtime)
    sidecar = start_sidecar(config, workdir / "sidecar")
    spec = EngineSpec(
        model=str(TARGET),
        served_model_name="tiny-sidecar",
        runtime_dir=str(runtime),
        drafter=ENGINE_DRAFTER,
        max_num_seqs=MAX_NUM_SEQS,
        bucket_bounds=BUCKETS,
        dtype=DTYPE,
        env={DEADLINE_ENV: "250"},
    )
    runs = []
    try:
        sidecar.wait_ready()
        (process,) = start_engines([spec], workdir / "logs", timeout_s=ENGINE_START_TIMEOUT_S)
        engine = RunningEngine("tiny-sidecar", process, ENGINE_DRAFTER, runtime, runtime / "steps.jsonl")
        try:
            version = config.initial_policy.policy_version
            async with aiohttp.ClientSession() as session:
                client = SidecarClient(sidecar.url, None, session, timeout_s=60)
                for drafter in SIDECAR_DRAFTERS:
                    version += 1
                    _, state = await client.put_policy(full_k_policy(version, drafter))
                    while state.policy_version != version:
                        await asyncio.sleep(0.1)
                        state = await client.state()
                    runs += await each_setting(engine, f"{drafter} (sidecar)")
        finally:
            process.stop()
    finally:
        sidecar.stop()
    return runs


def summary(runs: list[SamplingRun]) -> dict:
    by_label: dict[str, dict] = {}
    for run in runs:
        by_label.setdefault(run.label, {})[run.setting.name] = run.as_dict()
    return {
        "design": {
            "what": "randomized PIT of every tested token under the target's own distribution (temperature, "
            "top-k, top-p applied), pooled over the tested positions, chi-square uniformity test",
            "max_tokens": MAX_TOKENS,
            "tested_positions": "2..max_tokens (the first comes from the prefill)",
            "prompts": len(PROMPTS),
            "bins": BINS,
            "alpha_per_check": ALPHA,
            "detectable_total_variation": DETECTABLE_TV,
            "power": POWER,
            "observations_needed": OBSERVATIONS,
        },
        "runs": by_label,
        "all_pass": all(run.result.p_value >= ALPHA for run in runs),
    }


def table(runs: list[SamplingRun]) -> str:
    head = (
        f"{'drafter (placement)':<24} {'setting':<28} {'p':>9} {'TV':>7} {'N':>6} "
        f"{'drafts/tok':>10} {'accept':>6}"
    )
    lines = [head, "-" * len(head)]
    for run in runs:
        r = run.result
        acceptance = "-" if run.acceptance is None else f"{run.acceptance:.2f}"
        lines.append(
            f"{run.label:<24} {run.setting.name:<28} {r.p_value:>9.3g} {r.total_variation:>7.4f} "
            f"{r.observations:>6} {run.drafts_per_tested_token:>10.2f} {acceptance:>6}"
        )
    return "\n".join(lines)


def merge(out: Path, runs: list[SamplingRun]) -> None:
    """Write the key into the results file, keeping its other keys."""
    results = json.loads(out.read_text()) if out.exists() else {}
    results[KEY] = summary(runs)
    out.write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "engine.json"))
    args = parser.parse_args()
    out = Path(args.out)
    runs: list[SamplingRun] = []
    with tempfile.TemporaryDirectory(prefix="sampling-bench-") as tmp:
        for phase in (colocated, heads, sidecar_hosted):
            runs += asyncio.run(phase(Path(tmp) / phase.__name__))
            merge(out, runs)  # after each phase: a long run keeps what it has measured
    print(table(runs))
    print(f"\nmerged {KEY} into {out}")


if __name__ == "__main__":
    main()

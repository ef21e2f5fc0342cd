"""Record what a real engine pod exports to Prometheus, as test data for the controller's reader.

    .venv/bin/python scripts/record_engine_metrics.py [--out tests/tuner/data]

Starts one sidecar-hosted engine pod on the tiny models (the pod tests/sidecar/test_sidecar_engine.py
checks: a real `vllm serve` of models/tiny-target with the sidecar proposer, and the real sidecar), scrapes
the engine's and the sidecar's /metrics, runs a short load (batches of concurrent requests and single ones,
under n-gram then suffix drafting at K = 4 everywhere), and scrapes both again. Writes the four exposition
texts (`engine_start.prom`, `engine_end.prom`, `sidecar_start.prom`, `sidecar_end.prom`) and
`recording.json` (what ran, how long, the load average). tests/tuner/test_recorded_metrics.py feeds them
through a real Prometheus into the reader, the observation builder and a decision. About two minutes on
two cores, most of it the engine's start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from specserve_engine.client import SidecarClient
from specserve_engine.draft_protocol import DEADLINE_ENV
from specserve_engine.launch import EngineSpec, start_engines, start_sidecar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from specserve_testing.engines import (  # noqa: E402
    DOMAINS,
    DTYPE,
    ENGINE_START_TIMEOUT_S,
    MAX_NUM_SEQS,
    TARGET,
    RunningEngine,
    complete_many,
    prompts,
)
from specserve_testing.sidecar_pod import BUCKETS, ENGINE_DRAFTER, full_k_policy, sidecar_config  # noqa: E402

SERVED_NAME = "tiny-sidecar"
TOKENS = 32
# (drafter, requests sent together): batches fill the middle buckets, single requests bucket 1.
LOAD: tuple[tuple[str, int], ...] = (("ngram", 12), ("ngram", 1), ("ngram", 1), ("suffix", 12), ("suffix", 1))


async def _text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as resp:
        resp.raise_for_status()
        return await resp.text()


async def _scrape(engine_url: str, sidecar_url: str) -> tuple[str, str]:
    async with aiohttp.ClientSession() as session:
        return await _text(session, engine_url), await _text(session, sidecar_url)


async def _apply(sidecar_url: str, version: int, drafter: str) -> None:
    """Put a full-K policy for `drafter` and wait until the sidecar has it in force."""
    async with aiohttp.ClientSession() as session:
        client = SidecarClient(sidecar_url, None, session, timeout_s=30)
        await client.put_policy(full_k_policy(version, drafter))
        for _ in range(600):
            if (await client.state()).policy_version == version:
                return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"policy {version} ({drafter}) not in force after 60 s")


def record(out: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="record-metrics-") as tmp:
        workdir = Path(tmp)
        runtime = workdir / "run"
        sidecar = start_sidecar(sidecar_config(runtime), workdir / "sidecar")
        spec = EngineSpec(
            model=str(TARGET),
            served_model_name=SERVED_NAME,
            runtime_dir=str(runtime),
            drafter=ENGINE_DRAFTER,
            max_num_seqs=MAX_NUM_SEQS,
            bucket_bounds=BUCKETS,
            dtype=DTYPE,
            env={DEADLINE_ENV: "250"},
        )
        try:
            sidecar.wait_ready()
            (process,) = start_engines([spec], workdir / "logs", timeout_s=ENGINE_START_TIMEOUT_S)
        except BaseException:
            sidecar.stop()
            raise
        try:
            engine = RunningEngine(SERVED_NAME, process, ENGINE_DRAFTER, runtime, runtime / "steps.jsonl")
            engine_start, sidecar_start = asyncio.run(_scrape(engine.url, sidecar.url))
            started = time.monotonic()
            version, drafter = sidecar.config.initial_policy.policy_version, None
            texts = [p for d in DOMAINS for p in prompts(d)]
            for i, (name, n) in enumerate(LOAD):
                if name != drafter:
                    version, drafter = version + 1, name
                    asyncio.run(_apply(sidecar.url, version, name))
                batch = [texts[(i * 7 + j) % len(texts)] for j in range(n)]
                asyncio.run(complete_many(engine, batch, TOKENS))
            elapsed = time.monotonic() - started
            engine_end, sidecar_end = asyncio.run(_scrape(engine.url, sidecar.url))
        finally:
            process.stop()
            sidecar.stop()
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("engine_start.prom", engine_start),
        ("engine_end.prom", engine_end),
        ("sidecar_start.prom", sidecar_start),
        ("sidecar_end.prom", sidecar_end),
    ):
        (out / name).write_text(text)
    meta = {
        "served_model_name": SERVED_NAME,
        "buckets": list(BUCKETS),
        "load": [{"drafter": d, "concurrent_requests": n, "tokens": TOKENS} for d, n in LOAD],
        "seconds_between_scrapes": round(elapsed, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "machine": platform.machine(),
    }
    (out / "recording.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "tuner" / "data")
    print(json.dumps(record(parser.parse_args().out)))


if __name__ == "__main__":
    main()

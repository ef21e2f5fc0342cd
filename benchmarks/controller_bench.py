"""Controller benchmark: the fleet simulator on the shipped traces with every policy side by side, a
low-batch TPOT check, and one decision tick over 1,000 resources × 8 pods against a stub Prometheus.

    .venv/bin/python benchmarks/controller_bench.py            # everything (a few minutes on 2 cores)
    .venv/bin/python benchmarks/controller_bench.py --scale    # only the scale tick (used internally)

Writes benchmarks/results/controller.json and controller_<trace>.png, and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import aiohttp

from specserve_operator.simulator.fleet import DrafterProfile, FleetSim, SimConfig, flat
from specserve_operator.simulator.traces import load_trace, write_trace
from specserve_operator.tuner import core
from specserve_operator.tuner import observations as ob
from specserve_operator.tuner.loop import FleetController

ROOT = Path(__file__).resolve().parent
TRACES = [ROOT / "traces" / "diurnal_24h.csv", ROOT / "traces" / "bursty_6h.csv"]
RESULTS = ROOT / "results"
STATIC = ("off", "static_on", "static_table")
GOALS = {
    "specserve_vs_best_static_min_hourly": 0.98,
    "specserve_vs_oracle": 0.95,
    "low_batch_tpot_speedup_vs_off": 1.8,
    "scale_tick_s": 2.0,
    "scale_queries_per_tick": 5,
    "scale_rss_mb": 300.0,
}


def simulate(trace_path: Path, quantum_s: float) -> dict:
    trace = load_trace(trace_path)
    started = time.perf_counter()
    sim = FleetSim(SimConfig(quantum_s=quantum_s), trace)
    results = sim.run()
    policies = {name: r.summary(trace.duration_s) for name, r in results.items()}
    hours = len(policies["off"]["hourly"])
    hourly_goodput, hourly_tpot, cumulative = [], [], []
    served = dict.fromkeys(policies, 0.0)
    for h in range(hours):
        # Tokens served by the end of each hour: a policy that fell behind at the peak and serves its
        # backlog an hour late does not count as ahead in the later hour.
        for name in policies:
            served[name] += policies[name]["hourly"][h]["goodput_tokens_per_s"]
        cumulative.append(served["specserve"] / max(served[n] for n in STATIC))
        row = {name: policies[name]["hourly"][h] for name in policies}
        best_good = max(row[n]["goodput_tokens_per_s"] for n in STATIC)
        hourly_goodput.append(row["specserve"]["goodput_tokens_per_s"] / best_good if best_good else 1.0)
        tpots = [row[n]["tpot_mean_ms"] for n in STATIC if row[n]["tpot_mean_ms"]]
        if tpots and row["specserve"]["tpot_mean_ms"]:
            hourly_tpot.append(min(tpots) / row["specserve"]["tpot_mean_ms"])
    spec, oracle = policies["specserve"], policies["oracle"]
    return {
        "trace": trace.name,
        "hours": round(trace.duration_s / 3600, 2),
        "pods": sim.cfg.pods,
        "gpu": sim.cfg.gpu,
        "model": sim.cfg.model,
        "quantum_s": quantum_s,
        "wall_s": round(time.perf_counter() - started, 1),
        "controller_s": round(sim.controller_s, 2),
        "policies": policies,
        "specserve_vs_best_static_min_hourly": round(min(hourly_goodput), 4),
        "specserve_vs_best_static_min_hourly_tpot": round(min(hourly_tpot), 4),
        "specserve_vs_best_static_min_hourly_cumulative": round(min(cumulative), 4),
        "specserve_vs_oracle": round(spec["goodput_tokens_per_s"] / oracle["goodput_tokens_per_s"], 4),
        "specserve_vs_oracle_tpot": round(oracle["tpot_mean_ms"] / spec["tpot_mean_ms"], 4),
    }


def low_batch(quantum_s: float) -> dict:
    """Two pods at a trickle of traffic (batch ≤ 4), one EAGLE-style drafter with α = 0.8 at every
    position on all traffic: TPOT with the controller against plain decoding."""
    from specserve_operator.api.models import DrafterSpec

    drafter = DrafterProfile(
        DrafterSpec(name="eagle3", method="eagle3", source="hf://org/eagle3-head", maxSpeculativeTokens=5),
        {"code": flat(0.8), "prose": flat(0.8)},
    )
    path = RESULTS / ".low_batch_trace.csv"
    write_trace(path, [(0.0, 0.6, 0.5), (3600.0, 0.6, 0.5)])
    try:
        trace = load_trace(path)
    finally:
        path.unlink()
    cfg = SimConfig(pods=2, drafters=(drafter,), quantum_s=quantum_s, policies=("off", "specserve"))
    sim = FleetSim(cfg, trace)
    results = {name: r.summary(trace.duration_s) for name, r in sim.run().items()}
    off, spec = results["off"], results["specserve"]
    return {
        "drafter_alpha": 0.8,
        "rate_rps": 0.6,
        "batch_mean": spec["batch_mean"],
        "batch_max": spec["batch_max"],
        "tpot_off_ms": off["tpot_mean_ms"],
        "tpot_specserve_ms": spec["tpot_mean_ms"],
        "low_batch_tpot_speedup_vs_off": round(off["tpot_mean_ms"] / spec["tpot_mean_ms"], 3),
        "k_by_bucket": dict(sim.state.k_by_bucket),
    }


# ---- scale: one tick over 1,000 resources × 8 pods against a stub Prometheus ------------------------
RESOURCES, PODS = 1000, 8


def _stub_vectors() -> dict[str, bytes]:
    """Canned answers to the reader's four queries, keyed by the first row kind each query asks for."""
    rng = random.Random(3)
    engine, spec, state, fallback = [], [], [], []
    for r in range(RESOURCES):
        ns = f"ns-{r % 50}"
        for p in range(PODS):
            pod = f"res-{r}-{p}"
            base = {"namespace": ns, "pod": pod}
            for bucket, speculating in (("8", "true"), ("16", "true"), ("32", "false")):
                steps = rng.uniform(2000, 9000)
                lab = {**base, "bucket": bucket, "speculating": speculating}
                engine.append((ob.STEPS, lab, steps))
                engine.append((ob.STEP_SECONDS, lab, steps * 0.012))
                engine.append((ob.TOKENS, lab, steps * int(bucket) * (2.5 if speculating == "true" else 1)))
                if speculating == "true":
                    slab = {**base, "bucket": bucket, "drafter": "eagle3"}
                    drafts = steps * int(bucket)
                    spec += [(ob.DRAFTS, slab, drafts), (ob.DRAFT_TOKENS, slab, drafts * 4)]
                    spec.append((ob.ACCEPTED, slab, drafts * 1.8))
            surv = 1.0
            for pos in range(4):
                surv *= 0.8
                plab = {**base, "drafter": "eagle3", "position": str(pos)}
                spec += [(ob.ACCEPTED_POS, plab, 40000 * surv), (ob.PROPOSED_POS, plab, 40000.0)]
            info = {**base, "drafter": "eagle3", "mode": "on", "policy_version": "3"}
            state += [(ob.POLICY_INFO, info, 1.0), (ob.RUNNING, base, 20.0), (ob.GPU_UTIL, base, 60.0)]
    del fallback

    def encode(rows: list) -> bytes:
        result = [{"metric": {**labels, "m": kind}, "value": [0, str(value)]} for kind, labels, value in rows]
        return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()

    empty = json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}).encode()
    return {
        ob.STEPS: encode(engine),
        ob.DRAFTS: encode(spec),
        ob.POLICY_INFO: encode(state),
        ob.VLLM_DRAFTS: empty,
    }


def _serve_stub() -> None:
    """Serve the canned vectors on a free port (printed on stdout) until killed: the stub Prometheus,
    in a process of its own so that the controller's CPU time and memory are measured alone."""
    vectors = _stub_vectors()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            query = parse_qs(urlparse(self.path).query).get("query", [""])[0]
            kind = next((k for k in vectors if f'"m", "{k}"' in query), None)
            body = vectors[kind] if kind else b"{}"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], sum(len(v) for v in vectors.values()), flush=True)
    server.serve_forever()


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):  # peak resident set
            return int(line.split()[1]) / 1024
    return 0.0


async def _scale_tick(url: str) -> tuple[float, int]:
    from specserve_operator.api.models import SpeculativeServingSpec

    spec = SpeculativeServingSpec.model_validate(
        {
            "replicas": PODS,
            "model": {"name": "llama-3.1-8b-instruct", "source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
            "engine": {"image": "engine", "gpu": {"count": 1, "product": "NVIDIA-H100"}},
            "drafters": [
                {"name": "eagle3", "method": "eagle3", "source": "hf://org/eagle3", "maxSpeculativeTokens": 4}
            ],
        }
    )
    views = [
        core.ResourceView(f"ns-{r % 50}", f"res-{r}", spec, tuple(f"res-{r}-{p}" for p in range(PODS)))
        for r in range(RESOURCES)
    ]
    async with aiohttp.ClientSession() as session:
        controller = FleetController(url, session, max_age_s=60.0)
        started = time.perf_counter()
        ticks = await controller.decide_all(views)
        elapsed = time.perf_counter() - started
    decided = sum(1 for t in ticks.values() if t.decision is not None and t.decision.action != "noData")
    if decided != RESOURCES:
        raise RuntimeError(f"scale tick decided for {decided} of {RESOURCES} resources")
    return elapsed, sum(r.queries for r in controller.readers.values())


def scale() -> dict:
    stub = subprocess.Popen(
        [sys.executable, __file__, "--stub"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert stub.stdout is not None
        port, size = (int(x) for x in stub.stdout.readline().split())
        cpu = time.process_time()
        tick_s, queries = asyncio.run(_scale_tick(f"http://127.0.0.1:{port}"))
        cpu = time.process_time() - cpu
    finally:
        stub.terminate()
        stub.wait()
    return {
        "resources": RESOURCES,
        "pods_per_resource": PODS,
        "tick_s": round(tick_s, 3),
        "tick_cpu_s": round(cpu, 3),
        "queries_per_tick": queries,
        "response_mb": round(size / 1e6, 1),
        "rss_mb": round(_rss_mb(), 1),
        "load_average_1m": round(os.getloadavg()[0], 2),  # a shared 2-core machine: wall time > CPU time
    }


def plot(run: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name, s in run["policies"].items():
        hours = [h["hour"] for h in s["hourly"]]
        ax1.plot(hours, [h["tpot_mean_ms"] for h in s["hourly"]], marker=".", label=name)
        ax2.plot(hours, [h["goodput_tokens_per_s"] for h in s["hourly"]], marker=".", label=name)
    ax1.set_ylabel("TPOT mean (ms)")
    ax2.set_ylabel("goodput (tokens/s)")
    ax2.set_xlabel("hour of trace")
    ax1.set_title(f"{run['trace']}: {run['pods']} pods, {run['model']} on {run['gpu']} (simulated)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", action="store_true", help="only the scale tick; print its JSON")
    parser.add_argument("--stub", action="store_true", help="serve the stub Prometheus (used by --scale)")
    parser.add_argument("--quantum", type=float, default=1.0, help="simulated seconds per batch update")
    args = parser.parse_args()
    if args.stub:
        _serve_stub()
        return 0
    if args.scale:
        print(json.dumps(scale()))
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    # The scale tick in a process of its own, so its peak RSS is the controller's, not the simulator's.
    out = subprocess.run(
        [sys.executable, __file__, "--scale"], check=True, capture_output=True, text=True
    ).stdout
    scale_result = json.loads(out.strip().splitlines()[-1])
    runs = [simulate(path, args.quantum) for path in TRACES]
    low = low_batch(args.quantum)
    for run in runs:
        plot(run, RESULTS / f"controller_{run['trace']}.png")
    summary = {
        "specserve_vs_best_static_min_hourly": min(r["specserve_vs_best_static_min_hourly"] for r in runs),
        "specserve_vs_best_static_min_hourly_tpot": min(
            r["specserve_vs_best_static_min_hourly_tpot"] for r in runs
        ),
        "specserve_vs_best_static_min_hourly_cumulative": min(
            r["specserve_vs_best_static_min_hourly_cumulative"] for r in runs
        ),
        "specserve_vs_oracle": min(r["specserve_vs_oracle"] for r in runs),
        "specserve_vs_oracle_tpot": min(r["specserve_vs_oracle_tpot"] for r in runs),
        "low_batch_tpot_speedup_vs_off": low["low_batch_tpot_speedup_vs_off"],
        "scale_tick_s": scale_result["tick_s"],
        "scale_queries_per_tick": scale_result["queries_per_tick"],
        "scale_rss_mb": scale_result["rss_mb"],
    }
    met = {
        "specserve_vs_best_static_min_hourly": summary["specserve_vs_best_static_min_hourly"] >= 0.98,
        "specserve_vs_oracle": summary["specserve_vs_oracle"] >= 0.95,
        "low_batch_tpot_speedup_vs_off": summary["low_batch_tpot_speedup_vs_off"] >= 1.8,
        "scale_tick_s": summary["scale_tick_s"] < 2.0,
        "scale_queries_per_tick": summary["scale_queries_per_tick"] <= 5,
        "scale_rss_mb": summary["scale_rss_mb"] < 300.0,
    }
    report = {
        "note": (
            "Simulated fleet (operator/specserve_operator/simulator): step times from the roofline model "
            "with the H200 figures in docs/policy.md (4.3 TB/s, 790 TFLOP/s bf16); no GPU was lent, so "
            "no h200_calibration.json. Goodput is delivered output tokens per second: on an open-loop trace "
            "every policy that keeps up delivers the same tokens, so goodput ratios differ only where a "
            "policy saturates; the *_tpot ratios (best TPOT / specserve TPOT) show the latency side. A "
            "policy that saturates at the peak serves its backlog in later hours, above that hour's demand: "
            "*_cumulative compares tokens served by the end of each hour instead."
        ),
        "goals": GOALS,
        "summary": summary,
        "goals_met": met,
        "traces": {r["trace"]: r for r in runs},
        "low_batch": low,
        "scale": scale_result,
    }
    # numpy scalars (np.float64, np.bool_) as plain Python values.
    text = json.dumps(report, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o))
    (RESULTS / "controller.json").write_text(text + "\n")
    print(f"{'trace':<14}{'policy':<14}{'goodput tok/s':>14}{'TPOT ms':>10}{'p95 ms':>10}{'switches':>10}")
    for r in runs:
        for name, s in r["policies"].items():
            print(
                f"{r['trace']:<14}{name:<14}{s['goodput_tokens_per_s']:>14.1f}{s['tpot_mean_ms']:>10.2f}"
                f"{s['tpot_p95_ms']:>10.2f}{s['switches']:>10}"
            )
    for key, value in summary.items():
        goal = met.get(key)
        print(f"{key:<44}{value:>10}  {'' if goal is None else ('met' if goal else 'MISSED')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

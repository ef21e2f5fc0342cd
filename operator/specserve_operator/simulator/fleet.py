"""A fleet simulator that the real controller drives: metrics in, policy out, simulated time.

Every policy runs its own fleet of pods on the same arrivals (common random numbers), all fleets side by
side in one set of arrays. Time advances in quanta of `quantum_s`; within a quantum each pod's batch is
fixed: continuous batching admits waiting requests into free slots, prefill takes its share of the
quantum (chunked prefill), and decode runs quantum/T(B, K) steps. Each sequence replays its own
acceptance sequence step by step (truths.AcceptanceLibrary), so tokens per step differ between sequences
and along each one.

The truth (truths.py: `gpu` or `measured-cpu`) is not the controller's cost model: the controller has to
learn it from the metrics, exactly as it would from Prometheus. The `specserve` fleet's counters are
folded into the same observation rows (`observations.build_snapshot`) that the Prometheus reader produces.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specserve_engine.buckets import DEFAULT_BUCKETS, bucket_labels
from specserve_operator.api.models import DrafterSpec, SpeculativeServingSpec
from specserve_operator.render.children import initial_policy
from specserve_operator.simulator import truths
from specserve_operator.simulator.baselines import BucketBandit, EmaTiers, StaticTable
from specserve_operator.simulator.traces import Trace
from specserve_operator.tuner import core, observations
from specserve_operator.tuner import policy as tuner_policy

POLICIES = ("off", "static_on", "sglang", "bandit", "specserve", "oracle", "clairvoyant")
# The policies that pick per step from the truth itself (FleetSim._oracle): bounds, not contenders.
ORACLES = ("oracle", "clairvoyant")
TRUTHS = ("gpu", "measured-cpu")
POOL = 1 << 17  # requests per pod that may wait in some fleet's backlog while another fleet has served them
SHADOW_ROWS = 4  # rows of a pod's batch whose shadow drafts its sidecar scores (specserve_engine.shadow)
SHADOW_EVERY = 5  # shadow drafts are simulated in one quantum of this many, counted for all of them


@dataclass(frozen=True)
class DrafterProfile:
    """A drafter and, for the `gpu` truth, its mean conditional acceptance per position and domain."""

    spec: DrafterSpec
    alphas: dict[str, tuple[float, ...]] = field(default_factory=dict)


def flat(alpha: float, n: int = 16) -> tuple[float, ...]:
    return (alpha,) * n


def decaying(first: float, step: float, n: int = 16, floor: float = 0.05) -> tuple[float, ...]:
    return tuple(max(floor, first - step * i) for i in range(n))


def default_drafters() -> tuple[DrafterProfile, ...]:
    """A 1B draft model (good on both domains, costs GPU time) and n-gram lookup (free, good only on
    code): which one pays depends on the traffic mix and the batch size."""
    return (
        DrafterProfile(
            DrafterSpec(
                name="draft-1b",
                method="draftModel",
                source="hf://meta-llama/Llama-3.2-1B-Instruct",
                maxSpeculativeTokens=5,
                placement="sidecar",
            ),
            {"code": decaying(0.86, 0.015), "prose": decaying(0.74, 0.03)},
        ),
        DrafterProfile(
            DrafterSpec(name="ngram", method="ngram", maxSpeculativeTokens=5, placement="sidecar"),
            {"code": decaying(0.80, 0.02), "prose": decaying(0.30, 0.04)},
        ),
    )


@dataclass(frozen=True)
class SimConfig:
    pods: int = 8
    gpu: str = "NVIDIA-H200"
    model: str = "llama-3.1-8b-instruct"
    max_num_seqs: int = 256
    quantum_s: float = 0.5
    drafters: tuple[DrafterProfile, ...] = field(default_factory=default_drafters)
    prompt_mean: tuple[float, float] = (900.0, 500.0)  # code, prose
    output_mean: tuple[float, float] = (300.0, 400.0)
    truth: str = "gpu"  # gpu | measured-cpu
    measured_path: str | None = None  # the measured-cpu recording (default: benchmarks/truths/)
    # gpu truth, acceptance: per-sequence spread (logit σ), easy/hard stretches (logit ±shift, P(stay)
    # per step), and the drift of each domain's difficulty over the day (logit amplitude, periods).
    dispersion: float = 1.0
    regime_shift: float = 0.8
    regime_stay: float = 0.95
    drift_amplitude: float = 0.8
    drift_periods_h: tuple[float, float] = (5.0, 7.0)
    evaluation_interval_s: float = 30.0
    window_s: float = 300.0
    seed: int = 1
    policies: tuple[str, ...] = POLICIES
    # Static tables by policy name (any name; `static_on` is built in: the first drafter at its K).
    static_tables: dict[str, StaticTable] = field(default_factory=dict)
    baseline_drafter: int = 0  # the drafter the sglang and bandit fleets run

    def resource_spec(self) -> SpeculativeServingSpec:
        return SpeculativeServingSpec.model_validate(
            {
                "replicas": self.pods,
                "model": {"name": self.model, "source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
                "engine": {
                    "image": "specserve/engine:sim",
                    "gpu": {"count": 1, "product": self.gpu},
                    "maxNumSeqs": self.max_num_seqs,
                },
                "drafters": [d.spec.model_dump(by_alias=True, exclude_none=True) for d in self.drafters],
                "speculation": {"evaluationInterval": f"{self.evaluation_interval_s:g}s"},
            }
        )


def measured_cpu_config(path: str | Path | None = None, **overrides: object) -> SimConfig:
    """The configuration that matches the measured-cpu recording: its drafters (sidecar-hosted), its
    engines' max_num_seqs, and requests of the sizes the tiny engines served. The controller is told a
    GPU (its prior is a GPU roofline, far from a CPU): it has to learn the CPU from the metrics."""
    path = Path(path) if path else truths.DEFAULT_MEASURED
    data = json.loads(path.read_text())
    drafters = []
    for name, method in data["drafters"].items():
        source = f"pvc://models/{name}" if method != "ngram" else None
        spec = {"name": name, "method": method, "maxSpeculativeTokens": data["max_k"], "placement": "sidecar"}
        drafters.append(
            DrafterProfile(DrafterSpec.model_validate(spec | ({"source": source} if source else {})))
        )
    settings: dict = {
        "truth": "measured-cpu",
        "measured_path": str(path),
        "model": "tiny-target",
        "max_num_seqs": int(data["setup"]["max_num_seqs"]),
        "drafters": tuple(drafters),
        "prompt_mean": (40.0, 40.0),
        # Eight times the tokens the tiny engines' requests had: at 2.5-4 ms a step those took under half a
        # second, less than a quantum, and a finished request holds its slot to the end of its quantum,
        # which made the batch several times what the arrivals explain. These span several quanta.
        "output_mean": (960.0, 1280.0),
        "quantum_s": 1.0,
    }
    return SimConfig(**(settings | overrides))  # type: ignore[arg-type]


def make_truth(cfg: SimConfig) -> truths.GpuTruth | truths.MeasuredCpuTruth:
    if cfg.truth == "gpu":
        max_k = max(d.spec.max_speculative_tokens for d in cfg.drafters)
        library = truths.synthetic_library(
            [d.alphas for d in cfg.drafters],
            max_k,
            cfg.dispersion,
            cfg.regime_shift,
            cfg.regime_stay,
            seed=cfg.seed + 1000,
        )
        methods = [d.spec.method for d in cfg.drafters]
        return truths.GpuTruth(cfg.gpu, cfg.model, methods, library, truths.load_forward_times())
    if cfg.truth == "measured-cpu":
        data = truths.load_measured(cfg.measured_path or truths.DEFAULT_MEASURED)
        names = [d.spec.name for d in cfg.drafters]
        if names != list(data.drafters):
            raise ValueError(
                f"measured-cpu truth: drafters {names} differ from the recording's {list(data.drafters)}"
            )
        return truths.MeasuredCpuTruth(data)
    raise ValueError(f"unknown truth {cfg.truth!r} (known: {', '.join(TRUTHS)})")


@dataclass
class FleetResult:
    policy: str
    tokens: float = 0.0
    hourly_tokens: list[float] = field(default_factory=list)
    tpot_s: list[np.ndarray] = field(default_factory=list)
    tpot_hour: list[np.ndarray] = field(default_factory=list)
    wait_s: list[np.ndarray] = field(default_factory=list)
    switches: int = 0
    decisions: dict[str, int] = field(default_factory=dict)
    batch_sum: float = 0.0  # pod batch sizes summed over quanta (for the mean)
    batch_samples: int = 0
    batch_max: int = 0
    dropped: int = 0  # requests dropped once the fleet fell a whole request pool behind (saturated)

    def summary(self, duration_s: float) -> dict:
        tpot = np.concatenate(self.tpot_s) if self.tpot_s else np.zeros(0)
        hours = np.concatenate(self.tpot_hour) if self.tpot_hour else np.zeros(0, dtype=int)
        wait = np.concatenate(self.wait_s) if self.wait_s else np.zeros(0)
        hourly = []
        for h, tokens in enumerate(self.hourly_tokens):
            span = min(3600.0, duration_s - 3600.0 * h)
            sel = tpot[hours == h]
            hourly.append(
                {
                    "hour": h,
                    "tokens_per_s": round(tokens / span, 2) if span > 0 else 0.0,
                    "tpot_mean_ms": _ms(sel.mean()) if sel.size else None,
                    "tpot_p95_ms": _ms(np.percentile(sel, 95)) if sel.size else None,
                }
            )
        out = {
            "tokens_per_s": round(self.tokens / duration_s, 2),
            "tpot_mean_ms": _ms(tpot.mean()) if tpot.size else None,
            "tpot_p95_ms": _ms(np.percentile(tpot, 95)) if tpot.size else None,
            "wait_p95_ms": _ms(np.percentile(wait, 95)) if wait.size else None,
            "requests": int(tpot.size),
            "dropped": self.dropped,
            "switches": self.switches,
            "batch_mean": round(self.batch_sum / self.batch_samples, 2) if self.batch_samples else 0.0,
            "batch_max": self.batch_max,
            "hourly": hourly,
        }
        if self.decisions:
            out["decisions"] = dict(sorted(self.decisions.items()))
        return out


def _ms(seconds: float) -> float:
    return round(float(seconds) * 1e3, 3)


class FleetSim:
    def __init__(self, cfg: SimConfig, trace: Trace) -> None:
        self.cfg = cfg
        self.trace = trace
        self.truth = make_truth(cfg)
        self.library = self.truth.library
        self.rng = np.random.default_rng(cfg.seed)
        self.policies = cfg.policies
        self.bounds = np.array(DEFAULT_BUCKETS)
        self.labels = bucket_labels(DEFAULT_BUCKETS)
        self.nb = len(self.labels)
        nd = len(cfg.drafters)
        self.k_cap = np.array([min(d.spec.max_speculative_tokens, self.library.max_k) for d in cfg.drafters])
        self.max_k = int(self.k_cap.max())
        self.static = {"static_on": StaticTable(0, (int(self.k_cap[0]),) * self.nb), **cfg.static_tables}
        unknown = [p for p in self.policies if p not in self.static and p not in POLICIES]
        if unknown:
            raise ValueError(f"unknown policies {unknown} (known: {', '.join(POLICIES)} and static tables)")
        nf, p, s = len(self.policies), cfg.pods, cfg.max_num_seqs
        self.rows = nf * p
        shape = (self.rows, s)
        self.rem, self.gen, self.out = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        self.prompt, self.start, self.cursor = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        self.dom = np.zeros(shape, dtype=np.int64)
        self.seq = np.zeros(shape, dtype=np.int64)
        self.backlog = np.zeros(self.rows, dtype=np.int64)
        # Requests per pod in arrival order, shared by the fleets (a ring: the fleets' progress through
        # it differs by at most their backlogs).
        self.pool_dom = np.zeros((p, POOL), dtype=np.int8)
        self.pool_seq = np.zeros((p, POOL), dtype=np.int32)
        self.pool_prompt = np.zeros((p, POOL), dtype=np.float32)
        self.pool_out = np.zeros((p, POOL), dtype=np.float32)
        self.pool_arrival = np.zeros((p, POOL))
        self.produced = np.zeros(p, dtype=np.int64)
        self.consumed = np.zeros(self.rows, dtype=np.int64)
        self.saturated = np.zeros(nf, dtype=bool)
        self.rr = 0
        self.results = {name: FleetResult(name) for name in self.policies}
        hours = math.ceil(trace.duration_s / 3600.0)
        for r in self.results.values():
            r.hourly_tokens = [0.0] * hours
        # Per-row policy state: drafter index and K per bucket (specserve rows set by the controller).
        self.drafter = np.zeros(self.rows, dtype=np.int64)
        self.ktab = np.zeros((self.rows, self.nb), dtype=np.int64)
        self.prev_choice = np.full(self.rows, -1, dtype=np.int64)
        self.sglang = EmaTiers(p, int(self.k_cap[cfg.baseline_drafter]))
        self.bandit = BucketBandit(self.nb, int(self.k_cap[cfg.baseline_drafter]))
        # The specserve fleet's counters, cumulative, as a Prometheus target would export them.
        self.spec_rows = self._rows_of("specserve")
        # specserve's pods start as the operator renders them (render.children.initial_policy).
        start = initial_policy(cfg.resource_spec())
        self.drafter[self.spec_rows] = [d.spec.name for d in cfg.drafters].index(start.drafter)
        self.ktab[self.spec_rows] = [
            start.k_by_bucket.get(label, 0) if start.mode == "on" else 0 for label in self.labels
        ]
        ns, mk = len(self.spec_rows), self.max_k
        # Step counters per pod, drafter in force, bucket and K verified (0: plain), as the engine labels them
        self.c_steps = np.zeros((ns, nd, self.nb, mk + 1))
        self.c_secs = np.zeros((ns, nd, self.nb, mk + 1))
        self.c_tokens = np.zeros((ns, nd, self.nb, mk + 1))
        self.c_drafts = np.zeros((ns, nd, self.nb))
        self.c_dtok = np.zeros((ns, nd, self.nb))
        self.c_acc = np.zeros((ns, nd, self.nb))
        self.c_acc_pos = np.zeros((ns, nd, self.nb, mk))
        self.c_prop_pos = np.zeros((ns, nd, self.nb, mk))
        # The sidecars' scores of shadow drafts, per pod, drafter and position (no bucket).
        self.c_shadow_acc = np.zeros((ns, nd, mk))
        self.c_shadow_prop = np.zeros((ns, nd, mk))
        self.c_shadow_rows = np.zeros((ns, nd))  # rows shadow-drafted for, with a proposal or without
        self.running = np.zeros(ns)
        self.history: deque = deque()
        self.spec = cfg.resource_spec()
        self.pod_names = tuple(f"sim-{i}" for i in range(p))
        self.view = core.ResourceView("sim", "fleet", self.spec, self.pod_names)
        self.state = core.ResourceState.initial(self.spec)
        self.ratios = (
            tuner_policy.RatioMemory()
        )  # as FleetController: step-time ratios remembered across ticks
        self.names = [d.spec.name for d in cfg.drafters]
        self.controller_s = 0.0
        self.decisions: list[tuple[float, core.Decision]] = []

    def _rows_of(self, policy: str) -> np.ndarray:
        if policy not in self.policies:
            return np.zeros(0, dtype=np.int64)
        f = self.policies.index(policy)
        return np.arange(f * self.cfg.pods, (f + 1) * self.cfg.pods)

    # ---- the controller's side: counters → observation rows → decide → pod targets -----------------
    def _counters(self) -> tuple:
        return tuple(
            a.copy()
            for a in (
                self.c_steps,
                self.c_secs,
                self.c_tokens,
                self.c_drafts,
                self.c_dtok,
                self.c_acc,
                self.c_acc_pos,
                self.c_prop_pos,
                self.c_shadow_acc,
                self.c_shadow_prop,
                self.c_shadow_rows,
            )
        )

    def _rows(self, now_c: tuple, old_c: tuple, short_c: tuple) -> list[observations.Row]:
        """Rows as the reader's queries return them: the counters' increases since `old_c` (the metrics
        window), the per-position and shadow counts' and the steps per bucket since `short_c` (the
        acceptance window)."""
        d = [a - b for a, b in zip(now_c, old_c, strict=True)]
        steps, secs, tokens, drafts, dtok, acc = d[:6]
        acc_pos, prop_pos, shadow_acc, shadow_prop, shadow_rows = (
            a - b for a, b in zip(now_c[6:], short_c[6:], strict=True)
        )
        recent_steps = (now_c[0] - short_c[0]).sum(axis=(1, 3))  # pod × bucket, over drafters and K
        rows: list[observations.Row] = []
        for i, pod in enumerate(self.pod_names):
            base = {"namespace": "sim", "pod": pod}
            drafter = self.names[self.drafter[self.spec_rows[i]]]
            rows.append(
                (
                    observations.POLICY_INFO,
                    {**base, "drafter": drafter, "mode": "on", "policy_version": "0"},
                    1.0,
                )
            )
            rows.append((observations.RUNNING, base, float(self.running[i])))
            for b, label in enumerate(self.labels):
                if recent_steps[i, b] > 0:
                    rows.append((observations.RECENT_STEPS, {**base, "bucket": label}, recent_steps[i, b]))
                if steps[i, :, b, 0].sum() > 0:  # plain steps carry no drafter and no K
                    lab = {**base, "bucket": label, "speculating": "false", "drafter": ""}
                    rows.append((observations.STEPS, lab, steps[i, :, b, 0].sum()))
                    rows.append((observations.STEP_SECONDS, lab, secs[i, :, b, 0].sum()))
                    rows.append((observations.TOKENS, lab, tokens[i, :, b, 0].sum()))
                for j, name in enumerate(self.names):
                    for kk in np.nonzero(steps[i, j, b, 1:] > 0)[0] + 1:
                        lab = {
                            **base,
                            "bucket": label,
                            "speculating": "true",
                            "drafter": name,
                            "k": str(kk),
                        }
                        rows.append((observations.STEPS, lab, steps[i, j, b, kk]))
                        rows.append((observations.STEP_SECONDS, lab, secs[i, j, b, kk]))
                        rows.append((observations.TOKENS, lab, tokens[i, j, b, kk]))
                for j, name in enumerate(self.names):
                    if drafts[i, j, b] <= 0:
                        continue
                    lab = {**base, "bucket": label, "drafter": name}
                    rows.append((observations.DRAFTS, lab, drafts[i, j, b]))
                    rows.append((observations.DRAFT_TOKENS, lab, dtok[i, j, b]))
                    rows.append((observations.ACCEPTED, lab, acc[i, j, b]))
                    for pos in range(acc_pos.shape[3]):
                        if prop_pos[i, j, b, pos] > 0:
                            pl = {**lab, "position": str(pos)}
                            rows.append((observations.ACCEPTED_POS, pl, acc_pos[i, j, b, pos]))
                            rows.append((observations.PROPOSED_POS, pl, prop_pos[i, j, b, pos]))
            for j, name in enumerate(self.names):
                for pos in np.nonzero(shadow_prop[i, j] > 0)[0]:
                    pl = {**base, "drafter": name, "position": str(pos)}
                    rows.append((observations.SHADOW_ACCEPTED_POS, pl, shadow_acc[i, j, pos]))
                    rows.append((observations.SHADOW_PROPOSED_POS, pl, shadow_prop[i, j, pos]))
                if shadow_rows[i, j] > 0:
                    rows.append((observations.SHADOW_ROWS, {**base, "drafter": name}, shadow_rows[i, j]))
        return rows

    def _tick(self, now: float) -> None:
        current = self._counters()
        self.history.append((now, current))
        while self.history and now - self.history[0][0] > self.cfg.window_s:
            self.history.popleft()
        old = self.history[0][1]
        # The history holds one entry per tick: no acceptance window is shorter than an interval.
        short_window = max(
            observations.acceptance_window_of(self.cfg.window_s), self.cfg.evaluation_interval_s
        )
        short = next(c for t, c in self.history if now - t <= short_window)
        window = max(now - self.history[0][0], self.cfg.evaluation_interval_s)
        t0 = time.perf_counter()
        snapshot = observations.build_snapshot(self._rows(current, old, short), window)
        mixed = {("sim", pod) for pod in self.state.switched_pods(now, self.cfg.window_s)}
        costs = core.FleetCosts([self.view], snapshot, mixed, self.ratios, now)
        if len(self.history) == 1:
            # The first tick has no window yet: every pod is missing, and the controller holds.
            snapshot = observations.FleetSnapshot(window_s=window)
        decision = core.decide(self.view, snapshot, self.state, costs, now)
        self.controller_s += time.perf_counter() - t0
        res = self.results["specserve"]
        res.decisions[decision.action] = res.decisions.get(decision.action, 0) + 1
        if decision.changed:
            self.decisions.append((now, decision))
        if not decision.push:
            return  # nothing decided on metrics yet: the pods keep what they started with
        for i, pod in enumerate(self.pod_names):
            target = decision.pods[pod]
            row = self.spec_rows[i]
            new_d = self.names.index(target.drafter)
            new_k = np.array(
                [target.k_by_bucket.get(label, 0) if target.mode == "on" else 0 for label in self.labels]
            )
            if new_d != self.drafter[row] or not np.array_equal(new_k, self.ktab[row]):
                res.switches += 1
            self.drafter[row] = new_d
            self.ktab[row] = new_k

    # ---- the fleets ----------------------------------------------------------------------------------
    def _policy_k(
        self, t: float, batch: np.ndarray, bidx: np.ndarray, ctx: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        k = np.zeros(self.rows, dtype=np.int64)
        d = self.drafter.copy()
        for f, name in enumerate(self.policies):
            sl = slice(f * self.cfg.pods, (f + 1) * self.cfg.pods)
            if name in self.static:
                table = self.static[name]
                k[sl], d[sl] = np.array(table.k_by_bucket)[bidx[sl]], table.drafter
            elif name == "sglang":
                k[sl], d[sl] = self.sglang.k(), self.cfg.baseline_drafter
            elif name == "bandit":
                k[sl], d[sl] = self.bandit.choose(bidx[sl]), self.cfg.baseline_drafter
            elif name == "specserve":
                k[sl] = self.ktab[np.arange(sl.start, sl.stop), bidx[sl]]
            elif name == "oracle":
                mean = truths.class_mean_tokens(self.library, self._shift(t))[: self.max_k + 1]
                k[sl], d[sl] = self._oracle(sl, batch[sl], ctx[sl], mean[:, :, self.dom[sl]])
            elif name == "clairvoyant":
                mean = self.library.mean_tokens[: self.max_k + 1, :, self.dom[sl], self.seq[sl]]
                k[sl], d[sl] = self._oracle(sl, batch[sl], ctx[sl], mean)
        return k, d

    def _oracle(
        self, sl: slice, batch: np.ndarray, ctx: np.ndarray, mean: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The best (drafter, K) for each pod's actual batch, knowing the truth's step time and `mean`,
        the tokens per step [K+1, nd, pods, slots] each running request is expected to give. The
        `oracle` knows each request's domain and the drift now (what any policy could know at best of a
        request before it runs), the `clairvoyant` which of the library's sequences it replays (its
        luck, too: a bound no policy that picks K per batch can reach)."""
        nd, mk = len(self.cfg.drafters), self.max_k
        active = self.rem[sl] > 0
        tokens = (mean * active).sum(axis=-1).transpose(2, 1, 0)  # [pods, nd, K+1]
        ks = np.arange(mk + 1)[None, None, :]
        ds = np.arange(nd)[None, :, None]
        drafted = None
        if self.truth.prices_drafted_share:
            share = self.library.proposal_share[:, self.dom[sl], self.seq[sl]]  # [nd, pods, slots]
            drafted = ((share * active).sum(axis=-1) / np.maximum(active.sum(axis=-1), 1)).T[:, :, None]
        t = self.truth.step_s(batch[:, None, None].astype(float), ks, ctx[:, None, None], ds, drafted)
        good = np.where(ks <= self.k_cap[None, :, None], tokens / t, -np.inf)
        # One drafter for the whole fleet at a time (as pods run one drafter each, switched by the
        # controller), the one with the most goodput right now; K per pod and step.
        best_d = int(np.where(batch[:, None] > 0, good.max(axis=2), 0.0).sum(axis=0).argmax())
        return good[:, best_d, :].argmax(axis=1), np.full(len(batch), best_d)

    def _shift(self, t: float) -> np.ndarray:
        """Per domain, the logit shift of the acceptance sequences requests arriving at t draw."""
        cfg = self.cfg
        if cfg.truth != "gpu":
            return np.zeros(2)
        return truths.drift(t, cfg.drift_amplitude, cfg.drift_periods_h)

    def _arrive(self, t: float, per_pod: np.ndarray, code_frac: float) -> None:
        total = int(per_pod.sum())
        if total == 0:
            return
        cfg = self.cfg
        dom = (self.rng.random(total) >= code_frac).astype(np.int8)  # 0 = code
        pm = np.array(cfg.prompt_mean)[dom]
        om = np.array(cfg.output_mean)[dom]
        prompt = np.maximum(16.0, self.rng.lognormal(np.log(pm) - 0.32, 0.8))
        out = np.maximum(8.0, np.round(self.rng.lognormal(np.log(om) - 0.32, 0.8)))
        # Which acceptance sequence each request replays: a draw tilted by its domain's drift now.
        u = truths.logit_tilt(self.rng.random(total), self._shift(t)[dom])
        seq = np.minimum((u * self.library.sequences).astype(np.int64), self.library.sequences - 1)
        pod = np.repeat(np.arange(cfg.pods), per_pod)
        offset = np.arange(total) - np.repeat(np.cumsum(per_pod) - per_pod, per_pod)
        idx = (self.produced[pod] + offset) % POOL
        self.pool_dom[pod, idx] = dom
        self.pool_seq[pod, idx] = seq
        self.pool_prompt[pod, idx] = prompt
        self.pool_out[pod, idx] = out
        self.pool_arrival[pod, idx] = t + self.rng.random(total) * cfg.quantum_s
        self.produced += per_pod

    def _shed(self) -> None:
        """A fleet that fell a whole request pool behind is saturated: its waiting requests are dropped
        (counted), so the shared pool stays valid for the fleets that keep up."""
        p = self.cfg.pods
        lag = self.produced[np.arange(self.rows) % p] - self.consumed
        for f, name in enumerate(self.policies):
            rows = slice(f * p, (f + 1) * p)
            if int(lag[rows].max()) >= POOL // 2:
                self.saturated[f] = True
                self.results[name].dropped += int(self.backlog[rows].sum())
                self.backlog[rows] = 0
                self.consumed[rows] = self.produced

    def run(self) -> dict[str, FleetResult]:
        cfg, q = self.cfg, self.cfg.quantum_s
        p, s = cfg.pods, cfg.max_num_seqs
        nf = len(self.policies)
        spec_rows = self.spec_rows
        fleet_of_row = np.arange(self.rows) // p
        next_tick = 0.0
        steps_n = math.ceil(self.trace.duration_s / q)
        for n in range(steps_n):
            t = n * q
            hour = int(t // 3600)
            if len(spec_rows) and t >= next_tick:
                self._tick(t)
                next_tick += cfg.evaluation_interval_s
            rate, code_frac = self.trace.at(t)
            arrivals = int(self.rng.poisson(rate * q))
            per_pod = np.full(p, arrivals // p, dtype=np.int64)
            extra = arrivals % p
            per_pod[(np.arange(p) - self.rr) % p < extra] += 1
            self.rr = (self.rr + arrivals) % p
            self._arrive(t, per_pod, code_frac)
            self.backlog += np.tile(per_pod, nf)
            self._shed()

            active = self.rem > 0
            free = s - active.sum(axis=1)
            admit = np.minimum(free, self.backlog)
            self.backlog -= admit
            prefill = np.zeros(self.rows)
            if admit.any():
                free_mask = ~active
                rank = np.cumsum(free_mask, axis=1)
                new = free_mask & (rank <= admit[:, None])
                # The same request stream reaches pod p of every fleet, in the same order (FIFO).
                new_rows, _ = np.nonzero(new)
                idx = (self.consumed[new_rows] + rank[new] - 1) % POOL
                pod = new_rows % p
                self.consumed += admit
                out = self.pool_out[pod, idx]
                self.rem[new] = out
                self.out[new] = out
                self.gen[new] = 0.0
                self.cursor[new] = 0.0
                self.prompt[new] = self.pool_prompt[pod, idx]
                self.dom[new] = self.pool_dom[pod, idx]
                self.seq[new] = self.pool_seq[pod, idx]
                prompt_rows = np.zeros_like(self.rem)
                prompt_rows[new] = self.prompt[new]
                prefill = self.truth.prefill_s(prompt_rows.sum(axis=1))
                started = t + np.minimum(prefill, q)
                self.start[new] = started[new_rows]
                waits = np.maximum(0.0, started[new_rows] - self.pool_arrival[pod, idx])
                fleet_new = new_rows // p
                for f, name in enumerate(self.policies):
                    self.results[name].wait_s.append(waits[fleet_new == f])
                active = self.rem > 0
            decode = np.maximum(0.0, q - prefill)
            batch = active.sum(axis=1)
            bidx = np.searchsorted(self.bounds, batch, side="left")
            ctx_sum = ((self.prompt + self.gen) * active).sum(axis=1)
            ctx = np.where(batch > 0, ctx_sum / np.maximum(batch, 1), 0.0)
            k, d = self._policy_k(t, batch, bidx, ctx)
            k = np.minimum(k, self.k_cap[d])
            drafted = None
            if self.truth.prices_drafted_share:  # per quantum and row: skipped where the truth ignores it
                share = self.library.proposal_share[d[:, None], self.dom, self.seq]
                drafted = (share * active).sum(axis=1) / np.maximum(batch, 1)
            step = self.truth.step_s(batch.astype(float), k.astype(float), ctx, d, drafted)
            steps = np.where(batch > 0, decode / step, 0.0)

            r_act, s_act = np.nonzero(active)
            slot_steps = steps[r_act]
            span = self.library.span(
                d[r_act],
                self.dom[r_act, s_act],
                self.seq[r_act, s_act],
                self.cursor[r_act, s_act],
                slot_steps,
            )
            gain = np.zeros_like(self.rem)
            gain[r_act, s_act] = self.library.tokens(k[r_act], span)
            drafting = k[r_act] > 0
            proposed = np.zeros(len(r_act))
            proposed[drafting] = self.library.proposed(self.library.select(span, drafting))
            if len(spec_rows) and n % SHADOW_EVERY == 0:
                self._shadow(r_act, s_act, k, d, batch, slot_steps)
            self.cursor[r_act, s_act] += slot_steps

            done = active & (self.rem <= gain)
            produced = np.where(done, self.rem, gain)
            row_tokens = produced.sum(axis=1)
            if done.any():
                frac = np.where(done, self.rem / np.maximum(gain, 1e-12), 0.0)
                finish = t + np.minimum(prefill, q)[:, None] + decode[:, None] * frac
                tpot = (finish - self.start) / np.maximum(self.out, 1.0)
                rows_done, _ = np.nonzero(done)
                vals = tpot[done]
                fleet_done = rows_done // p
                for f, name in enumerate(self.policies):
                    sel = fleet_done == f
                    if sel.any():
                        r = self.results[name]
                        r.tpot_s.append(vals[sel])
                        r.tpot_hour.append(np.full(int(sel.sum()), hour))
            self.rem = np.where(done, 0.0, self.rem - gain)
            self.gen += np.where(done, 0.0, gain)
            fleet_tokens = np.bincount(fleet_of_row, weights=row_tokens, minlength=nf)
            for f, name in enumerate(self.policies):
                r = self.results[name]
                r.tokens += fleet_tokens[f]
                r.hourly_tokens[hour] += fleet_tokens[f]
                fleet_batch = batch[f * p : (f + 1) * p]
                r.batch_sum += float(fleet_batch.sum())
                r.batch_samples += p
                r.batch_max = max(r.batch_max, int(fleet_batch.max()))
            self._adapt(batch, bidx, k, d, steps, decode, gain, proposed, r_act)
            if len(spec_rows):
                self._count(
                    spec_rows, batch, bidx, k, d, steps, decode, gain.sum(axis=1), span, proposed, r_act
                )
        for name in ("sglang", "bandit"):
            if name in self.results:
                self.results[name].switches = getattr(self, name).switches
        return self.results

    def _adapt(
        self,
        batch: np.ndarray,
        bidx: np.ndarray,
        k: np.ndarray,
        d: np.ndarray,
        steps: np.ndarray,
        decode: np.ndarray,
        gain: np.ndarray,
        proposed: np.ndarray,
        r_act: np.ndarray,
    ) -> None:
        """Feed the adaptive baselines what their own pods did this quantum; count the oracles' changes."""
        if "sglang" in self.policies:
            rows = self._rows_of("sglang")
            accepted = gain[rows].sum(axis=1) - steps[rows] * batch[rows]  # tokens beyond the bonus token
            drafts = np.bincount(r_act, weights=proposed, minlength=self.rows)[rows]
            self.sglang.observe(np.where(drafts > 0, accepted / np.maximum(drafts, 1e-12), np.nan))
        if "bandit" in self.policies:
            rows = self._rows_of("bandit")
            busy = (batch[rows] > 0) & (decode[rows] > 0)
            rate = gain[rows].sum(axis=1) / np.maximum(decode[rows] * batch[rows], 1e-12)
            self.bandit.observe(bidx[rows][busy], k[rows][busy], rate[busy])
        for name in ORACLES:
            if name in self.policies:
                o = self._rows_of(name)
                choice = d[o] * 100 + k[o]
                self.results[name].switches += int((choice != self.prev_choice[o]).sum())
                self.prev_choice[o] = choice

    def _shadow(
        self,
        r_act: np.ndarray,
        s_act: np.ndarray,
        k: np.ndarray,
        d: np.ndarray,
        batch: np.ndarray,
        slot_steps: np.ndarray,
    ) -> None:
        """The specserve pods' sidecars score the shadow drafts of the drafters not in force: on up to
        SHADOW_ROWS rows of a speculating pod's batch, each other drafter's drafts at its largest K over
        the same steps of the same sequences (docs/sidecar.md, "Shadow drafts"). Called every SHADOW_EVERY
        quanta, its counts weighted to stand for all of them (the simulator's time, not the sidecar's)."""
        first, n = self.spec_rows[0], len(self.spec_rows)
        drafting = (r_act >= first) & (r_act < first + n) & (k[r_act] > 0)
        for j in range(len(self.names)):
            sel = drafting & (d[r_act] != j)
            if not sel.any():
                continue
            rows, slots = r_act[sel], s_act[sel]
            span = self.library.span(
                np.full(len(rows), j),
                self.dom[rows, slots],
                self.seq[rows, slots],
                self.cursor[rows, slots],
                slot_steps[sel],
            )
            share = np.minimum(1.0, SHADOW_ROWS / batch[rows]) * SHADOW_EVERY
            pod = rows - first
            proposed = self.library.proposed(span) * share
            # Every step of the span is a row drafted for: those without a proposal are scored as such.
            np.add.at(self.c_shadow_rows, (pod, j), slot_steps[sel] * share)
            for pos in range(int(self.k_cap[j])):
                np.add.at(self.c_shadow_prop, (pod, j, pos), proposed)
                np.add.at(self.c_shadow_acc, (pod, j, pos), self.library.accepted_at(pos, span) * share)

    def _count(
        self,
        rows: np.ndarray,
        batch: np.ndarray,
        bidx: np.ndarray,
        k: np.ndarray,
        d: np.ndarray,
        steps: np.ndarray,
        decode: np.ndarray,
        row_tokens: np.ndarray,
        span: truths.Span,
        proposed: np.ndarray,
        r_act: np.ndarray,
    ) -> None:
        """The specserve fleet's counters, from what each of its sequences did. A request that finished
        mid-quantum holds its slot to the quantum's end (the step time counts it in the batch), and its
        slot's tokens are counted for the whole quantum (`row_tokens`: what the slots' steps gave, as if
        the next request had taken the slot over at once): as on an engine, generated tokens are
        sequence-steps plus accepted tokens, at the batch the step time was charged for."""
        b = batch[rows]
        self.running = b.astype(float)
        busy = b > 0
        if not busy.any():
            return
        i = np.nonzero(busy)[0]
        r = rows[i]
        bi, kk, di = bidx[r], k[r], d[r]
        np.add.at(self.c_steps, (i, di, bi, kk), steps[r])
        np.add.at(self.c_secs, (i, di, bi, kk), decode[r])
        np.add.at(self.c_tokens, (i, di, bi, kk), row_tokens[r])
        # Slots of specserve pods that drafted: where in the counters each lands.
        first = rows[0]
        sel = (r_act >= first) & (r_act < first + len(rows)) & (k[r_act] > 0)
        if not sel.any():
            return
        pod = r_act[sel] - first
        sk, sd, sb = k[r_act[sel]], d[r_act[sel]], bidx[r_act[sel]]
        sp = self.library.select(span, sel)
        prop = proposed[sel]
        np.add.at(self.c_drafts, (pod, sd, sb), prop)
        np.add.at(self.c_dtok, (pod, sd, sb), prop * sk)
        for j in range(self.max_k):
            at = sk > j
            if not at.any():
                break
            acc = self.library.accepted_at(j, self.library.select(sp, at))
            np.add.at(self.c_acc, (pod[at], sd[at], sb[at]), acc)
            np.add.at(self.c_acc_pos, (pod[at], sd[at], sb[at], j), acc)
            np.add.at(self.c_prop_pos, (pod[at], sd[at], sb[at], j), prop[at])


def bucket_goodput(cfg: SimConfig, trace: Trace) -> np.ndarray:
    """True goodput, tokens per second, of every (drafter, bucket, K) at the bucket's largest batch (capped
    at max_num_seqs), a typical context, and the trace's mix of domains (request-weighted): what a user
    who measured their hardware and traffic well would tune a static table from. [nd, buckets, K+1]"""
    truth = make_truth(cfg)
    lib = truth.library
    nd = len(cfg.drafters)
    weights = trace.rates * np.diff(np.append(trace.starts, trace.duration_s))
    code = float((trace.code * weights).sum() / max(weights.sum(), 1e-12))
    mix = np.array([code, 1.0 - code])
    per_step = (lib.mean_tokens.mean(axis=-1) * mix[None, None, :]).sum(axis=-1)  # [K+1, nd]
    drafted = lib.proposal_share.mean(axis=-1) @ mix  # [nd]
    ctx = float(mix @ (np.array(cfg.prompt_mean) + np.array(cfg.output_mean) / 2))
    bounds = [min(b, cfg.max_num_seqs) for b in DEFAULT_BUCKETS] + [cfg.max_num_seqs]
    caps = [min(dr.spec.max_speculative_tokens, lib.max_k) for dr in cfg.drafters]
    ks = np.arange(lib.max_k + 1)
    out = np.zeros((nd, len(bounds), lib.max_k + 1))
    for i in range(nd):
        for j, b in enumerate(bounds):
            t = truth.step_s(
                np.full(len(ks), float(b)),
                ks.astype(float),
                np.full(len(ks), ctx),
                np.full(len(ks), i),
                np.full(len(ks), drafted[i]),
            )
            out[i, j] = np.where(ks <= caps[i], b * per_step[:, i] / t, 0.0)
    return out

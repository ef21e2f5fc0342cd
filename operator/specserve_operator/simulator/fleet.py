"""A fleet simulator that the real controller drives: metrics in, policy out, simulated time.

Every policy runs its own fleet of pods on the same arrivals (common random numbers), all fleets side by
side in one set of arrays so a 24-hour trace simulates in about a minute. Time advances in quanta of
`quantum_s`; within a quantum each pod's batch is fixed: continuous batching admits waiting requests
into free slots, prefill takes its share of the quantum (chunked prefill), and decode runs
quantum/T(B, K) steps, each giving every sequence E(K) tokens in expectation for its traffic domain.

The true step time is the controller's roofline (costmodel.py) with what a prior does not know: HBM
efficiency below the figure the prior assumes, and a fixed plus proportional cost of every speculative
step (rejection sampling, ragged-batch bookkeeping). The controller has to learn those from the
metrics, exactly as it would from Prometheus: the `specserve` fleet's counters are folded into the
same observation rows (`observations.build_snapshot`) that the Prometheus reader produces.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from specserve_engine.buckets import DEFAULT_BUCKETS, bucket_labels
from specserve_operator.api.models import DrafterSpec, SpeculativeServingSpec
from specserve_operator.simulator.traces import Trace
from specserve_operator.tuner import core
from specserve_operator.tuner import observations as ob
from specserve_operator.tuner import policy as pol
from specserve_operator.tuner.costmodel import DrafterCost, drafter_cost, gpu_spec, model_shape

POLICIES = ("off", "static_on", "static_table", "specserve", "oracle")
DOMAINS = ("code", "prose")
STATIC_K = 5
STATIC_TABLE_OFF_AT = 32
POOL = 1 << 17  # requests per pod that may wait in some fleet's backlog while another fleet has served them


@dataclass(frozen=True)
class DrafterProfile:
    """A drafter and its true conditional acceptance per position, per traffic domain."""

    spec: DrafterSpec
    alphas: dict[str, tuple[float, ...]]


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
    hbm_efficiency: float = 0.92  # of the prior's bandwidth
    spec_overhead_s: float = 4.0e-4  # per speculative step
    spec_overhead_frac: float = 0.08  # of the verify step
    evaluation_interval_s: float = 30.0
    window_s: float = 300.0
    seed: int = 1
    policies: tuple[str, ...] = POLICIES

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


@dataclass
class FleetResult:
    policy: str
    tokens: float = 0.0
    hourly_tokens: list[float] = field(default_factory=list)
    tpot_s: list[np.ndarray] = field(default_factory=list)
    tpot_hour: list[np.ndarray] = field(default_factory=list)
    switches: int = 0
    decisions: dict[str, int] = field(default_factory=dict)
    batch_sum: float = 0.0  # pod batch sizes summed over quanta (for the mean)
    batch_samples: int = 0
    batch_max: int = 0

    def summary(self, duration_s: float) -> dict:
        tpot = np.concatenate(self.tpot_s) if self.tpot_s else np.zeros(0)
        hours = np.concatenate(self.tpot_hour) if self.tpot_hour else np.zeros(0, dtype=int)
        hourly = []
        for h, tokens in enumerate(self.hourly_tokens):
            span = min(3600.0, duration_s - 3600.0 * h)
            sel = tpot[hours == h]
            hourly.append(
                {
                    "hour": h,
                    "goodput_tokens_per_s": round(tokens / span, 2) if span > 0 else 0.0,
                    "tpot_mean_ms": round(float(sel.mean()) * 1e3, 3) if sel.size else None,
                    "tpot_p95_ms": round(float(np.percentile(sel, 95)) * 1e3, 3) if sel.size else None,
                }
            )
        out = {
            "goodput_tokens_per_s": round(self.tokens / duration_s, 2),
            "tpot_mean_ms": round(float(tpot.mean()) * 1e3, 3) if tpot.size else None,
            "tpot_p95_ms": round(float(np.percentile(tpot, 95)) * 1e3, 3) if tpot.size else None,
            "requests": int(tpot.size),
            "switches": self.switches,
            "batch_mean": round(self.batch_sum / self.batch_samples, 2) if self.batch_samples else 0.0,
            "batch_max": self.batch_max,
            "hourly": hourly,
        }
        if self.decisions:
            out["decisions"] = dict(sorted(self.decisions.items()))
        return out


class _Truth:
    """The simulated hardware: true step times and true acceptance, vectorised."""

    def __init__(self, cfg: SimConfig) -> None:
        self.model = model_shape(cfg.model)
        gpu = gpu_spec(cfg.gpu)
        self.flops = gpu.flops_per_s
        self.bw = gpu.hbm_bytes_per_s * cfg.hbm_efficiency
        self.overhead = gpu.step_overhead_s
        self.cfg = cfg
        self.costs: list[DrafterCost] = [drafter_cost(d.spec.method) for d in cfg.drafters]
        self.max_k = max(d.spec.max_speculative_tokens for d in cfg.drafters)
        nd = len(cfg.drafters)
        # E[d, domain, k] and survival S[d, domain, j] = Π_{i≤j} α_i (j 0-based).
        self.surv = np.zeros((nd, 2, self.max_k))
        self.exp = np.ones((nd, 2, self.max_k + 1))
        self.k_cap = np.array([d.spec.max_speculative_tokens for d in cfg.drafters])
        for i, d in enumerate(cfg.drafters):
            for j, dom in enumerate(DOMAINS):
                s = np.cumprod(np.array(d.alphas[dom][: self.max_k]))
                self.surv[i, j] = s
                self.exp[i, j, 1:] = 1.0 + np.cumsum(s)

    def verify_s(self, batch: np.ndarray, n: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        m = self.model
        tokens = batch * n
        flops = 2.0 * m.params * tokens + 4.0 * m.layers * m.hidden * ctx * tokens
        moved = m.weight_bytes + batch * (ctx + n) * m.kv_bytes_per_token
        return np.maximum(flops / self.flops, moved / self.bw) + self.overhead

    def step_s(self, batch: np.ndarray, k: np.ndarray, ctx: np.ndarray, drafter: np.ndarray) -> np.ndarray:
        verify = self.verify_s(batch, k + 1.0, ctx)
        spec = k > 0
        draft = np.zeros(np.broadcast(batch, k, drafter).shape)
        for i, cost in enumerate(self.costs):
            sel = np.broadcast_to(drafter == i, draft.shape)
            if not sel.any():
                continue
            if cost.kind == "cpu" or cost.shape is None:
                d = cost.cpu_s_per_token * batch * k
            else:
                s = cost.shape
                one = (
                    np.maximum(
                        2.0 * s.params * batch / self.flops,
                        (s.weight_bytes + batch * ctx * s.kv_bytes_per_token) / self.bw,
                    )
                    + cost.step_overhead_s
                )
                d = one * (1.0 if cost.kind == "parallel" else k)
            draft = np.where(sel, np.broadcast_to(d, draft.shape), draft)
        extra = np.where(spec, self.cfg.spec_overhead_s + self.cfg.spec_overhead_frac * verify, 0.0)
        return verify + draft * spec + extra

    def prefill_s(self, prompt_tokens: np.ndarray) -> np.ndarray:
        return prompt_tokens * 2.0 * self.model.params / self.flops


class FleetSim:
    def __init__(self, cfg: SimConfig, trace: Trace) -> None:
        self.cfg = cfg
        self.trace = trace
        self.truth = _Truth(cfg)
        self.rng = np.random.default_rng(cfg.seed)
        self.policies = cfg.policies
        nf, p, s = len(self.policies), cfg.pods, cfg.max_num_seqs
        self.rows = nf * p
        self.rem = np.zeros((self.rows, s))
        self.gen = np.zeros((self.rows, s))
        self.out = np.zeros((self.rows, s))
        self.prompt = np.zeros((self.rows, s))
        self.dom = np.zeros((self.rows, s), dtype=np.int8)
        self.start = np.zeros((self.rows, s))
        self.backlog = np.zeros(self.rows, dtype=np.int64)
        # Requests per pod in arrival order, shared by the fleets (a ring: the fleets' progress through
        # it differs by at most their backlogs).
        self.pool_dom = np.zeros((cfg.pods, POOL), dtype=np.int8)
        self.pool_prompt = np.zeros((cfg.pods, POOL), dtype=np.float32)
        self.pool_out = np.zeros((cfg.pods, POOL), dtype=np.float32)
        self.produced = np.zeros(cfg.pods, dtype=np.int64)
        self.consumed = np.zeros(self.rows, dtype=np.int64)
        self.rr = 0
        self.bounds = np.array(DEFAULT_BUCKETS)
        self.labels = bucket_labels(DEFAULT_BUCKETS)
        self.nb = len(self.labels)
        nd = len(cfg.drafters)
        self.results = {name: FleetResult(name) for name in self.policies}
        hours = math.ceil(trace.duration_s / 3600.0)
        for r in self.results.values():
            r.hourly_tokens = [0.0] * hours
        # Per-row policy state: drafter index and K per bucket (specserve rows set by the controller).
        self.drafter = np.zeros(self.rows, dtype=np.int64)
        self.ktab = np.zeros((self.rows, self.nb), dtype=np.int64)
        self.prev_choice = np.full(self.rows, -1, dtype=np.int64)
        # The specserve fleet's counters, cumulative, as a Prometheus target would export them.
        self.spec_rows = self._rows_of("specserve")
        ns = len(self.spec_rows)
        mk = self.truth.max_k
        self.c_steps = np.zeros((ns, self.nb, 2))
        self.c_secs = np.zeros((ns, self.nb, 2))
        self.c_tokens = np.zeros((ns, self.nb, 2))
        self.c_drafts = np.zeros((ns, nd, self.nb))
        self.c_dtok = np.zeros((ns, nd, self.nb))
        self.c_acc = np.zeros((ns, nd, self.nb))
        self.c_acc_pos = np.zeros((ns, nd, self.nb, mk))
        self.c_prop_pos = np.zeros((ns, nd, self.nb, mk))
        self.running = np.zeros(ns)
        self.history: deque = deque()
        self.spec = cfg.resource_spec()
        self.pod_names = tuple(f"sim-{i}" for i in range(cfg.pods))
        self.view = core.ResourceView("sim", "fleet", self.spec, self.pod_names)
        self.state = core.ResourceState.initial(self.spec)
        self.ratios = pol.RatioMemory()  # as FleetController: step-time ratios remembered across ticks
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
            )
        )

    def _rows(self, now_c: tuple, old_c: tuple) -> list[ob.Row]:
        d = [a - b for a, b in zip(now_c, old_c, strict=True)]
        steps, secs, tokens, drafts, dtok, acc, acc_pos, prop_pos = d
        rows: list[ob.Row] = []
        for i, pod in enumerate(self.pod_names):
            base = {"namespace": "sim", "pod": pod}
            drafter = self.names[self.drafter[self.spec_rows[i]]]
            rows.append(
                (ob.POLICY_INFO, {**base, "drafter": drafter, "mode": "on", "policy_version": "0"}, 1.0)
            )
            rows.append((ob.RUNNING, base, float(self.running[i])))
            for b, label in enumerate(self.labels):
                for s, flag in ((0, "false"), (1, "true")):
                    if steps[i, b, s] > 0:
                        lab = {**base, "bucket": label, "speculating": flag}
                        rows.append((ob.STEPS, lab, steps[i, b, s]))
                        rows.append((ob.STEP_SECONDS, lab, secs[i, b, s]))
                        rows.append((ob.TOKENS, lab, tokens[i, b, s]))
                for j, name in enumerate(self.names):
                    if drafts[i, j, b] <= 0:
                        continue
                    lab = {**base, "bucket": label, "drafter": name}
                    rows.append((ob.DRAFTS, lab, drafts[i, j, b]))
                    rows.append((ob.DRAFT_TOKENS, lab, dtok[i, j, b]))
                    rows.append((ob.ACCEPTED, lab, acc[i, j, b]))
                    for pos in range(acc_pos.shape[3]):
                        if prop_pos[i, j, b, pos] > 0:
                            pl = {**lab, "position": str(pos)}
                            rows.append((ob.ACCEPTED_POS, pl, acc_pos[i, j, b, pos]))
                            rows.append((ob.PROPOSED_POS, pl, prop_pos[i, j, b, pos]))
        return rows

    def _tick(self, now: float) -> None:
        current = self._counters()
        self.history.append((now, current))
        while self.history and now - self.history[0][0] > self.cfg.window_s:
            self.history.popleft()
        old = self.history[0][1]
        window = max(now - self.history[0][0], self.cfg.evaluation_interval_s)
        t0 = time.perf_counter()
        snapshot = ob.build_snapshot(self._rows(current, old), window)
        mixed = {("sim", pod) for pod in self.state.switched_pods(now, self.cfg.window_s)}
        costs = core.FleetCosts([self.view], snapshot, mixed, self.ratios, now)
        if len(self.history) == 1:
            # The first tick has no window yet: every pod is missing, and the controller holds.
            snapshot = ob.FleetSnapshot(window_s=window)
        decision = core.decide(self.view, snapshot, self.state, costs, now)
        self.controller_s += time.perf_counter() - t0
        res = self.results["specserve"]
        res.decisions[decision.action] = res.decisions.get(decision.action, 0) + 1
        if decision.changed:
            self.decisions.append((now, decision))
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
        self, batch: np.ndarray, n_code: np.ndarray, ctx: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        k = np.zeros(self.rows, dtype=np.int64)
        d = self.drafter.copy()
        bidx = np.searchsorted(self.bounds, batch, side="left")
        for f, name in enumerate(self.policies):
            sl = slice(f * self.cfg.pods, (f + 1) * self.cfg.pods)
            if name == "static_on":
                k[sl] = min(STATIC_K, self.truth.k_cap[0])
                d[sl] = 0
            elif name == "static_table":
                k[sl] = np.where(batch[sl] >= STATIC_TABLE_OFF_AT, 0, min(STATIC_K, self.truth.k_cap[0]))
                d[sl] = 0
            elif name == "specserve":
                rows = np.arange(sl.start, sl.stop)
                k[sl] = self.ktab[rows, bidx[sl]]
            elif name == "oracle":
                kk, dd = self._oracle(batch[sl], n_code[sl], ctx[sl])
                k[sl], d[sl] = kk, dd
        return k, d

    def _oracle(
        self, batch: np.ndarray, n_code: np.ndarray, ctx: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The best (drafter, K) for each pod's actual batch and traffic mix, knowing the truth."""
        nd, mk = len(self.cfg.drafters), self.truth.max_k
        ks = np.arange(mk + 1)[None, None, :]
        ds = np.arange(nd)[None, :, None]
        b = batch[:, None, None].astype(float)
        c = ctx[:, None, None]
        t = self.truth.step_s(b, ks.astype(float), c, ds)
        e = self.truth.exp  # [d, dom, k]
        nc = n_code[:, None, None]
        tokens = nc * e[None, :, 0, :] + (b - nc) * e[None, :, 1, :]
        good = tokens / t
        good = np.where(ks <= self.truth.k_cap[None, :, None], good, -np.inf)
        # One drafter for the whole fleet at a time (as pods run one drafter each, switched by the
        # controller), the one with the most goodput right now; K per pod and step.
        best_d = int(np.where(batch[:, None] > 0, good.max(axis=2), 0.0).sum(axis=0).argmax())
        return good[:, best_d, :].argmax(axis=1), np.full(len(batch), best_d)

    def _arrive(self, per_pod: np.ndarray, code_frac: float) -> None:
        total = int(per_pod.sum())
        if total == 0:
            return
        cfg = self.cfg
        dom = (self.rng.random(total) >= code_frac).astype(np.int8)  # 0 = code
        pm = np.array(cfg.prompt_mean)[dom]
        om = np.array(cfg.output_mean)[dom]
        prompt = np.maximum(16.0, self.rng.lognormal(np.log(pm) - 0.32, 0.8))
        out = np.maximum(8.0, np.round(self.rng.lognormal(np.log(om) - 0.32, 0.8)))
        pod = np.repeat(np.arange(cfg.pods), per_pod)
        offset = np.arange(total) - np.repeat(np.cumsum(per_pod) - per_pod, per_pod)
        idx = (self.produced[pod] + offset) % POOL
        self.pool_dom[pod, idx] = dom
        self.pool_prompt[pod, idx] = prompt
        self.pool_out[pod, idx] = out
        self.produced += per_pod
        lag = self.produced[np.arange(self.rows) % cfg.pods] - self.consumed
        if int(lag.max()) >= POOL:
            raise RuntimeError("simulator: a fleet fell more than the request pool behind (overload)")

    def run(self) -> dict[str, FleetResult]:
        cfg, q = self.cfg, self.cfg.quantum_s
        p, s = cfg.pods, cfg.max_num_seqs
        nf = len(self.policies)
        spec_rows = self.spec_rows
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
            self._arrive(per_pod, code_frac)
            self.backlog += np.tile(per_pod, nf)

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
                dom = self.pool_dom[pod, idx]
                prompt = self.pool_prompt[pod, idx]
                out = self.pool_out[pod, idx]
                self.consumed += admit
                self.rem[new] = out
                self.out[new] = out
                self.gen[new] = 0.0
                self.prompt[new] = prompt
                self.dom[new] = dom
                prompt_rows = np.zeros_like(self.rem)
                prompt_rows[new] = prompt
                prefill = self.truth.prefill_s(prompt_rows.sum(axis=1))
                self.start[new] = np.broadcast_to((t + np.minimum(prefill, q))[:, None], self.rem.shape)[new]
                active = self.rem > 0
            decode = np.maximum(0.0, q - prefill)
            batch = active.sum(axis=1)
            code_mask = active & (self.dom == 0)
            n_code = code_mask.sum(axis=1)
            ctx_sum = ((self.prompt + self.gen) * active).sum(axis=1)
            ctx = np.where(batch > 0, ctx_sum / np.maximum(batch, 1), 0.0)
            k, d = self._policy_k(batch, n_code, ctx)
            k = np.minimum(k, self.truth.k_cap[d])
            step = self.truth.step_s(batch.astype(float), k.astype(float), ctx, d)
            steps = np.where(batch > 0, decode / step, 0.0)
            e_rows = self.truth.exp[d, :, k]  # [rows, 2]
            per_seq = steps[:, None] * np.where(self.dom == 0, e_rows[:, :1], e_rows[:, 1:2])
            gain = np.where(active, per_seq, 0.0)
            done = active & (self.rem <= gain)
            produced = np.where(done, self.rem, gain)
            row_tokens = produced.sum(axis=1)
            if done.any():
                frac = np.where(done, self.rem / np.maximum(gain, 1e-12), 0.0)
                finish = t + np.minimum(prefill, q)[:, None] + decode[:, None] * frac
                tpot = (finish - self.start) / np.maximum(self.out, 1.0)
                rows_done, _ = np.nonzero(done)
                vals = tpot[done]
                fleet_of = rows_done // p
                for f, name in enumerate(self.policies):
                    sel = fleet_of == f
                    if sel.any():
                        r = self.results[name]
                        r.tpot_s.append(vals[sel])
                        r.tpot_hour.append(np.full(int(sel.sum()), hour))
            self.rem = np.where(done, 0.0, self.rem - gain)
            self.gen += np.where(done, 0.0, gain)
            fleet_tokens = row_tokens.reshape(nf, p).sum(axis=1)
            for f, name in enumerate(self.policies):
                r = self.results[name]
                r.tokens += fleet_tokens[f]
                r.hourly_tokens[hour] += fleet_tokens[f]
                fleet_batch = batch[f * p : (f + 1) * p]
                r.batch_sum += float(fleet_batch.sum())
                r.batch_samples += p
                r.batch_max = max(r.batch_max, int(fleet_batch.max()))
            if "oracle" in self.policies:
                o = self._rows_of("oracle")
                choice = d[o] * 100 + k[o]
                self.results["oracle"].switches += int((choice != self.prev_choice[o]).sum())
                self.prev_choice[o] = choice
            if len(spec_rows):
                self._count(spec_rows, batch, n_code, k, d, steps, decode, row_tokens)
        return self.results

    def _count(
        self,
        rows: np.ndarray,
        batch: np.ndarray,
        code: np.ndarray,
        k: np.ndarray,
        d: np.ndarray,
        steps: np.ndarray,
        decode: np.ndarray,
        row_tokens: np.ndarray,
    ) -> None:
        b = batch[rows]
        busy = b > 0
        if not busy.any():
            self.running = b.astype(float)
            return
        i = np.nonzero(busy)[0]
        r = rows[i]
        bi = np.searchsorted(self.bounds, b[i], side="left")
        kk, dd, st = k[r], d[r], steps[r]
        spec = (kk > 0).astype(np.int64)
        np.add.at(self.c_steps, (i, bi, spec), st)
        np.add.at(self.c_secs, (i, bi, spec), decode[r])
        np.add.at(self.c_tokens, (i, bi, spec), row_tokens[r])
        sp = kk > 0
        if sp.any():
            i2, r2, b2, k2, d2, st2 = i[sp], r[sp], bi[sp], kk[sp], dd[sp], st[sp]
            n_code = code[r2]
            n_all = b[i2]
            n_prose = np.maximum(n_all - n_code, 0)
            np.add.at(self.c_drafts, (i2, d2, b2), st2 * n_all)
            np.add.at(self.c_dtok, (i2, d2, b2), st2 * n_all * k2)
            surv = self.truth.surv[d2]  # [m, 2, maxk]
            pos = np.arange(self.truth.max_k)[None, :]
            in_k = pos < k2[:, None]
            acc_pos = (
                st2[:, None] * (n_code[:, None] * surv[:, 0, :] + n_prose[:, None] * surv[:, 1, :]) * in_k
            )
            prop_pos = st2[:, None] * n_all[:, None] * in_k
            np.add.at(self.c_acc, (i2, d2, b2), acc_pos.sum(axis=1))
            np.add.at(self.c_acc_pos, (i2, d2, b2), acc_pos)
            np.add.at(self.c_prop_pos, (i2, d2, b2), prop_pos)
        self.running = b.astype(float)

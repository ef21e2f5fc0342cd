"""The simulated hardware and traffic: truths the controller does not share (docs/policy.md, "The
simulator's truths").

A truth answers two questions: how long one engine step takes (batch, K, mean context, drafter), and how
many drafted tokens each sequence gets accepted at each of its steps. Two are provided:

- `gpu`: unlike the controller's single roofline, forward passes recorded on an H200
  (scripts/record_gpu_truth.py → benchmarks/truths/measured_h200.json: the dense part by token count,
  attention by batch, query tokens and context), the batch padded to vLLM's captured CUDA-graph sizes,
  CPU time per step and per sequence; a GPU without a recording gets a model built per kernel (GEMM
  efficiency that varies with the number of tokens, attention and logits as kernels of their own);
  acceptance from a library of synthetic sequences, over-dispersed between sequences (a
  per-sequence difficulty), Markov-correlated along a sequence (easy and hard stretches), correlated
  between drafters (a hard prompt is hard for both) and drifting with the traffic domain over the day.
- `measured-cpu`: step times per (batch, K, drafter) and acceptance sequences recorded from the real
  engines on the tiny models (scripts/record_cpu_truth.py → benchmarks/truths/measured_cpu.json),
  replayed.

Acceptance is replayed from an `AcceptanceLibrary` in both: each request draws one sequence of its
domain (the same index for every drafter) and walks it step by step, cyclically.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specserve_operator.tuner.costmodel import ModelShape, drafter_cost, model_shape

DOMAINS = ("code", "prose")

# ---- acceptance ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AcceptanceLibrary:
    """Per drafter d, domain and sequence q: the drafted tokens accepted at each decode step when K is the
    largest (-1: nothing drafted), `accepted[d, dom, q, :lengths[d, dom, q]]`, replayed cyclically. With
    K smaller, a step accepts min(a, K): drafts are prefixes of the largest draft."""

    accepted: np.ndarray  # int8 [nd, 2, Q, L]
    lengths: np.ndarray  # int64 [nd, 2, Q]
    max_k: int

    def __post_init__(self) -> None:
        a = self.accepted.astype(np.int64)
        nd, _, nq, nl = a.shape
        max_k = self.max_k
        steps = np.arange(nl)[None, None, None, :] < self.lengths[..., None]

        def cum(x: np.ndarray) -> np.ndarray:
            # float32: exact for these counts, and half the memory each lookup walks.
            x = np.where(steps, x, 0).astype(np.float32)
            return np.concatenate([np.zeros((*x.shape[:-1], 1), np.float32), np.cumsum(x, axis=-1)], axis=-1)

        tokens = np.stack([cum(np.clip(a, 0, k) + 1) for k in range(max_k + 1)])  # [K+1, nd, 2, Q, L+1]
        object.__setattr__(self, "_tokens", tokens.reshape(-1))
        object.__setattr__(self, "_acc", np.stack([cum(a > j) for j in range(max_k)]).reshape(-1))
        object.__setattr__(self, "_prop", cum(a >= 0).reshape(-1))
        ends = np.take_along_axis(tokens, np.broadcast_to(self.lengths, tokens.shape[:-1])[..., None], -1)
        # Tokens per step of each sequence over its whole length, per K: [K+1, nd, 2, Q].
        object.__setattr__(self, "mean_tokens", ends[..., 0] / np.maximum(self.lengths, 1))
        # The share of each sequence's steps in which the drafter proposed anything: [nd, 2, Q].
        proposed = ((a >= 0) & steps).sum(axis=-1)
        object.__setattr__(self, "proposal_share", proposed / np.maximum(self.lengths, 1))
        object.__setattr__(self, "_shape", (max_k + 1, nd, 2, nq, nl + 1))

    @property
    def sequences(self) -> int:
        return int(self.accepted.shape[2])

    def span(self, d, dom, q, start, steps) -> Span:
        """Where `steps` steps from step `start` begin and end in sequences (d, dom, q), cyclically;
        computed once per quantum and read by every counter below."""
        _, nd, _, nq, width = self._shape
        length = self.lengths[d, dom, q]
        ends = []
        for c in (start, start + steps):
            full = np.floor(c / length)
            r = c - full * length
            i = np.minimum(r.astype(np.int64), length - 1)
            ends.append((full, i, r - i))
        return Span(((d * 2 + dom) * nq + q) * width, length, nd * 2 * nq * width, ends[0], ends[1])

    @staticmethod
    def _delta(flat: np.ndarray, first, span: Span) -> np.ndarray:
        base = np.asarray(first) * span.stride + span.rest
        end = flat[base + span.length]
        out = []
        for full, i, frac in (span.first, span.last):
            lo, hi = flat[base + i], flat[base + i + 1]
            out.append(full * end + lo + frac * (hi - lo))
        return out[1] - out[0]

    def tokens(self, k, span: Span) -> np.ndarray:
        """Tokens produced (accepted + the bonus token) over the span at K = k."""
        return self._delta(self._tokens, k, span)

    def accepted_at(self, j: int, span: Span) -> np.ndarray:
        """Steps of the span whose drafts were accepted at least up to position j (0-based)."""
        return self._delta(self._acc, j, span)

    def proposed(self, span: Span) -> np.ndarray:
        """Steps of the span in which the drafter proposed anything."""
        return self._delta(self._prop, 0, span)

    def select(self, span: Span, mask: np.ndarray) -> Span:
        """The span of the slots where `mask` holds."""
        return Span(
            span.rest[mask],
            span.length[mask],
            span.stride,
            tuple(x[mask] for x in span.first),
            tuple(x[mask] for x in span.last),
        )


@dataclass(frozen=True)
class Span:
    rest: np.ndarray  # flat offset of each sequence's row within one leading index
    length: np.ndarray
    stride: int  # flat size of one leading index (one K, or one position)
    first: tuple  # (full cycles, step, fraction) where the span starts
    last: tuple  # … and ends


def synthetic_library(
    alphas: list[dict[str, tuple[float, ...]]],
    max_k: int,
    dispersion: float,
    regime_shift: float,
    regime_stay: float,
    seed: int,
    sequences: int = 128,
    length: int = 128,
) -> AcceptanceLibrary:
    """Sequences whose acceptance at position j of a step is sigmoid(logit α_j + σ·z_q + δ·r_t):
    z_q a per-sequence difficulty (sorted, q = 0 hardest, shared by the drafters), r_t = ±1 a two-state
    Markov chain along the sequence (stays with probability `regime_stay` per step, shared by the
    drafters), α_j the drafter's mean conditional acceptance per position and domain."""
    rng = np.random.default_rng(seed)
    z = np.sort(rng.standard_normal(sequences))
    regime = np.empty((2, sequences, length))
    regime[:, :, 0] = rng.choice((-1.0, 1.0), size=(2, sequences))
    flips = rng.random((2, sequences, length)) > regime_stay
    for t in range(1, length):
        regime[:, :, t] = np.where(flips[:, :, t], -regime[:, :, t - 1], regime[:, :, t - 1])
    out = np.zeros((len(alphas), 2, sequences, length), dtype=np.int8)
    for d, by_domain in enumerate(alphas):
        for dom, name in enumerate(DOMAINS):
            a = np.clip(np.array(by_domain[name][:max_k], dtype=float), 1e-4, 1 - 1e-4)
            logit = np.log(a / (1 - a))
            lg = logit[None, None, :] + dispersion * z[:, None, None] + regime_shift * regime[dom][:, :, None]
            ok = rng.random((sequences, length, max_k)) < 1.0 / (1.0 + np.exp(-lg))
            out[d, dom] = np.where(ok.all(axis=-1), max_k, np.argmin(ok, axis=-1))
    return AcceptanceLibrary(out, np.full((len(alphas), 2, sequences), length, dtype=np.int64), max_k)


# ---- gpu: recorded forward passes, and a step-time model per kernel where nothing is recorded ----------

DEFAULT_GPU_RECORDING = Path(__file__).resolve().parents[3] / "benchmarks" / "truths" / "measured_h200.json"


def multilinear(table: np.ndarray, axes: tuple[np.ndarray, ...], points: tuple) -> np.ndarray:
    """`table` (one entry per grid point of `axes`) interpolated linearly along each axis at `points`:
    below an axis's first point the first point's value, above its last a linear extrapolation of the last
    two points."""
    points = np.broadcast_arrays(*(np.asarray(p, dtype=float) for p in points))
    corners = []
    for axis, x in zip(axes, points, strict=True):
        x = np.maximum(x, axis[0])
        hi = np.clip(np.searchsorted(axis, x, side="left"), 1, len(axis) - 1)
        w = (x - axis[hi - 1]) / (axis[hi] - axis[hi - 1])
        corners.append(((hi - 1, 1.0 - w), (hi, w)))
    out = np.zeros(points[0].shape)
    for corner in np.ndindex(*(2,) * len(axes)):
        index = tuple(corners[a][bit][0] for a, bit in enumerate(corner))
        weight = np.prod([corners[a][bit][1] for a, bit in enumerate(corner)], axis=0)
        out = out + weight * table[index]
    return out


@dataclass(frozen=True)
class ForwardTimes:
    """One GPU's recorded forward passes (scripts/record_gpu_truth.py): per model, the dense part of a pass
    by its token count; per attention layout, one layer's attention core by (batch, query tokens per
    sequence, context). A pass is the dense part at batch × query tokens plus layers × the core."""

    gpu: str
    dense: dict[str, tuple[np.ndarray, np.ndarray]]  # model → (token counts, seconds)
    layers: dict[str, int]  # model → its layers
    layout: dict[str, str]  # model → its attention layout
    attention: dict[str, tuple[tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray]]  # layout → grid

    def has(self, shape: ModelShape) -> bool:
        return shape.name in self.dense

    def pass_s(self, name: str, batch: np.ndarray, query: np.ndarray | float, ctx: np.ndarray) -> np.ndarray:
        tokens, seconds = self.dense[name]
        axes, table = self.attention[self.layout[name]]
        dense = multilinear(seconds, (tokens,), (np.asarray(batch) * query,))
        return dense + self.layers[name] * multilinear(table, axes, (batch, query, ctx))

    def prefill_token_s(self, name: str) -> float:
        """A prompt token's share of the largest dense pass recorded (prefill is one such pass)."""
        tokens, seconds = self.dense[name]
        return float(seconds[-1] / tokens[-1])


@functools.lru_cache(maxsize=4)
def load_forward_times(path: str | Path = DEFAULT_GPU_RECORDING) -> ForwardTimes:
    """Read a recording of scripts/record_gpu_truth.py; a table with a gap, a non-positive or
    non-finite time, or an axis that does not increase is refused (it would be replayed as a truth)."""
    data = json.loads(Path(path).read_text())

    def table(values: object, *axes: list) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
        grid = tuple(np.asarray(a, dtype=float) for a in axes)
        t = np.asarray(values, dtype=float)
        if t.shape != tuple(len(a) for a in grid) or not (np.isfinite(t).all() and (t > 0).all()):
            raise ValueError(f"{path}: a table is incomplete or holds a time that is not a positive number")
        if any(len(a) < 2 or (np.diff(a) <= 0).any() for a in grid):
            raise ValueError(f"{path}: a table's axis has fewer than two points or does not increase")
        return grid, t

    dense, layers, layout = {}, {}, {}
    for name, model in data["models"].items():
        (tokens,), seconds = table(model["dense_s"], model["tokens"])
        dense[name], layers[name], layout[name] = (
            (tokens, seconds),
            int(model["shape"]["layers"]),
            model["attention"],
        )
    attention = {
        key: table(a["per_layer_s"], a["batches"], a["query"], a["contexts"])
        for key, a in data["attention"].items()
    }
    missing = set(layout.values()) - set(attention)
    if missing:
        raise ValueError(f"{path}: no attention recorded for layout(s) {sorted(missing)}")
    return ForwardTimes(data["gpu"], dense, layers, layout, attention)


# Datasheet figures (docs/policy.md cites them): dense BF16 tensor throughput of the H100/H200 SXM and
# their HBM bandwidth.
PEAK_FLOPS = 989e12
PEAK_HBM = {"H200": 4.8e12, "H100": 3.35e12}
# Requests per captured CUDA graph, vLLM's default grid: 1, 2, 4, multiples of 8 below 256, then of 16.
CAPTURE_SIZES = np.array([1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)])
# Assumed kernel efficiencies of the model (not measured here; docs/policy.md says why these shapes).
HBM_EFFICIENCY = 0.80  # weight-streaming GEMMs at small M
GEMM_PEAK_EFFICIENCY = 0.75  # large GEMMs
GEMM_HALF_M = 64.0  # tokens at which a GEMM reaches half its peak efficiency
OVERLAP_LOSS = 0.2  # memory and compute phases of a GEMM overlap imperfectly
ATTENTION_HBM_EFFICIENCY = 0.55  # paged decode attention over the KV cache
ATTENTION_FLOP_EFFICIENCY = 0.30
LOGITS_BYTES = 8.0  # fp32 logits written and read by the sampler, per token and vocabulary entry
VOCAB = 128256
CPU_STEP_S = 6.0e-4  # scheduling, input preparation and output processing per step
CPU_SEQ_S = 4.0e-6  # … and per sequence
SPEC_STEP_S = 2.5e-4  # rejection sampling and draft bookkeeping per speculative step
SPEC_TOKEN_S = 1.0e-6  # … and per draft token
DRAFT_LAUNCH_S = 8.0e-5  # one captured draft pass
NGRAM_SEQ_S = 3.0e-6  # n-gram lookup on the CPU per sequence
NGRAM_CONTEXT_S = 2.0e-9  # … and per context token searched
PREFILL_EFFICIENCY = 0.6


def padded_batch(batch: np.ndarray) -> np.ndarray:
    """The captured graph size a batch runs in (larger batches run eagerly, unpadded)."""
    i = np.minimum(np.searchsorted(CAPTURE_SIZES, batch, side="left"), len(CAPTURE_SIZES) - 1)
    return np.where(batch <= CAPTURE_SIZES[-1], CAPTURE_SIZES[i], batch).astype(float)


class GpuTruth:
    """Step times of one GPU: each forward pass (the target's, a draft model's or head's) replayed from the
    GPU's recording where it holds the model (`ForwardTimes`), else built per kernel from datasheet
    figures and assumed efficiencies; the batch padded to the captured CUDA graph it runs in, and CPU time
    per step, per sequence and per speculative step added to either."""

    name = "gpu"
    prices_drafted_share = False  # `step_s` does not read `drafted`: the simulator need not compute it

    def __init__(
        self,
        gpu: str,
        model: str,
        methods: list[str],
        library: AcceptanceLibrary,
        recording: ForwardTimes | None = None,
    ) -> None:
        key = next((k for k in PEAK_HBM if k in gpu.upper()), None)
        if key is None:
            raise ValueError(f"gpu truth: unknown GPU {gpu!r} (known: {', '.join(sorted(PEAK_HBM))})")
        self.bw = PEAK_HBM[key]
        # A recording of another GPU does not describe this one.
        self.recording = recording if recording is not None and key in recording.gpu.upper() else None
        self.model = model_shape(model)
        self.costs = [drafter_cost(m) for m in methods]
        self.library = library

    def _gemm_s(self, params: float, tokens: np.ndarray) -> np.ndarray:
        tile = np.where(tokens <= 64, np.ceil(tokens / 16) * 16, np.ceil(tokens / 64) * 64)
        efficiency = GEMM_PEAK_EFFICIENCY * tile / (tile + GEMM_HALF_M)
        memory = 2.0 * params / (self.bw * HBM_EFFICIENCY)
        compute = 2.0 * params * tile / (PEAK_FLOPS * efficiency)
        return np.maximum(memory, compute) + OVERLAP_LOSS * np.minimum(memory, compute)

    def _attention_s(self, shape: ModelShape, batch: np.ndarray, q_len, ctx: np.ndarray) -> np.ndarray:
        kv = batch * ctx * shape.kv_bytes_per_token
        flops = 4.0 * shape.layers * shape.hidden * ctx * batch * q_len
        return np.maximum(
            kv / (self.bw * ATTENTION_HBM_EFFICIENCY), flops / (PEAK_FLOPS * ATTENTION_FLOP_EFFICIENCY)
        )

    def pass_s(
        self, shape: ModelShape, padded: np.ndarray, query: np.ndarray | float, ctx: np.ndarray, logits: bool
    ) -> np.ndarray:
        """One captured forward pass of `shape` over `padded` sequences of `query` tokens each; `logits`:
        the kernel model adds the LM head's fp32 logits for the sampler (a recorded pass includes them)."""
        if self.recording is not None and self.recording.has(shape):
            return self.recording.pass_s(shape.name, padded, query, ctx)
        t = self._gemm_s(shape.params, padded * query) + self._attention_s(shape, padded, query, ctx)
        if logits:
            t = t + padded * query * VOCAB * LOGITS_BYTES / (self.bw * HBM_EFFICIENCY)
        return t

    def step_s(
        self,
        batch: np.ndarray,
        k: np.ndarray,
        ctx: np.ndarray,
        drafter: np.ndarray,
        drafted: np.ndarray | None = None,
    ) -> np.ndarray:
        """`drafted` (the share of the batch that got a draft) is not read: the verify runs the whole batch
        at K in one captured graph shape, drafted or not, as a padded uniform decode batch would."""
        del drafted
        batch, k, ctx = np.asarray(batch, float), np.asarray(k, float), np.asarray(ctx, float)
        padded = padded_batch(batch)
        n = k + 1.0
        target = self.pass_s(self.model, padded, n, ctx, logits=True) + CPU_STEP_S + CPU_SEQ_S * batch
        shape = np.broadcast(batch, k, ctx, drafter).shape
        draft = np.zeros(shape)
        for i, cost in enumerate(self.costs):
            sel = np.broadcast_to(np.asarray(drafter) == i, shape)
            if not sel.any():
                continue
            if cost.kind == "cpu" or cost.shape is None:
                d = batch * (NGRAM_SEQ_S + NGRAM_CONTEXT_S * ctx)
            else:
                one = self.pass_s(cost.shape, padded, 1.0, ctx, logits=False) + DRAFT_LAUNCH_S
                if cost.kind == "parallel":
                    d = one
                else:
                    # The first pass runs over the tokens accepted in the last step, then K - 1 single passes.
                    first = self.pass_s(cost.shape, padded, n, ctx, logits=False) + DRAFT_LAUNCH_S
                    d = first + np.maximum(k - 1.0, 0.0) * one
            draft = np.where(sel, np.broadcast_to(d, shape), draft)
        spec = SPEC_STEP_S + SPEC_TOKEN_S * batch * k + draft
        return target + np.where(k > 0, spec, 0.0)

    def prefill_s(self, prompt_tokens: np.ndarray) -> np.ndarray:
        if self.recording is not None and self.recording.has(self.model):
            return prompt_tokens * self.recording.prefill_token_s(self.model.name)
        return prompt_tokens * 2.0 * self.model.params / (PEAK_FLOPS * PREFILL_EFFICIENCY)


# ---- measured-cpu: the tiny engines' recording, replayed ---------------------------------------------

DEFAULT_MEASURED = Path(__file__).resolve().parents[3] / "benchmarks" / "truths" / "measured_cpu.json"


@dataclass(frozen=True)
class MeasuredData:
    drafters: dict[str, str]  # name → method
    max_k: int
    batches: tuple[int, ...]
    step_s: np.ndarray  # [nd, K+1, batches]; K = 0 is the same plain step for every drafter
    library: AcceptanceLibrary
    max_num_seqs: int
    # Per drafter and batch, how much a speculative step's excess over a plain one grows per K
    # (`excess_fit`) [nd, batches], and the share of the sequences that drafted while the step times
    # were recorded (code and prose prompts alternating) [nd].
    excess_per_k: np.ndarray
    recorded_share: np.ndarray


def lower_envelope(values: np.ndarray) -> np.ndarray:
    """The largest non-decreasing sequence under `values`: each entry the minimum of it and everything
    after it."""
    return np.minimum.accumulate(np.asarray(values, dtype=float)[::-1])[::-1]


def load_measured(path: str | Path = DEFAULT_MEASURED) -> MeasuredData:
    """Read a recording of scripts/record_cpu_truth.py. Other processes on the shared cores only ever add
    time, so where the recording contradicts what a step must cost, the lower figure stands: a step never
    gets faster as the batch grows (each row's lower non-decreasing envelope), and a plain step is never
    slower than a speculative one at the same batch."""
    data = json.loads(Path(path).read_text())
    names = list(data["drafters"])
    max_k = int(data["max_k"])
    rows = {n: np.array(data["step_s"][n], dtype=float) for n in ["off", *names]}
    if not all(np.isfinite(r).all() for r in rows.values()):
        raise ValueError(f"{path}: a step time is missing (no steps measured in some bucket)")
    # A plain step does part of a speculative step's work at the same batch: never slower than one.
    rows["off"] = np.minimum(rows["off"], np.min([rows[n].min(axis=0) for n in names], axis=0))
    fitted = {n: np.array([lower_envelope(r) for r in rows[n]]) for n in rows}
    step = np.stack([np.vstack([fitted["off"][0], fitted[n]]) for n in names])
    seqs = [[data["acceptance"][n][dom] for dom in DOMAINS] for n in names]
    count = min(len(s) for by_dom in seqs for s in by_dom)
    longest = max(len(q) for by_dom in seqs for s in by_dom for q in s)
    accepted = np.full((len(names), 2, count, longest), -1, dtype=np.int8)
    lengths = np.zeros((len(names), 2, count), dtype=np.int64)
    for d, by_dom in enumerate(seqs):
        for dom, sequences in enumerate(by_dom):
            for q, seq in enumerate(sequences[:count]):
                accepted[d, dom, q, : len(seq)] = np.minimum(seq, max_k)
                lengths[d, dom, q] = max(len(seq), 1)
    library = AcceptanceLibrary(accepted, lengths, max_k)
    per_k = excess_fit(step)
    weights = library.lengths.reshape(len(names), -1)
    recorded = (library.proposal_share.reshape(len(names), -1) * weights).sum(axis=1) / weights.sum(axis=1)
    return MeasuredData(
        drafters=data["drafters"],
        max_k=max_k,
        batches=tuple(data["batches"]),
        step_s=step,
        library=library,
        max_num_seqs=int(data["setup"]["max_num_seqs"]),
        excess_per_k=per_k,
        recorded_share=recorded,
    )


def excess_fit(step: np.ndarray) -> np.ndarray:
    """Per drafter and batch, the least-squares slope over K = 1..max (at least 0) of what a speculative
    step at K adds to a plain one, step[d, K, b] − step[d, 0, b]."""
    ks = np.arange(1, step.shape[1], dtype=float)
    excess = step[:, 1:, :] - step[:, :1, :]  # [nd, K, b]
    dk = ks - ks.mean()
    return np.maximum(0.0, np.einsum("k,dkb->db", dk, excess) / float((dk**2).sum()))


class MeasuredCpuTruth:
    """Step time interpolated linearly in the batch size between the measured batches (the recording's
    contexts are short and fixed: context does not enter).

    With `drafted`, the share of the batch that got a draft, the part of the excess that grows with K
    grows with that share too (a CPU verifies the tokens it is given, and drafts only for those
    sequences): the recorded step plus per_k · K · (drafted / recorded share − 1), per_k the slope of
    the recorded excess over K (`excess_fit`). The rest of the excess (the sidecar's RPC, the sampler)
    is per step. (On the real engine, steps at batch 16 and K 4 with a quarter of the sequences
    drafting added 0.30 of what a whole batch drafting added. Only n-gram drafts for part of a batch
    here, so its slope is what this moves.)"""

    name = "measured-cpu"
    prices_drafted_share = True

    def __init__(self, data: MeasuredData) -> None:
        self.data = data
        self.library = data.library
        self.batches = np.array(data.batches, dtype=float)

    def step_s(
        self,
        batch: np.ndarray,
        k: np.ndarray,
        ctx: np.ndarray,
        drafter: np.ndarray,
        drafted: np.ndarray | None = None,
    ) -> np.ndarray:
        del ctx
        batch = np.asarray(batch, float)
        shape = np.broadcast(batch, k, drafter).shape
        b = np.broadcast_to(np.clip(batch, self.batches[0], self.batches[-1]), shape)
        kk = np.broadcast_to(np.asarray(k, dtype=np.int64), shape)
        dd = np.broadcast_to(np.asarray(drafter, dtype=np.int64), shape)
        hi = np.clip(np.searchsorted(self.batches, b, side="left"), 1, len(self.batches) - 1)
        lo = hi - 1
        w = (b - self.batches[lo]) / (self.batches[hi] - self.batches[lo])
        table = self.data.step_s
        recorded = (1 - w) * table[dd, kk, lo] + w * table[dd, kk, hi]
        if drafted is None:
            return recorded
        data = self.data
        per_k = (1 - w) * data.excess_per_k[dd, lo] + w * data.excess_per_k[dd, hi]
        share = np.broadcast_to(np.asarray(drafted, float), shape) / data.recorded_share[dd]
        return recorded + per_k * kk * (share - 1.0)

    def prefill_s(self, prompt_tokens: np.ndarray) -> np.ndarray:
        """A prompt token costs what one sequence's token costs in the largest plain decode step measured
        (the engine computes both in the same forward pass)."""
        return prompt_tokens * self.data.step_s[0, 0, -1] / self.batches[-1]


def logit_tilt(u: np.ndarray, shift: np.ndarray | float) -> np.ndarray:
    """u ∈ (0, 1) moved by `shift` in logit space: the drift of a domain toward easier (> 0) or harder
    sequences of its library."""
    u = np.clip(u, 1e-9, 1 - 1e-9)
    return 1.0 / (1.0 + np.exp(-(np.log(u / (1 - u)) + shift)))


def class_mean_tokens(library: AcceptanceLibrary, shift: np.ndarray) -> np.ndarray:
    """Tokens per step [K+1, nd, 2] expected of a request of each domain drawn at logit shift
    `shift[dom]` (as the simulator draws them): the sequences' means weighted by the chance of drawing
    each, P(q) = tilt((q+1)/Q, -s) - tilt(q/Q, -s)."""
    q = library.sequences
    cdf = logit_tilt(np.arange(q + 1)[None, :] / q, -np.asarray(shift, dtype=float)[:, None])
    cdf[:, 0], cdf[:, -1] = 0.0, 1.0
    return np.einsum("kdcq,cq->kdc", library.mean_tokens, np.diff(cdf, axis=1))


def drift(t: float, amplitude: float, periods_h: tuple[float, float]) -> np.ndarray:
    """Per domain, the logit shift of the sequences drawn at time t: slow, out of phase between domains."""
    return np.array(
        [amplitude * math.sin(2 * math.pi * t / (p * 3600.0) + i) for i, p in enumerate(periods_h)]
    )

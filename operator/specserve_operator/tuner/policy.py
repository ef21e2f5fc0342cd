"""The speculation policy as pure functions of plain data (docs/policy.md explains it in words).

Per (model, drafter, GPU) group and batch-size bucket b:

    E(K)     = 1 + Σ_{i=1..K} Π_{j≤i} α_j          tokens per draft verified, from per-position acceptance
    E_s(K)   = 1 + rate · (E(K) − 1)                tokens per sequence and step (rate: the share drafted)
    gain(K)  = E_s(K) · T(b, 0) / T(b, K)           goodput with K over goodput without speculation
    K*(b)    = argmax_K gain(K); speculate in b only where gain(K*) ≥ minGain

T(b, K) is the roofline prior (costmodel.py) calibrated by what the fleet measured in that bucket
(`CalibratedCost`: the plain step and what speculation adds to it, each on its own, the latter with a
fixed part where Ks measured far apart say so).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from specserve_engine.buckets import INF, bucket_labels
from specserve_operator.tuner.costmodel import StepCostPrior
from specserve_operator.tuner.observations import BucketStats

# Fewer samples than these and a measurement is not trusted (the prior stands).
MIN_STEPS = 20.0
MIN_DRAFTS = 50.0
# A drafter not in force is scored as off in buckets whose batches are more than this many times the
# largest one its speculative steps were measured at (CalibratedCost.above_measured_range).
MAX_EXTRAPOLATION = 8.0
# Acceptance at positions never measured continues the last measured one, a little lower: acceptance
# streams are over-dispersed, so the i.i.d. extrapolation over-predicts (speculation-research §1.4).
EXTRAPOLATION_DECAY = 0.97
PRIOR_ALPHA = 0.6
# A measured excess ratio under this is noise on a small difference (a step with drafts against one
# without, where drafting adds little): it is raised to it. There is no ceiling: on hardware far from the
# prior's (a CPU against a GPU roofline) what speculation adds is hundreds of times the prediction.
EXCESS_RATIO_FLOOR = 0.1
# The excess is fitted as a fixed cost plus the prior's shape (`_affine_excess`) only where the smallest K
# measured ran at least this many times the largest one's ratio: a shape the prior gets wrong by a factor,
# not by the noise of a few steps per K (which, fitted, invents fixed costs and moves K for nothing).
AFFINE_SHAPE_GAP = 2.0
RATIO_TTL_S = 86400.0  # step-time ratios are the hardware's, not the traffic's: kept a day


def expected_tokens(alphas: Sequence[float], k: int) -> float:
    """Tokens per verify step with K drafts: 1 + Σ_{i≤K} Π_{j≤i} α_j (the bonus token included)."""
    return expected_tokens_by_k(alphas, k)[-1] if k > 0 else 1.0


def expected_tokens_by_k(alphas: Sequence[float], max_k: int) -> list[float]:
    """E(K) for K = 1..max_k, each built on the last (positions past the measured ones add nothing)."""
    out: list[float] = []
    total, survive = 1.0, 1.0
    for i in range(max_k):
        if i < len(alphas):
            survive *= alphas[i]
            total += survive
        out.append(total)
    return out


def iid_alpha_from_mal(mal: float, k: float) -> float:
    """The per-token α for which (1 − α^(k+1)) / (1 − α) = MAL: used when only totals are known."""
    if k <= 0 or mal <= 1.0:
        return 0.0
    if mal >= k + 1:
        return 0.999
    lo, hi = 0.0, 0.999
    for _ in range(50):
        mid = (lo + hi) / 2
        if (1 - mid ** (k + 1)) / (1 - mid) < mal:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class Acceptance:
    alphas: tuple[float, ...]  # conditional acceptance per position, α_1..α_maxK
    source: str  # measured | totals | shadow | refused (core.measured_acceptance) | remembered | prior
    # The share of sequences in speculative steps that got a draft: below 1 for a drafter that proposes
    # only where it finds a match (n-gram, suffix); such a sequence still verifies, for one token.
    proposal_rate: float = 1.0

    def tokens(self, k: int) -> float:
        """Mean accepted length of a draft of K (bonus token included): what the MAL floor judges."""
        return expected_tokens(self.alphas, k)

    def step_tokens_by_k(self, max_k: int) -> tuple[float, ...]:
        """Tokens per sequence and speculative step for K = 1..max_k: 1 + rate·(E(K) − 1). Memoised: a
        resource's tick asks for them once per bucket and batch it prices."""
        tokens = self._tokens_by_max_k.get(max_k)
        if tokens is None:
            expected = expected_tokens_by_k(self.alphas, max_k)
            tokens = self._tokens_by_max_k[max_k] = tuple(
                1.0 + self.proposal_rate * (e - 1.0) for e in expected
            )
        return tokens

    @cached_property
    def _tokens_by_max_k(self) -> dict[int, tuple[float, ...]]:
        return {}


def spec_sequences(s: BucketStats) -> float:
    """Sequences in speculative steps (each once per step): each produced its accepted tokens plus one,
    whether or not it got a draft (an n-gram drafter that finds no match drafts nothing). Without those
    counters, or where they do not add up, one draft per sequence."""
    rows = s.tokens_spec - s.accepted
    return rows if rows >= s.drafts else s.drafts


def proposal_rate(s: BucketStats) -> float:
    """Drafts over the sequences of speculative steps (`spec_sequences`); 1 with too few to tell."""
    return _drafted_share(s.drafts, spec_sequences(s))


def _drafted_share(drafts: float, rows: float) -> float:
    """Drafts over the rows that could have had one, at most 1; 1 with fewer than MIN_DRAFTS rows or no
    drafts (nothing to tell a rate from)."""
    return min(1.0, drafts / rows) if rows >= MIN_DRAFTS and drafts > 0 else 1.0


def shadow_proposal_rate(stats: BucketStats, rows: float) -> float:
    """A shadow drafter's share of rows with a draft: its drafts (position 0) over the rows it drafted for,
    those it had nothing to propose for included; 1 with fewer than MIN_DRAFTS rows counted (a sidecar
    that does not count them). Its per-position counts are conditional on proposing, as live drafts are."""
    return _drafted_share(stats.proposed_pos.get(0, 0.0), rows)


def acceptance(stats: BucketStats, max_k: int, fallback: BucketStats | None = None) -> Acceptance:
    """Per-position conditional acceptance from pooled counters.

    survival_j = accepted_pos[j] / proposed_pos[j] is P(positions 0..j all accepted); the conditional
    α_{j+1} = survival_j / survival_{j-1}. The per-position counters cover the short acceptance window
    (observations.py); without MIN_DRAFTS of them there (little traffic), an i.i.d. α is solved from the
    long window's MAL and mean draft length; without any drafts, a prior.

    The proposal rate is drafts over the sequences of the drafter's speculative steps
    (`spec_sequences`), over the metrics window."""
    rate = proposal_rate(stats)
    alphas: list[float] = []
    prev_survival = 1.0
    for pos in range(max_k):
        proposed = stats.proposed_pos.get(pos, 0.0)
        if proposed < MIN_DRAFTS:
            break
        survival = min(1.0, stats.accepted_pos.get(pos, 0.0) / proposed)
        alpha = survival / prev_survival if prev_survival > 0 else 0.0
        alphas.append(min(alpha, 0.999))
        prev_survival = survival
    if alphas:
        return Acceptance(_extend(alphas, max_k), "measured", rate)
    for totals in (stats, fallback):
        if totals is not None and totals.drafts >= MIN_DRAFTS and totals.draft_tokens > 0:
            mean_k = totals.draft_tokens / totals.drafts
            alpha = iid_alpha_from_mal(1.0 + totals.accepted / totals.drafts, mean_k)
            return Acceptance(_extend([alpha], max_k), "totals", rate if totals is stats else 1.0)
    return Acceptance(tuple([PRIOR_ALPHA] * max_k), "prior")


def _extend(alphas: list[float], max_k: int) -> tuple[float, ...]:
    out = list(alphas[:max_k])
    while len(out) < max_k:
        out.append(out[-1] * EXTRAPOLATION_DECAY)
    return tuple(out)


def bucket_bounds_of(bounds: Sequence[int]) -> dict[str, tuple[int, int]]:
    """Each bucket's inclusive batch-size range; "+Inf" spans one more doubling past the last bound."""
    out: dict[str, tuple[int, int]] = {}
    lo = 1
    for b in bounds:
        out[str(b)] = (lo, b)
        lo = b + 1
    out[INF] = (lo, max(lo, 2 * bounds[-1]))
    return out


Remembered = tuple[Mapping[str, float], Mapping[str, float]]
# Per bucket, the excess ratio measured at each K (`CalibratedCost.excess_by_k`).
RememberedByK = Mapping[str, Mapping[int, float]]


@dataclass
class RatioMemory:
    """The last measured step-time ratios (plain and excess, `CalibratedCost`) per cost group and bucket,
    kept between ticks: a bucket switched off stops producing speculative steps, and without its own
    ratio it would borrow the other buckets' (measured where speculation is cheap) and be switched on
    again. The excess ratio of each K is kept too: the K in force changes, and the shape of what
    speculation adds with K is fitted across the Ks measured (`CalibratedCost`), now or before."""

    ttl_s: float = RATIO_TTL_S
    # group → bucket → (ratio, time measured)
    plain: dict[Hashable, dict[str, tuple[float, float]]] = field(default_factory=dict)
    excess: dict[Hashable, dict[str, tuple[float, float]]] = field(default_factory=dict)
    # group → (bucket, K) → (ratio, time measured)
    excess_by_k: dict[Hashable, dict[tuple[str, int], tuple[float, float]]] = field(default_factory=dict)

    def record(
        self,
        group: Hashable,
        plain: Mapping[str, float],
        excess: Mapping[str, float],
        now: float,
        excess_by_k: RememberedByK | None = None,
    ) -> None:
        """Remember every ratio measured in this window (a fresh measurement replaces the old one)."""
        by_k = {(label, k): r for label, ks in (excess_by_k or {}).items() for k, r in ks.items()}
        stores: tuple[tuple[dict, Mapping], ...] = (
            (self.plain, plain),
            (self.excess, excess),
            (self.excess_by_k, by_k),
        )
        for store, ratios in stores:
            entries = store.setdefault(group, {})
            entries.update({key: (r, now) for key, r in ratios.items()})
            for key in [key for key, (_, at) in entries.items() if now - at >= self.ttl_s]:
                del entries[key]

    def recall(self, group: Hashable, now: float) -> Remembered:
        """The group's unexpired ratios, (plain, excess), per bucket."""
        return tuple(  # type: ignore[return-value]
            {label: r for label, (r, at) in store.get(group, {}).items() if now - at < self.ttl_s}
            for store in (self.plain, self.excess)
        )

    def recall_by_k(self, group: Hashable, now: float) -> dict[str, dict[int, float]]:
        """The group's unexpired excess ratios per bucket and K."""
        out: dict[str, dict[int, float]] = {}
        for (label, k), (r, at) in self.excess_by_k.get(group, {}).items():
            if now - at < self.ttl_s:
                out.setdefault(label, {})[k] = r
        return out


def _excess_ratio(prior: StepCostPrior, s: BucketStats, batch: float, plain_ratio: float) -> float:
    """Measured over predicted excess of a bucket's speculative steps: the time a speculative step takes
    beyond a plain step at the same batch (drafting, and verifying K more tokens per sequence), the plain
    part at the bucket's measured plain ratio. Steps counted by the K they verified are predicted at that
    K each (a window where K changed is not one step at the mean K); otherwise all at the mean draft
    length.

    The prediction is for the sequences that got a draft (`proposal_rate`): a step where a quarter of
    the batch drafted verifies a quarter of the extra tokens, and measured as if all had, it would make
    speculation look cheap wherever the whole batch drafts. (A draft model's steps in a bucket switched
    off, at the edge of one switched on, ran with a quarter drafted and turned a measured loss at
    batch 16 into a predicted gain.) `CalibratedCost.step_s` prices the excess at the rate expected."""
    ks = [k for k, n in s.steps_by_k.items() if n > 0 and k in s.seconds_by_k]
    if sum(s.steps_by_k[k] for k in ks) >= MIN_STEPS:
        steps = {k: s.steps_by_k[k] for k in ks}
        seconds = sum(s.seconds_by_k[k] for k in ks)
    else:
        steps = {max(1, round(s.draft_tokens / s.drafts)): s.steps_spec}
        seconds = s.seconds_spec
    plain = prior.step_s(batch, 0)
    predicted = proposal_rate(s) * sum(n * (prior.step_s(batch, k) - plain) for k, n in steps.items())
    measured = seconds - plain_ratio * plain * sum(steps.values())
    return max(measured / predicted, EXCESS_RATIO_FLOOR) if predicted > 0 else 1.0


def _excess_ratios_by_k(
    prior: StepCostPrior, s: BucketStats, batch: float, plain_ratio: float
) -> dict[int, float]:
    """The excess ratio (`_excess_ratio`) of each K verified in at least MIN_STEPS steps of the bucket."""
    plain = prior.step_s(batch, 0)
    rate = proposal_rate(s)
    out: dict[int, float] = {}
    for k, n in s.steps_by_k.items():
        predicted = rate * (prior.step_s(batch, k) - plain)
        if k > 0 and n >= MIN_STEPS and k in s.seconds_by_k and predicted > 0:
            measured = s.seconds_by_k[k] / n - plain_ratio * plain
            out[k] = max(measured / predicted, EXCESS_RATIO_FLOOR)
    return out


def _affine_excess(
    excess_s: Mapping[int, float], predicted_s: Mapping[int, float]
) -> tuple[float, float] | None:
    """What speculation adds to a step, measured at two or more Ks, fitted as a fixed part plus a part in
    proportion to the prior's: excess(K) = fixed + r·predicted(K), by least squares over the Ks measured.
    None when fewer than two Ks were measured, or when the fit needs a negative fixed part (the prior's
    shape then fits at least as well: the proportional ratio stands). The slope is kept at or above
    EXCESS_RATIO_FLOOR: a measured flat excess is a fixed cost, not a free K."""
    ks = sorted(excess_s)
    if len(ks) < 2:
        return None
    ratio = {k: excess_s[k] / predicted_s[k] for k in (ks[0], ks[-1])}
    if ratio[ks[0]] < AFFINE_SHAPE_GAP * ratio[ks[-1]]:
        return None
    xs, ys = [predicted_s[k] for k in ks], [excess_s[k] for k in ks]
    x_mean, y_mean = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - x_mean) ** 2 for x in xs)
    if spread <= 0:
        return None
    slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys, strict=True)) / spread
    slope = max(slope, EXCESS_RATIO_FLOOR)
    fixed = y_mean - slope * x_mean
    return (fixed, slope) if fixed > 0 else None


class CalibratedCost:
    """Step time per bucket and K, calibrated in two parts on what the fleet measured in that bucket:

        T(b, K) = T₀(b)·r₀(b) + (T₀(b, K) − T₀(b))·r₊(b)        (T₀: the roofline prior)

    r₀, the plain ratio, from plain steps; r₊, the excess ratio, from speculative steps (each at the K it
    verified and the batch it ran with, `_excess_ratio`): what a speculative step costs beyond a plain
    one is calibrated on its own, so a prior that under-predicts that excess (verification turning
    compute-bound, a costlier drafter) makes every K dearer in proportion to what it adds, not by one
    factor on the whole step, which would make small K look dear against plain and large K cheap. (One
    r₊ per bucket: a ratio per K, kept a day, was tried and lost, its few steps per K too noisy to trust
    for that long.) A bucket without its own measurement in the window uses the ratio remembered from an
    earlier one (`remembered`: plain, excess), else borrows the median ratio of those measured in the
    window, else of those remembered: a measurement, however old within the memory's TTL, outranks the
    prior.

    Where a bucket's speculative steps were measured at two or more Ks (in the window, else remembered
    per K: `remembered_by_k`), the excess takes their shape instead of the prior's:

        T(b, K) = T₀(b)·r₀(b) + c(b) + (T₀(b, K) − T₀(b))·s(b)

    c, a fixed cost per speculative step, and s, the slope, fitted on the Ks measured (`_affine_excess`).
    A drafter whose step costs the same at any K (an n-gram lookup behind an RPC, on a CPU) then looks no
    cheaper at K = 1 than it measured at K = 4, where one ratio would have scaled its measured cost down
    with the prior's. Every K measured in the window is priced at its own excess ratio, fit or not (a
    line through the Ks is not what each measured); with a fit, the other Ks take the fit; without one,
    a bucket measured in the window at two or more Ks prices the Ks between and beyond them interpolated
    (`_interpolated`): the truth's shape in K, not the prior's, where the window shows it
    (docs/policy.md, "Each K measured now, at its own ratio")."""

    def __init__(
        self,
        prior: StepCostPrior,
        stats: Mapping[str, BucketStats],
        bounds: Sequence[int],
        sibling_excess: float | None = None,
        remembered: Remembered = ({}, {}),
        remembered_by_k: RememberedByK | None = None,
    ) -> None:
        self.prior = prior
        self._memo: dict[tuple[str, int, float | None], tuple[float, float]] = {}
        self._parts_by_k: dict[tuple[str, int, float | None], tuple[float, tuple[float, ...]]] = {}
        # best_k's answers: one resource's tick asks the same bucket several times (its drafters' scores,
        # its table, its cliff), and resources of one group with the same acceptance share them.
        self.choices: dict[tuple[Acceptance, str, int, float | None], BucketChoice] = {}
        self.ranges = bucket_bounds_of(bounds)
        self.batch: dict[str, float] = {}
        self.plain_ratio: dict[str, float] = {}
        self.excess_ratio: dict[str, float] = {}
        self.remembered_plain, self.remembered_excess = remembered
        self.borrowed = sibling_excess is not None
        speculative: dict[str, tuple[BucketStats, float]] = {}
        for label, (lo, hi) in self.ranges.items():
            s = stats.get(label)
            batch = (lo + hi) / 2
            if s is not None and s.steps_plain >= MIN_STEPS and s.tokens_plain > 0:
                batch = min(max(s.tokens_plain / s.steps_plain, lo), hi)  # one token per sequence per step
            elif s is not None and s.steps_spec >= MIN_STEPS and s.drafts > 0:
                batch = min(max(spec_sequences(s) / s.steps_spec, lo), hi)
            self.batch[label] = batch
            if s is None:
                continue
            if s.steps_plain >= MIN_STEPS:
                self.plain_ratio[label] = (s.seconds_plain / s.steps_plain) / prior.step_s(batch, 0)
            if s.steps_spec >= MIN_STEPS and s.drafts > 0:
                speculative[label] = (s, min(max(spec_sequences(s) / s.steps_spec, lo), hi))
        self._plain_default = _median(self.plain_ratio.values(), _median(self.remembered_plain.values(), 1.0))
        self.excess_by_k: dict[str, dict[int, float]] = {}  # measured in the window, per bucket and K
        for label, (s, spec_batch) in speculative.items():
            self.excess_ratio[label] = _excess_ratio(prior, s, spec_batch, self.ratio(label, 0))
            if by_k := _excess_ratios_by_k(prior, s, spec_batch, self.ratio(label, 0)):
                self.excess_by_k[label] = by_k
        # (c, s) per bucket measured at two or more Ks; a K measured now replaces the one remembered.
        self.affine: dict[str, tuple[float, float]] = {}
        for label in self.ranges:
            ratios = {**(remembered_by_k or {}).get(label, {}), **self.excess_by_k.get(label, {})}
            if len(ratios) < 2:  # nothing to fit: skip the prior's step times (every bucket, every tick)
                continue
            b = self.batch[label]
            plain = prior.step_s(b, 0)
            predicted = {k: prior.step_s(b, k) - plain for k in ratios}
            fit = _affine_excess({k: r * predicted[k] for k, r in ratios.items()}, predicted)
            if fit is not None:
                self.affine[label] = fit
        # Without speculative measurements of its own, a group borrows how much costlier than predicted
        # speculation ran in sibling groups (same model and GPU, another drafter): the verify overhead
        # belongs to the engine, not to the drafter.
        self._excess_default = _median(
            self.excess_ratio.values(), _median(self.remembered_excess.values(), sibling_excess or 1.0)
        )

    @property
    def measured_excess(self) -> float | None:
        """The median excess ratio measured in the window, for sibling groups to borrow."""
        return _median(self.excess_ratio.values(), 1.0) if self.excess_ratio else None

    @property
    def any_spec_measured(self) -> bool:
        """Whether any speculative step time behind this model was measured (in the window, remembered
        or borrowed from a sibling drafter): if not, every speculative step time is the prior's."""
        return bool(self.excess_ratio or self.remembered_excess or self.borrowed)

    @property
    def own_spec_measured(self) -> bool:
        """Whether this group's own speculative steps were measured, in the window or remembered (not
        borrowed from a sibling)."""
        return bool(self.excess_ratio or self.remembered_excess)

    @cached_property
    def above_measured_range(self) -> frozenset[str]:
        """The buckets whose smallest batch is more than MAX_EXTRAPOLATION times the largest batch of any
        bucket where speculative steps were measured (in the window or remembered); none where nothing
        was (every step time is then the prior's, and a trial measures it first). A step's cost can grow
        with the batch far faster than the prior's roofline says: on a CPU the draft model measured a
        gain of 2.6 at batch 1, was predicted 1.9 at batch 16, and measured 0.32 there (docs/policy.md,
        "Comparing drafters"). Cached: one cost group serves every resource of the group in a tick."""
        measured = [hi for label, (_, hi) in self.ranges.items() if self.measured_spec(label)]
        if not measured:
            return frozenset()
        limit = MAX_EXTRAPOLATION * max(measured)
        return frozenset(label for label, (lo, _) in self.ranges.items() if lo > limit)

    def measured_spec(self, label: str) -> bool:
        """Whether speculative steps in this bucket were measured, in the window or remembered."""
        return label in self.excess_ratio or label in self.remembered_excess

    def measured_plain_now(self, label: str) -> bool:
        """Whether plain steps in this bucket were measured in the window."""
        return label in self.plain_ratio

    def measured_ks_now(self, label: str) -> tuple[int, ...]:
        """The Ks whose speculative steps in this bucket were measured in the window (MIN_STEPS each)."""
        return tuple(sorted(self.excess_by_k.get(label, {})))

    def measured_spec_now(self, label: str) -> bool:
        """Whether speculative steps in this bucket were measured in the window."""
        return label in self.excess_ratio

    def ratio(self, label: str, k: int) -> float:
        """The plain ratio (k = 0) or the excess ratio (k > 0) of a bucket: in-window measurement, else the
        remembered one, else the median of the measured buckets."""
        if k == 0:
            return self.plain_ratio.get(label, self.remembered_plain.get(label, self._plain_default))
        return self.excess_ratio.get(label, self.remembered_excess.get(label, self._excess_default))

    def step_s(self, label: str, k: int, batch: float | None = None, rate: float = 1.0) -> float:
        """Step time at K with a share `rate` of the batch drafting (the excess scales with it)."""
        plain, excess = self._parts(label, k, batch)
        return plain + rate * excess

    def parts_by_k(
        self, label: str, max_k: int, batch: float | None = None
    ) -> tuple[float, tuple[float, ...]]:
        """A plain step's time and the excess of K = 1..max_k for a whole batch drafting (`step_s` is
        plain + rate·excess): one lookup for a bucket's Ks where best_k prices them all."""
        key = (label, max_k, batch)
        parts = self._parts_by_k.get(key)
        if parts is None:
            plain = self._parts(label, 0, batch)[0]
            excess = tuple(self._parts(label, k, batch)[1] for k in range(1, max_k + 1))
            parts = self._parts_by_k[key] = (plain, excess)
        return parts

    def _parts(self, label: str, k: int, batch: float | None) -> tuple[float, float]:
        """A step's plain time and its excess at K for a whole batch drafting. Memoised without the rate:
        one group's cost serves every resource of that group in a tick, each at its own rate."""
        key = (label, k, batch)
        if key not in self._memo:
            b = self.batch[label] if batch is None else batch
            plain = self.prior.step_s(b, 0)
            excess = 0.0
            measured_now = self.excess_by_k.get(label, {})
            if k > 0 and label in self.affine and k not in measured_now:
                fixed, slope = self.affine[label]
                excess = fixed + (self.prior.step_s(b, k) - plain) * slope
            elif k > 0 and (k in measured_now or len(measured_now) >= 2):
                excess = (self.prior.step_s(b, k) - plain) * _interpolated(measured_now, k)
            elif k > 0:
                excess = (self.prior.step_s(b, k) - plain) * self.ratio(label, k)
            self._memo[key] = (plain * self.ratio(label, 0), excess)
        return self._memo[key]


def _interpolated(ratios: Mapping[int, float], k: int) -> float:
    """The ratio at K from ratios measured at other Ks: linear between the nearest measured Ks on either
    side, the nearest one's beyond them."""
    if k in ratios:
        return ratios[k]
    below = [m for m in ratios if m < k]
    above = [m for m in ratios if m > k]
    if not below:
        return ratios[min(above)]
    if not above:
        return ratios[max(below)]
    lo, hi = max(below), min(above)
    return ratios[lo] + (ratios[hi] - ratios[lo]) * (k - lo) / (hi - lo)


def _median(values: object, default: float) -> float:
    vs = sorted(values)  # type: ignore[call-overload]
    if not vs:
        return default
    mid = len(vs) // 2
    return vs[mid] if len(vs) % 2 else (vs[mid - 1] + vs[mid]) / 2


@dataclass(frozen=True)
class BucketChoice:
    k: int  # the best K (≥ 1) for this bucket
    gain: float  # its predicted goodput over plain decoding
    gains: tuple[float, ...] = ()  # the gain of every K, 1..max_k

    def gain_at(self, k: int) -> float:
        return self.gains[k - 1] if 0 < k <= len(self.gains) else self.gain


def best_k(
    acc: Acceptance, cost: CalibratedCost, label: str, max_k: int, batch: float | None = None
) -> BucketChoice:
    """The K in 1..max_k with the highest goodput gain E_s(K)·T(b,0)/T(b,K), and that gain."""
    key = (acc, label, max_k, batch)
    choice = cost.choices.get(key)
    if choice is None:
        t0, excess = cost.parts_by_k(label, max_k, batch)
        rate = acc.proposal_rate
        choice = cost.choices[key] = _best_of(
            tuple(t * t0 / (t0 + rate * e) for t, e in zip(acc.step_tokens_by_k(max_k), excess, strict=True))
        )
    return choice


def ceiling_gain(cost: CalibratedCost, label: str, max_k: int) -> float:
    """The best gain a bucket could have: every sequence drafting and every draft accepted, K + 1 tokens
    a step. No measurement of acceptance can find more (with fewer sequences drafting the gain is
    nearer 1, either side)."""
    t0 = cost.step_s(label, 0)
    return max((k + 1) * t0 / cost.step_s(label, k) for k in range(1, max_k + 1))


def _best_of(gains: tuple[float, ...]) -> BucketChoice:
    """The K (1-based) with the highest gain, the smallest K among equals."""
    # A tie within rounding goes to the smaller K. Rounding is monotone, so the highest rounded gain is the
    # highest gain's, and only gains within 1e-11 of it can round to it: most are not rounded at all.
    top = round(max(gains), 12)
    near = top - 1e-11
    k = next(k for k, g in enumerate(gains, 1) if g >= near and round(g, 12) == top)
    return BucketChoice(k, gains[k - 1], gains)


def gain_caps(choices: Mapping[str, BucketChoice], cost: CalibratedCost) -> dict[str, float]:
    """Per bucket, the most gain it may be predicted: for a bucket whose speculative steps were never
    measured, the lowest best gain of the smaller buckets that were; for a measured one, no cap.

    Gain falls with batch size (verification turns compute-bound), so a bucket predicted from the prior
    and borrowed ratios cannot pay more than a smaller bucket measured to pay that much: a measurement
    is never overridden by an extrapolation (and stands on its own)."""
    caps: dict[str, float] = {}
    lowest_measured = math.inf
    for label, choice in choices.items():  # bucket order, smallest batch first
        if cost.measured_spec(label):
            caps[label] = math.inf
            lowest_measured = min(lowest_measured, choice.gain)
        else:
            caps[label] = lowest_measured
    return caps


def _capped(choice: BucketChoice, cap: float) -> BucketChoice:
    if choice.gain <= cap:
        return choice
    return _best_of(tuple(min(g, cap) for g in choice.gains))


def choose_table(
    acc: Acceptance, cost: CalibratedCost, bounds: Sequence[int], max_k: int
) -> dict[str, BucketChoice]:
    """Every bucket's best K and gain, an unmeasured bucket's gain capped by `gain_caps`."""
    choices = {label: best_k(acc, cost, label, max_k) for label in bucket_labels(bounds)}
    caps = gain_caps(choices, cost)
    return {label: _capped(choice, caps[label]) for label, choice in choices.items()}


def cliff_batch_size(
    acc: Acceptance, cost: CalibratedCost, bounds: Sequence[int], max_k: int, min_gain: float
) -> int | None:
    """The smallest batch size at which no K reaches `min_gain` (None: speculation pays everywhere).

    Gain falls with batch size (verification turns compute-bound), so the first bucket whose upper end
    fails is found first, then the exact batch inside it by bisection. A bucket's gain is capped as
    the table's is (`gain_caps`)."""
    caps = gain_caps({label: best_k(acc, cost, label, max_k) for label in bucket_labels(bounds)}, cost)

    def pays(batch: int) -> bool:
        label = _label_for(batch, bounds)
        return min(best_k(acc, cost, label, max_k, batch).gain, caps[label]) >= min_gain

    for lo, hi in cost.ranges.values():
        if pays(hi):
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if pays(mid):
                lo = mid + 1
            else:
                hi = mid
        return lo
    return None


def _label_for(batch: int, bounds: Sequence[int]) -> str:
    for b in bounds:
        if batch <= b:
            return str(b)
    return INF


@dataclass(frozen=True)
class Hysteresis:
    min_gain: float  # turn a bucket on at this predicted gain
    cooldown_s: float  # no on/off flip of a bucket within this long of its last flip
    k_change_gain: float = 0.02  # retune K only for at least this much more gain

    @property
    def off_gain(self) -> float:
        """Keep an already-on bucket on down to halfway between plain decoding and minGain."""
        return 1.0 + (self.min_gain - 1.0) / 2


@dataclass(frozen=True)
class TableUpdate:
    k_by_bucket: dict[str, int]
    flipped: dict[str, float]  # bucket → time of its on/off change (only those that changed now)
    reasons: list[str]


def update_table(
    current: Mapping[str, int],
    choices: Mapping[str, BucketChoice],
    hysteresis: Hysteresis,
    flipped_at: Mapping[str, float],
    now: float,
    waived: Collection[str] = frozenset(),
) -> TableUpdate:
    """The next K table from the current one and the predicted gains, with hysteresis and cooldown.

    Off → on needs gain ≥ minGain and a cooldown since the bucket's last flip, except in the buckets
    `waived` (turned off on an estimate that a measurement now corrects). On → off happens below the off
    threshold after the cooldown, and at once where speculation is predicted to be slower than plain
    decoding (gain < 1): a pod is never left slower than plain decoding for a cooldown."""
    table: dict[str, int] = {}
    flipped: dict[str, float] = {}
    reasons: list[str] = []
    for label, choice in choices.items():
        k_now = current.get(label, 0)
        cooled = now - flipped_at.get(label, -math.inf) >= hysteresis.cooldown_s
        if k_now == 0:
            if choice.gain >= hysteresis.min_gain and (cooled or label in waived):
                table[label] = choice.k
                flipped[label] = now
                reasons.append(f"bucket {label} on: k={choice.k} gain {choice.gain:.2f}")
            else:
                table[label] = 0
            continue
        current_k = min(k_now, len(choice.gains) or k_now)
        if choice.gain < 1.0 or (choice.gain < hysteresis.off_gain and cooled):
            table[label] = 0
            flipped[label] = now
            reasons.append(f"bucket {label} off: best gain {choice.gain:.2f}")
            continue
        # Stay on; move K only when the better K is clearly better than the K in force.
        current_gain = choice.gain_at(current_k)
        if (
            choice.k != k_now
            and (choice.gain - current_gain) / max(current_gain, 1e-9) < hysteresis.k_change_gain
        ):
            table[label] = current_k
        else:
            table[label] = choice.k
            if choice.k != k_now:
                reasons.append(f"bucket {label} k {k_now}→{choice.k}")
    return TableUpdate(table, flipped, reasons)


def drafter_score(
    acc: Acceptance,
    cost: CalibratedCost,
    bounds: Sequence[int],
    max_k: int,
    weights: Mapping[str, float],
    measured_range_only: bool = False,
) -> float:
    """Predicted goodput over plain decoding across the fleet's batch mix (weights: steps per bucket),
    each bucket at its best K or off: how much this drafter would be worth on the traffic seen. With
    `measured_range_only`, a bucket far above every bucket where its speculative steps were measured
    counts as off (gain 1), not at a gain extrapolated up the batch sizes
    (`CalibratedCost.above_measured_range`)."""
    total = sum(weights.values())
    if total <= 0:
        weights = {label: 1.0 for label in bucket_labels(bounds)}
        total = float(len(weights))
    choices = choose_table(acc, cost, bounds, max_k)
    unknown = cost.above_measured_range if measured_range_only else frozenset()
    score = sum(
        w * (1.0 if label in unknown else max(1.0, choices[label].gain))
        for label, w in weights.items()
        if label in choices
    )
    return score / total

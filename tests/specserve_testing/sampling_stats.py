"""The statistics of the lossless-sampling checks (docs/engine-pod.md, "Lossless under sampling").

- `sampling_probs`: vLLM's sampling transform (temperature, then top-k, then top-p), written out here as
  the reference, so that a fault in vLLM's own cannot cancel out;
- `randomized_pit`: the probability integral transform of each sampled token under the distribution it
  should follow, tokens ordered from most to least likely. Along a sequence sampled from those
  distributions the values are independent and uniform on [0, 1) (each is uniform given everything before
  it), so the drafted positions of many samples pool into one uniformity test. A changed distribution
  moves mass between the intervals of the tokens, and its total variation carries over unchanged;
- `uniformity_test`: a chi-square test of the values in `BINS` equal bins, and `observations_needed`, the
  power calculation that sizes it: the test's noncentrality is N times the chi-square divergence of the
  binned distribution from uniform, which is at least 4·TV² (Cauchy–Schwarz), so N = λ / (4·TV²) where λ
  is the noncentrality at which the noncentral chi-square reaches the wanted power.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BINS = 10


@dataclass(frozen=True)
class SamplingSetting:
    """One request's sampling parameters (None = that filter off)."""

    name: str
    temperature: float
    top_k: int | None = None
    top_p: float | None = None

    def request_fields(self) -> dict:
        """The completion request's fields: vLLM's "off" values where a filter is not used."""
        return {"temperature": self.temperature, "top_k": self.top_k or -1, "top_p": self.top_p or 1.0}


# The settings every drafter and placement is checked at.
SETTINGS = (
    SamplingSetting("temperature 1.0", 1.0),
    SamplingSetting("temperature 0.8, top-p 0.95", 0.8, top_p=0.95),
    SamplingSetting("temperature 0.8, top-k 20", 0.8, top_k=20),
)


def sampling_probs(logits: torch.Tensor, setting: SamplingSetting) -> torch.Tensor:
    """The distribution vLLM samples from, per row of `logits`: divide by the temperature, keep the
    top-k logits (ties kept), then the most likely tokens whose probabilities sum to at least top-p (the
    tokens whose ascending cumulative probability is at most 1 − top-p go, the most likely always stays)."""
    x = logits.to(torch.float64) / setting.temperature
    if setting.top_k is not None:
        kth = x.topk(setting.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if setting.top_p is not None:
        ascending, order = x.sort(dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - setting.top_p
        drop[:, -1] = False
        x = x.scatter(-1, order, ascending.masked_fill(drop, -math.inf))
    return x.softmax(dim=-1)


def randomized_pit(probs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """For each row, F(token−) + V·p(token) with V uniform, the tokens ordered by descending probability
    (ties by id). A token the reference gives probability 0 lands at 1.0, in the last bin."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = order.argsort(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    before = (sorted_probs.cumsum(dim=-1) - sorted_probs).gather(-1, rank[:, None]).squeeze(-1)
    p = probs.gather(-1, tokens[:, None]).squeeze(-1)
    v = torch.rand(tokens.shape[0], dtype=torch.float64, generator=generator)
    return (before + v * p).clamp(0.0, 1.0)


@dataclass(frozen=True)
class UniformityResult:
    observations: int
    p_value: float
    total_variation: float  # plug-in estimate on the bins (biased up by noise: ~0.01 at N = 20,000)
    impossible: int  # values of tokens the reference gives probability 0

    def as_dict(self) -> dict:
        return {
            "observations": self.observations,
            "p_value": self.p_value,
            "total_variation": round(self.total_variation, 4),
            "impossible_tokens": self.impossible,
        }


def uniformity_test(values: torch.Tensor, bins: int = BINS) -> UniformityResult:
    """Chi-square test that `values` are uniform on [0, 1), in `bins` equal bins."""
    n = values.numel()
    counts = torch.bincount((values * bins).long().clamp(max=bins - 1), minlength=bins).to(torch.float64)
    expected = n / bins
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return UniformityResult(
        observations=n,
        p_value=chi2_sf(statistic, bins - 1),
        total_variation=float((counts / n - 1 / bins).abs().sum() / 2),
        impossible=int((values >= 1.0).sum()),
    )


def chi2_sf(x: float, df: int) -> float:
    """P(χ²_df > x)."""
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)
        )
    )


def chi2_isf(alpha: float, df: int) -> float:
    """The x with P(χ²_df > x) = alpha (bisection)."""
    lo, hi = 0.0, 10.0 * df + 200.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def noncentral_chi2_sf(x: float, df: int, noncentrality: float) -> float:
    """P(χ'²_df(λ) > x), as the Poisson(λ/2) mixture of central chi-squares with df + 2j."""
    half = noncentrality / 2
    terms = range(int(half + 20 * math.sqrt(half + 1) + 20))
    return sum(
        math.exp(j * math.log(half) - half - math.lgamma(j + 1)) * chi2_sf(x, df + 2 * j) for j in terms
    )


def observations_needed(tv: float, alpha: float, power: float, bins: int = BINS) -> int:
    """The smallest N at which the uniformity test at level `alpha` detects, with probability `power`,
    any distribution whose total variation from uniform on the bins is at least `tv`."""
    critical = chi2_isf(alpha, bins - 1)
    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if noncentral_chi2_sf(critical, bins - 1, mid) < power else (lo, mid)
    return math.ceil(hi / (4 * tv**2))

"""PNG plots of the local fleet's report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from specserve_operator.local.report import (
    RUN_BEST_STATIC,
    RUN_OFF,
    RUN_ORDER,
    RUN_SPECSERVE,
    RUN_STATIC,
    RUN_TITLES,
    ReportInput,
    bucket_sort_key,
    phase_stats,
)

RUN_COLORS = {
    RUN_SPECSERVE: "tab:green",
    RUN_OFF: "tab:gray",
    RUN_STATIC: "tab:orange",
    RUN_BEST_STATIC: "tab:blue",
}


def draw_all(folder: Path, data: ReportInput) -> list[str]:
    images: list[str] = []
    if RUN_SPECSERVE in data.patterns:
        images.append(_timeline(folder / "timeline.png", data))
    images.append(_throughput(folder / "tokens_per_s.png", data))
    if data.mal_by_bucket:
        images.append(_mal(folder / "mal_per_bucket.png", data))
    return images


def _shade_phases(ax: plt.Axes, data: ReportInput) -> None:
    pattern = data.patterns[RUN_SPECSERVE]
    peak = pattern.max_concurrency
    for at in pattern.boundaries():
        ax.axvspan(at.start_s, at.end_s, color="tab:red", alpha=0.10 * at.phase.concurrency / peak, lw=0)


def _timeline(path: Path, data: ReportInput) -> str:
    samples = [s for s in data.samples if s.run == RUN_SPECSERVE]
    pods = sorted({p.pod for s in samples for p in s.pods})
    fig, axes = plt.subplots(4, 1, figsize=(11, 10), sharex=True, height_ratios=[1.2, 1, 0.7, 1])
    load, k_ax, drafter_ax, tps_ax = axes
    t = [s.t_s for s in samples]
    load.step(t, [s.target_concurrency for s in samples], where="post", color="black", label="clients")
    for pod in pods:
        series = [(s.t_s, p) for s in samples for p in s.pods if p.pod == pod]
        pt = [x for x, _ in series]
        load.plot(pt, [_nan(p.batch_size) for _, p in series], label=f"{pod} batch size")
        k_ax.step(pt, [_nan(p.k_now) for _, p in series], where="post", label=f"{pod} K in force")
        labels = [("off" if p.k_now == 0 else p.drafter) if p.drafter else None for _, p in series]
        drafter_ax.scatter(pt, [lab or "?" for lab in labels], s=6, label=pod)
        tps_ax.plot(pt, [_nan(p.tokens_per_s) for _, p in series], label=pod)
    for d in data.decisions:
        if d.run == RUN_SPECSERVE:
            k_ax.axvline(d.t_s, color="tab:purple", alpha=0.35, lw=0.8)
    for ax in axes:
        _shade_phases(ax, data)
    load.set_ylabel("requests")
    load.set_title("Load, K and drafter over time (specserve run; shading = load, purple = decisions)")
    load.legend(loc="upper right", fontsize=8)
    k_ax.set_ylabel("K at current batch")
    top_k = max((k for s in samples for p in s.pods for k in p.k_by_bucket.values()), default=4)
    k_ax.set_ylim(-0.3, top_k + 0.5)
    k_ax.legend(loc="upper right", fontsize=8)
    drafter_ax.set_ylabel("drafter")
    tps_ax.set_ylabel("tokens / s")
    tps_ax.set_xlabel("seconds")
    tps_ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _throughput(path: Path, data: ReportInput) -> str:
    runs = [r for r in RUN_ORDER if r in data.patterns]
    stats = {r: phase_stats(data.records, r, data.patterns[r]) for r in runs}
    n = len(stats[runs[0]]) if runs else 0
    # Left: tokens per second; right: the same relative to plain decoding (quiet phases' differences
    # vanish next to the busy phase's totals on one axis).
    fig, (ax, rel) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(runs))
    off = stats.get(RUN_OFF)
    for j, r in enumerate(runs):
        xs = [i + (j - (len(runs) - 1) / 2) * width for i in range(n)]
        ax.bar(xs, [s.tokens_per_s for s in stats[r]], width, label=RUN_TITLES[r], color=RUN_COLORS.get(r))
        if off is not None:
            ratios = [
                s.tokens_per_s / o.tokens_per_s if o.tokens_per_s else math.nan
                for s, o in zip(stats[r], off, strict=True)
            ]
            rel.bar(xs, ratios, width, color=RUN_COLORS.get(r))
    labels = [f"{s.index + 1}. {s.phase}\n(conc. {s.concurrency})" for s in stats[runs[0]]] if runs else []
    for a in (ax, rel):
        a.set_xticks(range(n), labels)
    ax.set_ylabel("generated tokens / s")
    ax.set_title("Throughput per traffic phase, same traffic")
    ax.legend(fontsize=8)
    rel.axhline(1.0, color="black", lw=0.8)
    rel.set_ylabel("× plain decoding")
    rel.set_title("Relative to speculation off" if off is not None else "(no run with speculation off)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _mal(path: Path, data: ReportInput) -> str:
    runs = [r for r in RUN_ORDER if r in data.mal_by_bucket]
    buckets = sorted({b for r in runs for b in data.mal_by_bucket[r]}, key=bucket_sort_key)
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(runs))
    for j, r in enumerate(runs):
        xs = [i + (j - (len(runs) - 1) / 2) * width for i in range(len(buckets))]
        ys = [_nan(data.mal_by_bucket[r].get(b)) for b in buckets]
        ax.bar(xs, ys, width, label=RUN_TITLES[r], color=RUN_COLORS.get(r))
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(buckets)), [f"≤{b}" if b != "+Inf" else b for b in buckets])
    ax.set_xlabel("batch-size bucket")
    ax.set_ylabel("mean accepted length")
    ax.set_title("MAL per batch-size bucket (1 = every draft rejected)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _nan(x: float | None) -> float:
    return math.nan if x is None else float(x)

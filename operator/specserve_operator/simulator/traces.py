"""Load traces: CSV `t_s,rate_rps,code_fraction`; a segment starts at `t_s` and lasts until the next one
(the last lasts `tail_s`). Arrivals are Poisson at `rate_rps`; `code_fraction` of requests are code-like.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Trace:
    name: str
    starts: np.ndarray  # segment start times, seconds, increasing, first 0
    rates: np.ndarray  # requests per second
    code: np.ndarray  # share of code-like requests
    duration_s: float

    def at(self, t: float) -> tuple[float, float]:
        i = int(np.searchsorted(self.starts, t, side="right")) - 1
        return float(self.rates[i]), float(self.code[i])


def load_trace(path: str | Path, tail_s: float | None = None) -> Trace:
    """Read a trace CSV; errors name the line and column."""
    path = Path(path)
    starts, rates, code = [], [], []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not {"t_s", "rate_rps", "code_fraction"} <= set(reader.fieldnames):
            raise ValueError(f"{path}: header must be t_s,rate_rps,code_fraction (got {reader.fieldnames})")
        for line, row in enumerate(reader, start=2):
            try:
                t, r, c = float(row["t_s"]), float(row["rate_rps"]), float(row["code_fraction"])
            except (TypeError, ValueError):
                raise ValueError(f"{path}:{line}: t_s, rate_rps and code_fraction must be numbers") from None
            if not (math.isfinite(t) and math.isfinite(r) and r >= 0):
                raise ValueError(f"{path}:{line}: rate_rps must be a finite number ≥ 0")
            if not 0.0 <= c <= 1.0:
                raise ValueError(f"{path}:{line}: code_fraction must be within 0..1")
            if starts and t <= starts[-1]:
                raise ValueError(f"{path}:{line}: t_s must increase")
            starts.append(t)
            rates.append(r)
            code.append(c)
    if not starts or starts[0] != 0.0:
        raise ValueError(f"{path}: the first segment must start at t_s=0")
    step = starts[-1] - starts[-2] if len(starts) > 1 else 60.0
    duration = starts[-1] + (tail_s if tail_s is not None else step)
    return Trace(path.stem, np.array(starts), np.array(rates), np.array(code), duration)


def write_trace(path: str | Path, rows: list[tuple[float, float, float]]) -> None:
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "rate_rps", "code_fraction"])
        for t, r, c in rows:
            w.writerow([f"{t:g}", f"{r:.3f}", f"{c:.3f}"])


def diurnal_rows(
    peak_rps: float, trough_rps: float, segment_s: float = 600.0
) -> list[tuple[float, float, float]]:
    """24 hours: quiet at 04:00, busiest at 15:00; code-heavy in working hours, prose in the evening."""
    rows = []
    for i in range(int(86400 / segment_s)):
        t = i * segment_s
        hour = t / 3600.0
        shape = 0.5 - 0.5 * math.cos(2 * math.pi * (hour - 4.0) / 24.0)  # 0 at 04:00, 1 at 16:00
        shape = shape**1.5
        rate = trough_rps + (peak_rps - trough_rps) * shape
        code = 0.25 + 0.45 * max(0.0, math.sin(math.pi * (hour - 8.0) / 10.0)) if 8 <= hour <= 18 else 0.2
        rows.append((t, rate, code))
    return rows


def bursty_rows(
    base_rps: float, burst_rps: float, hours: float = 6.0, seed: int = 7
) -> list[tuple[float, float, float]]:
    """Quiet stretches with sudden bursts of 2–10 minutes, each with its own traffic mix."""
    rng = np.random.default_rng(seed)
    rows: list[tuple[float, float, float]] = []
    t = 0.0
    while t < hours * 3600:
        quiet = float(rng.uniform(600, 1800))
        rows.append((t, base_rps * float(rng.uniform(0.3, 1.0)), float(rng.uniform(0.1, 0.7))))
        t += quiet
        if t >= hours * 3600:
            break
        rows.append((t, burst_rps * float(rng.uniform(0.6, 1.0)), float(rng.uniform(0.1, 0.9))))
        t += float(rng.uniform(120, 600))
    return rows


def scaled(trace: Trace, factor: float) -> Trace:
    """The same trace with every arrival rate multiplied by `factor`."""
    return replace(trace, rates=trace.rates * factor)


def window(trace: Trace, start_s: float, end_s: float) -> Trace:
    """The part of a trace between two times, starting at 0."""
    start_s, end_s = max(0.0, start_s), min(trace.duration_s, end_s)
    if end_s <= start_s:
        raise ValueError(f"window: empty ({start_s} to {end_s} s of {trace.name})")
    first = int(np.searchsorted(trace.starts, start_s, side="right")) - 1
    last = int(np.searchsorted(trace.starts, end_s, side="left"))
    starts = np.maximum(trace.starts[first:last] - start_s, 0.0)
    return Trace(trace.name, starts, trace.rates[first:last], trace.code[first:last], end_s - start_s)

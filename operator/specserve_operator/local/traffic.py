"""The local fleet's traffic pattern: phases of constant concurrency (quiet → busy → quiet), pure data.

A phase is written `NAME:DURATION:CONCURRENCY[:CODE_FRACTION]` on the command line, e.g.
`quiet:40s:1,busy:60s:12,quiet:40s:1`; DURATION takes an `s` or `m` suffix (seconds without one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(s|m)?$")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")


class TrafficPatternError(ValueError):
    """A traffic pattern that cannot be run; the message names the phase and the field."""


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    concurrency: int
    code_fraction: float = 0.5  # share of requests drawn from the code-like domain, the rest prose-like

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise TrafficPatternError(f"phase name {self.name!r}: use letters, digits, '-' or '_'")
        if self.duration_s <= 0:
            raise TrafficPatternError(f"phase {self.name!r}: duration must be > 0 (got {self.duration_s})")
        if not 1 <= self.concurrency <= 1024:
            raise TrafficPatternError(
                f"phase {self.name!r}: concurrency must be 1..1024 (got {self.concurrency})"
            )
        if not 0.0 <= self.code_fraction <= 1.0:
            raise TrafficPatternError(
                f"phase {self.name!r}: code fraction must be within 0..1 (got {self.code_fraction})"
            )

    def render(self) -> str:
        return f"{self.name}:{_fmt_seconds(self.duration_s)}:{self.concurrency}:{self.code_fraction:g}"


@dataclass(frozen=True)
class PhaseAt:
    index: int
    phase: Phase
    start_s: float  # the phase's start, from the start of the pattern

    @property
    def end_s(self) -> float:
        return self.start_s + self.phase.duration_s


@dataclass(frozen=True)
class TrafficPattern:
    phases: tuple[Phase, ...]

    def __post_init__(self) -> None:
        if not self.phases:
            raise TrafficPatternError("the traffic pattern needs at least one phase")

    @property
    def total_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    @property
    def max_concurrency(self) -> int:
        return max(p.concurrency for p in self.phases)

    def phase_at(self, t_s: float) -> PhaseAt | None:
        """The phase running `t_s` seconds into the pattern; None before the start or after the end."""
        if t_s < 0:
            return None
        start = 0.0
        for i, phase in enumerate(self.phases):
            if t_s < start + phase.duration_s:
                return PhaseAt(i, phase, start)
            start += phase.duration_s
        return None

    def boundaries(self) -> list[PhaseAt]:
        """Every phase with its start time, in order."""
        out: list[PhaseAt] = []
        start = 0.0
        for i, phase in enumerate(self.phases):
            out.append(PhaseAt(i, phase, start))
            start += phase.duration_s
        return out

    def scaled(self, factor: float) -> TrafficPattern:
        """The same phases with every duration multiplied by `factor` (the short comparison runs)."""
        if factor <= 0:
            raise TrafficPatternError(f"scale factor must be > 0 (got {factor})")
        return TrafficPattern(
            tuple(Phase(p.name, p.duration_s * factor, p.concurrency, p.code_fraction) for p in self.phases)
        )

    def render(self) -> str:
        return ",".join(p.render() for p in self.phases)


def parse_duration(text: str) -> float:
    m = _DURATION.match(text.strip())
    if not m:
        raise TrafficPatternError(f"duration {text!r}: write seconds, e.g. 40, 40s or 1.5m")
    value = float(m.group(1))
    return value * 60 if m.group(2) == "m" else value


def parse_pattern(text: str) -> TrafficPattern:
    """Parse `NAME:DURATION:CONCURRENCY[:CODE_FRACTION],...`."""
    phases: list[Phase] = []
    for n, item in enumerate(text.split(","), start=1):
        fields = item.strip().split(":")
        if len(fields) not in (3, 4):
            raise TrafficPatternError(
                f"phase {n} ({item.strip()!r}): write NAME:DURATION:CONCURRENCY[:CODE_FRACTION]"
            )
        name, duration, concurrency = fields[0], fields[1], fields[2]
        try:
            conc = int(concurrency)
        except ValueError:
            raise TrafficPatternError(
                f"phase {n} ({name}): concurrency {concurrency!r} is not an integer"
            ) from None
        code_fraction = 0.5
        if len(fields) == 4:
            try:
                code_fraction = float(fields[3])
            except ValueError:
                raise TrafficPatternError(
                    f"phase {n} ({name}): code fraction {fields[3]!r} is not a number"
                ) from None
        try:
            phases.append(Phase(name, parse_duration(duration), conc, code_fraction))
        except TrafficPatternError as exc:
            raise TrafficPatternError(f"phase {n}: {exc}") from None
    return TrafficPattern(tuple(phases))


def _fmt_seconds(seconds: float) -> str:
    return f"{seconds:g}s"

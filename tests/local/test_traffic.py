"""The traffic pattern: parsing, errors that name the phase, and where time t falls."""

from __future__ import annotations

import pytest

from specserve_operator.local.traffic import Phase, TrafficPattern, TrafficPatternError, parse_pattern


def test_parse_and_locate() -> None:
    p = parse_pattern("quiet:10s:1,busy:0.5m:12:0.8,quiet:5:2")
    assert [ph.name for ph in p.phases] == ["quiet", "busy", "quiet"]
    assert p.total_s == 45
    assert p.max_concurrency == 12
    assert p.phases[1].code_fraction == 0.8
    assert p.phases[0].code_fraction == 0.5
    assert [p.phase_at(t).index for t in (0, 9.99, 10)] == [0, 0, 1]
    at = p.phase_at(41)
    assert at is not None and at.index == 2 and at.start_s == 40 and at.end_s == 45
    assert p.phase_at(45) is None
    assert p.phase_at(-1) is None


def test_render_round_trips() -> None:
    p = parse_pattern("quiet:10s:1,busy:30s:12:0.8")
    assert parse_pattern(p.render()) == p


def test_scaled_keeps_concurrency() -> None:
    p = parse_pattern("a:10:1,b:20:8").scaled(0.5)
    assert [(ph.duration_s, ph.concurrency) for ph in p.phases] == [(5, 1), (10, 8)]
    with pytest.raises(TrafficPatternError, match="scale factor"):
        p.scaled(0)


def test_boundaries() -> None:
    p = parse_pattern("a:10:1,b:20:8,c:5:1")
    assert [(b.start_s, b.end_s) for b in p.boundaries()] == [(0, 10), (10, 30), (30, 35)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("quiet:10s", "phase 1 .*NAME:DURATION:CONCURRENCY"),
        ("quiet:10s:1,busy:ten:4", "phase 2: duration 'ten'"),
        ("quiet:10s:many", "phase 1 \\(quiet\\): concurrency 'many'"),
        ("quiet:10s:0", "concurrency must be 1..1024"),
        ("quiet:10s:1:1.5", "code fraction must be within 0..1"),
        ("quiet:10s:1:x", "code fraction 'x'"),
        ("9bad:10s:1", "phase name"),
        ("quiet:0s:1", "duration must be > 0"),
    ],
)
def test_errors_name_the_phase(text: str, message: str) -> None:
    with pytest.raises(TrafficPatternError, match=message):
        parse_pattern(text)


def test_empty_pattern_is_refused() -> None:
    with pytest.raises(TrafficPatternError, match="at least one phase"):
        TrafficPattern(())
    with pytest.raises(TrafficPatternError):
        Phase("x", 1, 2000)

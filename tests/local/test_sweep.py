"""The best static table in hindsight, from sweep measurements (pure; the fleet test runs the sweep on
real engines)."""

from __future__ import annotations

import pytest

from specserve_operator.local.sweep import (
    Candidate,
    Shape,
    SweepPoint,
    best_static_table,
    median_tokens_per_s,
    sweep_candidates,
    sweep_shapes,
)
from specserve_operator.local.traffic import parse_pattern

BOUNDS = (1, 2, 4, 8, 16, 32)
CODE_QUIET, PROSE_QUIET, BUSY = Shape(1, 1.0), Shape(1, 0.0), Shape(16, 0.5)


def _points(table: dict[Shape, dict[Candidate, float]]) -> list[SweepPoint]:
    return [SweepPoint(shape, c, tps) for shape, row in table.items() for c, tps in row.items()]


OFF = Candidate(None, 0)
DRAFT = {k: Candidate("draft", k) for k in (1, 2, 3)}
NGRAM = {k: Candidate("ngram", k) for k in (1, 2, 3)}


def test_shapes_and_candidates() -> None:
    pattern = parse_pattern("a:10:1:1,b:10:1:0,c:10:16,d:10:1:1")
    assert sweep_shapes(pattern) == [CODE_QUIET, PROSE_QUIET, BUSY]
    assert sweep_candidates({"draft": 2, "ngram": 1}) == [OFF, DRAFT[1], DRAFT[2], NGRAM[1]]


def test_each_bucket_takes_its_best_k_and_off_where_speculation_loses() -> None:
    pattern = parse_pattern("quiet:60:1:0.5,busy:60:16:0.5")
    quiet, busy = Shape(1, 0.5), BUSY
    points = _points(
        {
            quiet: {OFF: 100, DRAFT[1]: 130, DRAFT[2]: 150, DRAFT[3]: 140},
            busy: {OFF: 900, DRAFT[1]: 800, DRAFT[2]: 700, DRAFT[3]: 600},
        }
    )
    table = best_static_table(points, pattern, BOUNDS)
    assert table.drafter == "draft"
    # Bucket 1 is measured (K 2); 16 is measured (off); 2 and 4 are nearer 1, 8 and 32 nearer 16.
    assert table.k_by_bucket == {"1": 2, "2": 2, "4": 2, "8": 0, "16": 0, "32": 0, "+Inf": 0}
    assert table.predicted_tokens == pytest.approx(60 * 150 + 60 * 900)


def test_one_k_per_bucket_serves_every_phase_in_it_weighted_by_time() -> None:
    """Code-like and prose-like quiet phases share bucket 1: the K chosen is the one that generates the most
    tokens over both, so the longer phase weighs more; the drafter that wins overall is chosen."""
    pattern = parse_pattern("code:30:1:1,prose:90:1:0,busy:30:16")
    points = _points(
        {
            CODE_QUIET: {OFF: 100, DRAFT[1]: 120, DRAFT[3]: 130, NGRAM[1]: 140, NGRAM[3]: 300},
            PROSE_QUIET: {OFF: 100, DRAFT[1]: 125, DRAFT[3]: 140, NGRAM[1]: 105, NGRAM[3]: 90},
            BUSY: {OFF: 900, DRAFT[1]: 800, DRAFT[3]: 500, NGRAM[1]: 950, NGRAM[3]: 850},
        }
    )
    table = best_static_table(points, pattern, BOUNDS)
    # ngram: bucket 1 K 3 -> 30*300 + 90*90 = 17,100 (K 1: 4,200 + 9,450 = 13,650), busy K 1 -> 28,500.
    # draft: bucket 1 K 3 -> 3,900 + 12,600 = 16,500, busy off -> 27,000. ngram wins, 45,600 to 43,500.
    assert table.drafter == "ngram"
    assert table.k_by_bucket["1"] == 3 and table.k_by_bucket["16"] == 1
    assert table.predicted_tokens == pytest.approx(17_100 + 28_500)


def test_a_missing_measurement_is_an_error_not_a_zero() -> None:
    pattern = parse_pattern("quiet:10:1:0.5,busy:10:16:0.5")
    points = _points({Shape(1, 0.5): {OFF: 100, DRAFT[1]: 120}, BUSY: {OFF: 900}})
    with pytest.raises(ValueError, match="not measured"):
        best_static_table(points, pattern, BOUNDS)
    with pytest.raises(ValueError, match="no drafter"):
        best_static_table(_points({BUSY: {OFF: 900}}), pattern, BOUNDS)


def test_a_candidate_measured_in_rounds_counts_at_its_median() -> None:
    """One noisy round does not pick the table: n-gram's one fast busy measurement (1000 against off's 900)
    is outvoted by its other two rounds."""
    pattern = parse_pattern("quiet:60:1:1,busy:60:16:0.5")
    rounds = [
        {CODE_QUIET: {OFF: 100, NGRAM[1]: 150}, BUSY: {OFF: 900, NGRAM[1]: 1000}},
        {CODE_QUIET: {OFF: 100, NGRAM[1]: 150}, BUSY: {OFF: 900, NGRAM[1]: 700}},
        {CODE_QUIET: {OFF: 110, NGRAM[1]: 140}, BUSY: {OFF: 880, NGRAM[1]: 720}},
    ]
    points = [p for r in rounds for p in _points(r)]
    assert median_tokens_per_s(points)[(BUSY, NGRAM[1])] == 720
    table = best_static_table(points, pattern, BOUNDS)
    assert (table.k_by_bucket["1"], table.k_by_bucket["16"]) == (1, 0)
    assert table.predicted_tokens == pytest.approx(60 * 150 + 60 * 900)
    assert best_static_table(_points(rounds[0]), pattern, BOUNDS).k_by_bucket["16"] == 1

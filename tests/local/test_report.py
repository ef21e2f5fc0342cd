"""The report's numbers (pure functions of samples and records) and the files it writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve_operator.local.loadgen import RequestRecord
from specserve_operator.local.report import (
    ReportInput,
    SweepResult,
    controller_verdict,
    load_report_input,
    phase_goals,
    phase_stats,
    render_markdown,
    speculating_share,
    write_report,
)
from specserve_operator.local.samples import DecisionRecord, FleetSample, PodSample
from specserve_operator.local.sweep import Candidate, Shape, StaticTable, SweepPoint
from specserve_operator.local.traffic import parse_pattern

PATTERN = parse_pattern("quiet:10:1,busy:10:8,quiet:10:1")
K_TABLE = {"1": 4, "2": 4, "4": 2, "8": 0, "+Inf": 0}


def _pod(batch: float, mode: str = "on", table: dict[str, int] | None = None) -> PodSample:
    return PodSample("pod-0", batch, 10.0 * batch, 2.5, "draft", mode, table or K_TABLE, 1, (1, 2, 4, 8))


def _samples(controller_works: bool) -> list[FleetSample]:
    out = []
    for t in range(30):
        at = PATTERN.phase_at(t)
        assert at is not None
        batch = float(at.phase.concurrency)
        # A working controller keeps K off at batch 8 via the table; a broken one runs K=4 everywhere.
        table = K_TABLE if controller_works else dict.fromkeys(K_TABLE, 4)
        # It takes the controller two seconds to turn speculation off at the start of the busy phase.
        if controller_works and 10 <= t < 12:
            table = dict.fromkeys(K_TABLE, 4)
        out.append(
            FleetSample(
                "specserve", t, at.index, at.phase.name, at.phase.concurrency, 1, (_pod(batch, table=table),)
            )
        )
    return out


def test_share_and_verdict_follow_the_load() -> None:
    samples = _samples(controller_works=True)
    assert speculating_share(samples, "specserve", 0, 10) == 1.0
    assert speculating_share(samples, "specserve", 10, 20) == pytest.approx(0.2)  # two late seconds
    assert speculating_share(samples, "specserve", 15, 20) == 0.0
    assert speculating_share(samples, "off", 0, 30) is None
    v = controller_verdict(samples, PATTERN)
    assert (v.busiest_phase, v.quiet_before, v.quiet_after) == (1, 0, 2)
    assert (v.share_quiet_before, v.share_busy, v.share_quiet_after) == (1.0, 0.0, 1.0)
    assert v.turned_off_under_load and v.turned_back_on


def test_verdict_fails_for_static_speculation() -> None:
    v = controller_verdict(_samples(controller_works=False), PATTERN)
    assert v.share_busy == 1.0
    assert not v.turned_off_under_load
    assert not v.turned_back_on


def test_verdict_fails_when_speculation_stays_off() -> None:
    samples = [
        FleetSample(
            s.run, s.t_s, s.phase_index, s.phase, s.target_concurrency, s.in_flight, (_pod(8, mode="off"),)
        )
        for s in _samples(controller_works=True)
    ]
    v = controller_verdict(samples, PATTERN)
    assert v.turned_off_under_load and not v.turned_back_on


def test_k_now_follows_mode_and_batch() -> None:
    assert _pod(1).k_now == 4
    assert _pod(3).k_now == 2
    assert _pod(8).k_now == 0
    assert _pod(1, mode="off").k_now == 0
    assert PodSample("p", None, None, None, None, None).speculating is None


def _records() -> list[RequestRecord]:
    return [
        RequestRecord("specserve", "pod-0", "code", "quiet", 0.0, 2.0, 20, True),
        RequestRecord("specserve", "pod-0", "prose", "quiet", 2.0, 6.0, 20, True),
        RequestRecord("specserve", "pod-0", "code", "busy", 10.0, 15.0, 50, True),
        RequestRecord("specserve", "pod-0", "code", "busy", 11.0, 19.0, 0, False, "HTTP 500"),
        RequestRecord("off", "pod-0", "code", "quiet", 0.0, 4.0, 40, True),
    ]


def test_phase_stats_count_the_tokens_generated_inside_each_phase() -> None:
    stats = phase_stats(_records(), "specserve", PATTERN)
    assert [s.tokens_per_s for s in stats] == [4.0, 5.0, 0.0]
    assert [s.requests for s in stats] == [2, 2, 0]
    assert [s.failed for s in stats] == [0, 1, 0]
    assert stats[0].ms_per_token == pytest.approx((100 + 200) / 2)
    assert stats[2].ms_per_token is None
    off = phase_stats(_records(), "off", PATTERN.scaled(0.5))
    assert off[0].tokens_per_s == 8.0
    # A busy phase's last request still running when the quiet phase starts: three quarters of its tokens
    # were generated in the busy phase; it counts as a request (and for latency) of the phase it ended in.
    tail = RequestRecord("specserve", "pod-0", "code", "busy", 17.0, 21.0, 40, True)
    stats = phase_stats([*_records(), tail], "specserve", PATTERN)
    assert [s.tokens_per_s for s in stats] == [4.0, 8.0, 1.0]
    assert [s.requests for s in stats] == [2, 2, 1]


def _input() -> ReportInput:
    return ReportInput(
        title="test fleet",
        patterns={"specserve": PATTERN, "off": PATTERN.scaled(0.5), "static": PATTERN.scaled(0.5)},
        samples=_samples(controller_works=True),
        decisions=[DecisionRecord("specserve", 11.5, "pod-0", "disable", "batch 8 > cliff 4")],
        records=_records(),
        mal_by_bucket={"specserve": {"1": 2.6, "+Inf": 1.2, "4": 2.2}, "static": {"1": 2.5, "8": 1.9}},
        facts={"model": "tiny"},
    )


def test_markdown_says_what_happened() -> None:
    md = render_markdown(_input(), ["timeline.png"])
    assert "turned off under load: **yes**" in md
    assert "turned back on: **yes**" in md
    assert "| 1 | 2.60 | 2.50 |" in md
    assert "| +Inf | 1.20 | – |" in md
    assert "batch 8 > cliff 4" in md
    assert "![timeline](timeline.png)" in md


def test_write_report_writes_plots(tmp_path: Path) -> None:
    md = write_report(tmp_path / "report", _input())
    again = load_report_input(md.parent / "data.json")
    assert render_markdown(again, ["x.png"]) == render_markdown(_input(), ["x.png"])
    names = sorted(p.name for p in md.parent.iterdir())
    assert names == ["data.json", "mal_per_bucket.png", "report.md", "timeline.png", "tokens_per_s.png"]
    for png in md.parent.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 10_000


def _with_best_static() -> ReportInput:
    """Phase tokens/s: specserve 4.0 / 5.0 / 1.0; plain 8.0 / 6.0 / 0; best static 2.0 / 4.0 / 0."""
    data = _input()
    half = PATTERN.scaled(0.5)
    data.patterns = {**data.patterns, "best-static": half}
    data.records = [
        *_records(),
        RequestRecord("off", "pod-0", "code", "busy", 5.0, 9.0, 30, True),
        RequestRecord("best-static", "pod-0", "code", "quiet", 0.0, 4.0, 10, True),
        RequestRecord("best-static", "pod-0", "code", "busy", 5.0, 9.0, 20, True),
        RequestRecord("specserve", "pod-0", "code", "quiet", 20.0, 25.0, 10, True),
    ]
    data.sweep = SweepResult(
        [
            SweepPoint(Shape(1, 0.5), Candidate(None, 0), 90.0),
            SweepPoint(Shape(1, 0.5), Candidate("draft", 2), 120.0),
            SweepPoint(Shape(1, 0.5), Candidate(None, 0), 94.0),
            SweepPoint(Shape(1, 0.5), Candidate("draft", 2), 110.0),
        ],
        StaticTable("draft", {"1": 2, "+Inf": 0}, 1200.0),
    )
    return data


def test_goals_compare_each_phase_with_the_better_fixed_alternative() -> None:
    data = _with_best_static()
    stats = {r: phase_stats(data.records, r, p) for r, p in data.patterns.items()}
    goals = phase_goals(stats)
    assert [g.busy for g in goals] == [False, True, False]
    assert goals[0].of_best_fixed == pytest.approx(4.0 / 8.0) and not goals[0].met
    assert goals[1].of_best_fixed == pytest.approx(5.0 / 6.0)
    assert goals[1].of_plain == pytest.approx(5.0 / 6.0)
    assert goals[2].of_best_fixed is None and not goals[2].met  # nothing finished in the fixed runs' phase
    assert phase_goals({r: v for r, v in stats.items() if r != "best-static"}) == []
    md = render_markdown(data, [])
    assert "| 2. busy (busy) | 0.83 | 0.83 | **no** |" in md
    assert "**draft**, K by bucket 1: 2, +Inf: 0" in md
    assert "| concurrency 1, 50% code | draft K=2 | 115.0 | 120.0, 110.0 |" in md


def test_the_sweep_survives_the_data_file(tmp_path: Path) -> None:
    md = write_report(tmp_path / "report", _with_best_static())
    again = load_report_input(md.parent / "data.json")
    assert again.sweep == _with_best_static().sweep
    assert render_markdown(again, ["x.png"]) == render_markdown(_with_best_static(), ["x.png"])

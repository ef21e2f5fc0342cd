"""The fleet simulator: traces, the true step-time model, and the real controller driving it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specserve_operator.api.models import DrafterSpec
from specserve_operator.cli import main as specserve
from specserve_operator.simulator.fleet import DrafterProfile, FleetSim, SimConfig, flat
from specserve_operator.simulator.traces import bursty_rows, diurnal_rows, load_trace, write_trace

REPO = Path(__file__).resolve().parents[2]


def test_shipped_traces_load() -> None:
    diurnal = load_trace(REPO / "benchmarks" / "traces" / "diurnal_24h.csv")
    assert diurnal.duration_s == pytest.approx(86400)
    assert diurnal.rates.max() > 20 * diurnal.rates.min()
    bursty = load_trace(REPO / "benchmarks" / "traces" / "bursty_6h.csv")
    assert bursty.duration_s > 5 * 3600 and bursty.rates.max() > 3 * np.median(bursty.rates)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("t,rate\n0,1\n", "header"),
        ("t_s,rate_rps,code_fraction\n0,1,0.5\n0,2,0.5\n", ":3: t_s must increase"),
        ("t_s,rate_rps,code_fraction\n0,-1,0.5\n", ":2: rate_rps"),
        ("t_s,rate_rps,code_fraction\n0,1,1.5\n", ":2: code_fraction"),
        ("t_s,rate_rps,code_fraction\n5,1,0.5\n", "start at t_s=0"),
        ("t_s,rate_rps,code_fraction\n0,x,0.5\n", ":2: t_s, rate_rps and code_fraction must be numbers"),
    ],
)
def test_bad_traces_name_the_line_and_column(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_trace(path)


def test_trace_generators_are_well_formed(tmp_path: Path) -> None:
    for rows in (diurnal_rows(200, 5), bursty_rows(40, 300, hours=2)):
        write_trace(tmp_path / "t.csv", rows)
        trace = load_trace(tmp_path / "t.csv")
        assert (np.diff(trace.starts) > 0).all() and ((trace.code >= 0) & (trace.code <= 1)).all()


def _constant(tmp_path: Path, rate: float, seconds: float, code: float = 0.5):
    write_trace(tmp_path / "c.csv", [(0.0, rate, code), (seconds, rate, code)])
    return load_trace(tmp_path / "c.csv", tail_s=0.0)


def test_truth_step_time_is_the_roofline_plus_speculation_overheads() -> None:
    sim = FleetSim(SimConfig(pods=1, policies=("off",)), _trace_stub())
    truth = sim.truth
    one = np.array([1.0])
    plain = truth.step_s(one, np.array([0.0]), np.array([512.0]), np.array([0]))
    spec = truth.step_s(one, np.array([3.0]), np.array([512.0]), np.array([0]))
    assert spec > plain + 3 * 1e-4  # three draft passes and the verify overhead
    # At batch 256 verifying 6 tokens per sequence is compute-bound: far slower than one.
    big = truth.step_s(np.array([256.0]), np.array([5.0]), np.array([512.0]), np.array([1]))
    assert big > 2 * truth.step_s(np.array([256.0]), np.array([0.0]), np.array([512.0]), np.array([1]))


def _trace_stub():
    from specserve_operator.simulator.traces import Trace

    return Trace("stub", np.array([0.0]), np.array([1.0]), np.array([0.5]), 60.0)


def test_same_requests_reach_every_policy(tmp_path: Path) -> None:
    """Common random numbers: below saturation every policy serves the same requests and tokens."""
    trace = _constant(tmp_path, rate=4.0, seconds=600)
    results = FleetSim(SimConfig(pods=2, policies=("off", "static_on", "specserve")), trace).run()
    tokens = {name: r.tokens for name, r in results.items()}
    assert max(tokens.values()) == pytest.approx(min(tokens.values()), rel=0.01)


def test_controller_speeds_up_a_quiet_fleet(tmp_path: Path) -> None:
    drafter = DrafterProfile(
        DrafterSpec(name="eagle3", method="eagle3", source="hf://org/eagle3", maxSpeculativeTokens=5),
        {"code": flat(0.8), "prose": flat(0.8)},
    )
    trace = _constant(tmp_path, rate=0.6, seconds=900)
    cfg = SimConfig(pods=2, drafters=(drafter,), policies=("off", "specserve", "oracle"))
    sim = FleetSim(cfg, trace)
    s = {name: r.summary(trace.duration_s) for name, r in sim.run().items()}
    assert s["specserve"]["batch_max"] <= 8
    assert s["off"]["tpot_mean_ms"] / s["specserve"]["tpot_mean_ms"] > 1.8
    assert s["specserve"]["tpot_mean_ms"] <= 1.1 * s["oracle"]["tpot_mean_ms"]
    assert sim.state.k_by_bucket["1"] >= 3


def test_controller_does_not_lose_to_plain_decoding_under_load(tmp_path: Path) -> None:
    trace = _constant(tmp_path, rate=200.0, seconds=600)
    sim = FleetSim(SimConfig(pods=8, policies=("off", "static_on", "specserve")), trace)
    s = {name: r.summary(trace.duration_s) for name, r in sim.run().items()}
    assert s["specserve"]["tpot_mean_ms"] < s["off"]["tpot_mean_ms"]
    assert s["specserve"]["tpot_mean_ms"] < s["static_on"]["tpot_mean_ms"]
    # The controller measured the high buckets and switched speculation off (or down) where it costs.
    assert sim.state.k_by_bucket["+Inf"] < sim.state.k_by_bucket["1"]


def test_simulate_command(tmp_path: Path, capsys) -> None:
    write_trace(tmp_path / "t.csv", [(0.0, 3.0, 0.5), (300.0, 3.0, 0.5)])
    out = tmp_path / "r.json"
    assert specserve(["simulate", "--trace", str(tmp_path / "t.csv"), "--pods", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "specserve" in printed and "oracle" in printed and out.exists()
    assert specserve(["simulate", "--trace", str(tmp_path / "missing.csv")]) == 2

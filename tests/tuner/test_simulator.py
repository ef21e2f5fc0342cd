"""The fleet simulator: traces, the truths the controller does not share, the baselines, and the real
controller driving it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specserve_operator.api.models import DrafterSpec
from specserve_operator.cli import main as specserve
from specserve_operator.simulator import fleet, truths
from specserve_operator.simulator.baselines import BucketBandit, EmaTiers, StaticTable, static_candidates
from specserve_operator.simulator.fleet import (
    DrafterProfile,
    FleetSim,
    SimConfig,
    decaying,
    default_drafters,
    flat,
    make_truth,
    measured_cpu_config,
)
from specserve_operator.simulator.traces import (
    bursty_rows,
    diurnal_rows,
    load_trace,
    scaled,
    window,
    write_trace,
)
from specserve_operator.tuner import core, observations

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


def test_traces_scale_and_window(tmp_path: Path) -> None:
    write_trace(tmp_path / "t.csv", [(0.0, 2.0, 0.1), (600.0, 8.0, 0.9), (1200.0, 4.0, 0.5)])
    trace = load_trace(tmp_path / "t.csv")
    assert scaled(trace, 3.0).at(700.0) == (24.0, 0.9)
    part = window(trace, 900.0, 1500.0)
    assert part.duration_s == 600.0 and part.at(0.0) == (8.0, 0.9) and part.at(400.0) == (4.0, 0.5)
    with pytest.raises(ValueError, match="empty"):
        window(trace, 5000.0, 6000.0)


# ---- truths -------------------------------------------------------------------------------------------


def _gpu() -> truths.GpuTruth:
    return make_truth(SimConfig(pods=1, policies=("off",)))


def _step(truth, batch: float, k: float = 0.0, ctx: float = 1000.0, drafter: int = 0) -> float:
    return float(truth.step_s(np.array([batch]), np.array([k]), np.array([ctx]), np.array([drafter]))[0])


def test_gpu_truth_pads_batches_to_the_captured_cuda_graphs() -> None:
    truth = _gpu()
    assert list(truths.padded_batch(np.array([1, 3, 9, 16, 17, 250, 257]))) == [1, 4, 16, 16, 24, 256, 272]
    # Batches 9..16 run the graph captured for 16: the same GPU time (only the CPU's per-sequence work
    # differs), then a jump at 17.
    assert _step(truth, 9) == pytest.approx(_step(truth, 16) - 7 * truths.CPU_SEQ_S, rel=1e-6)
    assert _step(truth, 17) > _step(truth, 16)


def test_gpu_truth_attention_grows_with_context() -> None:
    truth = _gpu()
    assert _step(truth, 64, ctx=4000) > 1.5 * _step(truth, 64, ctx=500)
    # Verifying K + 1 tokens against a long context costs more than against a short one.
    long_gap = _step(truth, 64, 4, ctx=4000) - _step(truth, 64, 0, ctx=4000)
    assert long_gap > _step(truth, 64, 4, ctx=500) - _step(truth, 64, 0, ctx=500)


def test_gpu_truth_is_not_the_controllers_prior_rescaled() -> None:
    """The controller's roofline prior is off by a factor that changes with the shape of the step: no
    single calibration ratio fits every batch size and K."""
    truth = _gpu()
    prior = core.ResourceView("ns", "r", SimConfig().resource_spec(), ("p",)).prior(
        default_drafters()[0].spec
    )
    ratios = [_step(truth, b, k, ctx=1024) / prior.step_s(b, int(k)) for b in (1, 32, 256) for k in (0, 4)]
    assert max(ratios) > 1.3 * min(ratios)


def test_multilinear_interpolates_clamps_below_and_extrapolates_above() -> None:
    axes = (np.array([1.0, 2.0, 4.0]), np.array([10.0, 20.0]))
    table = np.array([[1.0, 2.0], [3.0, 4.0], [7.0, 8.0]])  # 2·a + b/10 - 2 on the grid
    at = lambda a, b: float(truths.multilinear(table, axes, (np.array([a]), np.array([b])))[0])  # noqa: E731
    assert at(2.0, 20.0) == 4.0 and at(3.0, 15.0) == pytest.approx(5.5)
    assert at(0.5, 10.0) == 1.0  # below the first point: the first point's value
    assert at(8.0, 30.0) == pytest.approx(17.0)  # above the last: the last two points' line


def test_gpu_truth_replays_the_h200_recording_and_models_other_gpus() -> None:
    rec = truths.load_forward_times()
    h200 = _gpu()
    assert h200.recording is rec and "H200" in rec.gpu
    # A plain step at batch 1: the 8B's dense pass at one token, 32 layers of attention at the context,
    # and the CPU's share, all as recorded.
    axes, attention = rec.attention[rec.layout["llama-3.1-8b"]]
    one = rec.dense["llama-3.1-8b"][1][0] + 32 * truths.multilinear(attention, axes, (1.0, 1.0, 1024.0))
    assert _step(h200, 1, ctx=1024) == pytest.approx(one + truths.CPU_STEP_S + truths.CPU_SEQ_S, rel=1e-9)
    # Drafting with the 1B model adds its own recorded passes: the first over K + 1 tokens, K - 1 of one.
    assert _step(h200, 1, 3, ctx=1024) - _step(h200, 1, 2, ctx=1024) > rec.dense["llama-3.2-1b"][1][0]
    h100 = make_truth(SimConfig(pods=1, policies=("off",), gpu="NVIDIA-H100"))
    assert h100.recording is None and _step(h100, 1) > _step(h200, 1) * 0.5


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["models"]["llama-3.1-8b"]["dense_s"].__setitem__(0, -1.0), "positive"),
        (lambda d: d["models"]["llama-3.1-8b"]["dense_s"].__setitem__(0, float("nan")), "positive"),
        (lambda d: d["models"]["llama-3.1-8b"]["dense_s"].pop(), "incomplete"),
        (lambda d: d["models"]["llama-3.1-8b"]["tokens"].__setitem__(1, 1), "increase"),
        (lambda d: d["attention"].pop("hd64_kv8_g4"), "no attention recorded"),
    ],
)
def test_a_gpu_recording_that_is_not_a_truth_is_refused(tmp_path: Path, edit, message: str) -> None:
    data = json.loads(truths.DEFAULT_GPU_RECORDING.read_text())
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        truths.load_forward_times(path)


def test_committed_gpu_recording_is_sane() -> None:
    """The H200 recording (scripts/record_gpu_truth.py): its rounds agreed, a pass costs more with more
    tokens beyond what the rounds' spread allows, and attention grows with the batch and the context."""
    raw = json.loads(truths.DEFAULT_GPU_RECORDING.read_text())
    assert raw["rounds"] >= 3 and max(raw["spread"].values()) < 0.15
    rec = truths.load_forward_times()
    for _, seconds in rec.dense.values():
        assert (seconds[:-1] <= 1.1 * seconds[1:]).all() and seconds[-1] > 3 * seconds[0]
    for _, table in rec.attention.values():
        assert (table[-1] > 5 * table[0]).all()  # batch 256 against batch 1
        assert (table[..., -1] > 2 * table[..., 0]).all()  # 4,096 tokens of context against 256
    # Near the copy ceiling measured on the same GPU: the 8B's 15 GB of weights at one token.
    weights = 15.0e9
    assert 0.8 < weights / rec.dense["llama-3.1-8b"][1][0] / raw["ceilings"]["copy_bytes_per_s"] < 1.5


def test_library_replays_sequences_cyclically() -> None:
    # One drafter, both domains the same sequence: accepted 4, 0, 2, nothing drafted.
    seq = np.array([4, 0, 2, -1], dtype=np.int8)
    lib = truths.AcceptanceLibrary(
        np.broadcast_to(seq, (1, 2, 1, 4)).copy(), np.full((1, 2, 1), 4, dtype=np.int64), max_k=4
    )

    def span(start: float, steps: float) -> truths.Span:
        return lib.span(np.array([0]), np.array([1]), np.array([0]), np.array([start]), np.array([steps]))

    assert lib.tokens(np.array([2]), span(0, 4))[0] == pytest.approx(3 + 1 + 3 + 1)
    assert lib.tokens(np.array([2]), span(0, 8))[0] == pytest.approx(16)  # cyclic
    assert lib.tokens(np.array([4]), span(0, 0.5))[0] == pytest.approx(2.5)  # half of the first step
    assert lib.tokens(np.array([0]), span(1, 6))[0] == pytest.approx(6)  # K = 0: one token a step
    assert lib.accepted_at(0, span(0, 4))[0] == 2 and lib.accepted_at(3, span(0, 4))[0] == 1
    assert lib.proposed(span(0, 4))[0] == 3
    assert lib.mean_tokens[4, 0, 0, 0] == pytest.approx((5 + 1 + 3 + 1) / 4)


def test_gpu_acceptance_is_over_dispersed_correlated_and_drifting() -> None:
    cfg = SimConfig()
    lib = make_truth(cfg).library
    a = lib.accepted[0, 0].astype(float)  # draft model, code: [sequences, steps]
    per_sequence = a.mean(axis=1)
    # Sequences differ far more than steps drawn i.i.d. from the pooled distribution would.
    iid_spread = a.std() / np.sqrt(a.shape[1])
    assert per_sequence.std() > 5 * iid_spread
    # Along a sequence, consecutive steps are correlated (easy and hard stretches).
    centred = a - per_sequence[:, None]
    lag1 = (centred[:, 1:] * centred[:, :-1]).mean() / centred.var()
    assert lag1 > 0.1
    # A hard prompt is hard for both drafters.
    assert np.corrcoef(per_sequence, lib.accepted[1, 0].astype(float).mean(axis=1))[0, 1] > 0.5
    # The domains drift: at some hours requests draw easier sequences than at others.
    shifts = np.array([truths.drift(h * 3600.0, cfg.drift_amplitude, cfg.drift_periods_h) for h in range(24)])
    assert shifts[:, 0].max() - shifts[:, 0].min() > cfg.drift_amplitude
    u = np.linspace(0.01, 0.99, 99)
    assert truths.logit_tilt(u, 1.0).mean() > 0.6 > 0.4 > truths.logit_tilt(u, -1.0).mean()


def test_class_mean_tokens_is_the_mean_of_the_sequences_drawn() -> None:
    """The oracle's expectation of a request of a domain, drifted: what drawing requests as the simulator
    draws them (FleetSim._arrive) averages to."""
    lib = make_truth(SimConfig()).library
    shift = np.array([0.9, -0.6])
    expected = truths.class_mean_tokens(lib, shift)
    rng = np.random.default_rng(0)
    for dom in (0, 1):
        u = truths.logit_tilt(rng.random(200_000), shift[dom])
        seq = np.minimum((u * lib.sequences).astype(np.int64), lib.sequences - 1)
        drawn = lib.mean_tokens[:, :, dom, seq].mean(axis=-1)
        assert expected[:, :, dom] == pytest.approx(drawn, rel=0.01)
    # Drift toward easier sequences raises what a request is expected to give.
    assert (expected[3, :, 0] > truths.class_mean_tokens(lib, np.zeros(2))[3, :, 0]).all()


def test_the_oracle_is_close_to_the_clairvoyant(tmp_path: Path) -> None:
    """At low load on the gpu truth both speculate and more than halve plain decoding's TPOT; knowing each
    request's luck as well as its domain helps the clairvoyant, but by little (the benchmark finds 1 %)."""
    trace = _constant(tmp_path, rate=2.0, seconds=600)
    cfg = SimConfig(pods=2, policies=("off", "oracle", "clairvoyant"))
    s = {name: r.summary(trace.duration_s)["tpot_mean_ms"] for name, r in FleetSim(cfg, trace).run().items()}
    assert s["clairvoyant"] <= s["oracle"] <= 1.05 * s["clairvoyant"]
    assert s["oracle"] < 0.5 * s["off"]


def _recording(path: Path) -> Path:
    data = {
        "setup": {"max_num_seqs": 8},
        "max_k": 2,
        "batches": [1, 2, 4, 8],
        "drafters": {"small": "draftModel", "ngram": "ngram"},
        "step_s": {
            "off": [[0.010, 0.011, 0.012, 0.016]],
            "small": [[0.014, 0.016, 0.020, 0.030], [0.016, 0.019, 0.025, 0.040]],
            "ngram": [[0.011, 0.012, 0.013, 0.017], [0.011, 0.012, 0.014, 0.018]],
        },
        "acceptance": {
            "small": {"code": [[2, 2, 1], [0, 1]], "prose": [[1, 0, 0]]},
            "ngram": {"code": [[2, -1, 2, 2], [-1]], "prose": [[0, -1]]},
        },
    }
    path.write_text(json.dumps(data))
    return path


def test_measured_truth_replays_the_recording(tmp_path: Path) -> None:
    data = truths.load_measured(_recording(tmp_path / "m.json"))
    truth = truths.MeasuredCpuTruth(data)
    # Linear in the batch between measured points; K = 0 is the plain step whatever the drafter.
    assert _step(truth, 3, 1, drafter=0) == pytest.approx((0.016 + 0.020) / 2)
    assert _step(truth, 8, 0, drafter=1) == pytest.approx(0.016)
    assert _step(truth, 40, 2, drafter=0) == pytest.approx(0.040)  # beyond the last batch: the last
    assert truth.prefill_s(np.array([100.0]))[0] == pytest.approx(100 * 0.016 / 8)
    # Time other processes added is taken out: a step never gets faster as the batch grows.
    assert list(truths.lower_envelope(np.array([3.0, 1.0, 2.0, 5.0, 4.0]))) == [1.0, 1.0, 2.0, 4.0, 4.0]
    lib = data.library
    assert lib.sequences == 1  # the fewest any (drafter, domain) recorded
    assert list(lib.accepted[1, 0, 0, :4]) == [2, -1, 2, 2] and lib.lengths[0, 1, 0] == 3


def test_measured_truth_prices_the_share_that_drafted(tmp_path: Path) -> None:
    """n-gram drafts for part of a batch: the part of a speculative step that grows with K grows with the
    share of sequences that got a draft, against the share drafting while the step times were recorded
    (code and prose alternating). At that share the step is the recording's."""
    data = truths.load_measured(_recording(tmp_path / "m.json"))
    truth = truths.MeasuredCpuTruth(data)
    # Recorded (one sequence per domain, the fewest any kept): n-gram proposed in 3 of 4 code steps and
    # 1 of 2 prose steps; the small model always.
    assert data.recorded_share == pytest.approx([1.0, 2 / 3])
    # n-gram's recorded excess: 1 ms at K 1 and 2 ms at K 2 at batch 8 (1 ms per K); 1 ms at either K at
    # batch 1 (none per K: all of it per step).
    assert data.excess_per_k[1, [0, 3]] == pytest.approx([0.0, 0.001])

    def ngram(batch: float, k: int, drafted: float | None) -> float:
        shares = None if drafted is None else np.array([drafted])
        return float(truth.step_s(np.array([batch]), np.array([k]), np.zeros(1), np.array([1]), shares)[0])

    assert ngram(8, 2, 2 / 3) == pytest.approx(ngram(8, 2, None)) == pytest.approx(0.018)
    assert ngram(8, 2, 1.0) == pytest.approx(0.018 + 0.001 * 2 * (3 / 2 - 1))
    assert ngram(8, 1, 1 / 3) == pytest.approx(0.017 - 0.001 * 0.5)
    assert ngram(1, 2, 0.0) == pytest.approx(0.011)  # the per-step part stays
    assert ngram(8, 0, 0.0) == ngram(8, 0, 1.0) == pytest.approx(0.016)
    # The gpu truth verifies the whole batch at K, drafted or not.
    gpu = fleet.make_truth(SimConfig())
    args = (np.array([8.0]), np.array([3.0]), np.array([512.0]), np.array([1]))
    assert gpu.step_s(*args, np.array([0.2]))[0] == gpu.step_s(*args)[0]


def test_committed_cpu_recording_is_sane() -> None:
    data = truths.load_measured(truths.DEFAULT_MEASURED)
    assert data.step_s.shape == (len(data.drafters), data.max_k + 1, len(data.batches))
    assert (data.step_s > 0).all() and data.library.sequences >= 8
    # A model drafter drafting K tokens costs more than plain decoding at every batch size.
    model = list(data.drafters.values()).index("draftModel")
    assert (data.step_s[model, data.max_k] > data.step_s[model, 0]).all()
    # Recorded on a quiet machine: the raw plain step (before the loader's envelopes) grows with the batch
    # within the rounds' spread, and the load never passed the cores. A recording made beside other work
    # (load 13-17 on 2 cores) once read 76 ms at batch 2 against 5 ms at batch 4, and priced every draft
    # as never paying.
    raw = json.loads(truths.DEFAULT_MEASURED.read_text())
    plain = np.array(raw["step_s"]["off"][0])
    assert (plain[:-1] <= 1.25 * plain[1:]).all(), plain
    assert raw["setup"]["rounds"] >= 3
    # The recording itself keeps about two processes busy.
    assert max(raw["setup"]["load_average_1m"]) <= 2 * raw["setup"]["cores"]


# ---- baselines ----------------------------------------------------------------------------------------


def test_ema_tiers_move_k_with_accepted_length() -> None:
    ema = EmaTiers(pods=2, max_k=5)
    assert list(ema.tiers) == [1, 3, 5] and list(ema.k()) == [5, 5]
    for _ in range(20):
        ema.observe(np.array([0.5, 4.0]))  # pod 0: few drafts accepted; pod 1: almost all
    assert list(ema.k()) == [1, 5]
    ema.observe(np.array([np.nan, np.nan]))  # no drafts: nothing moves
    assert list(ema.k()) == [1, 5] and ema.switches == 2


def test_bucket_bandit_finds_the_best_k_per_bucket() -> None:
    bandit = BucketBandit(buckets=2, max_k=3)
    truth = np.array([[1.0, 1.6, 1.9, 1.7], [1.0, 0.9, 0.7, 0.5]])  # bucket 0: K = 2; bucket 1: off
    rng = np.random.default_rng(0)
    for _ in range(400):
        buckets = np.array([0, 1, 0, 1])
        k = bandit.choose(buckets)
        bandit.observe(buckets, k, truth[buckets, k] * rng.uniform(0.97, 1.03, size=4))
    picks = [bandit.choose(np.array([b] * 50)) for b in (0, 1)]
    assert np.bincount(picks[0], minlength=4).argmax() == 2
    assert np.bincount(picks[1], minlength=4).argmax() == 0


def test_static_candidates_sweep_cutoffs_and_k() -> None:
    goodput = np.array(
        [
            [[10, 20, 25, 24], [10, 14, 13, 12], [10, 9, 8, 7]],  # pays at bucket 0 (K = 2), 1 (K = 1), not 2
            [[10, 12, 11, 10], [10, 11, 10, 9], [10, 10.5, 9, 8]],
        ]
    )
    tables = static_candidates(goodput)
    values = set(tables.values())
    assert StaticTable(0, (2, 1, 0)) in values  # best K per bucket, cut at the break-even
    assert StaticTable(0, (2, 0, 0)) in values  # … one bucket earlier
    assert StaticTable(0, (2, 1, 1)) in values  # … never cut
    assert StaticTable(0, (3, 3, 0)) in values  # one K below the drafter's break-even
    assert StaticTable(1, (1, 1, 1)) in values  # drafter 1 pays everywhere
    assert StaticTable(0, (0, 0, 0)) in values  # no speculation at all
    assert len(values) == len(tables)  # no table twice


def test_a_saturated_fleet_sheds_without_stopping_the_others(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(fleet, "POOL", 256)
    trace = _constant(tmp_path, rate=150.0, seconds=120)
    cfg = SimConfig(pods=1, max_num_seqs=16, quantum_s=1.0, policies=("off", "oracle"))
    sim = FleetSim(cfg, trace)
    results = sim.run()
    assert sim.saturated.all() and results["off"].dropped > 0


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
    # Half an hour: the first minute or so runs plain while a canary measures the drafter (measurement
    # first), which at a plain step of 6 ms weighs a tenth of a 15-minute run.
    trace = _constant(tmp_path, rate=0.6, seconds=1800)
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
    # The controller measured the high buckets and turned K down (or off) where verifying costs most.
    assert sim.state.k_by_bucket["+Inf"] < 3


def _best_gain(truth: truths.MeasuredCpuTruth, batch: float) -> float:
    """The truth's best goodput over plain decoding at `batch`, any drafter and K, on half code, half
    prose (the mean tokens a step of the recorded sequences gives)."""
    tokens = truth.library.mean_tokens.mean(axis=(2, 3))  # [K + 1, drafter]
    gains = []
    for d in range(tokens.shape[1]):
        for k in range(1, tokens.shape[0]):
            plain, spec = (_step(truth, batch, kk, drafter=d) for kk in (0, k))
            gains.append(tokens[k, d] * plain / spec)
    return max(gains)


def test_a_cold_fleet_under_heavy_load_measures_before_it_speculates(tmp_path: Path) -> None:
    """The capacity probe's cold start (docs/policy.md, "Cold start"): a fleet started under heavy load on
    the measured CPU, where no speculation pays from batch 9 on. Its pods start plain, so its first
    decisions calibrate on a measured plain step: they turn no bucket from 32 up on (bucket 16 may be on
    for an interval at K 1, from the prior, until its measurement turns it off), and the fleet keeps up as
    plain decoding does. Started at the drafter's largest K (the initial policy before), the first
    decision saw speculative steps only, turned n-gram on up to bucket 32, and the queue grew for
    minutes."""
    cfg = measured_cpu_config(pods=8, policies=("off", "specserve"))
    truth = make_truth(cfg)
    assert isinstance(truth, truths.MeasuredCpuTruth) and _best_gain(truth, 9) < 1.0
    # Three quarters of what plain decoding serves at max_num_seqs (the benchmark's load scaling).
    plain_rps = cfg.pods * cfg.max_num_seqs / _step(truth, cfg.max_num_seqs) / np.mean(cfg.output_mean)
    trace = _constant(tmp_path, rate=0.75 * plain_rps, seconds=900)
    sim = FleetSim(cfg, trace)
    s = {name: r.summary(trace.duration_s) for name, r in sim.run().items()}
    high = [label for label in sim.labels if label == "+Inf" or int(label) >= 32]
    first = [d for t, d in sim.decisions if t <= 5 * cfg.evaluation_interval_s]
    assert first and all(d.k_by_bucket[label] == 0 for d in first for label in high), [
        (d.action, d.k_by_bucket) for d in first
    ]
    assert s["specserve"]["wait_p95_ms"] <= 2000.0  # the capacity SLO's wait for a batch slot
    assert s["specserve"]["tpot_mean_ms"] <= 1.03 * s["off"]["tpot_mean_ms"]


@pytest.mark.parametrize("drafters", ["two", "one"])
def test_a_cold_fleet_speculates_one_interval_after_its_first_decision_where_it_pays(
    tmp_path: Path, drafters: str
) -> None:
    """The plain start costs the gpu truth, where speculation pays at low batch, one interval: the first
    decision on metrics measures on one canary (an exploration of the drafter in force), the next turns
    speculation on fleet-wide."""
    eagle = DrafterProfile(
        DrafterSpec(name="eagle3", method="eagle3", source="hf://org/eagle3", maxSpeculativeTokens=5),
        {"code": flat(0.8), "prose": flat(0.8)},
    )
    cfg = SimConfig(pods=2, policies=("off", "specserve"))
    if drafters == "one":
        cfg = SimConfig(pods=2, policies=("off", "specserve"), drafters=(eagle,))
    trace = _constant(tmp_path, rate=2.0, seconds=300)
    sim = FleetSim(cfg, trace)
    s = {name: r.summary(trace.duration_s) for name, r in sim.run().items()}
    interval = cfg.evaluation_interval_s
    (first, decision), (second, enabled) = sim.decisions[:2]
    assert first == interval and not any(decision.k_by_bucket.values()), decision.reason
    assert second == 2 * interval and enabled.k_by_bucket["1"] > 0, enabled.reason
    # With two, the draft model (listed first) runs from the second decision and n-gram, faster on this
    # truth, from its trial two intervals later: 0.60 of plain over the five minutes, 0.51 with one.
    assert s["specserve"]["tpot_mean_ms"] < 0.65 * s["off"]["tpot_mean_ms"]


def test_every_policy_runs_on_the_measured_cpu_truth(tmp_path: Path) -> None:
    trace = _constant(tmp_path, rate=2.0, seconds=300)
    cfg = measured_cpu_config(pods=2, quantum_s=1.0, policies=fleet.POLICIES)
    s = {name: r.summary(trace.duration_s) for name, r in FleetSim(cfg, trace).run().items()}
    assert set(s) == set(fleet.POLICIES) and all(r["requests"] > 100 for r in s.values())
    assert max(s["oracle"]["tpot_mean_ms"], s["clairvoyant"]["tpot_mean_ms"]) < s["off"]["tpot_mean_ms"]
    assert s["bandit"]["switches"] > 0


def test_simulate_command(tmp_path: Path, capsys) -> None:
    write_trace(tmp_path / "t.csv", [(0.0, 3.0, 0.5), (300.0, 3.0, 0.5)])
    out = tmp_path / "r.json"
    assert specserve(["simulate", "--trace", str(tmp_path / "t.csv"), "--pods", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "specserve" in printed and "oracle" in printed and out.exists()
    assert json.loads(out.read_text())["truth"] == "gpu"
    assert specserve(["simulate", "--trace", str(tmp_path / "missing.csv")]) == 2


def test_shadow_drafts_bring_the_fleet_to_the_drafter_the_traffic_turned_to(
    tmp_path: Path, monkeypatch
) -> None:
    """Prose-like, then code-like traffic: n-gram, which a trial measured poorly on prose, is measured on
    the code by its shadow drafts and switched to within a few intervals; without shadow drafts the
    fleet keeps the draft model until n-gram's next trial, a trial period after the one on prose."""
    write_trace(tmp_path / "mix.csv", [(0.0, 2.0, 0.0), (900.0, 2.0, 1.0), (2700.0, 2.0, 1.0)])
    trace = load_trace(tmp_path / "mix.csv", tail_s=0.0)
    # An n-gram that rarely matches prose: on the measured H200 a draft-model pass costs a quarter of a
    # target step, so the default n-gram (α 0.30 on prose, free) would beat the draft model on prose too.
    model, ngram = default_drafters()
    ngram = DrafterProfile(ngram.spec, {"code": ngram.alphas["code"], "prose": decaying(0.10, 0.02)})
    cfg = SimConfig(pods=2, policies=("static_on", "specserve"), drafters=(model, ngram))

    def run() -> tuple[FleetSim, dict]:
        sim = FleetSim(cfg, trace)
        return sim, {name: r.summary(trace.duration_s) for name, r in sim.run().items()}

    sim, s = run()
    switches = [(t, d) for t, d in sim.decisions if d.action == "switchDrafter"]
    assert switches and switches[0][1].drafter == "ngram"
    assert 900 < switches[0][0] <= 900 + 4 * cfg.evaluation_interval_s
    monkeypatch.setattr(fleet, "SHADOW_ROWS", 0)
    blind, s_blind = run()
    trials = [t for t, d in blind.decisions if "trial of drafter ngram" in d.reason]
    late = [t for t, d in blind.decisions if t >= 900 and d.action == "switchDrafter"]
    assert trials and trials[0] < 900 and late and late[0] >= trials[0] + core.TRIAL_PERIOD_S
    assert s["specserve"]["tpot_mean_ms"] < 0.97 * s_blind["specserve"]["tpot_mean_ms"]


def test_shadow_drafts_report_the_rows_drafted_for(tmp_path: Path) -> None:
    """On the measured CPU truth n-gram finds a match for only some rows: its sidecars count the rows they
    shadow-drafted for, so the tuner reads n-gram's shadow acceptance at a proposal rate under 1 (as it
    reads its live one), while the draft model in force proposes for every row."""
    write_trace(tmp_path / "code.csv", [(0.0, 2.0, 1.0), (900.0, 2.0, 1.0)])
    sim = FleetSim(
        measured_cpu_config(pods=2, policies=("specserve",)), load_trace(tmp_path / "code.csv", tail_s=0.0)
    )
    sim.run()
    seen = {name: acc for name, (acc, _) in sim.state.acceptance_seen.items()}
    assert sim.state.drafter == "tiny-draft" and seen["tiny-draft"].proposal_rate == 1.0
    assert seen["ngram"].source == "shadow" and 0.3 < seen["ngram"].proposal_rate < 0.9


def test_the_specserve_fleets_counters_add_up_as_an_engines_do(tmp_path: Path) -> None:
    """Speculative step counters carry the K verified, and generated tokens are sequence-steps plus
    accepted tokens: for a drafter that always proposes (the draft model), exactly one draft per
    sequence-step, so the proposal rate the tuner reads is 1."""
    # Two requests a second: batches of 1 to 8, so the first canary (bucket 1) measures. At four, on the
    # measured H200, the batches sit at 4-14 after the first seconds and a canary in bucket 1 measures
    # nothing for a whole exploration period (docs/policy.md, "Keeping measurements fresh: canaries").
    cfg = SimConfig(pods=2, policies=("specserve",), drafters=default_drafters()[:1])
    sim = FleetSim(cfg, _constant(tmp_path, rate=2.0, seconds=300))
    sim.run()
    i, d = 0, 0  # pod, drafter: the draft model, in force from the first decision on
    assert sim.c_steps[i, d, :, 1:].sum() > 0, "the fleet never speculated"
    spec_tokens = sim.c_tokens[i, d, :, 1:].sum(axis=-1)
    sequences = spec_tokens - sim.c_acc[i, d]
    assert np.allclose(sequences, sim.c_drafts[i, d], rtol=1e-6)
    rows = sim._rows(sim._counters(), tuple(np.zeros_like(a) for a in sim._counters()), sim._counters())
    ks = {
        lab.get("k") for kind, lab, _ in rows if kind == observations.STEPS and lab["speculating"] == "true"
    }
    assert ks and None not in ks and all(1 <= int(k) <= 5 for k in ks)

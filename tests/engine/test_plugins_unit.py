"""The vLLM plugins' pure parts, on vLLM's own stats objects: the live-policy table and the step
observation the stat logger records."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from vllm.v1.metrics.stats import IterationStats, SchedulerIterationDetails, SchedulerStats
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from specserve_engine.buckets import bucket_labels
from specserve_engine.policy_file import PodPolicy, PolicyReader, policy_path, write_policy
from specserve_engine.vllm_plugins.live_policy import lookup_for_policy
from specserve_engine.vllm_plugins.plain_filled_blocks import PlainFilledBlocks
from specserve_engine.vllm_plugins.plugin_config import SpecservePluginConfig
from specserve_engine.vllm_plugins.stat_logger import KInForce, observe_step, step_labels

BOUNDS = (1, 2, 4, 8)


def policy(mode: str = "on", drafter: str = "ngram", **k: int) -> PodPolicy:
    return PodPolicy(policy_version=1, drafter=drafter, mode=mode, k_by_bucket=k, bucket_bounds=BOUNDS)


def test_lookup_follows_the_k_table_per_batch_size() -> None:
    p = policy(**{"1": 4, "2": 3, "4": 2, "8": 1, "+Inf": 0})
    table = lookup_for_policy(p.drafter, p.mode, p.schedule(12), "ngram", 12, 4)
    # index = batch size (0 unused)
    assert table[1:] == [4, 3, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0]


def test_lookup_caps_k_at_the_startup_maximum() -> None:
    p = policy(**{"1": 9, "2": 9, "4": 9, "8": 9, "+Inf": 9})
    assert max(lookup_for_policy(p.drafter, p.mode, p.schedule(4), "ngram", 4, 3)) == 3


def test_off_and_another_drafter_turn_the_engines_drafter_off() -> None:
    on = {"1": 4, "2": 4, "4": 4, "8": 4, "+Inf": 4}
    off = policy("off", **on)
    assert lookup_for_policy(off.drafter, off.mode, off.schedule(8), "ngram", 8, 4) == [0] * 9
    other = policy("on", drafter="eagle3", **on)
    assert lookup_for_policy(other.drafter, other.mode, other.schedule(8), "ngram", 8, 4) == [0] * 9


def test_plugin_config_reads_the_additional_config_block() -> None:
    vllm_config = SimpleNamespace(
        additional_config={"specserve": {"drafter": "ngram", "runtimeDir": "/r", "bucketBounds": [1, 4]}}
    )
    cfg = SpecservePluginConfig.from_vllm_config(vllm_config)
    assert (cfg.drafter, cfg.runtime_dir, cfg.bucket_bounds) == ("ngram", "/r", (1, 4))
    assert str(cfg.policy_reader().path) == "/r/policy.json"


def _details(ctx: int, gen: int, ms: float = 20.0, dummy: bool = False) -> SchedulerIterationDetails:
    return SchedulerIterationDetails(
        iteration_index=0,
        num_ctx_requests=ctx,
        num_ctx_tokens=ctx * 10,
        num_generation_requests=gen,
        num_generation_tokens=gen,
        elapsed_ms=ms,
        is_dummy=dummy,
    )


def _iteration(tokens: int) -> IterationStats:
    it = IterationStats()
    it.num_generation_tokens = tokens
    return it


def test_a_speculating_step_is_bucketed_by_the_requests_it_scheduled() -> None:
    spec = SpecDecodingStats.new(3)
    spec.observe_draft(num_draft_tokens=3, num_accepted_tokens=2)
    spec.observe_draft(num_draft_tokens=2, num_accepted_tokens=0)
    stats = SchedulerStats(iteration_details=_details(ctx=1, gen=2, ms=12.5), spec_decoding_stats=spec)
    step = observe_step(stats, _iteration(5), BOUNDS)
    assert step is not None
    assert (step.bucket, step.speculating, step.seconds, step.generated_tokens) == ("4", True, 0.0125, 5)
    assert (step.drafts, step.draft_tokens, step.accepted_tokens) == (2, 5, 2)
    assert step.accepted_per_position == (1, 1, 0)
    assert step.draft_tokens_per_position == (2, 2, 1)
    assert step.k == 3  # the longest draft: the K in force
    assert step.prefill  # one request was in its prompt: the counters leave this step out


def test_a_step_that_prefilled_no_prompt_is_a_decode_step() -> None:
    step = observe_step(SchedulerStats(iteration_details=_details(ctx=0, gen=1)), _iteration(1), BOUNDS)
    assert step is not None and not step.prefill
    alone = observe_step(SchedulerStats(iteration_details=_details(ctx=1, gen=0)), _iteration(1), BOUNDS)
    assert alone is not None and alone.prefill and alone.bucket == "1"


def test_k_is_the_longest_draft_not_the_engines_maximum() -> None:
    spec = SpecDecodingStats.new(5)  # started with K = 5, the table says 2 for this batch size
    spec.observe_draft(num_draft_tokens=2, num_accepted_tokens=1)
    spec.observe_draft(num_draft_tokens=1, num_accepted_tokens=1)  # a drafter may propose fewer
    stats = SchedulerStats(iteration_details=_details(ctx=0, gen=2), spec_decoding_stats=spec)
    step = observe_step(stats, _iteration(4), BOUNDS)
    assert step is not None and step.k == 2


def test_a_plain_step_and_a_large_batch() -> None:
    step = observe_step(SchedulerStats(iteration_details=_details(0, 20)), _iteration(20), BOUNDS)
    assert step is not None
    assert (step.bucket, step.speculating, step.drafts, step.k) == ("+Inf", False, 0, 0)


def test_a_step_without_drafts_under_a_k_in_force_is_speculative() -> None:
    """n-gram without a match proposes nothing, and the step still runs the speculative path: it counts
    as a speculative step of the drafter at the K in force, not as a plain step."""
    step = observe_step(SchedulerStats(iteration_details=_details(0, 1)), _iteration(1), BOUNDS)
    assert step is not None and (step.batch, step.speculating, step.drafts) == (1, False, 0)
    assert step_labels(step, k_in_force=3) == (True, 3)
    assert step_labels(step, k_in_force=0) == (False, 0)
    spec = SpecDecodingStats.new(4)
    spec.observe_draft(num_draft_tokens=2, num_accepted_tokens=1)
    drafted = observe_step(
        SchedulerStats(iteration_details=_details(0, 1), spec_decoding_stats=spec), _iteration(2), BOUNDS
    )
    # Drafts verified make a speculative step whatever the table says now (it changed since they were made).
    assert step_labels(drafted, k_in_force=0) == (True, 2)


def test_k_in_force_is_the_schedulers_table_for_the_policy(tmp_path: Path) -> None:
    labels = bucket_labels(BOUNDS)
    reader = PolicyReader(policy_path(tmp_path), recheck_s=0.0)
    k = KInForce(reader, engine_drafter=None, max_num_seqs=12, max_k=4)
    assert k.at(1) == 4  # no policy yet: the start-up table, K everywhere
    table = {"1": 4, "2": 3, "4": 2, "8": 1, "+Inf": 0}
    write_policy(PodPolicy(1, "ngram", "on", table, BOUNDS), tmp_path)
    p = reader.current()
    assert [k.at(b) for b in range(1, 13)] == lookup_for_policy(
        p.drafter, p.mode, p.schedule(12), None, 12, 4
    )[1:]
    assert [k.at(b) for b in (1, 2, 3, 8, 9)] == [4, 3, 2, 1, 0]
    write_policy(PodPolicy(2, "ngram", "off", table, BOUNDS), tmp_path)
    assert k.at(1) == 0
    write_policy(PodPolicy(3, "ngram", "on", dict.fromkeys(labels, 9), BOUNDS), tmp_path)
    assert k.at(1) == 4  # capped at the engine's start-up K, as the scheduler caps it
    colocated = KInForce(reader, engine_drafter="eagle3", max_num_seqs=12, max_k=4)
    assert colocated.at(1) == 0  # the policy names a drafter the engine does not run
    assert KInForce(reader, engine_drafter=None, max_num_seqs=12, max_k=0).at(1) == 0  # no speculation


def test_messages_that_are_not_steps_are_ignored() -> None:
    assert observe_step(None, None, BOUNDS) is None
    assert observe_step(SchedulerStats(), _iteration(1), BOUNDS) is None  # no iteration details
    assert observe_step(SchedulerStats(iteration_details=_details(1, 0, dummy=True)), None, BOUNDS) is None


def test_the_policy_file_is_looked_at_once_per_recheck_interval(tmp_path: Path, monkeypatch) -> None:
    """The scheduler and stat logger ask every step; the file is stat()ed at most every recheck_s (a
    system call per step cost 4 % of a step where the engine's processes share a core), a changed file is
    picked up at the next look, and a bad one keeps the last good policy."""
    clock = [100.0]
    monkeypatch.setattr("specserve_engine.policy_file.time.monotonic", lambda: clock[0])
    stats = []
    real_stat = os.stat

    def counted_stat(path, *args, **kwargs):  # os.stat is global: count the policy file's only
        if path == policy_path(tmp_path):
            stats.append(path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counted_stat)
    labels = bucket_labels(BOUNDS)
    write_policy(PodPolicy(1, "d", "on", dict.fromkeys(labels, 2), BOUNDS), tmp_path)
    reader = PolicyReader(policy_path(tmp_path), recheck_s=0.05)
    assert reader.current().policy_version == 1 and len(stats) == 1
    write_policy(PodPolicy(2, "d", "on", dict.fromkeys(labels, 3), BOUNDS), tmp_path)
    clock[0] += 0.04
    assert reader.current().policy_version == 1 and len(stats) == 1  # within the interval: no look
    clock[0] += 0.02
    assert reader.current().policy_version == 2 and len(stats) == 2
    policy_path(tmp_path).write_text("{not json")
    clock[0] += 0.06
    assert reader.current().policy_version == 2 and len(stats) == 3  # bad file: the last good stands


def _block(block_id: int, block_hash: bytes | None) -> SimpleNamespace:
    return SimpleNamespace(block_id=block_id, block_hash=block_hash)


def test_plain_filled_blocks_are_those_from_a_requests_first_plain_position() -> None:
    """Blocks of a request from its first plain step on are plain-filled, live or freed; a freed block id
    that holds other content since (another hash) is not; nor is one that left the prefix cache."""
    record = PlainFilledBlocks()
    live = {"a": ([_block(0, b"h0"), _block(1, b"h1"), _block(2, None)],), "b": ([_block(3, b"h3")],)}
    record.note_plain_step({"a": 4}, {"a": SimpleNamespace(num_computed_tokens=20)})  # positions 16-19
    record.note_plain_step({"a": 1}, {"a": SimpleNamespace(num_computed_tokens=21)})  # the first one stays
    assert record.plain_from == {"a": 16}

    def blocks_of(req_id: str) -> tuple[list[SimpleNamespace], ...]:
        return live[req_id]

    hit = ([_block(0, b"h0"), _block(1, b"h1")],)
    assert record.in_hit(hit, blocks_of, [16]) == [(1, 1)]  # block 1 holds positions 16-31
    assert record.in_hit(([_block(3, b"h3")],), blocks_of, [16]) == []  # b ran no plain step

    record.release("a", live.pop("a"), [16])
    assert record.plain_from == {}
    assert record.in_hit(hit, blocks_of, [16]) == [(1, 1)]  # freed, still cached
    assert record.in_hit(([_block(0, b"h0"), _block(1, b"other")],), blocks_of, [16]) == []  # reused
    record.forget_blocks({1})
    assert record.in_hit(hit, blocks_of, [16]) == []

"""engine_args: the speculative config per drafter and the `vllm serve` argv, checked against vLLM's own
argument parser and config validation (no engine is started)."""

from __future__ import annotations

import json

import pytest

from specserve_engine.api import SidecarDrafter
from specserve_engine.engine_args import (
    ADDITIONAL_CONFIG_KEY,
    LIVE_POLICY_SCHEDULER,
    PLAIN_STEP_EXECUTOR,
    PLAIN_STEP_WORKER,
    SIDECAR_PROPOSER,
    STOCK_ENGINE_ENV,
    build_engine_args,
    speculative_config,
)
from specserve_engine.launch import EngineSpec

BOUNDS = [1, 2, 4, 8, 16]


def drafter(
    method: str, placement: str = "colocated", k: int = 4, source: str | None = "/models/d"
) -> SidecarDrafter:
    return SidecarDrafter(
        name=f"d-{method}", method=method, source=source, maxSpeculativeTokens=k, placement=placement
    )


def test_no_drafter_means_no_speculation() -> None:
    assert speculative_config(None, BOUNDS, 32) is None


@pytest.mark.parametrize(
    ("method", "vllm_method"),
    [
        ("eagle3", "eagle3"),
        ("eagle", "eagle"),
        ("mtp", "mtp"),
        ("draftModel", "draft_model"),
        ("ngram", "ngram"),
        ("medusa", "medusa"),
        ("suffix", "suffix"),
    ],
)
def test_colocated_methods_start_with_a_full_k_schedule(method: str, vllm_method: str) -> None:
    config = speculative_config(drafter(method, k=3), BOUNDS, 32)
    assert config is not None
    assert config["method"] == vllm_method
    assert config["num_speculative_tokens"] == 3
    # One range per bucket up to max_num_seqs, K everywhere: live control rewrites it later.
    assert config["num_speculative_tokens_per_batch_size"] == [
        [1, 1, 3],
        [2, 2, 3],
        [3, 4, 3],
        [5, 8, 3],
        [9, 16, 3],
        [17, 32, 3],
    ]


def test_model_based_methods_carry_the_checkpoint_and_ngram_does_not() -> None:
    assert speculative_config(drafter("draftModel"), BOUNDS, 8)["model"] == "/models/d"
    ngram = speculative_config(drafter("ngram"), BOUNDS, 8)
    assert "model" not in ngram
    assert ngram["prompt_lookup_min"] <= ngram["prompt_lookup_max"]


@pytest.mark.parametrize("placement", ["sidecar", "separateGpu"])
def test_sidecar_hosted_drafters_use_the_custom_class_proposer(placement: str) -> None:
    config = speculative_config(drafter("selfSpeculative", placement, k=5, source=None), BOUNDS, 8)
    # With a table like colocated drafters: the step's K reaches the proposer, K = 0 steps skip it.
    assert config == {
        "method": "custom_class",
        "model": SIDECAR_PROPOSER,
        "num_speculative_tokens": 5,
        "num_speculative_tokens_per_batch_size": [[1, 1, 5], [2, 2, 5], [3, 4, 5], [5, 8, 5]],
    }


def test_self_speculation_cannot_run_colocated() -> None:
    with pytest.raises(ValueError, match=r"drafters\[d-selfSpeculative\]\.method"):
        speculative_config(drafter("selfSpeculative", source=None), BOUNDS, 8)


def test_a_model_based_drafter_needs_a_source() -> None:
    with pytest.raises(ValueError, match=r"drafters\[d-eagle3\]\.source"):
        speculative_config(drafter("eagle3", source=None), BOUNDS, 8)


def _args(**overrides: object) -> list[str]:
    kwargs: dict = dict(
        model="/models/target",
        served_model_name="m",
        port=8000,
        max_model_len=512,
        tensor_parallel_size=1,
        drafter=drafter("ngram"),
        bucket_bounds=BOUNDS,
        max_num_seqs=32,
        runtime_dir="/run/specserve",
        extra_args=["--enforce-eager"],
    )
    kwargs.update(overrides)
    return build_engine_args(**kwargs)


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_argv_carries_the_plugins_and_extra_args_last() -> None:
    args = _args()
    assert args[0] == "/models/target"
    assert _flag(args, "--scheduler-cls") == LIVE_POLICY_SCHEDULER
    assert "--enable-logging-iteration-details" in args
    assert json.loads(_flag(args, "--additional-config")) == {
        ADDITIONAL_CONFIG_KEY: {"drafter": "d-ngram", "runtimeDir": "/run/specserve", "bucketBounds": BOUNDS}
    }
    assert json.loads(_flag(args, "--speculative-config"))["method"] == "ngram"
    assert _flag(args, "--worker-cls") == PLAIN_STEP_WORKER
    assert args[-1] == "--enforce-eager"


def test_the_plain_step_executor_only_where_vllm_runs_workers_in_processes() -> None:
    assert "--distributed-executor-backend" not in _args()  # one GPU: vLLM's in-process executor
    for args in (_args(cpu_backend=True), _args(tensor_parallel_size=2)):
        assert _flag(args, "--distributed-executor-backend") == PLAIN_STEP_EXECUTOR
    assert "--distributed-executor-backend" not in _args(drafter=None, cpu_backend=True)
    # A user's own executor (engine.extraArgs) comes last and wins.
    user = _args(cpu_backend=True, extra_args=["--distributed-executor-backend", "ray"])
    assert user[-2:] == ["--distributed-executor-backend", "ray"]


def test_argv_without_drafter_has_no_speculative_config() -> None:
    args = _args(drafter=None)
    assert "--speculative-config" not in args
    assert "--worker-cls" not in args  # nothing to skip: vLLM's own worker
    assert json.loads(_flag(args, "--additional-config"))[ADDITIONAL_CONFIG_KEY]["drafter"] is None


@pytest.mark.parametrize(("field", "value"), [("tensor_parallel_size", 0), ("max_model_len", 0)])
def test_bad_sizes_name_the_field(field: str, value: int) -> None:
    with pytest.raises(
        ValueError, match="tensorParallelSize" if field == "tensor_parallel_size" else "maxModelLen"
    ):
        _args(**{field: value})


def test_vllm_accepts_the_argv_and_the_schedule() -> None:
    """vLLM's own `serve` parser and SpeculativeConfig validation take what we render."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    ns = parser.parse_args(["--model", *_args()])
    engine_args = EngineArgs.from_cli_args(ns)
    assert engine_args.scheduler_cls == LIVE_POLICY_SCHEDULER
    assert engine_args.worker_cls == PLAIN_STEP_WORKER
    assert engine_args.enable_logging_iteration_details
    assert engine_args.additional_config[ADDITIONAL_CONFIG_KEY]["drafter"] == "d-ngram"
    spec = engine_args.speculative_config
    assert spec["num_speculative_tokens_per_batch_size"][-1] == [17, 32, 4]
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    lookup = build_dynamic_sd_schedule_lookup(spec["num_speculative_tokens_per_batch_size"], 32, 4)
    assert lookup[1:] == [4] * 32


def test_a_stock_engine_has_the_same_engine_flags_and_none_of_specserves() -> None:
    """The baseline: what a user would start, with the model and engine flags of a specserve engine."""
    common = {
        "model": "/models/target",
        "served_model_name": "tiny",
        "runtime_dir": "/run/s",
        "dtype": "float32",
    }
    ours = EngineSpec(**common, drafter=drafter("ngram")).argv(8000)
    stock = EngineSpec(**common, stock=True).argv(8000)
    ours_flags = {a for a in ours if a.startswith("--")}
    stock_flags = {a for a in stock if a.startswith("--")}
    assert stock_flags < ours_flags
    assert ours_flags - stock_flags == {
        "--scheduler-cls",
        "--enable-logging-iteration-details",
        "--disable-log-stats",
        "--additional-config",
        "--speculative-config",
        "--worker-cls",
        "--distributed-executor-backend",
    }
    for flag in stock_flags:
        assert _flag(stock, flag) == _flag(ours, flag), flag
    env = EngineSpec(**common, stock=True).environment()
    assert env["VLLM_PLUGINS"] == STOCK_ENGINE_ENV["VLLM_PLUGINS"] == ""
    assert "SPECSERVE_RUNTIME_DIR" not in env
    with pytest.raises(ValueError, match="no drafter"):
        EngineSpec(**common, stock=True, drafter=drafter("ngram"))


def test_vllm_loads_no_plugin_in_a_stock_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """specserve's plugins are installed here; the stock engine's environment keeps vLLM from loading any."""
    from vllm.plugins import load_plugins_by_group

    assert load_plugins_by_group("vllm.general_plugins")  # installed: specserve's lossless sampling
    for name, value in STOCK_ENGINE_ENV.items():
        monkeypatch.setenv(name, value)
    assert load_plugins_by_group("vllm.general_plugins") == {}
    assert load_plugins_by_group("vllm.stat_logger_plugins") == {}

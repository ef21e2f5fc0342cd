"""The --speculative-config the operator renders passes the installed vLLM's own SpeculativeConfig
validation, for every method and placement. Weights are not needed: the target and the drafters are
tiny config-only checkpoints written into tmp_path (the pod paths in the config are mapped to them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specserve_engine.engine_args import COLOCATED_METHODS
from specserve_operator.api.models import METHODS_BY_PLACEMENT, METHODS_NEEDING_SOURCE, parse_spec
from specserve_operator.render import children as render

vllm_config = pytest.importorskip("vllm.config")
transformers = pytest.importorskip("transformers")

# The drafter checkpoint's architecture per method (what EAGLE/Medusa heads declare in config.json).
DRAFTER_ARCHITECTURES = {
    "eagle3": "LlamaForCausalLMEagle3",
    "eagle": "EagleLlamaForCausalLM",
    "draftModel": "LlamaForCausalLM",
}


def _llama(path: Path, architecture: str = "LlamaForCausalLM", layers: int = 2) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    config.architectures = [architecture]
    config.save_pretrained(path)
    return path


def _deepseek_with_mtp(path: Path) -> Path:
    config = transformers.DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=512,
    )
    config.num_nextn_predict_layers = 1
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(path)
    return path


def _medusa(path: Path) -> Path:
    path.mkdir(parents=True)
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": 64, "vocab_size": 256}
    config |= {"num_heads": 4, "num_hidden_layers": 1, "truncated_vocab_size": 256}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _rendered_config(method: str, placement: str, k: int) -> tuple[dict[str, Any] | None, str | None]:
    drafter: dict[str, Any] = {
        "name": "d",
        "method": method,
        "placement": placement,
        "maxSpeculativeTokens": k,
    }
    if method in METHODS_NEEDING_SOURCE:
        drafter["source"] = "pvc://weights/drafter"
    spec = parse_spec(
        {
            "model": {"name": "t", "source": "pvc://weights/target", "maxModelLen": 256},
            "engine": {"image": "i", "maxNumSeqs": 64},
            "drafters": [drafter],
            "speculation": {"batchBuckets": [1, 4, 16]},
        }
    )
    deployment = render.build_deployment("demo", "ns", spec, render.RenderOptions())
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    config = (
        json.loads(args[args.index("--speculative-config") + 1]) if "--speculative-config" in args else None
    )
    return config, drafter.get("source")


PAIRS = [(p, m) for p, methods in METHODS_BY_PLACEMENT.items() for m in methods]


@pytest.mark.parametrize(("placement", "method"), PAIRS, ids=[f"{p}-{m}" for p, m in PAIRS])
def test_vllm_accepts_the_rendered_speculative_config(tmp_path: Path, placement: str, method: str) -> None:
    k = 2 if method == "mtp" else 4
    config, source = _rendered_config(method, placement, k)
    assert config is not None
    target = _deepseek_with_mtp(tmp_path / "target") if method == "mtp" else _llama(tmp_path / "target")
    if "model" in config and config["method"] != "custom_class":
        assert source is not None and config["model"] == "/models/pvc/weights/drafter"
        if method == "medusa":
            config["model"] = str(_medusa(tmp_path / "drafter"))
        else:
            config["model"] = str(_llama(tmp_path / "drafter", DRAFTER_ARCHITECTURES[method], layers=1))
    model_config = vllm_config.ModelConfig(model=str(target), skip_tokenizer_init=True, max_model_len=256)
    speculative = vllm_config.SpeculativeConfig(
        **config, target_model_config=model_config, target_parallel_config=vllm_config.ParallelConfig()
    )
    assert speculative.num_speculative_tokens == k
    expected = "custom_class" if placement != "colocated" else COLOCATED_METHODS[method]
    assert speculative.method == expected

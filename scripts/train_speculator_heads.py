#!/usr/bin/env python3
"""Train the speculator heads vLLM's colocated methods load, on top of the committed tiny target.

Writes, under models/ (committed, so tests never retrain), checkpoints in the layouts vLLM 0.32 loads:
- tiny-eagle3/: an EAGLE-3 head (`method: eagle3`): one decoder layer fed the target's hidden states
  after layers 1 and 2 (fused by `fc`) and the next token's embedding; its own lm_head, the target's
  embeddings (shared by vLLM, so not stored);
- tiny-eagle/:  an EAGLE-1 head (`method: eagle`): `fc` over [embedding; final hidden state] and one
  decoder layer without input norm; vLLM shares the target's embeddings and lm_head;
- tiny-medusa/: four Medusa heads (`method: medusa`): a residual SiLU block and an lm_head each, head k
  reading the target's final hidden state at position i and guessing the token at i + k + 2;
- tiny-mtp/:    the target re-packaged as MiMo (Qwen2 layers, zero q/k/v biases) with one MTP layer in
  its own checkpoint (`method: mtp`, no drafter model: serve this directory as the model).

The target stays frozen. EAGLE heads and the MTP layer are trained as they run: step 1 reads the
target's features, steps 2..DEPTH read the head's own previous output ("training-time test", EAGLE-3
§3.3): the query at step s of row i attends to the step-1 keys of positions 0..i plus its own earlier
steps' keys at row i, exactly what vLLM's drafter sees in its KV cache while it drafts. Losses distil
the target's next-token distribution, so acceptance (agreeing with the target) is what is optimised.

Seeded; about ten minutes on two cores.
Usage: .venv/bin/python scripts/train_speculator_heads.py [--out models]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_models import SEED, corpus  # the target's own synthetic corpus and seed

SEQ_LEN = 128
DEPTH = 4  # drafting steps trained; the heads' maximum K
EAGLE3_AUX_LAYERS = (1, 2)  # vLLM's ids: the residual stream after target layers 0 and 1 (0 = embeddings)
MEDUSA_HEADS = DEPTH


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class UnrolledAttention(nn.Module):
    """Llama attention (GQA, neox RoPE) for a draft unrolled over several steps.

    Step 1 is plain causal attention over the sequence; its keys and values are kept. At step s > 1,
    row i (position i + s - 1) attends to step 1's keys at rows 0..i and to its own keys from steps
    2..s, which is what vLLM's drafter cache holds for a request while it drafts."""

    def __init__(self, in_size: int, hidden: int, heads: int, kv_heads: int, qkv_bias: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(in_size, heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_size, kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_size, kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self._split(self.q_proj(x), self.heads)
        k = self._split(self.k_proj(x), self.kv_heads)
        v = self._split(self.v_proj(x), self.kv_heads)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scale = self.head_dim**-0.5
        self.cache.append((k, v))
        if len(self.cache) == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            k1, v1 = self.cache[0]
            t = q.shape[2]
            main = (q @ k1.transpose(-1, -2)) * scale
            main = main.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            diag = torch.stack([(q * ks).sum(-1) * scale for ks, _ in self.cache[1:]], dim=-1)
            weights = torch.softmax(torch.cat([main, diag], dim=-1), dim=-1)
            out = weights[..., :t] @ v1
            for j, (_, vs) in enumerate(self.cache[1:]):
                out = out + weights[..., t + j, None] * vs
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def layer_tensors(prefix: str, attn: UnrolledAttention, mlp: MLP) -> dict[str, torch.Tensor]:
    """A decoder layer's attention and MLP tensors (biases included) under the checkpoint names vLLM's
    loaders map onto their fused qkv and gate_up projections."""
    return {f"{prefix}self_attn.{n}": t for n, t in attn.named_parameters()} | {
        f"{prefix}mlp.{n}": t for n, t in mlp.named_parameters()
    }


class Eagle3Head(nn.Module):
    """vLLM's llama_eagle3 forward for one layer (norm_before_residual off, no norm before fc)."""

    def __init__(self, cfg: dict, target: LlamaForCausalLM) -> None:
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.fc = nn.Linear(h * len(EAGLE3_AUX_LAYERS), h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = UnrolledAttention(2 * h, h, cfg["num_attention_heads"], cfg["num_key_value_heads"])
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, cfg["intermediate_size"])
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, cfg["vocab_size"], bias=False)
        self.lm_head.weight.data.copy_(target.lm_head.weight.data)
        self.embed = target.model.embed_tokens  # shared with the target in vLLM: frozen, not saved

    def first_input(self, feats: dict) -> torch.Tensor:
        return self.fc(torch.cat([feats[i] for i in EAGLE3_AUX_LAYERS], dim=-1))

    def step(self, hidden, tokens, _positions, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden
        x = torch.cat([self.input_layernorm(self.embed(tokens)), self.hidden_norm(hidden)], dim=-1)
        residual = self.self_attn(x, cos, sin) + residual
        pre_norm = self.mlp(self.post_attention_layernorm(residual)) + residual
        return self.lm_head(self.norm(pre_norm)), pre_norm

    def state_dict_for_vllm(self) -> dict[str, torch.Tensor]:
        out = {
            "fc.weight": self.fc.weight,
            "norm.weight": self.norm.weight,
            "lm_head.weight": self.lm_head.weight,
        }
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            out[f"midlayer.{name}.weight"] = getattr(self, name).weight
        return out | layer_tensors("midlayer.", self.self_attn, self.mlp)


class EagleHead(nn.Module):
    """vLLM's llama_eagle forward (EAGLE-1) for one layer; embeddings and lm_head are the target's."""

    def __init__(self, cfg: dict, target: LlamaForCausalLM) -> None:
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.self_attn = UnrolledAttention(h, h, cfg["num_attention_heads"], cfg["num_key_value_heads"])
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, cfg["intermediate_size"])
        self.embed = target.model.embed_tokens
        self.lm_head = target.lm_head

    def first_input(self, feats: dict) -> torch.Tensor:
        return feats["final"]

    def step(self, hidden, tokens, _positions, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat([self.embed(tokens), hidden], dim=-1))
        residual = self.self_attn(x, cos, sin) + x
        out = self.mlp(self.post_attention_layernorm(residual)) + residual
        return self.lm_head(out), out

    def state_dict_for_vllm(self) -> dict[str, torch.Tensor]:
        out = {
            "fc.weight": self.fc.weight,
            "layers.0.post_attention_layernorm.weight": self.post_attention_layernorm.weight,
        }
        return out | layer_tensors("layers.0.", self.self_attn, self.mlp)


class MTPHead(nn.Module):
    """vLLM's MiMo MTP layer (a Qwen2 decoder layer behind token/hidden norms and `input_proj`). It reads
    the target's pre-norm final residual stream; vLLM reuses the one layer for every draft step, feeding
    it its own (normed) output. Embeddings and lm_head are the target's."""

    def __init__(self, cfg: dict, target: LlamaForCausalLM) -> None:
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.token_layernorm = RMSNorm(h, eps)
        self.hidden_layernorm = RMSNorm(h, eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = UnrolledAttention(
            h, h, cfg["num_attention_heads"], cfg["num_key_value_heads"], qkv_bias=True
        )
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, cfg["intermediate_size"])
        self.final_layernorm = RMSNorm(h, eps)
        self.embed = target.model.embed_tokens
        self.lm_head = target.lm_head

    def first_input(self, feats: dict) -> torch.Tensor:
        return feats["pre_norm"]  # what MiMoModel returns: the last layer's output before the final norm

    def step(self, hidden, tokens, positions, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed(tokens).masked_fill((positions == 0).unsqueeze(-1), 0.0)  # as vLLM's MTP does
        x = self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(embeds)], dim=-1))
        residual = self.self_attn(self.input_layernorm(x), cos, sin) + x
        out = self.final_layernorm(self.mlp(self.post_attention_layernorm(residual)) + residual)
        return self.lm_head(out), out

    def state_dict_for_vllm(self) -> dict[str, torch.Tensor]:
        prefix = "model.mtp_layers.0."
        out = {f"{prefix}input_proj.weight": self.input_proj.weight}
        for name in (
            "token_layernorm",
            "hidden_layernorm",
            "input_layernorm",
            "post_attention_layernorm",
            "final_layernorm",
        ):
            out[f"{prefix}{name}.weight"] = getattr(self, name).weight
        return out | layer_tensors(prefix, self.self_attn, self.mlp)


def mimo_checkpoint(target: LlamaForCausalLM, mtp: MTPHead) -> dict[str, torch.Tensor]:
    """The target re-packaged as MiMo (Qwen2 layers: zero q/k/v biases keep it the same function) with
    the MTP layer inside its own checkpoint, which is how MTP ships: `method: mtp` needs no `model`."""
    tensors = dict(target.state_dict())
    for i, layer in enumerate(target.model.layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            rows = getattr(layer.self_attn, name).weight.shape[0]
            tensors[f"model.layers.{i}.self_attn.{name}.bias"] = torch.zeros(rows)
    tensors.update(mtp.state_dict_for_vllm())
    return tensors


class MedusaHeads(nn.Module):
    """vLLM's medusa forward: per head, x + SiLU(W x) on the target's final hidden state, then an lm_head."""

    def __init__(self, cfg: dict, target: LlamaForCausalLM) -> None:
        super().__init__()
        h, v = cfg["hidden_size"], cfg["vocab_size"]
        self.blocks = nn.ModuleList(nn.Linear(h, h, bias=False) for _ in range(MEDUSA_HEADS))
        for block in self.blocks:
            nn.init.zeros_(block.weight)  # start as the identity: head k begins as the target's own lm_head
        self.lm_heads = nn.ModuleList(nn.Linear(h, v, bias=False) for _ in range(MEDUSA_HEADS))
        for head in self.lm_heads:
            head.weight.data.copy_(target.lm_head.weight.data)

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        return [
            lm(hidden + F.silu(block(hidden))) for block, lm in zip(self.blocks, self.lm_heads, strict=True)
        ]

    def state_dict_for_vllm(self) -> dict[str, torch.Tensor]:
        out = {}
        for k, (block, lm) in enumerate(zip(self.blocks, self.lm_heads, strict=True)):
            out[f"blocks.{k}.layers.0.weight"] = block.weight
            out[f"lm_heads.{k}.weight"] = lm.weight
        return out


@torch.no_grad()
def target_features(target: LlamaForCausalLM, batch: torch.Tensor) -> dict:
    """The target's residual stream after each layer (vLLM's aux hidden states, pre-norm), its final
    normed hidden state and its next-token log-probabilities."""
    captured: dict = {}
    hooks = [
        layer.register_forward_hook(
            lambda _m, _i, out, idx=idx: captured.__setitem__(
                idx + 1, out[0] if isinstance(out, tuple) else out
            )
        )
        for idx, layer in enumerate(target.model.layers)
    ]
    out = target(input_ids=batch, output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    captured["pre_norm"] = captured[len(target.model.layers)]
    captured["final"] = out.hidden_states[-1]
    captured["logprobs"] = torch.log_softmax(out.logits.float(), dim=-1)
    return captured


Unrolled = list[tuple[torch.Tensor, torch.Tensor]]  # per draft position: (draft logits, target log-probs)


def eagle_unroll(
    head: Eagle3Head | EagleHead | MTPHead, target: LlamaForCausalLM, batch: torch.Tensor, feats: dict
) -> Unrolled:
    """DEPTH drafting steps. Row i, step s: position i + s - 1, input token x[i + s], guesses x[i + s + 1],
    whose target distribution is the target's output at position i + s."""
    head.self_attn.cache = []
    t = batch.shape[1]
    positions = torch.arange(t).unsqueeze(0)
    hidden = head.first_input(feats)
    pairs = []
    for s in range(1, DEPTH + 1):
        rows = t - s  # rows whose guessed token lies inside the window
        tokens = torch.cat([batch[:, s:], batch[:, -1:].expand(-1, s)], dim=1)  # x[i + s], padded
        step_positions = positions + s - 1
        cos, sin = target.model.rotary_emb(hidden, step_positions)
        logits, hidden = head.step(hidden, tokens, step_positions, cos, sin)
        pairs.append((logits[:, :rows], feats["logprobs"][:, s : s + rows]))
    head.self_attn.cache = []
    return pairs


def medusa_unroll(heads: MedusaHeads, batch: torch.Tensor, feats: dict) -> Unrolled:
    """Head k at row i guesses x[i + k + 2]: the target's distribution at position i + k + 1."""
    t = batch.shape[1]
    return [
        (logits[:, : t - k - 1], feats["logprobs"][:, k + 1 : t])
        for k, logits in enumerate(heads(feats["final"]))
    ]


def distil_loss(pairs: Unrolled) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Cross-entropy against the target's distribution per draft position; later positions weigh less,
    as their tokens only count when every earlier one was accepted."""
    losses = [-(lp.exp() * torch.log_softmax(logits, dim=-1)).sum(-1).mean() for logits, lp in pairs]
    weights = [0.8**s for s in range(len(losses))]
    return sum(w * loss for w, loss in zip(weights, losses, strict=True)) / sum(weights), losses


def estimated_mal(pairs: Unrolled) -> float:
    """1 + the mean number of leading draft tokens equal to the target's greedy choice (what greedy
    verification accepts), over the rows every position covers. Teacher-forced, so an estimate."""
    rows = min(logits.shape[1] for logits, _ in pairs)
    agree = torch.stack([logits[:, :rows].argmax(-1) == lp[:, :rows].argmax(-1) for logits, lp in pairs])
    return 1.0 + float(agree.int().cumprod(dim=0).sum(dim=0).float().mean())


def train(
    name: str,
    module: nn.Module,
    unroll: Callable[[torch.Tensor, dict], Unrolled],
    target: LlamaForCausalLM,
    ids: torch.Tensor,
    steps: int,
    batch_size: int,
    lr: float,
) -> list[float]:
    gen = torch.Generator().manual_seed(SEED)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    started = time.monotonic()
    per_step: list[float] = []
    for step in range(steps):
        starts = torch.randint(0, ids.numel() - SEQ_LEN - 1, (batch_size,), generator=gen).tolist()
        batch = torch.stack([ids[s : s + SEQ_LEN] for s in starts])
        feats = target_features(target, batch)
        loss, parts = distil_loss(unroll(batch, feats))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        per_step = [float(p.detach()) for p in parts]
        if step % 50 == 0 or step == steps - 1:
            shown = " ".join(f"{p:.3f}" for p in per_step)
            print(
                f"[{name}] step {step:4d}/{steps} loss per draft position {shown}"
                f" ({time.monotonic() - started:.0f} s)"
            )
    return per_step


def save_head(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def llama_head_config(target_cfg: dict, architecture: str, intermediate: int, **extra) -> dict:
    keys = (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "vocab_size",
        "max_position_embeddings",
        "rope_parameters",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "hidden_act",
    )
    return {
        "architectures": [architecture],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "intermediate_size": intermediate,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **{k: target_cfg[k] for k in keys if k in target_cfg},
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "models")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--docs", type=int, default=12000)
    args = parser.parse_args()

    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    target_dir = args.out / "tiny-target"
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    tok = PreTrainedTokenizerFast.from_pretrained(target_dir)
    stream: list[int] = []
    for _, doc in corpus(random.Random(SEED), args.docs):
        stream += [tok.bos_token_id, *tok.encode(doc, add_special_tokens=False), tok.eos_token_id]
    ids = torch.tensor(stream)
    h = target_cfg["hidden_size"]

    report: dict = {"seed": SEED, "depth": DEPTH, "steps": args.steps, "heads": {}}
    eagle3_cfg = llama_head_config(
        target_cfg,
        "LlamaForCausalLMEagle3",
        intermediate=2 * h,
        draft_vocab_size=target_cfg["vocab_size"],
        target_hidden_size=h,
        # Where vLLM reads both the fc width (LlamaModel) and which layers the target exports (the runner).
        eagle_config={
            "eagle_aux_hidden_state_layer_ids": list(EAGLE3_AUX_LAYERS),
            "use_aux_hidden_state": True,
        },
    )
    eagle_cfg = llama_head_config(target_cfg, "EagleLlamaForCausalLM", intermediate=2 * h)
    medusa_cfg = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": h,
        "vocab_size": target_cfg["vocab_size"],
        "num_heads": MEDUSA_HEADS,
        "num_hidden_layers": 1,
        "torch_dtype": "float32",
    }
    torch.manual_seed(SEED)
    eagle3 = Eagle3Head(eagle3_cfg, target)
    torch.manual_seed(SEED)
    eagle = EagleHead(eagle_cfg, target)
    torch.manual_seed(SEED)
    medusa = MedusaHeads(medusa_cfg, target)
    # MTP ships inside the target's checkpoint: the target as MiMo (Qwen2 layers) plus one MTP layer.
    mimo_cfg = {
        **{
            k: v
            for k, v in target_cfg.items()
            if k not in ("architectures", "model_type", "transformers_version")
        },
        "architectures": ["MiMoForCausalLM"],
        "model_type": "qwen2",
        "num_nextn_predict_layers": 1,
        "use_sliding_window": False,
    }
    torch.manual_seed(SEED)
    mtp = MTPHead(target_cfg, target)
    held_out: dict[str, list[torch.Tensor]] = {"code": [], "prose": []}
    for domain, doc in corpus(random.Random(SEED + 1), 40):  # the target script's held-out documents
        held_out[domain].append(torch.tensor([tok.bos_token_id, *tok.encode(doc, add_special_tokens=False)]))
    for name, module, config, unroll in (
        ("tiny-eagle3", eagle3, eagle3_cfg, lambda b, f: eagle_unroll(eagle3, target, b, f)),
        ("tiny-eagle", eagle, eagle_cfg, lambda b, f: eagle_unroll(eagle, target, b, f)),
        ("tiny-medusa", medusa, medusa_cfg, lambda b, f: medusa_unroll(medusa, b, f)),
        ("tiny-mtp", mtp, mimo_cfg, lambda b, f: eagle_unroll(mtp, target, b, f)),
    ):
        losses = train(name, module, unroll, target, ids, args.steps, batch_size=16, lr=3e-3)
        tensors = mimo_checkpoint(target, mtp) if module is mtp else module.state_dict_for_vllm()
        save_head(args.out / name, config, tensors)
        with torch.no_grad():
            mal = {
                domain: sum(estimated_mal(unroll(d[None], target_features(target, d[None]))) for d in docs)
                / len(docs)
                for domain, docs in held_out.items()
            }
        print(f"[{name}] estimated MAL at K={DEPTH} on held-out text: {mal}")
        report["heads"][name] = {
            "parameters": sum(t.numel() for t in module.state_dict_for_vllm().values()),
            "final_loss_per_position": losses,
            "estimated_mal_k4": mal,
        }
    tok.save_pretrained(args.out / "tiny-mtp")  # a target checkpoint: vLLM loads its tokenizer
    (args.out / "heads.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

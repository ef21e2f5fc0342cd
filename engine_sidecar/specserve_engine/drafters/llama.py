"""A minimal Llama forward pass in torch with a per-sequence KV cache, for the sidecar's model drafters.

It reads Hugging Face Llama checkpoints (config.json + safetensors) and can keep only the first
`num_layers` decoder layers: with the target's checkpoint that is self-speculation (first layers, final
norm and LM head of the target, no training). Greedy drafting appends K−1 speculative entries past the
committed length; they are simply overwritten on the next step, so nothing has to be rolled back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specserve_engine.drafters.base import DrafterError


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    eps: float
    rope_theta: float

    @classmethod
    def from_config(cls, cfg: dict) -> LlamaShape:
        if cfg.get("model_type") not in ("llama", None):
            raise DrafterError(f"model_type {cfg.get('model_type')!r} is not a Llama checkpoint")
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in ("default", None):
            raise DrafterError(f"rope_scaling {scaling} is not supported by the sidecar's Llama drafter")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            hidden=hidden,
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            layers=int(cfg["num_hidden_layers"]),
            vocab=int(cfg["vocab_size"]),
            eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
        )


def read_config(path: str | Path) -> dict:
    file = Path(path) / "config.json"
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise DrafterError(f"cannot read {file}: {exc}") from exc


class KVCache:
    """One sequence's keys and values for every layer, grown by doubling."""

    def __init__(self, shape: LlamaShape, layers: int, dtype: torch.dtype, device: torch.device) -> None:
        self.capacity = 64

        def empty() -> torch.Tensor:
            return torch.empty(shape.kv_heads, self.capacity, shape.head_dim, dtype=dtype, device=device)

        self.k = [empty() for _ in range(layers)]
        self.v = [empty() for _ in range(layers)]
        self.length = 0  # entries that belong to the committed sequence

    def reserve(self, n: int) -> None:
        if n <= self.capacity:
            return
        cap = self.capacity
        while cap < n:
            cap *= 2
        for cache in (self.k, self.v):
            for i, old in enumerate(cache):
                new = old.new_empty(old.shape[0], cap, old.shape[2])
                new[:, : self.capacity] = old
                cache[i] = new
        self.capacity = cap


class TinyLlama:
    def __init__(
        self,
        path: str | Path,
        num_layers: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> None:
        path = Path(path)
        cfg = read_config(path)
        self.shape = LlamaShape.from_config(cfg)
        self.num_layers = self.shape.layers if num_layers is None else num_layers
        if not 1 <= self.num_layers <= self.shape.layers:
            raise DrafterError(f"layers={num_layers} is outside 1..{self.shape.layers} for {path}")
        self.device = torch.device(device)
        self.dtype = dtype
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise DrafterError(f"no *.safetensors weights in {path}")
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(str(f)))
        keep = self._wanted(weights)
        self.w = {k: v.to(device=self.device, dtype=dtype) for k, v in keep.items()}
        inv = 1.0 / (
            self.shape.rope_theta
            ** (torch.arange(0, self.shape.head_dim, 2, dtype=torch.float32) / self.shape.head_dim)
        )
        self._inv_freq = inv.to(self.device)

    def _wanted(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        keep = {}
        for name in ("model.embed_tokens.weight", "model.norm.weight"):
            if name not in weights:
                raise DrafterError(f"checkpoint lacks {name}")
            keep[name] = weights[name]
        # Tied checkpoints store no lm_head: the embedding is the head.
        keep["lm_head.weight"] = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        parts = (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        )
        for i in range(self.num_layers):
            for p in parts:
                name = f"model.layers.{i}.{p}.weight"
                if name not in weights:
                    raise DrafterError(f"checkpoint lacks {name}")
                keep[name] = weights[name]
        return keep

    def new_cache(self) -> KVCache:
        return KVCache(self.shape, self.num_layers, self.dtype, self.device)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.shape.eps)
        return weight * xf.to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """Logits of the last of `tokens`, placed at positions start..; writes their KV into `cache`."""
        s = self.shape
        w = self.w
        n = tokens.shape[0]
        end = start + n
        cache.reserve(end)
        cos, sin = self._rope(torch.arange(start, end, device=self.device))
        cos, sin = cos[None], sin[None]  # broadcast over heads
        x = w["model.embed_tokens.weight"][tokens]
        mask = None
        if n > 1:
            q_pos = torch.arange(start, end, device=self.device)[:, None]
            mask = q_pos >= torch.arange(end, device=self.device)[None, :]
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            h = self._norm(x, w[p + "input_layernorm.weight"])
            q = F.linear(h, w[p + "self_attn.q_proj.weight"]).view(n, s.heads, s.head_dim).transpose(0, 1)
            k = F.linear(h, w[p + "self_attn.k_proj.weight"]).view(n, s.kv_heads, s.head_dim).transpose(0, 1)
            v = F.linear(h, w[p + "self_attn.v_proj.weight"]).view(n, s.kv_heads, s.head_dim).transpose(0, 1)
            q = self._rotate(q, cos, sin)
            k = self._rotate(k, cos, sin)
            cache.k[i][:, start:end] = k
            cache.v[i][:, start:end] = v
            att = F.scaled_dot_product_attention(
                q[None],
                cache.k[i][None, :, :end],
                cache.v[i][None, :, :end],
                attn_mask=mask,
                enable_gqa=s.heads != s.kv_heads,
            )[0]
            x = x + F.linear(
                att.transpose(0, 1).reshape(n, s.heads * s.head_dim), w[p + "self_attn.o_proj.weight"]
            )
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            gate = F.linear(h, w[p + "mlp.gate_proj.weight"])
            up = F.linear(h, w[p + "mlp.up_proj.weight"])
            x = x + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        last = self._norm(x[-1:], w["model.norm.weight"])
        return F.linear(last, w["lm_head.weight"])[0]

    @torch.inference_mode()
    def forward_batch(
        self, tokens: torch.Tensor, caches: list[KVCache], positions: list[int]
    ) -> torch.Tensor:
        """Logits [B, vocab] of one token per sequence, token b at positions[b] of caches[b]; the
        projections and MLP run batched, attention per sequence over its own cache."""
        s = self.shape
        w = self.w
        b = len(caches)
        for cache, pos in zip(caches, positions, strict=True):
            cache.reserve(pos + 1)
        cos, sin = self._rope(torch.tensor(positions, device=self.device))
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        x = w["model.embed_tokens.weight"][tokens]
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            h = self._norm(x, w[p + "input_layernorm.weight"])
            q = self._rotate(
                F.linear(h, w[p + "self_attn.q_proj.weight"]).view(b, s.heads, s.head_dim), cos, sin
            )
            k = self._rotate(
                F.linear(h, w[p + "self_attn.k_proj.weight"]).view(b, s.kv_heads, s.head_dim), cos, sin
            )
            v = F.linear(h, w[p + "self_attn.v_proj.weight"]).view(b, s.kv_heads, s.head_dim)
            outs = []
            for j, (cache, pos) in enumerate(zip(caches, positions, strict=True)):
                cache.k[i][:, pos] = k[j]
                cache.v[i][:, pos] = v[j]
                outs.append(
                    F.scaled_dot_product_attention(
                        q[j][None, :, None],
                        cache.k[i][None, :, : pos + 1],
                        cache.v[i][None, :, : pos + 1],
                        enable_gqa=s.heads != s.kv_heads,
                    )[0, :, 0]
                )
            att = torch.stack(outs).reshape(b, s.heads * s.head_dim)
            x = x + F.linear(att, w[p + "self_attn.o_proj.weight"])
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            x = x + F.linear(
                F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"])) * F.linear(h, w[p + "mlp.up_proj.weight"]),
                w[p + "mlp.down_proj.weight"],
            )
        return F.linear(self._norm(x, w["model.norm.weight"]), w["lm_head.weight"])

"""Record the GPU forward times the fleet simulator's `gpu` truth replays, on the GPU this runs on.

    python3 scripts/record_gpu_truth.py --out benchmarks/truths/measured_h200.json   # needs a CUDA GPU
    python3 scripts/record_gpu_truth.py --smoke                                        # tiny shapes, CPU

Builds, with random bf16 weights, the decoder shapes the simulator serves (Llama-3.1-8B as the target,
Llama-3.2-1B as a draft model, an EAGLE-3 head for the 8B: one decoder layer over the embedding and the
hidden state, the 3-state fusion layer, a 32k draft vocabulary) and times, replaying CUDA graphs as vLLM
does (so no Python launch cost is counted):

- the dense part of one forward pass over M tokens (fused RMS norms, QKV, output projection, gated MLP,
  the LM head and the logits' cast to fp32 for the sampler, every layer with its own weights so nothing
  stays in L2), per model and M;
- the attention core of one layer for B sequences with n query tokens each over a KV cache of `ctx`
  tokens, per head layout and (B, n, ctx): the faster of PyTorch's fused attention and two batched matrix
  products (a kernel picker's choice), GQA groups folded into the query length as decode kernels do, and
  a KV cache per layer wherever the layers' caches fit in 4 GB (so successive layers read memory, not L2).

A forward pass is the dense part at M = B·n plus layers × the attention core: times add, because one
stream runs the kernels one after another. Also recorded: the copy bandwidth and the bf16 matrix rate
measured on the same GPU, the ceilings to read the rest against. What this leaves out (RoPE, the KV
cache write, the scheduler and sampler's CPU time) the truth models itself (docs/policy.md, "The
simulator's truths"). Writes JSON; prints a short table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    qkv_in: int  # the QKV projection's input width: 2·hidden for an EAGLE-3 layer (embedding ‖ hidden)
    fusion_in: int = 0  # an EAGLE-3 head's first projection of 3 target hidden states, 0 for none

    @property
    def attention(self) -> str:
        return f"hd{self.head_dim}_kv{self.kv_heads}_g{self.heads // self.kv_heads}"


SHAPES = {
    "llama-3.1-8b": Shape(32, 4096, 32, 8, 128, 14336, 128256, 4096),
    "llama-3.2-1b": Shape(16, 2048, 32, 8, 64, 8192, 128256, 2048),
    "eagle3-head-8b": Shape(1, 4096, 32, 8, 128, 14336, 32000, 8192, fusion_in=3 * 4096),
}
SMOKE_SHAPES = {
    "tiny-target": Shape(2, 64, 4, 2, 16, 128, 256, 64),
    "tiny-head": Shape(1, 64, 4, 2, 16, 128, 128, 128, fusion_in=192),
}
TOKENS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536)
BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
QUERY = (1, 2, 3, 4, 5, 6)
CONTEXTS = (256, 1024, 4096)
KV_BUDGET_BYTES = 4e9
ATTENTION_LAYERS = 8  # attention calls per timed graph, cycling through the layers' caches


class Timer:
    """Median seconds of one call of `fn`: replayed from a CUDA graph on a GPU, called on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn, min_total_s: float = 0.02) -> float:
        if not self.cuda:
            fn()
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(2):
            graph.replay()
        first = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first[0].record()
        graph.replay()
        first[1].record()
        torch.cuda.synchronize()
        reps = max(5, min(50, math.ceil(min_total_s / max(first[0].elapsed_time(first[1]) / 1e3, 1e-6))))
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
        ]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        del graph
        return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # PyTorch's own RMSNorm: one fused kernel on a GPU, as vLLM's is (a norm spelled out in elementwise
    # operations launches six: in a first recording they added 30 % to the 1B's pass at one token, 10 %
    # to the 8B's).
    return F.rms_norm(x, w.shape, w, 1e-5)


class Dense:
    """One model's weights and a forward pass without the attention core."""

    def __init__(self, s: Shape, device: torch.device, dtype: torch.dtype) -> None:
        def w(*size: int) -> torch.Tensor:
            return torch.randn(*size, device=device, dtype=dtype) * 0.02

        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.s = s
        self.layers = [
            dict(n1=w(s.hidden), qkv=w(s.qkv_in, q + 2 * kv), o=w(q, s.hidden), n2=w(s.hidden),
                 gu=w(s.hidden, 2 * s.ffn), d=w(s.ffn, s.hidden))
            for _ in range(s.layers)
        ]  # fmt: skip
        self.fusion = w(s.fusion_in, s.hidden) if s.fusion_in else None
        self.norm, self.head = w(s.hidden), w(s.hidden, s.vocab)
        self.q = q

    def inputs(self, m: int) -> torch.Tensor:
        s = self.s
        width = s.fusion_in or s.hidden
        return torch.randn(m, width, device=self.head.device, dtype=self.head.dtype)

    def time(self, m: int, timer: Timer) -> float:
        x = self.inputs(m)
        return timer(lambda: self.forward(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.s
        if self.fusion is not None:
            x = x @ self.fusion
        for p in self.layers:
            h = rms_norm(x, p["n1"])
            if s.qkv_in != s.hidden:
                h = torch.cat([h, x], dim=-1)
            qkv = h @ p["qkv"]
            x = x + qkv[:, : self.q] @ p["o"]
            gu = rms_norm(x, p["n2"]) @ p["gu"]
            x = x + (F.silu(gu[:, : s.ffn]) * gu[:, s.ffn :]) @ p["d"]
        logits = (rms_norm(x, self.norm) @ self.head).float()
        return logits.argmax(-1)


def attention_core(layout: Shape, batch: int, n: int, ctx: int, device, dtype, timer: Timer) -> float:
    """Seconds of one layer's attention core at (batch, n, ctx): the faster of the two implementations."""
    g = layout.heads // layout.kv_heads
    per_layer = 2 * batch * layout.kv_heads * ctx * layout.head_dim * torch.finfo(dtype).bits // 8
    caches = max(1, min(ATTENTION_LAYERS, int(KV_BUDGET_BYTES // per_layer)))
    shape = (batch, layout.kv_heads, ctx, layout.head_dim)
    kv = [(torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype))
          for _ in range(caches)]  # fmt: skip
    q = torch.randn(batch, layout.kv_heads, g * n, layout.head_dim, device=device, dtype=dtype)
    scale = layout.head_dim**-0.5

    def fused() -> None:
        for i in range(ATTENTION_LAYERS):
            k, v = kv[i % caches]
            F.scaled_dot_product_attention(q, k, v)

    def matmuls() -> None:
        for i in range(ATTENTION_LAYERS):
            k, v = kv[i % caches]
            torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1) @ v

    return min(timer(fused, 0.005), timer(matmuls, 0.005)) / ATTENTION_LAYERS


def ceilings(device: torch.device, dtype: torch.dtype, timer: Timer, smoke: bool) -> dict:
    n = 1 << (20 if smoke else 30)  # elements: 2 GiB of bf16 on a GPU
    src, dst = torch.empty(n, device=device, dtype=dtype), torch.empty(n, device=device, dtype=dtype)
    copy_s = timer(lambda: dst.copy_(src))
    size = 256 if smoke else 8192
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    mm_s = timer(lambda: a @ b)
    return {
        "copy_bytes_per_s": 2 * n * src.element_size() / copy_s,
        "bf16_matmul_flops_per_s": 2 * size**3 / mm_s,
    }


def _at(tree: dict, path: list) -> object:
    for key in path:
        tree = tree[key]
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/truths/measured_h200.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and grids on the CPU")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.bfloat16
    timer = Timer(device)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    grids = (TOKENS, BATCHES, QUERY, CONTEXTS)
    tokens, batches, query, contexts = (g[:2] for g in grids) if args.smoke else grids
    started = time.time()
    layouts = {shape.attention: shape for shape in shapes.values()}
    rounds: list[dict] = []
    with torch.inference_mode():
        models = {name: Dense(shape, device, dtype) for name, shape in shapes.items()}
        for r in range(args.rounds):
            # Every figure once a round, the rounds one after another: a slow spell (clocks, another tenant)
            # falls on one round of a figure, and the median of the rounds drops it.
            one = {"ceilings": ceilings(device, dtype, timer, args.smoke)}
            one["dense_s"] = {name: [model.time(m, timer) for m in tokens] for name, model in models.items()}
            one["attention_s"] = {
                key: [[[attention_core(lay, b, n, c, device, dtype, timer) for c in contexts] for n in query]
                      for b in batches]
                for key, lay in layouts.items()
            }  # fmt: skip
            rounds.append(one)
            print(f"round {r + 1}: {json.dumps(one['ceilings'])}", flush=True)
            for name, times in one["dense_s"].items():
                print(f"  {name}: dense ms at M={tokens}: {[round(t * 1e3, 3) for t in times]}", flush=True)

    def median(path: list) -> tuple[np.ndarray, float]:
        values = np.array([_at(one, path) for one in rounds])
        mid = np.median(values, axis=0)
        return mid, float(np.max((values.max(axis=0) - values.min(axis=0)) / mid))

    out: dict = {
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "rounds": args.rounds,
        "ceilings": {key: median(["ceilings", key])[0].item() for key in rounds[0]["ceilings"]},
        "models": {},
        "attention": {},
        "spread": {},  # per table, the largest (max − min) / median of its entries over the rounds
    }
    for name, shape in shapes.items():
        dense, out["spread"][name] = median(["dense_s", name])
        out["models"][name] = {"shape": asdict(shape), "attention": shape.attention,
                               "tokens": list(tokens), "dense_s": dense.tolist()}  # fmt: skip
    for key in layouts:
        grid, out["spread"][key] = median(["attention_s", key])
        out["attention"][key] = {
            "batches": list(batches),
            "query": list(query),
            "contexts": list(contexts),
            "per_layer_s": grid.tolist(),
        }
    print(f"spread over {args.rounds} rounds: {json.dumps(out['spread'])}", flush=True)
    out["recorded_s"] = round(time.time() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} in {out['recorded_s']} s", flush=True)


if __name__ == "__main__":
    main()

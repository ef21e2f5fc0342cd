#!/usr/bin/env python3
"""Train the tiny models the engine tests, the benchmarks and the local fleet serve (no downloads).

Writes, under models/ (committed, so tests never retrain):
- tiny-target/: a small Llama-architecture target, HF format (safetensors), with its tokenizer;
- tiny-draft/:  a one-layer Llama draft model with the same tokenizer (vLLM `draft_model`, or the
  sidecar's torch drafter);
- prompts/code.jsonl, prompts/prose.jsonl: held-out prompts per domain.

The corpus is synthetic, with two domains of clearly different predictability:
- code: templated, code-like functions whose identifiers repeat inside each function, so the target,
  a draft model and n-gram prompt lookup all predict most tokens;
- prose: sentences of words drawn uniformly from a large vocabulary, so the next word is a guess and
  acceptance stays low.

Seeded and deterministic for a given torch build and thread count; about three minutes on two cores.
Usage: .venv/bin/python scripts/train_tiny_models.py [--out models] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 1234
VOCAB_SIZE = 512
SEQ_LEN = 128
MAX_POSITIONS = 1024
BOS, EOS, PAD = "<s>", "</s>", "<pad>"

# Architectures: the target is sized so that on a small CPU a verify step of K+1 tokens costs about as
# much as one token at batch 1 (speculation pays) but not at larger batches (the cliff).
# Shallow with a wide MLP: two layers learn the templates (copying needs attention over two layers)
# in a few hundred steps on two cores.
TARGET = {
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
DRAFT = {
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 1,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
}

# --- synthetic corpus ---------------------------------------------------------------------------------
NOUNS = [
    "user",
    "order",
    "item",
    "price",
    "total",
    "count",
    "index",
    "value",
    "name",
    "record",
    "cache",
    "queue",
    "table",
    "score",
    "limit",
]
VERBS = ["get", "set", "load", "save", "compute", "update", "check", "build", "parse", "merge"]
OPS = ["+", "-", "*"]
PROSE_WORDS = [
    "river",
    "stone",
    "lantern",
    "meadow",
    "whisper",
    "harbor",
    "velvet",
    "ember",
    "orchard",
    "shadow",
    "thunder",
    "silver",
    "garden",
    "window",
    "morning",
    "journey",
    "feather",
    "candle",
    "mountain",
    "forest",
    "ocean",
    "valley",
    "bridge",
    "castle",
    "island",
    "winter",
    "summer",
    "autumn",
    "spring",
    "market",
    "village",
    "letter",
    "mirror",
    "dream",
    "story",
    "song",
    "voice",
    "cloud",
    "storm",
    "field",
    "road",
    "tower",
    "gate",
    "fire",
    "water",
    "salt",
    "honey",
    "bread",
    "wine",
    "iron",
    "glass",
    "paper",
    "ribbon",
    "thread",
    "needle",
    "basket",
    "cradle",
    "quiet",
    "bright",
    "ancient",
    "gentle",
    "hollow",
    "golden",
    "restless",
    "silent",
    "weary",
    "tender",
    "distant",
    "crimson",
    "pale",
    "wild",
    "walked",
    "sang",
    "drifted",
    "slept",
    "wandered",
    "carried",
    "opened",
    "painted",
    "gathered",
    "followed",
    "remembered",
    "whispered",
    "under",
    "over",
    "beside",
    "beyond",
    "across",
    "through",
    "toward",
    "against",
    "within",
    "without",
    "before",
    "after",
]


def code_document(rng: random.Random) -> str:
    noun, other = rng.sample(NOUNS, 2)
    verb = rng.choice(VERBS)
    op = rng.choice(OPS)
    n = rng.randint(1, 9)
    name = f"{verb}_{noun}"
    lines = [
        f"def {name}(self, {other}):",
        f"    {noun} = self.{noun}",
        f"    if {other} is None:",
        f"        return {noun}",
        f"    {noun} = {noun} {op} {other}",
        f"    self.{noun} = {noun}",
        f"    return {noun}",
        "",
        f"def {name}_all(self, {other}s):",
        f"    for {other} in {other}s:",
        f"        self.{name}({other})",
        f"    return self.{noun} {op} {n}",
        "",
    ]
    return "\n".join(lines)


def prose_document(rng: random.Random) -> str:
    """Words drawn without replacement: the next word is any unused one (unpredictable), and a model
    that learned this never loops on a word, so greedy output does not turn into easy repeats."""
    words = rng.sample(PROSE_WORDS, rng.randint(24, 40))
    sentences, i = [], 0
    while i < len(words):
        n = rng.randint(6, 10)
        sentences.append(" ".join(words[i : i + n]).capitalize() + ".")
        i += n
    return " ".join(sentences) + "\n"


def corpus(rng: random.Random, n_docs: int) -> list[tuple[str, str]]:
    docs = []
    for _ in range(n_docs):
        domain = "code" if rng.random() < 0.5 else "prose"
        docs.append((domain, code_document(rng) if domain == "code" else prose_document(rng)))
    return docs


# --- tokenizer ----------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Prompts get a BOS token, as every training document starts with one.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=MAX_POSITIONS
    )
    fast.save_pretrained(out)
    return fast


# --- models -------------------------------------------------------------------------------------------
def llama_config(arch: dict, tok: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
        **arch,
    )


def batches(ids: torch.Tensor, batch_size: int, steps: int, gen: torch.Generator):
    starts = torch.randint(0, ids.numel() - SEQ_LEN - 1, (steps, batch_size), generator=gen)
    for row in starts:
        yield torch.stack([ids[s : s + SEQ_LEN] for s in row.tolist()])


def train(
    model: LlamaForCausalLM, ids: torch.Tensor, steps: int, batch_size: int, lr: float, label: str
) -> float:
    gen = torch.Generator().manual_seed(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)),
    )
    model.train()
    started = time.monotonic()
    loss_value = float("nan")
    for step, batch in enumerate(batches(ids, batch_size, steps, gen)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss  # the model shifts the labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
        if step % 50 == 0 or step == steps - 1:
            print(
                f"[{label}] step {step:4d}/{steps} loss {loss_value:.3f} ({time.monotonic() - started:.0f} s)"
            )
    model.eval()
    return loss_value


@torch.no_grad()
def domain_loss(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, docs: list[str]) -> float:
    losses = []
    for doc in docs:
        ids = torch.tensor([tok.encode(doc)])
        losses.append(float(model(input_ids=ids, labels=ids).loss))
    return sum(losses) / len(losses)


def save_model(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def prompts(rng: random.Random, n: int) -> dict[str, list[str]]:
    """Held-out prompt prefixes: the first lines of fresh documents, which the model must continue."""
    # No trailing newline: the tokenizer merges "\n" with the next line's indent, so a prompt ending in a
    # bare "\n" would end in a token the models rarely saw.
    code = ["\n".join(code_document(rng).split("\n")[:2]) for _ in range(n)]
    prose = [" ".join(prose_document(rng).split(" ")[:6]) for _ in range(n)]
    return {"code": code, "prose": prose}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "models")
    parser.add_argument("--steps", type=int, default=350, help="target training steps")
    parser.add_argument("--draft-steps", type=int, default=600, help="draft training steps (10x cheaper)")
    parser.add_argument("--docs", type=int, default=12000)
    args = parser.parse_args()

    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    rng = random.Random(SEED)
    docs = corpus(rng, args.docs)
    held_out = corpus(random.Random(SEED + 1), 40)

    tok_raw = train_tokenizer([d for _, d in docs])
    staging = args.out / ".tokenizer"
    tok = save_tokenizer(tok_raw, staging)
    stream: list[int] = []
    for _, doc in docs:
        stream += [tok.bos_token_id, *tok.encode(doc, add_special_tokens=False), tok.eos_token_id]
    ids = torch.tensor(stream)
    print(f"corpus: {len(docs)} documents, {ids.numel()} tokens, vocab {len(tok)}")

    report: dict = {"seed": SEED, "corpus_tokens": ids.numel(), "models": {}}
    for name, arch, steps, batch_size in (
        ("tiny-target", TARGET, args.steps, 8),
        ("tiny-draft", DRAFT, args.draft_steps, 16),
    ):
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(llama_config(arch, tok))
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{name}: {n_params / 1e6:.2f} M parameters")
        final = train(model, ids, steps, batch_size=batch_size, lr=3e-3, label=name)
        by_domain = {
            domain: domain_loss(model, tok, [d for dd, d in held_out if dd == domain])
            for domain in ("code", "prose")
        }
        print(f"{name}: held-out loss {by_domain}")
        save_model(model, tok, args.out / name)
        report["models"][name] = {"parameters": n_params, "train_loss": final, "held_out_loss": by_domain}
    shutil.rmtree(staging)

    prompt_dir = args.out / "prompts"
    prompt_dir.mkdir(parents=True, exist_ok=True)
    for domain, items in prompts(random.Random(SEED + 2), 16).items():
        with open(prompt_dir / f"{domain}.jsonl", "w") as f:
            for text in items:
                f.write(json.dumps({"domain": domain, "prompt": text}) + "\n")
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

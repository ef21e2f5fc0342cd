"""The load generator's prompts: the held-out prompts per traffic domain that the tiny-model training
script writes (models/prompts/<domain>.jsonl, one {"domain", "prompt"} object per line)."""

from __future__ import annotations

import json
from pathlib import Path

from specserve_operator.local.errors import LocalFleetError
from specserve_operator.local.loadgen import DOMAINS


def load_prompts(models_dir: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for domain in DOMAINS:
        path = models_dir / "prompts" / f"{domain}.jsonl"
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            raise LocalFleetError(
                f"no {domain} prompts at {path}",
                hint="the tiny models and their prompts come with the repository under models/ "
                "(scripts/train_tiny_models.py writes them); check --models-dir",
            ) from None
        prompts = []
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise LocalFleetError(f"{path}:{n}: not a JSON object with a `prompt` string") from None
        if not prompts:
            raise LocalFleetError(f"{path}: no prompts")
        out[domain] = prompts
    return out

"""Supervised warm start of the tiny policy, cached on disk and keyed by its settings.

The model imitates guess-and-check demonstrations that try the candidate attempts in a random
order (bapo.experiments.task), so it learns the format and the arithmetic but not which attempt to try
first: the start policy of the RL demo is uncertain at every attempt (high entropy) and its
held-out accuracy is about what blind tries within the token budget give.
Cache: $BAPO_CACHE (default ~/.cache/bapo) / warmstart-<hash of all settings>/, written with
`save_pretrained` (model + tokenizer) plus warmstart.json (settings, start accuracy, time).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bapo.experiments.harness import cache_root
from bapo.experiments.task import TaskConfig, demonstrations, make_split, verify
from bapo.train.tiny import ModelConfig, build_model, build_tokenizer

CACHE_VERSION = 3  # bump when the code below changes what a cached model is


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 600
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 30
    seed: int = 0


@dataclass(frozen=True)
class WarmStartConfig:
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)

    def key(self) -> str:
        blob = json.dumps({"v": CACHE_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _response_labels(input_ids, prompt_lengths, pad_id):
    """Labels [B, T]: the input ids, with -100 on padding and on each row's prompt tokens."""
    labels = input_ids.clone()
    labels[input_ids == pad_id] = -100
    for i, n in enumerate(prompt_lengths):
        labels[i, :n] = -100
    return labels


def supervised_finetune(
    model,
    tokenizer,
    prompts: list[str],
    texts: list[str],
    cfg: SFTConfig,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Next-token cross-entropy on the response part of `texts` (= prompt + solution + eos).

    Right-padded batches [batch_size, T]; AdamW, linear warmup then cosine decay.
    Returns the loss per step.
    """
    import torch

    gen = torch.Generator().manual_seed(cfg.seed)
    prompt_lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * s / cfg.steps))
    )
    tokenizer.padding_side = "right"
    model.train()
    losses = []
    for step in range(cfg.steps):
        idx = torch.randint(len(texts), (cfg.batch_size,), generator=gen).tolist()
        batch = tokenizer([texts[i] + tokenizer.eos_token for i in idx], return_tensors="pt", padding=True)
        labels = _response_labels(batch["input_ids"], [prompt_lengths[i] for i in idx], tokenizer.pad_token_id)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if on_step:
            on_step(step, losses[-1])
    tokenizer.padding_side = "left"
    return losses


def warm_start(
    cfg: WarmStartConfig, root: Path | None = None, eval_k: int = 8, on_step: Callable[[int, float], None] | None = None
) -> Path:
    """Path of the warm-started model for `cfg`: from the cache, or trained and saved now."""
    from bapo.analysis.evaluate import evaluate

    target = (root or cache_root()) / f"warmstart-{cfg.key()}"
    if (target / "warmstart.json").exists():
        return target
    t0 = time.time()
    tokenizer = build_tokenizer()
    model = build_model(cfg.model, tokenizer)
    train_rows, heldout = make_split(cfg.task)
    texts = demonstrations(train_rows, cfg.sft.seed)
    losses = supervised_finetune(model, tokenizer, [r["prompt"] for r in train_rows], texts, cfg.sft, on_step)
    sft_s = time.time() - t0
    scores = evaluate(model, tokenizer, heldout, verify, k=eval_k, max_new_tokens=cfg.task.max_new_tokens)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    info = {
        "settings": asdict(cfg),
        "key": cfg.key(),
        "sft_seconds": round(sft_s, 1),
        "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        "heldout": scores,
    }
    (tmp / "warmstart.json").write_text(json.dumps(info, indent=2))
    if target.exists():  # another process finished first: keep theirs
        shutil.rmtree(tmp)
    else:
        tmp.rename(target)
    return target


def warmstart_info(path: Path) -> dict:
    return json.loads((Path(path) / "warmstart.json").read_text())

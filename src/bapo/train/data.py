"""Prompt data: rows {"prompt", "answer", ...} from JSONL/Parquet (through `datasets`) or a list,
tokenized once, served in a seeded, resumable order (epoch-wise shuffle)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from bapo.train.config import DataSection


def load_examples(cfg: DataSection) -> list[dict]:
    import datasets

    kind = "parquet" if cfg.path.lower().endswith(".parquet") else "json"
    rows = datasets.load_dataset(kind, data_files=cfg.path, split="train")
    return [dict(row) for row in rows]


def tokenize_prompts(examples: list[dict], tokenizer, cfg: DataSection) -> tuple[list[dict], list[list[int]], int]:
    """-> (kept examples, their prompt token ids, number dropped for being too long)."""
    if cfg.chat_template:
        def turn(text):
            msgs = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []) + \
                   [{"role": "user", "content": text}]
            return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        texts = [turn(ex[cfg.prompt_key]) for ex in examples]
    else:
        texts = [(cfg.system_prompt or "") + ex[cfg.prompt_key] for ex in examples]
    ids = tokenizer(texts, add_special_tokens=not cfg.chat_template)["input_ids"]
    kept = [(ex, p) for ex, p in zip(examples, ids) if 0 < len(p) <= cfg.max_prompt_tokens]
    if not kept:
        raise ValueError(f"no prompt fits data.max_prompt_tokens={cfg.max_prompt_tokens}")
    return [k[0] for k in kept], [k[1] for k in kept], len(examples) - len(kept)


@dataclass
class PromptSampler:
    """Endless prompt indices; reshuffled every epoch. Its state is two ints and an RNG state."""

    size: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    position: int = 0
    order: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.order:
            self._new_order()

    def _new_order(self):
        self.order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(self.order)

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._new_order()
            out.append(self.order[self.position])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._new_order()

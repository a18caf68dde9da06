"""The example's tiny model and toy task (addition prompts, a dense digit reward); the TRL tests and
bench/ use them too.

    from tiny_task import ...               # in bapo_grpo.py, run as `python examples/trl/bapo_grpo.py`
    from examples.trl.tiny_task import ...  # from the repository root (tests/, bench/)

Nothing here downloads anything. The model and tokenizer are the demo's (bapo.train.tiny): a
randomly initialised Llama built from a config and a character-level ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

import random
from pathlib import Path


def build_tiny_model(save_dir: str | Path, hidden_size: int = 64, num_layers: int = 2, seed: int = 0) -> Path:
    """Build and save (model + tokenizer) bapo's built-in tiny policy architecture: the demo's
    character tokenizer and a random-init Llama of ``num_layers`` x ``hidden_size``.

    Returns ``save_dir``, loadable by ``AutoModelForCausalLM.from_pretrained`` and by TRL's
    ``GRPOTrainer(model=str(save_dir))``.
    """
    from bapo.train.tiny import ModelConfig, save_tiny_model

    return save_tiny_model(
        save_dir,
        ModelConfig(
            hidden_size=hidden_size,
            layers=num_layers,
            heads=4,
            intermediate_size=2 * hidden_size,
            max_positions=256,
            seed=seed,
        ),
    )


def addition_prompts(count: int, seed: int = 0, max_operand: int = 50) -> list[dict[str, str]]:
    """``count`` rows ``{"prompt": "12+7=", "answer": "19"}`` (the column names TRL and bapo.train read)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        left, right = rng.randrange(max_operand), rng.randrange(max_operand)
        rows.append({"prompt": f"{left}+{right}=", "answer": str(left + right)})
    return rows


def digit_match_reward(completions: list[str], answer: list[str], **_) -> list[float]:
    """TRL reward function: share of the answer's characters matched position by position (dense, in [0, 1]).

    Dense so that a random-init model already gets reward variance inside a group.
    """
    rewards = []
    for completion, target in zip(completions, answer):
        hits = sum(1 for got, want in zip(completion.strip(), target) if got == want)
        rewards.append(hits / max(len(target), 1))
    return rewards

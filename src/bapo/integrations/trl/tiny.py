"""A tiny, locally built causal LM and a toy task: for tests, the example and the bench.

Nothing here downloads anything. The model is a randomly initialised Qwen2 built from a config,
the tokenizer a character-level ``PreTrainedTokenizerFast`` built with ``tokenizers``.
"""

from __future__ import annotations

import random
from pathlib import Path

#: Characters of the toy vocabulary (digits and arithmetic), after the special tokens. No space
#: or newline: transformers 5 reloads any tokenizer saved beside a qwen2 config as the byte-level
#: Qwen2Tokenizer, which would silently drop plain " " / "\n" entries.
CHARS = "0123456789+=-*xyz."
SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]


def build_char_tokenizer(save_dir: str | Path | None = None):
    """A char-level ``PreTrainedTokenizerFast`` over :data:`CHARS`; saved with save_pretrained if asked.

    Padding is on the left (generation), ``eos`` doubles as the end of a completion.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + list(CHARS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )
    if save_dir is not None:
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def build_tiny_qwen2(save_dir: str | Path, hidden_size: int = 64, num_layers: int = 2, seed: int = 0) -> Path:
    """Build and save (model + tokenizer) a random-init Qwen2 of ``num_layers`` x ``hidden_size``.

    Returns ``save_dir``, loadable by ``AutoModelForCausalLM.from_pretrained`` and by TRL's
    ``GRPOTrainer(model=str(save_dir))``.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    save_dir = Path(save_dir)
    tokenizer = build_char_tokenizer(save_dir)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(save_dir))
    return save_dir


def addition_prompts(count: int, seed: int = 0, max_operand: int = 50) -> list[dict[str, str]]:
    """``count`` rows ``{"prompt": "12+7=", "answer": "19"}`` (the column names TRL and bapo.train read)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randrange(max_operand), rng.randrange(max_operand)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
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

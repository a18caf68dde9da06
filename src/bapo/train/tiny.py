"""The built-in tiny policy: a character tokenizer made with `tokenizers` and a small Llama.

One builder for the demo's warm start, the tests, the TRL example and the benches (it lives in
bapo.train so that bapo.integrations can use it without importing bapo.experiments).

Both are plain Hugging Face objects (`PreTrainedTokenizerFast`, `LlamaForCausalLM`), so once
saved with `save_pretrained` they load with `AutoTokenizer` / `AutoModelForCausalLM` and go
through exactly the code path a real model would.
Why Llama and not Qwen2: transformers 5.10 forces `Qwen2Tokenizer` onto any directory whose
config says qwen2 (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), and that class rebuilds a
byte-level tokenizer which drops our "\n" tokens; for llama it keeps the saved tokenizer.json.
"""

from __future__ import annotations

from dataclasses import dataclass

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
# Every character the task can write; anything else encodes as <unk>.
ALPHABET = "0123456789+-=:,>\nanswer"


@dataclass(frozen=True)
class ModelConfig:
    """Size of the random-init Llama (defaults: ~0.4M parameters)."""

    hidden_size: int = 128
    layers: int = 2
    heads: int = 4
    intermediate_size: int = 384
    max_positions: int = 96
    seed: int = 0


def build_tokenizer():
    """Character-level `PreTrainedTokenizerFast`: "<bos>" + one token per char, left padding.

    encode("12+7=") -> [<bos>, 1, 2, +, 7, =]; decode(skip_special_tokens=True) gives the
    text back exactly (a Fuse decoder joins characters without spaces).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(ALPHABET))
    vocab = {token: token_id for token_id, token in enumerate([PAD, BOS, EOS, UNK] + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char, \n too
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK, padding_side="left"
    )


def build_model(cfg: ModelConfig, tokenizer):
    """Random-init `LlamaForCausalLM` sized by `cfg`, token ids taken from `tokenizer`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_tiny_model(save_dir, cfg: ModelConfig = ModelConfig()):
    """Build the tokenizer and a random-init model sized by `cfg`, `save_pretrained` both into
    `save_dir` (loadable by `AutoModelForCausalLM` / `AutoTokenizer`); returns the path."""
    from pathlib import Path

    save_dir = Path(save_dir)
    tokenizer = build_tokenizer()
    build_model(cfg, tokenizer).save_pretrained(str(save_dir))
    tokenizer.save_pretrained(str(save_dir))
    return save_dir

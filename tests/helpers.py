"""Helpers for the trainer tests (plain functions, imported explicitly; fixtures stay in conftest.py):
a tiny random Qwen2 with a char-level tokenizer saved through the real save_pretrained path, a small
arithmetic task with a dense test reward, a fast config builder, and the TRL tests' CPU GRPOConfig fields."""

from __future__ import annotations

import random

CHARS = list("0123456789+=-*abcdefghijklmnopqrstuvwxyz ,.?!:\n")


def build_tiny_model(path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # Byte-level symbols (" " -> "Ġ", "\n" -> "Ċ"): AutoTokenizer in transformers 5 loads any
    # tokenizer saved next to a qwen2 config as Qwen2Tokenizer, which pre-tokenizes byte-level;
    # with plain " " / "\n" entries spaces and newlines would silently vanish.
    byte_symbol = bytes_to_unicode()
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for c in CHARS:
        vocab[byte_symbol[ord(c)]] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), pre_tokenizers.Split("", "isolated")]
    )
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def arithmetic_examples(n: int = 40, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(20), rng.randrange(20)
        out.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return out


def digit_share(response: str, example: dict) -> float:
    """A dense test reward (a random model rarely answers right): share of digits, quantised."""
    return round(sum(c.isdigit() for c in response) / max(len(response), 1), 1)


def make_config(tiny_model: str, run_dir, **sections):
    """A fast config for the tiny model; `sections` are dotted overrides, e.g. {"loss.method": "bapo"}."""
    from bapo.train import config_from_dict

    base = {
        "model": {"path": tiny_model, "device": "cpu"},
        "rollout": {"prompts_per_batch": 4, "group_size": 4, "max_new_tokens": 8, "temperature": 1.0},
        "optim": {"lr": 1e-3, "micro_batch_size": 16},
        "run": {
            "output_dir": str(run_dir),
            "rollout_steps": 3,
            "checkpoint_every": 0,
            "progress": False,
            "tensorboard": "off",
        },
    }
    return config_from_dict(base, [f"{k}={v}" for k, v in sections.items()])


def cpu_grpo_args(output_dir, **fields) -> dict:
    """The GRPOConfig / BAPOGRPOConfig fields of a quiet, seeded CPU run (no saving, no reporting,
    no KL, T=1, a learning rate a random-init tiny model moves at), with `fields` on top: what the
    TRL tests share (examples/trl/bapo_grpo.py spells its fields out for the reader); a caller names
    its batch shape in `fields`."""
    return {
        "output_dir": str(output_dir),
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "save_strategy": "no",
        "beta": 0.0,
        "temperature": 1.0,
        "learning_rate": 3e-3,
        "logging_steps": 1,
        "seed": 0,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        **fields,
    }


def json_from_module(module: str, *args: str, **env: str):
    """Run `python -m module args` from the repository root in a fresh process (one vLLM engine
    per process) with `env` added, assert it exits 0, and return the JSON of its last stdout line."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def batch_log_probs(trainer, batch):
    """[N, R] log-probs of `batch`'s response tokens under the trainer's current weights (no grad)."""
    import torch

    from bapo.train.logprobs import token_log_probs

    with torch.no_grad():
        log_prob, _ = token_log_probs(
            trainer.model,
            batch.prompt_ids,
            batch.prompt_mask,
            batch.response_ids,
            batch.response_mask,
            trainer.cfg.rollout.temperature,
        )
    return log_prob

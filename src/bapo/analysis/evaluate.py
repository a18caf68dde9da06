"""Held-out evaluation: avg@k and pass@k with batched Hugging Face `generate`.

avg@k  = mean over prompts of (correct samples / k)          (expected single-sample accuracy)
pass@k = mean over prompts of [at least one of k is correct] (the unbiased estimator with n = k)
Works for any causal LM + tokenizer that `AutoModelForCausalLM` loads: the built-in tiny model
or a real one; the verifier is any `bapo.train` verifier `(response, row) -> float`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

Verifier = Callable[[str, dict], float]


def sample_responses(
    model,
    tokenizer,
    prompts: list[str],
    n: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    batch_size: int = 256,
    chat: bool = False,
    seed: int | None = 0,
    top_p: float = 1.0,
    top_k: int = 0,
    system_prompt: str | None = None,
) -> list[list[str]]:
    """n sampled responses per prompt -> [len(prompts)][n] decoded strings (specials dropped).

    The prompts are repeated n times and generated in left-padded batches of `batch_size`
    sequences; temperature 0 means greedy. `seed` reseeds torch first, so that two models are
    scored with the same random numbers (a fairer comparison; None leaves the RNG alone).
    top_p / top_k / system_prompt: as bapo.train's rollout and prompt format (`bapo eval --config`).
    """
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    from bapo.train.data import format_prompt

    prompts = [format_prompt(p, tokenizer, chat, system_prompt) for p in prompts]
    tokenizer.padding_side = "left"
    flat = [p for p in prompts for _ in range(n)]
    texts: list[str] = []
    sampling = (
        dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
        if temperature > 0
        else dict(do_sample=False)
    )
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(flat), batch_size):
            batch = tokenizer(
                flat[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=not chat
            ).to(model.device)
            out = model.generate(
                **batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling
            )
            new_tokens = out[:, batch["input_ids"].shape[1] :]
            texts += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    model.train(was_training)
    return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(
    model,
    tokenizer,
    rows: list[dict],
    verifier: Verifier,
    k: int = 8,
    max_new_tokens: int = 48,
    temperature: float = 1.0,
    batch_size: int = 256,
    chat: bool = False,
    seed: int | None = 0,
    top_p: float = 1.0,
    top_k: int = 0,
    system_prompt: str | None = None,
) -> dict[str, float]:
    """Score k samples per row of `rows` ({"prompt", "answer", ...}) with `verifier`.

    Returns {"avg@{k}", "pass@{k}", "response_length/mean" (characters),
    "response_length/mean_tokens" (tokens of the decoded responses), "n" (rows)}.
    """
    samples = sample_responses(
        model,
        tokenizer,
        [r["prompt"] for r in rows],
        k,
        max_new_tokens,
        temperature,
        batch_size,
        chat,
        seed,
        top_p,
        top_k,
        system_prompt,
    )
    return score_samples(samples, rows, verifier, k, tokenizer)


def score_samples(
    samples: list[list[str]], rows: list[dict], verifier: Verifier, k: int, tokenizer
) -> dict[str, float]:
    """Score k decoded samples per row (samples [len(rows)][k]) with `verifier`: the keys of
    `evaluate`. Shared by `evaluate` (HF generate) and any other sampler (bapo study scores
    with the run's own rollout engine, Trainer.sample_texts)."""
    correct = [sum(verifier(s, r) > 0.5 for s in group) for group, r in zip(samples, rows)]
    lengths = [len(s) for group in samples for s in group]
    return {
        f"avg@{k}": sum(correct) / (k * len(rows)),
        f"pass@{k}": sum(pass_at_k(k, c, k) for c in correct) / len(rows),
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/mean_tokens": sum(
            map(len, tokenizer([s for g in samples for s in g], add_special_tokens=False)["input_ids"])
        )
        / len(lengths),
        "n": float(len(rows)),
    }

"""Ancestral sampling for the rollout: a lean loop over the model's own forward with its KV cache,
and Hugging Face `generate` as the fallback.

The lean loop draws from exactly the distribution `generate(do_sample=True)` draws from: the same
forward calls (prefill over the left-padded context, then one token per step on a `DynamicCache`,
positions from the attention mask as `generate` derives them), HF's own temperature / top-k /
top-p warpers in `generate`'s order, one `torch.multinomial` per step over every row. With the same
torch seed it returns the same tokens (tests/train/test_sampling.py). What it leaves out is
`generate`'s per-step machinery (config merging, stopping-criteria lists, cache/mask preparation
for every model family), which dominates the time of small models.

It also returns each sampled token's log-prob under logits / T (no top-k/top-p renormalisation:
the behaviour log-prob the loss needs), read from the same logits it sampled from.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

SamplerName = Literal["auto", "lean", "hf"]
_LEAN_FORWARD_ARGS = {"input_ids", "attention_mask", "position_ids", "past_key_values", "use_cache", "logits_to_keep"}


@dataclass(frozen=True)
class SamplingParams:
    """What to draw: temperature > 0, top_k (0 = off), top_p in (0, 1] (1 = off)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass
class Sampled:
    """One generation pass over n rows of width W context.

    tokens:   [n, m] long, m <= max_new_tokens new tokens per row (pad after a row finished)
    log_prob: [n, m] float32 log-softmax(logits / T) of each sampled token, or None (hf sampler)
    """

    tokens: Tensor
    log_prob: Tensor | None


def lean_supported(model) -> bool:
    """Whether the lean loop can drive `model`: a decoder-only HF model whose forward takes a
    `DynamicCache`, positions, a 2-D mask and `logits_to_keep` (Llama, Qwen2, Mistral, GPT-NeoX...)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    supports_cache = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports_cache is None or not supports_cache():
        return False
    try:
        forward_args = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return False
    return forward_args >= _LEAN_FORWARD_ARGS


def resolve_sampler(name: SamplerName, model) -> Literal["lean", "hf"]:
    """auto -> lean when `lean_supported(model)`, else hf; lean on an unsupported model is an error."""
    if name == "hf":
        return "hf"
    supported = lean_supported(model)
    if name == "lean" and not supported:
        raise ValueError(
            f"rollout.sampler=lean: {type(model).__name__} is not a decoder-only model whose forward "
            "takes past_key_values/position_ids/logits_to_keep; use rollout.sampler=auto or hf"
        )
    return "lean" if supported else "hf"


def _warpers(params: SamplingParams):
    """HF's own logits warpers, in the order and under the conditions `generate` builds them."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList()
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    return warpers


@torch.inference_mode()  # cheaper than no_grad per op; outputs are cloned out of inference mode
def lean_sample(
    model,
    context_ids: Tensor,
    context_mask: Tensor,
    max_new_tokens: int,
    params: SamplingParams,
    eos_ids: list[int],
    pad_id: int,
    row_budget: Tensor | None = None,
    stop: Callable[[Tensor, None], Tensor] | None = None,
) -> Sampled:
    """Sample up to `max_new_tokens` tokens after left-padded `context_ids` [n, W] (mask [n, W] bool).

    A row finishes at an EOS id, when `stop(sequences [n, W+t], None) -> [n] bool` says so (HF's
    StopStringCriteria), or after `row_budget[i]` tokens; finished rows get `pad_id`. The loop ends
    when every row has finished. Tensors come back on the CPU.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    n = context_ids.shape[0]
    input_ids = context_ids.to(device)
    attention = context_mask.to(device).long()
    # generate()'s positions: cumsum of the mask, 0 on left padding, +1 per new token
    position_ids = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 0)
    eos = torch.tensor(sorted(set(eos_ids)), device=device)
    budget = (torch.full((n,), max_new_tokens) if row_budget is None else row_budget).to(device)
    warpers = _warpers(params)
    cache = DynamicCache(config=model.config)
    unfinished = torch.ones(n, dtype=torch.bool, device=device)
    rows = torch.arange(n, device=device)  # the rows the model still runs on (finished ones are dropped)
    logits = torch.zeros((n, model.config.vocab_size), dtype=torch.float32, device=device)
    sequences = input_ids
    tokens, log_probs = [], []
    step_ids, step_positions = input_ids, position_ids
    for step in range(max_new_tokens):
        out = model(
            input_ids=step_ids,
            attention_mask=attention,
            position_ids=step_positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = out.past_key_values
        # Every row keeps a row of logits (finished ones: stale values, their draw is discarded) so
        # that multinomial consumes the generator exactly as generate() does for the full batch.
        logits[rows] = out.logits[:, -1, :].to(dtype=torch.float32)
        next_tokens = torch.multinomial(torch.softmax(warpers(sequences, logits.clone()), dim=-1), 1).squeeze(1)
        next_tokens = torch.where(unfinished, next_tokens, pad_id)
        scaled = logits / params.temperature  # the behaviour log-prob: logits / T, as token_log_probs reads it
        log_probs.append(scaled.gather(-1, next_tokens[:, None]).squeeze(1) - torch.logsumexp(scaled, -1))
        tokens.append(next_tokens)
        sequences = torch.cat([sequences, next_tokens[:, None]], dim=1)
        ended = torch.isin(next_tokens, eos) | (step + 1 >= budget)
        if stop is not None:
            ended |= stop(sequences, None).to(device)
        unfinished &= ~ended
        if not bool(unfinished.any()):
            break
        attention = torch.cat([attention, attention.new_ones((len(rows), 1))], dim=1)
        step_positions = step_positions[:, -1:] + 1
        still = unfinished[rows]
        if not bool(still.all()):  # drop finished rows from the cache and the batch
            keep = still.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, attention, step_positions = rows[keep], attention[keep], step_positions[keep]
        step_ids = next_tokens[rows, None]
    if not tokens:
        empty = torch.zeros((n, 0))
        return Sampled(empty.long(), empty)
    # clone: inference tensors could not take part in a later autograd graph (e.g. as old log-probs)
    return Sampled(torch.stack(tokens, 1).cpu().clone(), torch.stack(log_probs, 1).cpu().clone())


@torch.no_grad()
def hf_sample(
    model,
    context_ids: Tensor,
    context_mask: Tensor,
    max_new_tokens: int,
    params: SamplingParams,
    eos_ids: list[int],
    pad_id: int,
    tokenizer=None,
    stop_strings: list[str] | None = None,
) -> Sampled:
    """The same draw through `model.generate` (any model HF can generate with); no log-probs."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    # Neutral values set explicitly: generate() fills unset fields from the model's own
    # generation_config (a repetition penalty, min_p, ...), which would sample from another
    # distribution than the one the behaviour log-probs describe.
    generation_config = GenerationConfig(
        do_sample=True,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        pad_token_id=pad_id,
        eos_token_id=list(eos_ids),
        stop_strings=stop_strings or None,
        use_cache=True,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_p=0.0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
    )
    sequences = model.generate(
        input_ids=context_ids.to(device),
        attention_mask=context_mask.to(device).long(),
        generation_config=generation_config,
        tokenizer=tokenizer if stop_strings else None,
    )
    return Sampled(sequences[:, context_ids.shape[1] :].cpu(), None)

"""The log-prob forward: log pi(y_t | prefix) of every response token under logits / T, the way the
trainer reads it for the behaviour recompute (rollout), the reference model and every update's
micro-batches. One padded forward (`padded_log_probs`), or the shared-prompt forward
(bapo.train.prefix) with the rows in buckets of similar response length (`token_log_probs`), under
the trainer's precision context (`forward_autocast`, model.autocast)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from bapo.train.logits import chosen_log_probs
from bapo.train.precision import forward_autocast
from bapo.train.prefix import (
    bucketed,
    call_cost,
    fall_back,
    prompt_groups,
    shared_prompt_log_probs,
    shared_prompt_reason,
)


def token_log_probs(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    autocast: str = "none",
    shared_prompt: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """log pi(y_t | prefix) of every response token under logits / T: [N, R] float32, and the
    per-token entropy [N, R] when asked (differentiable only with entropy_grad), under `autocast`
    (model.autocast). With `shared_prompt` (model.shared_prompt_forward) each distinct prompt runs
    once and its KV cache serves all its rows (bapo.train.prefix), where the model allows it; else
    `padded_log_probs`. Either way the rows go in buckets of similar response length, so short
    replies do not pay for the longest one. Equal to one `padded_log_probs` up to float rounding."""
    keep_r = response_mask.any(0).nonzero()
    width_r = int(keep_r[-1]) + 1 if len(keep_r) else 0
    r_full = response_ids.shape[1]
    options = (temperature, with_entropy, entropy_grad, autocast)
    if width_r == 0 or len(response_ids) == 0:
        return padded_log_probs(model, (prompt_ids, prompt_mask, response_ids, response_mask), *options)
    rows = (prompt_ids, prompt_mask, response_ids[:, :width_r], response_mask[:, :width_r])
    found = None
    if shared_prompt:
        first_rows, group = prompt_groups(prompt_ids, prompt_mask)
        reason = shared_prompt_reason(model, len(first_rows), len(prompt_ids), prompt_mask)
        if reason is None:
            context = functools.partial(forward_autocast, model, autocast)
            found = shared_prompt_log_probs(model, rows, first_rows, group, *options[:3], context)
        else:
            fall_back(reason)
    if found is None:
        found = bucketed(
            lambda bucket: padded_log_probs(model, tuple(part[bucket] for part in rows), *options),
            rows[3].sum(1),
            width_r,
            call_cost(model),
            with_entropy,
        )
    log_prob, entropy = found
    if width_r < r_full:  # back to the full response width so callers can keep their own masks
        log_prob = torch.nn.functional.pad(log_prob, (0, r_full - width_r))
        entropy = None if entropy is None else torch.nn.functional.pad(entropy, (0, r_full - width_r))
    return log_prob, entropy


def padded_log_probs(
    model,
    rows: tuple,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    autocast: str = "none",
) -> tuple[Tensor, Tensor | None]:
    """`token_log_probs` in one forward over prompt + response, every row padded to the widest:
    rows = (prompt_ids, prompt_mask, response_ids, response_mask) as token_log_probs takes them
    -> [N, R] float32 log-probs (and entropy). Only the last R+1 positions are projected to the
    vocabulary, and the log-probs are taken from those logits in float32 chunks
    (bapo.train.logits). Columns that are padding in every row are trimmed first (speed), which
    does not change any value."""
    prompt_ids, prompt_mask, response_ids, response_mask = rows
    keep_p = prompt_mask.any(0).nonzero()
    start = int(keep_p[0]) if len(keep_p) else prompt_ids.shape[1]
    keep_r = response_mask.any(0).nonzero()
    width_r = int(keep_r[-1]) + 1 if len(keep_r) else 0
    n, r_full = response_ids.shape
    prompt_ids, prompt_mask = prompt_ids[:, start:], prompt_mask[:, start:]
    response_ids, response_mask_t = response_ids[:, :width_r], response_mask[:, :width_r]

    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention = torch.cat([prompt_mask, response_mask_t], dim=1).long()
    # positions from the mask, as generate() computes them for left-padded prompts
    position_ids = (attention.cumsum(1) - 1).clamp_min(0)
    with forward_autocast(model, autocast):
        logits = model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=position_ids,
            logits_to_keep=width_r + 1,
            use_cache=False,
        ).logits[:, :-1]  # [N, R', V] in the forward's dtype
    log_prob, entropy = chosen_log_probs(logits, response_ids, temperature, with_entropy, entropy_grad)
    # back to the full response width so callers can keep their own masks
    if width_r < r_full:
        log_prob = torch.nn.functional.pad(log_prob, (0, r_full - width_r))
        entropy = None if entropy is None else torch.nn.functional.pad(entropy, (0, r_full - width_r))
    return log_prob, entropy


@torch.no_grad()
def batched_log_probs(
    model,
    prompt_ids,
    prompt_mask,
    response_ids,
    response_mask,
    temperature,
    chunk: int,
    autocast: str = "none",
    shared_prompt: bool = True,
) -> Tensor:
    """token_log_probs without grad, `chunk` rows at a time, on the model's device -> [N, R] CPU."""
    device = next(model.parameters()).device
    parts = []
    for first in range(0, len(response_ids), chunk):
        rows = slice(first, first + chunk)
        log_prob, _ = token_log_probs(
            model,
            prompt_ids[rows].to(device),
            prompt_mask[rows].to(device),
            response_ids[rows].to(device),
            response_mask[rows].to(device),
            temperature,
            autocast=autocast,
            shared_prompt=shared_prompt,
        )
        parts.append(log_prob.cpu())
    return torch.cat(parts) if parts else torch.zeros(response_ids.shape)

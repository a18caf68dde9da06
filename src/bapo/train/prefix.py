"""The trainer's log-prob forwards without repeated prompts or padding waste.

Shared-prompt forward (Prefix Grouper, arXiv 2506.05433): the G responses of a group share one
prompt, so the prompt runs once (a batch of the K distinct prompts, `use_cache=True`) and its keys
and values serve every response of it: the cache is gathered along the batch to the response rows
(`index_select`, whose backward adds each row's gradient back into its prompt's computation), and
the responses run on top of it. Every attention score, position and mask is the one of the padded
forward over prompt + response, so log-probs and gradients are the same up to float rounding
(tests/train/test_prefix.py). The first response token's log-prob comes from the prompt's last logit.

Length buckets: the rows of one forward are sorted by response length and split into a few
buckets (`length_buckets`), each a forward of its own width, so a 15-token reply does not pay for
the 64 positions of the longest one. Buckets live inside one micro-batch's forward: the micro-batches
(and so every loss that looks at a micro-batch as a whole, e.g. BAPO's scope=micro_batch) are unchanged.

Where the shared forward does not apply (gradient checkpointing in train mode turns the KV cache
off; a cache that is not a plain full-attention DynamicCache: sliding windows, static or linear-
attention caches; no two rows with the same prompt; an empty prompt) the padded forward runs,
with the reason logged once.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from bapo.train.logits import chosen_log_probs

log = logging.getLogger(__name__)

#: What one extra forward call costs, in parameter x positions per layer (CPU: ~0.3 ms of kernel
#: launches per layer vs ~6 FLOP per parameter per position): a model of P parameters and L layers
#: splits a bucket when that saves more than CALL_COST * L / P padded positions. SmolLM2-135M: ~4
#: positions; the 0.4M-parameter tiny Llama: ~100 (tiny models are launch-bound).
CALL_COST = 2e7

_logged: set[str] = set()
# models whose cache turned out unusable for the shared forward -> the reason (checked once per model)
_no_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fall_back(reason: str) -> None:
    """Log once per distinct reason that the padded forward runs instead of the shared one."""
    if reason not in _logged:
        _logged.add(reason)
        log.warning("shared-prompt forward off, padded forward instead: %s", reason)


def prompt_groups(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Rows with the same prompt (same tokens under the same left-padding mask): (the first row of
    each of the K distinct prompts [K], the prompt index of every row [N] in 0..K-1)."""
    key = torch.where(prompt_mask, prompt_ids, -1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    k = int(inverse.max()) + 1 if len(inverse) else 0
    rows = torch.arange(len(inverse), device=inverse.device)
    first = torch.full((k,), len(inverse), dtype=torch.long, device=inverse.device).scatter_reduce(
        0, inverse, rows, reduce="amin"
    )
    # number the prompts in order of first appearance (unique's sort order is arbitrary for us)
    order = first.argsort()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(k, device=order.device)
    return first[order], rank[inverse]


def length_buckets(lengths: Tensor, call_cost: float) -> list[Tensor]:
    """Rows [N] split into buckets of similar length (ascending), each bucket's row indices:
    minimises sum over buckets of (rows x longest length + call_cost) by dynamic programming over
    the sorted lengths (N is a micro-batch, so O(N^2) is nothing)."""
    order = lengths.argsort(stable=True)
    sorted_len = lengths[order].tolist()
    n = len(sorted_len)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # bucket (i, j]: its longest row is the j-th
            cost = best[i] + (j - i) * sorted_len[j - 1] + call_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bounds, j = [], n
    while j > 0:
        bounds.append((cut[j], j))
        j = cut[j]
    return [order[i:j] for i, j in reversed(bounds)]


def call_cost(model) -> float:
    """`length_buckets`' call_cost for `model`, in padded positions (CALL_COST)."""
    params = sum(p.numel() for p in model.parameters())
    layers = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", 1)
    return CALL_COST * layers / max(params, 1)


def shared_prompt_reason(model, n_groups: int, n_rows: int, prompt_mask: Tensor) -> str | None:
    """Why the shared-prompt forward cannot run here (None: it can)."""
    if getattr(model, "is_gradient_checkpointing", False) and model.training:
        return "gradient checkpointing in train mode turns the KV cache off"
    if getattr(model.config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if model in _no_cache:
        return _no_cache[model]
    if n_groups == n_rows:
        return "no two rows share a prompt"
    if not bool(prompt_mask.any(1).all()):
        return "a row with an empty prompt (no logit to score its first token)"
    return None


def _cache_reason(cache) -> str | None:
    """None when `cache` (a prompt forward's past_key_values) is a plain full-attention DynamicCache."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if not isinstance(cache, DynamicCache):
        return f"the model's cache is {type(cache).__name__}, not a DynamicCache"
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if kinds:
        return f"the model's cache has {', '.join(sorted(kinds))} layers (sliding window / linear attention)"
    return None


def bucketed(
    forward: Callable[[Tensor], tuple[Tensor, Tensor | None]],
    lengths: Tensor,
    width: int,
    cost: float,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """Run `forward(rows) -> (log_prob [n, w], entropy [n, w] or None)` over `length_buckets` of the
    rows and put the results back in row order at width `width` ([N, width] each, 0 beyond a row's
    bucket width)."""
    parts = [(rows, *forward(rows)) for rows in length_buckets(lengths, cost)]
    if len(parts) == 1 and parts[0][1].shape[1] == width:
        rows, log_prob, entropy = parts[0]
        if bool((rows == torch.arange(len(rows), device=rows.device)).all()):
            return log_prob, entropy
    first = parts[0][1]
    log_prob = first.new_zeros((len(lengths), width))
    entropy = first.new_zeros((len(lengths), width)) if with_entropy else None
    for rows, part, part_entropy in parts:
        # index_put (not in place on a leaf): the gradient of each row goes back to its bucket
        log_prob = log_prob.index_put((rows,), torch.nn.functional.pad(part, (0, width - part.shape[1])))
        if entropy is not None and part_entropy is not None:
            entropy = entropy.index_put((rows,), torch.nn.functional.pad(part_entropy, (0, width - part.shape[1])))
    return log_prob, entropy


def shared_prompt_log_probs(
    model,
    rows: tuple[Tensor, Tensor, Tensor, Tensor],
    first_rows: Tensor,
    group: Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    context: Callable[[], contextlib.AbstractContextManager],
) -> tuple[Tensor, Tensor | None] | None:
    """log pi(y_t | prefix) [N, R] float32 (and the entropy [N, R] when asked) with each of the K
    distinct prompts encoded once: rows = (prompt_ids / prompt_mask [N, P] left-padded, response_ids /
    response_mask [N, R] right-padded, columns all-padding already trimmed), first_rows [K] and
    group [N] from `prompt_groups`. Returns None when the model's cache cannot serve (the reason is
    logged once and remembered for the model). `context()`: the forwards' precision context."""
    prompt_ids, prompt_mask, response_ids, response_mask = rows
    prompts, prompt_attention = prompt_ids[first_rows], prompt_mask[first_rows].long()
    start = int(prompt_attention.any(0).nonzero()[0])  # the K prompts may need fewer columns than N rows
    prompts, prompt_attention = prompts[:, start:], prompt_attention[:, start:]
    prompt_len = prompt_attention.sum(1)  # [K]
    with context():
        out = model(
            input_ids=prompts,
            attention_mask=prompt_attention,
            position_ids=(prompt_attention.cumsum(1) - 1).clamp_min(0),
            logits_to_keep=1,
            use_cache=True,
        )
    reason = _cache_reason(out.past_key_values)
    if reason is not None:
        _no_cache[model] = reason
        fall_back(reason)
        return None
    from transformers.cache_utils import DynamicCache

    last_logit = out.logits[:, -1]  # [K, V]: scores each response's first token
    layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]  # [K, H, P', D] each
    lengths = response_mask.sum(1)

    def forward(rows: Tensor) -> tuple[Tensor, Tensor | None]:
        width = max(int(lengths[rows].max()), 1)
        ids = response_ids[rows, :width]
        owner = group[rows]
        logits = last_logit[owner].unsqueeze(1)  # [n, 1, V]
        if width > 1:
            # the last response token is only an input for what follows it: not fed
            mask = response_mask[rows, : width - 1].long()
            cache = DynamicCache(
                ddp_cache_data=[(k.index_select(0, owner), v.index_select(0, owner)) for k, v in layers]
            )
            with context():
                body = model(
                    input_ids=ids[:, :-1],
                    attention_mask=torch.cat([prompt_attention[owner], mask], dim=1),
                    # the padded forward's positions: prompt length + index (a fully padded row: clamped)
                    position_ids=(prompt_len[owner, None] + mask.cumsum(1) - 1).clamp_min(0),
                    past_key_values=cache,
                    use_cache=True,
                ).logits  # [n, width - 1, V]
            logits = torch.cat([logits, body.to(logits.dtype)], dim=1)
        return chosen_log_probs(logits, ids, temperature, with_entropy, entropy_grad)

    return bucketed(forward, lengths, response_ids.shape[1], call_cost(model), with_entropy)

"""Log-prob of the chosen token (and the entropy) from a model's logits, without materialising the
[N, R, V] float32 intermediates (upcast logits, log-softmax, softmax) that a plain
`log_softmax(logits.float()).gather(...)` keeps for backward: a vocabulary of 49152 (SmolLM2) makes
each of them 200 kB per token.

`chosen_log_probs` goes over the rows a few at a time: each chunk is upcast to float32, its
log-normaliser (logsumexp) and chosen logit are taken, and only the logits (in their own dtype,
bf16 under autocast) and the [N, R] log-normaliser are saved; backward recomputes the chunk's
softmax, so d log p(y) / d z = (onehot(y) - softmax(z / T)) / T is formed one chunk at a time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

#: Elements of one float32 chunk of logits (32 MB): rows per chunk = this // (R * V), at least 1.
CHUNK_ELEMENTS = 1 << 23


def _rows_per_chunk(logits: Tensor) -> int:
    per_row = max(logits.shape[1] * logits.shape[2], 1)
    return max(1, CHUNK_ELEMENTS // per_row)


def _upcast(chunk: Tensor, temperature: float) -> Tensor:
    """float32 (float64 stays float64, for gradcheck) logits / T of one chunk [n, R, V]."""
    return chunk.to(torch.promote_types(chunk.dtype, torch.float32)) / temperature


class _ChosenLogProb(torch.autograd.Function):
    """(log_prob [N, R], entropy [N, R] or empty) from logits [N, R, V] and ids [N, R]; entropy
    carries no gradient (a diagnostic here; the differentiable path is `plain_log_probs`)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, ids: Tensor, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor]:
        out_dtype = torch.promote_types(logits.dtype, torch.float32)
        n = logits.shape[0]
        log_norm = torch.empty(logits.shape[:2], dtype=out_dtype, device=logits.device)
        log_prob = torch.empty_like(log_norm)
        entropy = torch.empty_like(log_norm) if with_entropy else log_norm.new_empty(0)
        step = _rows_per_chunk(logits)
        for first in range(0, n, step):
            rows = slice(first, first + step)
            scaled = _upcast(logits[rows], temperature)  # [n', R, V]
            log_norm[rows] = torch.logsumexp(scaled, dim=-1)
            log_prob[rows] = scaled.gather(-1, ids[rows].unsqueeze(-1)).squeeze(-1) - log_norm[rows]
            if with_entropy:  # H = log Z - sum p z
                probs = torch.exp(scaled - log_norm[rows].unsqueeze(-1))
                entropy[rows] = log_norm[rows] - (probs * scaled).sum(-1)
        ctx.save_for_backward(logits, ids, log_norm)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return log_prob, entropy

    @staticmethod
    def backward(ctx: Any, grad_log_prob: Tensor, _grad_entropy: Tensor) -> tuple[Tensor, None, None, None]:
        logits, ids, log_norm = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
        step = _rows_per_chunk(logits)
        for first in range(0, logits.shape[0], step):
            rows = slice(first, first + step)
            grad = grad_log_prob[rows].to(log_norm.dtype)  # [n', R]
            scaled = _upcast(logits[rows], temperature)
            chunk = torch.exp(scaled - log_norm[rows].unsqueeze(-1)).mul_(-grad.unsqueeze(-1))  # -g p
            chunk.scatter_add_(-1, ids[rows].unsqueeze(-1), grad.unsqueeze(-1))  # + g onehot(y)
            grad_logits[rows] = chunk.div_(temperature)
        return grad_logits, None, None, None


def plain_log_probs(
    logits: Tensor, ids: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """The unchunked reference: float32 logits / T -> (log p(ids) [N, R], entropy [N, R] or None),
    both differentiable (the path of an entropy loss term)."""
    scaled = _upcast(logits, temperature)
    log_norm = torch.logsumexp(scaled, dim=-1)
    log_prob = scaled.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - log_norm
    entropy = log_norm - (torch.softmax(scaled, -1) * scaled).sum(-1) if with_entropy else None
    return log_prob, entropy


def chosen_log_probs(
    logits: Tensor, ids: Tensor, temperature: float, with_entropy: bool = False, entropy_grad: bool = False
) -> tuple[Tensor, Tensor | None]:
    """log pi(ids) under logits / T ([N, R] float32, differentiable) and, when asked, the entropy
    [N, R] float32 (differentiable only with entropy_grad), from logits [N, R, V] of any float dtype
    and ids [N, R] long. Chunked (module docstring) unless the entropy needs a gradient."""
    if with_entropy and entropy_grad and torch.is_grad_enabled():
        return plain_log_probs(logits, ids, temperature, with_entropy=True)
    log_prob, entropy = _ChosenLogProb.apply(logits, ids, temperature, with_entropy)
    return log_prob, entropy if with_entropy else None

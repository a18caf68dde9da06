"""`TokenBatch`: the per-token tensors of one (micro-)batch, as the losses and BAPO's bound search
read them, and `token_ratio`, the ratio it carries.

A leaf module (torch only), so that bapo.core.losses, bapo.core.search and bapo.core.diagnostics
all import it without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# log(ratio) is clamped before exp so that a log-prob gap of 1e4 gives a huge but finite ratio
# (the same clamp verl applies); the gradient is zero beyond it.
LOG_RATIO_CLAMP = 20.0


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float32, or float64 when an input is float64: ratios and losses never run in fp16/bf16
    (exp(11.1) already overflows float16)."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def token_ratio(log_prob: Tensor, old_log_prob: Tensor) -> Tensor:
    """r_t = pi_theta / pi_behaviour, [B, T], from clamped log-probs, in float32 (float64 if given)."""
    dtype = compute_dtype(log_prob, old_log_prob)
    return torch.exp((log_prob.to(dtype) - old_log_prob.to(dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


@dataclass(frozen=True, kw_only=True)
class TokenBatch:
    """Per-token tensors of one (micro-)batch, [B, T] each (advantages: [B, T], or [B] where the
    search reads them: one per response); fields by keyword.

    ratio: pi / pi_behaviour of each token as the bounds compare it (policy_loss: exp(clamped
      log_prob - old_log_prob) in float32, float64 when given, from log-probs it sets to 0 outside
      the mask, so padding holding -inf never reaches the arithmetic).
    mask: 0/1 or bool, the tokens that count (positions outside it are never read).
    old_log_prob: the behaviour policy's log-probs log pi_behaviour(y_t) (detached), which
      BAPO's weighting="behaviour_prob" (paper Eq. 8) weighs each token by.
    log_prob: the current policy's log-probs (carries grad in policy_loss).
    Every loss reads log_prob and old_log_prob (policy_loss always sets them: `log_probs()`);
    the search reads only ratio, advantages, mask, importance_weights and, for
    weighting="behaviour_prob", old_log_prob, so a batch for the search alone may leave the
    log-probs None (e.g. a ratio without the log-probs behind it) rather than hold made-up ones.
    importance_weights: per-token multipliers >= 0 policy_loss applies to the token loss; a
      loss reads them only to weigh tokens (the search counts a token with w*|A|).
    proximal_log_prob: log-probs of the proximal policy (decoupled PPO), detached; None unless
      the caller has them.
    """

    ratio: Tensor
    advantages: Tensor
    mask: Tensor
    log_prob: Tensor | None = None
    old_log_prob: Tensor | None = None
    importance_weights: Tensor | None = None
    proximal_log_prob: Tensor | None = None

    @classmethod
    def from_log_probs(
        cls,
        log_prob: Tensor,
        old_log_prob: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        importance_weights: Tensor | None = None,
        proximal_log_prob: Tensor | None = None,
    ) -> TokenBatch:
        """The batch of these log-probs, ratio = token_ratio(log_prob, old_log_prob) (it carries
        log_prob's grad: pass log_prob detached for the search alone)."""
        return cls(
            ratio=token_ratio(log_prob, old_log_prob),
            advantages=advantages,
            mask=mask,
            log_prob=log_prob,
            old_log_prob=old_log_prob,
            importance_weights=importance_weights,
            proximal_log_prob=proximal_log_prob,
        )

    @classmethod
    def fresh(
        cls,
        advantages: Tensor,
        mask: Tensor,
        *,
        old_log_prob: Tensor | None = None,
        importance_weights: Tensor | None = None,
    ) -> TokenBatch:
        """A batch the current weights have just generated and scored (old_log_prob): the current
        policy is the behaviour one, so every ratio is exactly 1 (float32, float64 for float64
        old_log_prob) and log_prob is old_log_prob; no forward needed."""
        dtype = torch.float64 if old_log_prob is not None and old_log_prob.dtype == torch.float64 else torch.float32
        return cls(
            ratio=torch.ones(mask.shape, dtype=dtype, device=mask.device),
            advantages=advantages,
            mask=mask,
            log_prob=old_log_prob,
            old_log_prob=old_log_prob,
            importance_weights=importance_weights,
        )

    def log_probs(self) -> tuple[Tensor, Tensor]:
        """(log_prob, old_log_prob), which every loss reads; ValueError naming the one missing
        (a batch built for the search alone)."""
        if self.log_prob is None or self.old_log_prob is None:
            missing = "log_prob" if self.log_prob is None else "old_log_prob"
            raise ValueError(f"{missing}: this batch has none, and the loss reads it; build it with policy_loss")
        return self.log_prob, self.old_log_prob

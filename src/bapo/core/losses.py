"""Clipped policy losses with explicit ratio bounds, registered by name with one signature.

Every registered loss maps a `TokenBatch` to a per-token loss [B, T] plus the bounds it used
(floats or per-token tensors, for the diagnostics). `policy_loss` validates the inputs, runs the
chosen loss, applies optional importance weights, aggregates, and returns the diagnostics.
"""

from __future__ import annotations

import difflib
import inspect
import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch import Tensor

from bapo.core.diagnostics import clip_diagnostics, token_ratio
from bapo.core.search import BAPOConfig, BoundStats
from bapo.core.validation import check_ratio_bounds, check_token_inputs, per_token

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class TokenBatch:
    """Per-token tensors of one (micro-)batch, all [B, T]; ratio = exp(clamped log_prob - old_log_prob).
    importance_weights are applied by policy_loss; a loss reads them only to weigh tokens (BAPO's search)."""

    log_prob: Tensor
    old_log_prob: Tensor
    ratio: Tensor
    advantages: Tensor
    mask: Tensor
    importance_weights: Tensor | None = None  # [B, T] multipliers policy_loss applies to the token loss


@dataclass
class TokenLoss:
    """What a registered loss returns: loss [B, T] and the ratio bounds in effect."""

    loss: Tensor
    lower: float | Tensor
    upper: float | Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class PolicyLossFn(Protocol):
    def __call__(self, batch: TokenBatch, **params) -> TokenLoss: ...


POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: make a loss available to `policy_loss(method=name)` (and the integrations)."""

    def register(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = fn
        return fn

    return register


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, lower: float | Tensor, upper: float | Tensor, dual_clip: float | None = None
) -> Tensor:
    """PPO's -min(r*A, clip(r, lower, upper)*A) per token [B, T]; dual_clip caps it at -dual_clip*A for A < 0."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, lower, upper) * advantages
    loss = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    return loss


def _fixed_bounds(default_lower: float, default_upper: float, default_dual_clip: float | None = None) -> PolicyLossFn:
    """A clipped surrogate with fixed ratio bounds; the registered baselines differ only in defaults."""

    def loss(batch: TokenBatch, *, lower: float = default_lower, upper: float = default_upper,
             dual_clip: float | None = default_dual_clip) -> TokenLoss:
        check_ratio_bounds(lower, upper)
        if dual_clip is not None and not dual_clip > 1.0:
            raise ValueError(f"dual_clip: {dual_clip} must be > 1 (a cap on the ratio of negative tokens)")
        return TokenLoss(clipped_surrogate(batch.ratio, batch.advantages, lower, upper, dual_clip), lower, upper)

    return loss


register_policy_loss("grpo")(_fixed_bounds(0.8, 1.2))
register_policy_loss("clip-higher")(_fixed_bounds(0.8, 1.28))
register_policy_loss("dual-clip")(_fixed_bounds(0.8, 1.2, 3.0))


@register_policy_loss("bapo")
def bapo_loss(batch: TokenBatch, *, bapo: BAPOConfig | None = None, bounds: tuple[float, float] | None = None,
              dual_clip: float | None = None) -> TokenLoss:
    """Clipped surrogate with BAPO's adaptive bounds.

    bounds: (lower, upper) already solved over the whole update (BoundStats over all
    micro-batches and ranks); None = search on this batch alone with `bapo` (default BAPOConfig()),
    each token weighted by its importance weight as in BoundStats.add.
    """
    metrics: dict[str, float] = {}
    if bounds is None:
        # policy_loss has validated the inputs already.
        found = BoundStats(bapo or BAPOConfig()).add(batch.ratio, batch.advantages, batch.mask,
                                                     weights=batch.importance_weights, validate=False,
                                                     behaviour_log_prob=batch.old_log_prob).solve(sync=False)
        bounds = (found.lower, found.upper)
        # Missing values (no signal: NaN reached; pos/neg inf when neg == 0) are left out, not faked.
        metrics = {f"bapo/{name}": value for name, value in found.metrics().items()
                   if name in ("reached", "steps", "pos_neg", "no_signal") and math.isfinite(value)}
    lower, upper = bounds
    check_ratio_bounds(lower, upper)
    return TokenLoss(clipped_surrogate(batch.ratio, batch.advantages, lower, upper, dual_clip), lower, upper, metrics)


@register_policy_loss("topr")
def topr_loss(batch: TokenBatch, *, negative_ratio_max: float = 1.0) -> TokenLoss:
    """TOPR (tapered off-policy REINFORCE), per token: positive tokens get the plain SFT-like
    gradient -A * grad log pi (no ratio, no clip); negative tokens get it weighted by the
    truncated importance ratio sg(min(r, negative_ratio_max)).
    The value is -A * weight; exp(log pi - sg(log pi)) = 1 carries the gradient of log pi.
    """
    if not negative_ratio_max > 0.0:
        raise ValueError(f"negative_ratio_max: {negative_ratio_max} must be > 0")
    weight = torch.where(batch.advantages > 0, torch.ones_like(batch.ratio),
                         batch.ratio.detach().clamp(max=negative_ratio_max))
    score = torch.exp(batch.log_prob - batch.log_prob.detach())
    # Nothing is clipped to zero gradient: diagnostics see the widest bounds.
    return TokenLoss(-batch.advantages * weight * score, 0.0, float("inf"))


@register_policy_loss("dcpo")
def dcpo_loss(batch: TokenBatch, *, eps_low: float = 0.16, eps_high: float = 0.2, ratio_max: float = 10.0) -> TokenLoss:
    """DCPO's dynamic adaptive clipping (arXiv 2509.02333): per-token ratio bounds from the prior
    probability q = pi_behaviour(y_t), from the constraint |(r - 1) * r| * q <= eps:
        lower = 0.5 + 0.5 * sqrt(max(1 - 4 eps_low / q, 0)),  upper = 0.5 + 0.5 * sqrt(1 + 4 eps_high / q),
    upper capped at ratio_max. At q = 1 they are (0.8, 1.17); they widen as q falls.
    (DCPO's smooth advantage standardisation and OTM aggregation are not part of this loss.)
    """
    for name, value in (("eps_low", eps_low), ("eps_high", eps_high)):
        if not value > 0.0:
            raise ValueError(f"{name}: {value} must be > 0")
    if not ratio_max > 1.0:
        raise ValueError(f"ratio_max: {ratio_max} must be > 1")
    prior = batch.old_log_prob.detach().float().exp().clamp_min(1e-12)
    lower = 0.5 + 0.5 * torch.sqrt((1.0 - 4.0 * eps_low / prior).clamp_min(0.0))
    upper = (0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * eps_high / prior)).clamp(max=ratio_max)
    return TokenLoss(clipped_surrogate(batch.ratio, batch.advantages, lower, upper), lower, upper)


def aggregate_loss(token_loss: Tensor, mask: Tensor, mode: str = "token-mean", normalizer: float | None = None) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    token-mean: sum over masked tokens / normalizer (default: this batch's masked token count).
    seq-mean-token-sum: per-sequence token sums, summed / normalizer (default: B).
    seq-mean-token-mean: per-sequence token means, summed / normalizer (default: B).
    seq-mean-token-sum-norm (Dr.GRPO): sum over masked tokens / normalizer (default: B * T, a
      fixed denominator that does not depend on response lengths).
    Pass `normalizer` when this batch is one micro-batch of a larger update so that the sum of
    the micro-batch losses equals the loss of the whole update.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode: {mode!r} is not one of {LOSS_AGG_MODES}")
    weight = mask.to(token_loss.dtype)
    # where() rather than multiply: a masked position holding inf must not turn into NaN.
    masked_loss = torch.where(mask.to(torch.bool), token_loss, torch.zeros_like(token_loss))
    batch_size, length = token_loss.shape
    if mode == "token-mean":
        denominator = normalizer if normalizer is not None else weight.sum().clamp_min(1.0)
        return masked_loss.sum() / denominator
    if mode == "seq-mean-token-sum":
        return masked_loss.sum(-1).sum() / (normalizer if normalizer is not None else max(batch_size, 1))
    if mode == "seq-mean-token-mean":
        per_sequence = masked_loss.sum(-1) / weight.sum(-1).clamp_min(1.0)
        return per_sequence.sum() / (normalizer if normalizer is not None else max(batch_size, 1))
    return masked_loss.sum() / (normalizer if normalizer is not None else max(batch_size * length, 1))


def _check_params(method: str, params: dict) -> PolicyLossFn:
    if method not in POLICY_LOSSES:
        near = difflib.get_close_matches(method, POLICY_LOSSES, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"method: unknown policy loss {method!r}{hint} Registered: {sorted(POLICY_LOSSES)}")
    fn = POLICY_LOSSES[method]
    accepted = [name for name, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"{unknown[0]}: not a parameter of the {method!r} loss; it takes {accepted}")
    return fn


def policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    method: str = "grpo",
    *,
    loss_agg_mode: str = "token-mean",
    normalizer: float | None = None,
    importance_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    logits: Tensor | None = None,
    validate: bool = True,
    **params,
) -> tuple[Tensor, dict[str, float]]:
    """The policy-gradient loss of `method` and its diagnostics.

    log_prob: [B, T] current log-probs of the sampled tokens (carries grad); old_log_prob: [B, T]
    behaviour log-probs; advantages: [B, T] or [B]; mask: [B, T] 0/1; importance_weights: [B, T]
    optional detached per-token weights (rollout/training mismatch) multiplying the loss;
    entropy [B, T] / logits [B, T, V]: optional, for the entropy diagnostic. params: the method's
    own (lower=, upper=, dual_clip=, bapo=, bounds=, ...). Returns (scalar loss, metrics).
    """
    fn = _check_params(method, params)
    if validate:
        named = {"log_prob": log_prob, "old_log_prob": old_log_prob, "advantages": advantages}
        if importance_weights is not None:
            named["importance_weights"] = importance_weights
        check_token_inputs(named, mask, reference="log_prob", allow_row_vector=("advantages",))
    advantages = per_token(advantages, log_prob).to(log_prob.dtype)
    weights = None if importance_weights is None else importance_weights.detach()
    batch = TokenBatch(log_prob, old_log_prob.detach(), token_ratio(log_prob, old_log_prob.detach()),
                       advantages.detach(), mask, weights)
    result = fn(batch, **params)
    token_loss = result.loss
    if importance_weights is not None:
        token_loss = token_loss * weights.to(token_loss.dtype)
    loss = aggregate_loss(token_loss, mask, loss_agg_mode, normalizer)
    metrics = clip_diagnostics(log_prob, old_log_prob, advantages, mask, result.lower, result.upper,
                               entropy=entropy, logits=logits)
    metrics["loss"] = float(loss.detach())
    metrics.update(result.metrics)
    return loss, metrics

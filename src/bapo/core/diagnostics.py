"""The quantities the BAPO paper plots, from one batch of per-token tensors.

Clipping convention (the paper's X_t): a positive-advantage token is clipped when r > upper, a
negative-advantage one when r < lower; every other masked token carries gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bapo.core.validation import per_token

# log(ratio) is clamped before exp so that a log-prob gap of 1e4 gives a huge but finite ratio
# (the same clamp verl applies); the gradient is zero beyond it.
LOG_RATIO_CLAMP = 20.0
QUADRANTS = ("high_pos", "high_neg", "low_pos", "low_neg")


def token_ratio(log_prob: Tensor, old_log_prob: Tensor) -> Tensor:
    """r_t = pi_theta / pi_behaviour, [B, T], from clamped log-probs."""
    return torch.exp((log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def k3_kl(log_ratio: Tensor) -> Tensor:
    """Per-token k3 estimate exp(x) - x - 1 >= 0 of KL(p || q), x = log q - log p on samples of p
    ([B, T]); x is clamped like the ratio so the estimate stays finite."""
    clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return clamped.exp() - clamped - 1.0


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-token entropy [B, T] of the softmax over logits [B, T, V]."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def _masked_mean(values: Tensor, weights: Tensor) -> Tensor:
    return (values * weights).sum() / weights.sum().clamp_min(1.0)


@torch.no_grad()
def clip_diagnostics(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    lower: float | Tensor,
    upper: float | Tensor,
    *,
    entropy: Tensor | None = None,
    logits: Tensor | None = None,
) -> dict[str, float]:
    """Clip fractions per side, positive share, Entropy-Clip quadrants, entropy-change estimate.

    log_prob, old_log_prob, mask: [B, T]; advantages: [B, T] or [B]; lower/upper: floats or
    per-token [B, T] bounds; entropy: [B, T] or logits: [B, T, V] (optional).

    Keys: clip_frac/upper (share of positive tokens above upper), clip_frac/lower (share of
    negative tokens below lower), clip_frac (all masked tokens), positive_share (rho),
    quadrant/{high,low}_{pos,neg}/{count,loss_share,clip_frac} where high/low splits tokens at
    the batch mean of log pi (the split the covariance below uses), entropy_change_estimate
    (-Cov[log pi, A*X], the sign of the entropy change of one step), entropy (mean token
    entropy, when given), approx_kl (k3 estimate of KL(behaviour || current)), ratio/{mean,max,min},
    lower, upper (masked means when per-token), tokens. One host sync.
    """
    log_prob = log_prob.detach().float()
    old_log_prob = old_log_prob.detach().float()
    advantages = per_token(advantages.detach().float(), log_prob)
    counted = mask.to(torch.bool)
    weight = counted.float()
    ratio = token_ratio(log_prob, old_log_prob)

    positive = counted & (advantages > 0)
    negative = counted & (advantages < 0)
    clipped_high = positive & (ratio > upper)
    clipped_low = negative & (ratio < lower)
    carries_gradient = counted & ~clipped_high & ~clipped_low
    contribution = torch.where(carries_gradient, (ratio * advantages).abs(), torch.zeros_like(ratio))
    total_contribution = contribution.sum()

    high_prob = log_prob >= _masked_mean(log_prob, weight)
    quadrant_masks = {
        "high_pos": positive & high_prob,
        "high_neg": negative & high_prob,
        "low_pos": positive & ~high_prob,
        "low_neg": negative & ~high_prob,
    }

    # Entropy-Clip Rule: dH ~ -eta * Cov[log pi, A * X] over the batch's tokens.
    signal = advantages * carries_gradient.float()
    covariance = _masked_mean(log_prob * signal, weight) - _masked_mean(log_prob, weight) * _masked_mean(signal, weight)

    names: list[str] = []
    values: list[Tensor] = []

    def put(name: str, value: Tensor) -> None:
        names.append(name)
        values.append(value.float().reshape(()))

    put("clip_frac/upper", clipped_high.sum() / positive.sum().clamp_min(1))
    put("clip_frac/lower", clipped_low.sum() / negative.sum().clamp_min(1))
    put("clip_frac", (clipped_high | clipped_low).sum() / counted.sum().clamp_min(1))
    positive_contribution = torch.where(positive, contribution, torch.zeros_like(contribution)).sum()
    put("positive_share", torch.where(total_contribution > 0, positive_contribution / total_contribution.clamp_min(1e-30),
                                      torch.ones_like(total_contribution)))
    for quadrant, members in quadrant_masks.items():
        put(f"quadrant/{quadrant}/count", members.sum())
        put(f"quadrant/{quadrant}/loss_share", torch.where(members, contribution, 0.0).sum() / total_contribution.clamp_min(1e-30))
        put(f"quadrant/{quadrant}/clip_frac", (members & ~carries_gradient).sum() / members.sum().clamp_min(1))
    put("entropy_change_estimate", -covariance)
    if logits is not None and entropy is None:
        entropy = entropy_from_logits(logits)
    if entropy is not None:
        put("entropy", _masked_mean(entropy.detach().float(), weight))
    put("approx_kl", _masked_mean(k3_kl(log_prob - old_log_prob), weight))
    put("ratio/mean", _masked_mean(ratio, weight))
    put("ratio/max", torch.where(counted, ratio, 0.0).amax() if ratio.numel() else torch.zeros(()))
    put("ratio/min", torch.where(counted, ratio, float("inf")).amin().nan_to_num(posinf=0.0) if ratio.numel() else torch.zeros(()))
    for name, bound in (("lower", lower), ("upper", upper)):
        if isinstance(bound, Tensor):  # per-token bounds (DCPO): their masked mean
            put(name, _masked_mean(bound.float(), weight))
    put("tokens", counted.sum())

    metrics = dict(zip(names, torch.stack(values).tolist()))
    for name, bound in (("lower", lower), ("upper", upper)):
        if not isinstance(bound, Tensor):
            metrics[name] = float(bound)
    return metrics

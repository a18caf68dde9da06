"""Straightforward reference implementations the vectorised core is checked against."""

from __future__ import annotations

import torch

from bapo.core import BAPOConfig

TOL = 1e-9


def reference_share(ratio, advantages, mask, lower, upper, kind="share"):
    """rho (or pos/neg) by masking, in float64: the definition, written plainly."""
    compute = torch.float64 if ratio.dtype == torch.float64 else torch.float32
    ratio = ratio.to(compute)
    adv = advantages.to(compute)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(ratio)
    counted = mask.bool()
    weight = (ratio * adv).abs().double()  # product in the inputs' precision, sums in float64
    ratio = ratio.double()
    positive = weight[counted & (adv > 0) & (ratio <= upper)].sum().item()
    negative = weight[counted & (adv < 0) & (ratio >= lower)].sum().item()
    if kind == "pos_neg":
        return positive, negative
    total = positive + negative
    return 1.0 if total == 0 else positive / total


def reference_search(ratio, advantages, mask, cfg: BAPOConfig):
    """The loop of the issue, one pass per candidate, grid by multiplication."""
    lower_k = upper_j = 0
    lower = lambda k: cfg.lower_start + k * cfg.lower_step  # noqa: E731
    upper = lambda j: cfg.upper_start + j * cfg.upper_step  # noqa: E731

    def below_target():
        if cfg.target_kind == "pos_neg":
            positive, negative = reference_share(ratio, advantages, mask, lower(lower_k), upper(upper_j), "pos_neg")
            return not positive >= cfg.target * negative
        return reference_share(ratio, advantages, mask, lower(lower_k), upper(upper_j)) < cfg.target

    reached = True
    while below_target():
        can_upper = upper(upper_j + 1) <= cfg.upper_max + TOL
        can_lower = lower(lower_k + 1) <= cfg.lower_max + TOL
        if cfg.order == "upper-first":
            if can_upper:
                upper_j += 1
            elif can_lower:
                lower_k += 1
            else:
                reached = False
                break
        else:
            if can_lower:
                lower_k += 1
            elif can_upper:
                upper_j += 1
            else:
                reached = False
                break
    return lower(lower_k), upper(upper_j), reached, lower_k + upper_j

"""Straightforward reference implementations the vectorised core is checked against, written
from each formula token by token (BAPO.md, arXiv 2510.18927 Eq. 8, recipe/bapo/policy_loss.py).

Precision policy (part of the definition, as in bapo.core): a token's weighted magnitude
a = |A * w * pi_behaviour| and r * a are formed in the inputs' precision (at least float32);
bound comparisons, clamped values bound * a and the sums are float64.
"""

from __future__ import annotations

import math

import torch

from bapo.core import BAPOConfig

TOL = 1e-9


def _tokens(ratio, advantages, mask, cfg, weights=None, behaviour_log_prob=None):
    """Per counted token with A != 0: (side +1/-1, r as float64, r*a, a), Python floats."""
    compute = torch.float64 if ratio.dtype == torch.float64 else torch.float32
    r = ratio.to(compute)
    adv = advantages.to(compute)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(r)
    signed = adv
    if weights is not None:
        signed = signed * weights.to(compute)
    if cfg.weighting == "behaviour_prob":
        signed = signed * behaviour_log_prob.to(compute).exp()
    a = signed.abs()
    rows = zip(
        mask.bool().flatten().tolist(),
        signed.flatten().tolist(),
        r.flatten().tolist(),
        (r * a).flatten().tolist(),
        a.flatten().tolist(),
    )
    return [(1 if s > 0 else -1, rv, ra, av) for counted, s, rv, ra, av in rows if counted and s != 0]


def reference_sums(tokens, lower, upper, cfg):
    """(pos, neg) at bounds (lower, upper) under cfg.contribution, from _tokens."""
    positive = negative = 0.0
    for side, r, ra, a in tokens:
        if cfg.contribution == "gradient":  # |r*A| while the token still carries gradient (X_t = 1)
            if side > 0 and r <= upper:
                positive += ra
            elif side < 0 and r >= lower:
                negative += ra
        else:  # clipped-surrogate magnitude: A>0 min(r, upper)*a, A<0 max(r, lower)*a
            if side > 0:
                positive += ra if r <= upper else upper * a
            else:
                negative += ra if r >= lower else lower * a
    return positive, negative


def reference_share(ratio, advantages, mask, lower, upper, cfg=None, weights=None, behaviour_log_prob=None):
    """rho = pos / (pos + neg); NaN when nothing contributes."""
    cfg = cfg or BAPOConfig()
    positive, negative = reference_sums(
        _tokens(ratio, advantages, mask, cfg, weights, behaviour_log_prob), lower, upper, cfg
    )
    total = positive + negative
    return math.nan if total == 0 else positive / total


def _met(positive, negative, cfg):
    if cfg.target_kind == "pos_neg":  # the recipe: pos/(neg + eps), inf when neg == 0
        return negative <= 0 or positive / (negative + cfg.pos_neg_eps) >= cfg.target
    total = positive + negative
    return total == 0 or positive / total >= cfg.target


def _algorithm1(tokens, cfg):
    """Algorithm 1's loop, one pass per candidate, grid start + k*step <= max (by multiplication)."""
    lower_k = upper_j = 0

    def lower(k):
        return cfg.lower_start + k * cfg.lower_step

    def upper(j):
        return cfg.upper_start + j * cfg.upper_step

    reached = True
    while not _met(*reference_sums(tokens, lower(lower_k), upper(upper_j), cfg), cfg):
        can_upper = upper(upper_j + 1) <= cfg.upper_max + TOL
        can_lower = lower(lower_k + 1) <= cfg.lower_max + TOL
        first, second = ("upper", "lower") if cfg.order == "upper-first" else ("lower", "upper")
        moved = None
        for side in (first, second):
            if side == "upper" and can_upper:
                moved = "upper"
                break
            if side == "lower" and can_lower:
                moved = "lower"
                break
        if moved is None:
            reached = False
            break
        if moved == "upper":
            upper_j += 1
        else:
            lower_k += 1
    return lower(lower_k), upper(upper_j), reached, lower_k + upper_j


def _recipe_loop(tokens, cfg):
    """recipe/bapo/policy_loss.py's loop: lower first, each step min(current + step, max)."""
    low, high, steps = cfg.lower_start, cfg.upper_start, 0
    met = _met(*reference_sums(tokens, low, high, cfg), cfg)
    first_is_lower = cfg.order == "lower-first"
    for side in ("lower", "upper") if first_is_lower else ("upper", "lower"):
        while not met and (low < cfg.lower_max if side == "lower" else high < cfg.upper_max):
            if side == "lower":
                low = min(low + cfg.lower_step, cfg.lower_max)
            else:
                high = min(high + cfg.upper_step, cfg.upper_max)
            steps += 1
            met = _met(*reference_sums(tokens, low, high, cfg), cfg)
    return low, high, met, steps


def reference_search(ratio, advantages, mask, cfg: BAPOConfig, weights=None, behaviour_log_prob=None):
    """(lower, upper, reached, steps) of the loop each definition prescribes, or None for
    reached when no token contributes at any candidate (no signal)."""
    tokens = _tokens(ratio, advantages, mask, cfg, weights, behaviour_log_prob)
    # No signal: nothing contributes at any candidate (pos depends only on upper, neg only on lower).
    uppers = _grid(cfg.upper_start, cfg.upper_step, cfg.upper_max, cfg.stepping)
    lowers = _grid(cfg.lower_start, cfg.lower_step, cfg.lower_max, cfg.stepping)
    if not any(reference_sums(tokens, lowers[0], u, cfg)[0] > 0 for u in uppers) and not any(
        reference_sums(tokens, low, uppers[0], cfg)[1] > 0 for low in lowers
    ):
        return cfg.lower_start, cfg.upper_start, None, 0
    loop = _recipe_loop if cfg.stepping == "add_clamped" else _algorithm1
    return loop(tokens, cfg)


def _grid(start, step, maximum, stepping):
    values = [start]
    if stepping == "add_clamped":
        while values[-1] < maximum:
            values.append(min(values[-1] + step, maximum))
        return values
    while start + len(values) * step <= maximum + TOL:
        values.append(start + len(values) * step)
    return values

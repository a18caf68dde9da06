"""Straightforward references for the peer losses (bapo.core.peers), written token by token from
each paper's formula, in Python floats (float64): (loss, d loss / d log pi per token [B][T]).

Every batch is lists: log_prob, old_log_prob [B][T], advantages [B] (one per sequence), mask
[B][T] of 0/1; each reference aggregates as its method's default (PAPER_AGG_MODES).
"""

from __future__ import annotations

import math


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _tokens(mask_row):
    return [t for t, m in enumerate(mask_row) if m]


def gspo(log_prob, old, adv, mask, lower=1 - 3e-4, upper=1 + 4e-4):
    """GSPO: s_i = exp(mean_t log r_t); loss_i = -min(s_i A_i, clip(s_i) A_i), mean over sequences;
    gradient of token t: -A_i s_i / |y_i| / B unless the sequence is clipped."""
    batch = len(log_prob)
    loss, grad = 0.0, [[0.0] * len(row) for row in log_prob]
    for i in range(batch):
        tokens = _tokens(mask[i])
        if not tokens:
            continue
        s = math.exp(min(sum(log_prob[i][t] - old[i][t] for t in tokens) / len(tokens), 10.0))
        a = adv[i]
        loss += -min(s * a, min(max(s, lower), upper) * a) / batch
        clipped = (a > 0 and s > upper) or (a < 0 and s < lower)
        for t in tokens:
            grad[i][t] = 0.0 if clipped else -a * s / len(tokens) / batch
    return loss, grad


def cispo(log_prob, old, adv, mask, lower=None, upper=5.0):
    """CISPO: -sg(clip(r, lower, upper)) A log pi per token, token-mean."""
    count = sum(sum(row) for row in mask) or 1
    loss, grad = 0.0, [[0.0] * len(row) for row in log_prob]
    for i, row in enumerate(log_prob):
        for t in _tokens(mask[i]):
            r = math.exp(row[t] - old[i][t])
            w = min(r, upper) if lower is None else min(max(r, lower), upper)
            loss += -w * adv[i] * row[t] / count
            grad[i][t] = -w * adv[i] / count
    return loss, grad


def sapo(log_prob, old, adv, mask, tau_pos=1.0, tau_neg=1.05):
    """SAPO: -(4/tau) sigmoid(tau (r - 1)) A, seq-mean-token-mean; d/dlog pi = -4 r s (1 - s) A."""
    batch = len(log_prob)
    loss, grad = 0.0, [[0.0] * len(row) for row in log_prob]
    for i, row in enumerate(log_prob):
        tokens = _tokens(mask[i])
        tau = tau_pos if adv[i] > 0 else tau_neg
        for t in tokens:
            r = math.exp(row[t] - old[i][t])
            s = _sigmoid(tau * (r - 1.0))
            loss += -(4.0 / tau) * s * adv[i] / len(tokens) / batch
            grad[i][t] = -4.0 * r * s * (1.0 - s) * adv[i] / len(tokens) / batch
    return loss, grad


def gmpo(log_prob, old, adv, mask, lower=math.exp(-0.4), upper=math.exp(0.4)):
    """GMPO: loss_i = -A_i prod_t clip_side(r_t)^(1/|y_i|), mean over sequences; a token on its
    clipped side (A > 0, r > upper; A < 0, r < lower) has no gradient."""
    batch = len(log_prob)
    loss, grad = 0.0, [[0.0] * len(row) for row in log_prob]
    for i, row in enumerate(log_prob):
        tokens = _tokens(mask[i])
        if not tokens:
            continue
        a = adv[i]
        product, free = 1.0, []
        for t in tokens:
            r = math.exp(row[t] - old[i][t])
            if a > 0 and r > upper:
                r = upper
            elif a < 0 and r < lower:
                r = lower
            else:
                free.append(t)
            product *= r ** (1.0 / len(tokens))
        loss += -a * product / batch
        for t in free:
            grad[i][t] = -a * product / len(tokens) / batch
    return loss, grad


def _centred_products(log_prob, adv, mask):
    cells = [(i, t) for i in range(len(log_prob)) for t in _tokens(mask[i])]
    mean_a = sum(adv[i] for i, _ in cells) / len(cells)
    mean_lp = sum(log_prob[i][t] for i, t in cells) / len(cells)
    return {(i, t): (adv[i] - mean_a) * (log_prob[i][t] - mean_lp) for i, t in cells}


def clip_cov_all(log_prob, old, adv, mask, lower=0.8, upper=1.2, cov_lower=1.0, cov_upper=5.0):
    """Clip-Cov with every candidate dropped (cov_fraction >= 1): PPO's clipped surrogate,
    token-mean, and the tokens the bounds leave free with cov_lower < cov < cov_upper get 0."""
    count = sum(sum(row) for row in mask)
    cov = _centred_products(log_prob, adv, mask)
    loss, grad, dropped = 0.0, [[0.0] * len(row) for row in log_prob], set()
    for (i, t), c in cov.items():
        r, a = math.exp(log_prob[i][t] - old[i][t]), adv[i]
        clipped = (a > 0 and r > upper) or (a < 0 and r < lower)
        if not clipped and cov_lower < c < cov_upper:
            dropped.add((i, t))
            continue
        loss += -min(r * a, min(max(r, lower), upper) * a) / count
        grad[i][t] = 0.0 if clipped else -r * a / count
    return loss, grad, dropped


def kl_cov(log_prob, old, adv, mask, cov_fraction=2e-4, kl_coef=0.1):
    """KL-Cov: -r A per token, + kl_coef |log r| on the k tokens of largest centred product."""
    count = sum(sum(row) for row in mask)
    cov = _centred_products(log_prob, adv, mask)
    k = max(1, int(count * cov_fraction))
    penalized = set(sorted(cov, key=lambda cell: -cov[cell])[:k])
    loss, grad = 0.0, [[0.0] * len(row) for row in log_prob]
    for i, t in cov:
        x, a = log_prob[i][t] - old[i][t], adv[i]
        r = math.exp(x)
        loss += -r * a / count
        grad[i][t] = -r * a / count
        if (i, t) in penalized:
            loss += kl_coef * abs(x) / count
            grad[i][t] += kl_coef * math.copysign(1.0, x) / count
    return loss, grad, penalized


def m2po(log_prob, old, adv, mask, budget=0.04):
    """M2PO, Algorithm 1 literally: while the mean (log r)^2 of the kept tokens exceeds the
    budget, drop the kept token of largest (log r)^2; then -r A on the kept ones, token-mean
    over all masked tokens."""
    cells = [(i, t) for i in range(len(log_prob)) for t in _tokens(mask[i])]
    moment = {(i, t): (log_prob[i][t] - old[i][t]) ** 2 for i, t in cells}
    kept = set(cells)
    while kept and sum(moment[c] for c in kept) / len(kept) > budget:
        kept.remove(max(kept, key=lambda c: moment[c]))
    count = len(cells) or 1
    loss, grad = 0.0, [[0.0] * len(row) for row in log_prob]
    for i, t in kept:
        r = math.exp(log_prob[i][t] - old[i][t])
        loss += -r * adv[i] / count
        grad[i][t] = -r * adv[i] / count
    return loss, grad, set(cells) - kept


def m2po_official_bounds(log_prob, old, adv, mask, budget=0.04, lower_max=0.7, upper_min=1.5):
    """The official code's bounds: over harmful tokens (A > 0, r > 1; A < 0, r < 1) sorted
    ascending by (log r)^2, the first k whose capped sum sum_{j<=k} v_j + v_k (n - k - 1)
    reaches budget * n; tau = sqrt(v_{k-1}) (0 for k = 0); floors on the bounds. The code's
    1e-12 slack is part of it: tau sits just below the (k-1)-th value, so that token is clipped."""
    values = []
    for i in range(len(log_prob)):
        for t in _tokens(mask[i]):
            x, a = log_prob[i][t] - old[i][t], adv[i]
            if (a > 0 and x > 0) or (a < 0 and x < 0):
                values.append(x * x)
    values.sort()
    n = len(values)
    if n == 0 or sum(values) / n <= budget + 1e-12:
        return 0.0, 1e5
    for k in range(n):
        if sum(values[: k + 1]) + (values[k] - 1e-12) * (n - k - 1) >= budget * n - 1e-12:
            tau = math.sqrt(max(values[k - 1] - 1e-12, 0.0)) if k > 0 else 0.0
            return min(math.exp(-tau), lower_max), max(math.exp(tau), upper_min)
    raise AssertionError("unreachable: k = n - 1 always reaches the budget")


def decoupled_ppo(log_prob, old, adv, mask, proximal, lower=0.8, upper=1.2, weight_cap=None):
    """Decoupled PPO: w = pi_prox / mu (constant), r' = pi / pi_prox; loss_t = w * -min(r' A,
    clip(r') A), token-mean over all masked tokens; w > weight_cap drops the token."""
    count = sum(sum(row) for row in mask) or 1
    loss, grad = 0.0, [[0.0] * len(row) for row in log_prob]
    for i, row in enumerate(log_prob):
        for t in _tokens(mask[i]):
            w = math.exp(proximal[i][t] - old[i][t])
            if weight_cap is not None and w > weight_cap:
                continue
            r, a = math.exp(row[t] - proximal[i][t]), adv[i]
            loss += -w * min(r * a, min(max(r, lower), upper) * a) / count
            clipped = (a > 0 and r > upper) or (a < 0 and r < lower)
            grad[i][t] = 0.0 if clipped else -w * r * a / count
    return loss, grad


def _dppo_keep(p, q, a, divergence, delta_low, delta_high):
    """DPPO's trust region: a token leaves it only by moving in its advantage's direction."""
    if divergence == "tv":
        return p - q <= delta_high if a > 0 else q - p <= delta_low
    kl = q * math.log(q / p) + (1.0 - q) * math.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
    return (kl <= delta_high or p <= q) if a > 0 else (kl <= delta_low or p >= q)


def dppo(log_prob, old, adv, mask, divergence="tv", delta_low=None, delta_high=None, ratio_cap=None):
    """DPPO-Binary-TV / -KL (arXiv 2602.04879): with p = pi(y_t), q = mu(y_t), a token inside the
    trust region contributes -min(r, cap) A log pi (weight detached: gradient -min(r, cap) A),
    one outside contributes 0; seq-mean-token-sum-norm: the sum over tokens / (B * T)."""
    default = 0.15 if divergence == "tv" else 0.05
    delta_low = default if delta_low is None else delta_low
    delta_high = default if delta_high is None else delta_high
    denominator = len(log_prob) * len(log_prob[0])
    loss, grad = 0.0, [[0.0] * len(row) for row in log_prob]
    for i, row in enumerate(log_prob):
        for t in _tokens(mask[i]):
            p, q, a = math.exp(row[t]), math.exp(old[i][t]), adv[i]
            if not _dppo_keep(p, q, a, divergence, delta_low, delta_high):
                continue
            w = p / q if ratio_cap is None else min(p / q, ratio_cap)
            loss += -w * a * row[t] / denominator
            grad[i][t] = -w * a / denominator
    return loss, grad

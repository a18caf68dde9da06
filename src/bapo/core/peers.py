"""BAPO's peers as registered policy losses: GSPO, CISPO, SAPO, GMPO, Clip-Cov, KL-Cov, M2PO, DPPO.

Each is its paper's formula with the defaults of the framework function named in its docstring
(verl 0.9.1's `verl/trainer/ppo/core_algos.py`, TRL's `GRPOTrainer._compute_loss`, the
official M2PO code); docs/CORE.md has the table. Bounds are ratio bounds, as everywhere in
bapo.core. What the diagnostics see (TokenLoss): the bounds a token's gradient is cut at, the
ratio they are compared with (GSPO: the sequence ratio), and the tokens a rule of the method
drops (Clip-Cov, M2PO); a method that only reweights (CISPO, SAPO, KL-Cov) cuts no token's
gradient and reports (0, inf), with its own share of affected tokens in its metrics.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bapo.core.diagnostics import LOG_RATIO_CLAMP
from bapo.core.losses import PolicyLossFn, TokenBatch, TokenLoss, clipped_surrogate, register_policy_loss
from bapo.core.validation import check_ratio_bounds

#: The losses whose per-token loss depends on statistics of the whole batch they are given (token
#: selections, a bound solved from it): a caller holding several independent runs in one batch
#: (the lab's seeds) calls them once per run, and micro-batches select apart (as in verl).
BATCH_LEVEL_METHODS = frozenset({"clip-cov", "kl-cov", "m2po", "m2po-official"})
#: What a loss that cuts no token's gradient reports as its bounds.
NO_BOUNDS = (0.0, math.inf)
#: verl's gspo clamps the log sequence ratio at 10 (gradient zero beyond).
GSPO_LOG_RATIO_MAX = 10.0


def log_ratio(batch: TokenBatch, clamp: bool = True) -> Tensor:
    """log r_t = log pi - log pi_behaviour [B, T] (0 outside the mask), with the gradient of log pi;
    clamped to +-LOG_RATIO_CLAMP like token_ratio unless clamp=False."""
    log_prob, old_log_prob = batch.log_probs()
    difference = log_prob - old_log_prob
    return difference.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) if clamp else difference


def sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence mean over masked tokens, [B, 1] (0 for an empty sequence)."""
    weight = mask.to(values.dtype)
    return torch.where(mask.to(torch.bool), values, 0.0).sum(-1, keepdim=True) / weight.sum(-1, keepdim=True).clamp_min(
        1.0
    )


def _masked_share(flags: Tensor, mask: Tensor) -> float:
    """Share of masked tokens where flags is True (0 when none is masked)."""
    counted = mask.to(torch.bool)
    return float((flags & counted).sum()) / max(float(counted.sum()), 1.0)


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0.0:
            raise ValueError(f"{name}: {value} must be > 0")


@register_policy_loss("gspo", agg_mode="seq-mean-token-mean")
def gspo_loss(batch: TokenBatch, *, lower: float = 1 - 3e-4, upper: float = 1 + 4e-4) -> TokenLoss:
    """GSPO (arXiv 2507.18071), its GSPO-token form as verl's `gspo`:
        s_i = exp(mean_t log r_t) over the response's masked tokens, s_i,t = sg(s_i) * pi_t / sg(pi_t),
        loss_t = -min(s_i,t A, clip(s_i,t, lower, upper) A)
    so each token's gradient is s_i A grad log pi_t unless the sequence is clipped. Defaults: the
    paper's and verl's GSPO example's clip_ratio_low 3e-4 / clip_ratio_high 4e-4 (verl's actor
    default 0.2 leaves a sequence ratio practically unclipped); aggregation seq-mean-token-mean
    (the paper's; verl passes its configured mode). As in verl, log s_i,t is clamped at 10 (no
    gradient beyond: the diagnostics count that as a dual-clip at e^10) and the log-ratios in
    the mean are not clamped. Diagnostics compare s_i, not r_t, with the bounds.
    """
    check_ratio_bounds(lower, upper)
    sequence_log_ratio = sequence_mean(log_ratio(batch, clamp=False).detach(), batch.mask)
    log_prob, _ = batch.log_probs()
    combined = (sequence_log_ratio + log_prob - log_prob.detach()).clamp(max=GSPO_LOG_RATIO_MAX)
    ratio = torch.exp(combined)
    sequence_ratio = sequence_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().expand_as(batch.ratio)
    return TokenLoss(
        clipped_surrogate(ratio, batch.advantages, lower, upper),
        lower,
        upper,
        dual_clip=math.exp(GSPO_LOG_RATIO_MAX),
        ratio=sequence_ratio,
    )


def _cispo(default_lower: float | None, default_upper: float) -> PolicyLossFn:
    def loss(batch: TokenBatch, *, lower: float | None = default_lower, upper: float = default_upper) -> TokenLoss:
        check_ratio_bounds(0.0 if lower is None else lower, upper)
        weight = batch.ratio.clamp(min=lower, max=upper).detach()
        truncated = batch.ratio > upper
        if lower is not None:
            truncated = truncated | (batch.ratio < lower)
        # every token keeps its gradient (weight * A * grad log pi): no bound cuts it
        return TokenLoss(
            -weight * batch.advantages * batch.log_probs()[0],
            *NO_BOUNDS,
            metrics={"cispo/truncated_frac": _masked_share(truncated, batch.mask)},
        )

    loss.__doc__ = """CISPO (MiniMax-M1, arXiv 2506.13585): loss_t = -sg(clip(r_t, lower, upper)) * A * log pi_t,
    a REINFORCE term whose importance weight is truncated and detached; no token loses its gradient.
    `cispo`: the paper's form, no lower bound (lower=None) and upper 5.0 = TRL's loss_type="cispo"
    with epsilon_high=5.0 (TRL's and ScaleRL's recommended cap, a ratio, not an epsilon).
    `cispo-verl`: verl's `cispo`, two-sided [1 - 0.2, 1 + 0.2] (its actor's clip_ratio defaults).
    Aggregation token-mean (both frameworks). metrics cispo/truncated_frac: masked tokens whose
    ratio lies outside the bounds (verl's pg_clipfrac)."""
    return loss


register_policy_loss("cispo")(_cispo(None, 5.0))
register_policy_loss("cispo-verl")(_cispo(0.8, 1.2))


@register_policy_loss("sapo", agg_mode="seq-mean-token-mean")
def sapo_loss(batch: TokenBatch, *, tau_pos: float = 1.0, tau_neg: float = 1.05) -> TokenLoss:
    """SAPO (arXiv 2511.20347): a soft gate in place of the clip,
        loss_t = -(4 / tau) * sigmoid(tau * (r_t - 1)) * A,  tau = tau_pos if A > 0 else tau_neg,
    whose gradient is 4 r sigma (1 - sigma) A grad log pi (= r A at r = 1), decaying smoothly
    away from r = 1. Defaults tau_pos 1.0, tau_neg 1.05 (the paper's, verl's tau_pos/tau_neg and
    TRL's sapo_temperature_pos/neg); aggregation seq-mean-token-mean (verl and TRL fix it).
    No token's gradient is cut: the diagnostics see (0, inf)."""
    _check_positive(tau_pos=tau_pos, tau_neg=tau_neg)
    tau = torch.where(batch.advantages > 0, batch.ratio.new_tensor(tau_pos), batch.ratio.new_tensor(tau_neg))
    # exp(logsigmoid) = sigmoid, with the gradient sigma(z) sigma(-z) exact in the tail, where
    # sigmoid's own backward, sigma (1 - sigma), rounds to 0 (float32 from z ~ 17)
    gate = torch.exp(torch.nn.functional.logsigmoid(tau * (batch.ratio - 1.0))) * (4.0 / tau)
    return TokenLoss(-gate * batch.advantages, *NO_BOUNDS)


@register_policy_loss("gmpo", agg_mode="seq-mean-token-mean")
def gmpo_loss(batch: TokenBatch, *, lower: float = math.exp(-0.4), upper: float = math.exp(0.4)) -> TokenLoss:
    """GMPO (arXiv 2507.20673), verl's `geo_mean`: the geometric mean of the token ratios,
    each clipped on its advantage's side in log space,
        S_i = exp(mean_t sgn(A) min(sgn(A) log r_t, sgn(A) clip(log r_t, log lower, log upper))),
        loss_i = -A_i S_i  (A_i: the sequence's mean advantage),
    on every token of the sequence, so seq-mean-token-mean (the default) is verl's mean over
    sequences. Defaults: the paper's range (e^-0.4, e^0.4) (verl: clip_ratio_low = clip_ratio_high
    = 0.4; its actor default 0.2 is (e^-0.2, e^0.2)). A token is cut where its clipped side binds:
    A > 0 and r > upper, A < 0 and r < lower, which is what the diagnostics count. Log-ratios
    are clamped to +-20 (verl leaves that clamp commented out). Importance weights multiply the
    per-token loss (verl takes their geometric mean per sequence)."""
    check_ratio_bounds(lower, upper)
    log_lower = math.log(lower) if lower > 0 else -math.inf
    values = log_ratio(batch)
    sign = torch.sign(batch.advantages)
    clipped = values.clamp(log_lower, math.log(upper))
    kept = sign * torch.minimum(sign * values, sign * clipped)
    sequence_ratio = torch.exp(sequence_mean(kept, batch.mask))
    sequence_advantage = sequence_mean(batch.advantages, batch.mask)
    return TokenLoss((-sequence_advantage * sequence_ratio).expand_as(batch.ratio), lower, upper)


def _covariance(batch: TokenBatch) -> Tensor:
    """Cui et al.'s per-token centred product (A - mean A) * (log pi - mean log pi) over the
    masked tokens, [B, T] (detached)."""
    counted = batch.mask.to(torch.bool)
    total = counted.sum().clamp_min(1)
    log_prob = batch.log_probs()[0].detach()
    mean_advantage = torch.where(counted, batch.advantages, 0.0).sum() / total
    mean_log_prob = torch.where(counted, log_prob, 0.0).sum() / total
    return (batch.advantages - mean_advantage) * (log_prob - mean_log_prob)


@register_policy_loss("clip-cov")
def clip_cov_loss(
    batch: TokenBatch,
    *,
    lower: float = 0.8,
    upper: float = 1.2,
    cov_fraction: float = 2e-4,
    cov_lower: float = 1.0,
    cov_upper: float = 5.0,
) -> TokenLoss:
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617), verl's `clip_cov`: the clipped surrogate, and
    among the tokens the bounds leave free those with cov_lower < (A - mean A)(log pi - mean log pi)
    < cov_upper, max(int(cov_fraction * masked tokens), 1) drawn uniformly at random (torch's
    global generator, `torch.randperm`, as verl) lose their gradient. Defaults verl's:
    clip_cov_ratio 2e-4, clip_cov_lb 1.0, clip_cov_ub 5.0, clip_ratio 0.2 -> bounds (0.8, 1.2).
    Diagnostics: the bounds, and the drawn tokens as dropped."""
    check_ratio_bounds(lower, upper)
    _check_positive(cov_fraction=cov_fraction)
    if not cov_lower < cov_upper:
        raise ValueError(f"cov_lower: {cov_lower} must be < cov_upper {cov_upper}")
    counted = batch.mask.to(torch.bool)
    unclipped = -batch.advantages * batch.ratio
    clamped = -batch.advantages * batch.ratio.clamp(lower, upper)
    covariance = _covariance(batch)
    candidates = counted & ~(clamped > unclipped) & (covariance > cov_lower) & (covariance < cov_upper)
    positions = torch.nonzero(candidates)
    drawn = max(int(cov_fraction * int(counted.sum())), 1)
    chosen = positions[torch.randperm(len(positions))[:drawn].to(positions.device)]
    dropped = torch.zeros_like(counted)
    dropped[chosen[:, 0], chosen[:, 1]] = True
    loss = torch.where(dropped, 0.0, torch.maximum(unclipped, clamped))
    return TokenLoss(loss, lower, upper, dropped=dropped)


@register_policy_loss("kl-cov")
def kl_cov_loss(batch: TokenBatch, *, cov_fraction: float = 2e-4, kl_coef: float = 0.1) -> TokenLoss:
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617), verl's `kl_cov`: the unclipped surrogate -r A,
    plus kl_coef * |log r| on the max(int(cov_fraction * masked tokens), 1) tokens of largest
    (A - mean A)(log pi - mean log pi). Defaults verl's: kl_cov_ratio 2e-4, ppo_kl_coef 0.1 (its
    config's value). No bound cuts a token (0, inf); metrics kl_cov/penalized_frac."""
    _check_positive(cov_fraction=cov_fraction)
    if not kl_coef >= 0.0:
        raise ValueError(f"kl_coef: {kl_coef} must be >= 0")
    counted = batch.mask.to(torch.bool)
    penalized = torch.zeros_like(counted)
    total = int(counted.sum())
    if total > 0:
        chosen = torch.topk(_covariance(batch)[counted], max(1, int(total * cov_fraction))).indices
        flat = penalized.view(-1)
        flat[torch.nonzero(counted.reshape(-1)).squeeze(-1)[chosen]] = True
    penalty = kl_coef * log_ratio(batch, clamp=False).abs()
    loss = -batch.advantages * batch.ratio + torch.where(penalized, penalty, 0.0)
    return TokenLoss(loss, *NO_BOUNDS, metrics={"kl_cov/penalized_frac": _masked_share(penalized, batch.mask)})


def _squared_log_ratio(batch: TokenBatch) -> Tensor:
    """(log r_t)^2 [B, T] in float64, unclamped, detached."""
    return log_ratio(batch, clamp=False).detach().double().square()


@register_policy_loss("m2po")
def m2po_loss(batch: TokenBatch, *, budget: float = 0.04) -> TokenLoss:
    """M2PO (arXiv 2510.01161, Algorithm 1; AReaL's m2po): mask the tokens of largest M2 = (log r)^2
    until the mean M2 of the remaining masked tokens is <= budget (the paper's tau_M2 = 0.04),
    then the unclipped surrogate -r A on the rest, token-mean. M2 is the current policy's
    against the behaviour policy (the paper's); AReaL measures it once per batch as
    log(pi_prox / mu) with its recomputed proximal log-probs. When no non-empty rest meets the
    budget every token is masked (the literal loop; AReaL keeps the smallest one). No bound
    cuts a token: (0, inf), the masked ones dropped; metrics m2po/m2 and m2po/m2_kept."""
    _check_positive(budget=budget)
    counted = batch.mask.to(torch.bool)
    moments = _squared_log_ratio(batch)[counted]
    ordered, order = torch.sort(moments, descending=True)
    count = ordered.numel()
    # mean M2 of the rest after masking the k largest, k = 0..count (the empty rest meets any budget)
    rest = ordered.flip(0).cumsum(0).flip(0) / torch.arange(count, 0, -1, device=ordered.device, dtype=ordered.dtype)
    meets = torch.cat([rest <= budget, torch.ones(1, dtype=torch.bool, device=ordered.device)])
    masked_count = torch.argmax(meets.to(torch.int8))
    masked = torch.zeros_like(moments, dtype=torch.bool)
    masked[order] = torch.arange(count, device=ordered.device) < masked_count
    dropped = torch.zeros_like(counted)
    dropped[counted] = masked
    loss = torch.where(dropped, 0.0, -batch.ratio * batch.advantages)
    kept = moments[~masked]
    metrics = {
        "m2po/m2": float(moments.mean()) if count else 0.0,
        "m2po/m2_kept": float(kept.mean()) if kept.numel() else 0.0,
    }
    return TokenLoss(loss, *NO_BOUNDS, metrics=metrics, dropped=dropped)


#: The official code's "no constraint" bound.
M2PO_OFFICIAL_NO_BOUND = 1e5


@register_policy_loss("m2po-official")
def m2po_official_loss(
    batch: TokenBatch, *, budget: float = 0.04, lower_max: float = 0.7, upper_min: float = 1.5
) -> TokenLoss:
    """M2PO as its official code runs it (Infini-AI-Lab/M2PO, compute_m2po_policy_loss): one
    threshold tau on |log r| over the "harmful" tokens (A > 0 and r > 1, A < 0 and r < 1): with
    their squared log-ratios sorted ascending, v_0 <= ... <= v_{n-1}, k is the first index where
    capping every value above v_k at v_k keeps the sum >= budget * n, and tau = sqrt(v_{k-1})
    (0 when k = 0); the clipped surrogate then runs at bounds (min(e^-tau, lower_max),
    max(e^tau, upper_min)), i.e. its floors 0.3 / 0.5 on the epsilons. When the harmful tokens'
    mean already meets the budget (or there are none) the bounds are (0, 1e5), the code's
    sentinel. Budget 0.04 (its scripts' M2_budget); token-mean. Like the code, 1e-12 slack in
    the comparisons."""
    _check_positive(budget=budget)
    check_ratio_bounds(lower_max, upper_min)
    counted = batch.mask.to(torch.bool)
    advantages, ratio = batch.advantages, batch.ratio
    harmful = counted & (
        ((advantages > 1e-12) & (ratio > 1.0 + 1e-12)) | ((advantages < -1e-12) & (ratio < 1.0 - 1e-12))
    )
    values, _ = torch.sort(_squared_log_ratio(batch)[harmful])
    count = values.numel()
    device = ratio.device
    lower = torch.zeros((), dtype=torch.float64, device=device)
    upper = torch.full((), M2PO_OFFICIAL_NO_BOUND, dtype=torch.float64, device=device)
    if count and float(values.mean()) > budget + 1e-12:
        target = budget * count
        rest = torch.arange(count - 1, -1, -1, device=device, dtype=values.dtype)
        reaches = values.cumsum(0) + (values - 1e-12) * rest >= target - 1e-12
        first = int(torch.argmax(reaches.to(torch.int8)))
        tau = (values[first - 1] - 1e-12).clamp_min(0.0).sqrt() if first > 0 else values.new_zeros(())
        lower = torch.exp(-tau).clamp(max=lower_max)
        upper = torch.exp(tau).clamp(min=upper_min)
    lower, upper = lower.to(ratio.dtype), upper.to(ratio.dtype)
    return TokenLoss(clipped_surrogate(ratio, advantages, lower, upper), lower, upper)


@register_policy_loss("decoupled-ppo", needs_proximal=True)
def decoupled_ppo_loss(
    batch: TokenBatch,
    *,
    lower: float = 0.8,
    upper: float = 1.2,
    weight_cap: float | None = None,
    dual_clip: float | None = None,
) -> TokenLoss:
    """Decoupled PPO (Hilton et al. 2022, arXiv 2110.00641; AReaL arXiv 2505.24298, its
    ppo_actor_loss_fn with use_decoupled_loss): the trust region is taken around a proximal
    policy pi_prox (the weights before this batch's updates), not the stale behaviour policy mu,
        loss_t = sg(pi_prox / mu) * -min(r' A, clip(r', lower, upper) A),  r' = pi / pi_prox,
    and with weight_cap a token whose behaviour weight pi_prox / mu exceeds it is dropped (its
    loss 0, still counted in the token mean), as AReaL's behav_imp_weight_cap (default None
    there; its examples use 5). Needs policy_loss(proximal_log_prob=...); `bapo train` computes
    them with a no-grad forward of the current weights before each rollout batch's first
    update. dual_clip: AReaL's c_clip (off). Diagnostics: r' against the bounds, capped tokens
    dropped; metrics decoupled/behaviour_weight_mean (over masked tokens, before the cap)."""
    check_ratio_bounds(lower, upper)
    if weight_cap is not None and not weight_cap > 1.0:
        raise ValueError(f"weight_cap: {weight_cap} must be > 1 (or None)")
    if batch.proximal_log_prob is None:
        raise ValueError("proximal_log_prob: method 'decoupled-ppo' needs the proximal policy's log-probs")
    counted = batch.mask.to(torch.bool)
    proximal = batch.proximal_log_prob
    log_prob, old_log_prob = batch.log_probs()
    ratio = torch.exp((log_prob - proximal).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    behaviour_weight = torch.exp((proximal - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    dropped = counted & (behaviour_weight > weight_cap) if weight_cap is not None else torch.zeros_like(counted)
    surrogate = clipped_surrogate(ratio, batch.advantages, lower, upper, dual_clip)
    loss = torch.where(dropped, 0.0, surrogate * behaviour_weight)
    mean_weight = float(torch.where(counted, behaviour_weight, 0.0).sum()) / max(float(counted.sum()), 1.0)
    return TokenLoss(
        loss,
        lower,
        upper,
        metrics={"decoupled/behaviour_weight_mean": mean_weight},
        dual_clip=dual_clip,
        ratio=ratio.detach(),
        dropped=dropped,
    )


def _check_dppo(delta_low: float, delta_high: float, ratio_cap: float | None) -> None:
    _check_positive(delta_low=delta_low, delta_high=delta_high)
    if ratio_cap is not None and not ratio_cap > 0.0:
        raise ValueError(f"ratio_cap: {ratio_cap} must be > 0 (or None: no truncation)")


def _dppo(batch: TokenBatch, keep_positive: Tensor, keep_negative: Tensor, ratio_cap: float | None) -> TokenLoss:
    """DPPO's loss from its trust-region masks [B, T] (True = the token keeps its gradient): the
    REINFORCE term -sg(min(r, ratio_cap)) * A * log pi on the kept tokens. The mask of a token
    follows its advantage's sign (A > 0: keep_positive, else keep_negative)."""
    keep = torch.where(batch.advantages > 0, keep_positive, keep_negative)
    weight = batch.ratio.detach() if ratio_cap is None else batch.ratio.detach().clamp(max=ratio_cap)
    counted = batch.mask.to(torch.bool)
    truncated = (batch.ratio > ratio_cap) & keep if ratio_cap is not None else torch.zeros_like(keep)
    return TokenLoss(
        torch.where(keep, -weight * batch.advantages * batch.log_probs()[0], 0.0),
        *NO_BOUNDS,
        metrics={"dppo/truncated_frac": _masked_share(truncated, batch.mask)},
        dropped=counted & ~keep & (batch.advantages != 0),
    )


@register_policy_loss("dppo-tv", agg_mode="seq-mean-token-sum-norm")
def dppo_tv_loss(
    batch: TokenBatch, *, delta_low: float = 0.15, delta_high: float = 0.15, ratio_cap: float | None = None
) -> TokenLoss:
    """DPPO-Binary-TV (Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning",
    arXiv 2602.04879), verl's `dppo_tv`: a trust region on the probability change of the sampled
    token rather than on its ratio. With p = pi(y_t), q = pi_behaviour(y_t):
        keep_t = (p - q <= delta_high) if A > 0 else (p - q >= -delta_low),
        loss_t = -keep_t * sg(min(r_t, ratio_cap)) * A * log pi(y_t),
    so a kept token's gradient is min(r, ratio_cap) A grad log pi (the unclipped surrogate's) and a
    token that moved its probability by more than delta in its advantage's direction has none.
    Defaults: the paper's runs as verl's example encodes them (examples/dppo_trainer:
    clip_ratio_low = clip_ratio_high = 0.15, the TV threshold; clip_ratio_c = 10000, i.e. no
    truncation: ratio_cap None; verl's function falls back to 20 when its config lacks
    clip_ratio_c, and verl's ActorConfig default is 3.0). Aggregation seq-mean-token-sum-norm
    (Dr. GRPO, the paper's). Diagnostics: no ratio bound (0, inf); tokens outside the trust
    region as dropped; metrics dppo/truncated_frac (kept tokens with r > ratio_cap)."""
    _check_dppo(delta_low, delta_high, ratio_cap)
    log_prob, old_log_prob = batch.log_probs()
    change = log_prob.detach().exp() - old_log_prob.exp()
    return _dppo(batch, change <= delta_high, change >= -delta_low, ratio_cap)


#: verl's dppo_kl adds 1e-8 to both 1 - q and 1 - p (p = 1 would be log 0).
DPPO_KL_EPS = 1e-8


@register_policy_loss("dppo-kl", agg_mode="seq-mean-token-sum-norm")
def dppo_kl_loss(
    batch: TokenBatch, *, delta_low: float = 0.05, delta_high: float = 0.05, ratio_cap: float | None = None
) -> TokenLoss:
    """DPPO-Binary-KL (arXiv 2602.04879), verl's `dppo_kl`: the trust region is the KL divergence
    between the Bernoulli distributions (q, 1 - q) and (p, 1 - p) of the sampled token,
        D_t = q log(q / p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8)),
        keep_t = (D_t <= delta_high or p <= q) if A > 0 else (D_t <= delta_low or p >= q),
    i.e. a token is masked only when it left the region in the direction its advantage pushes;
    the loss is dppo-tv's, -keep_t * sg(min(r_t, ratio_cap)) * A * log pi(y_t). Defaults: verl's
    example of the paper's runs (KL threshold 0.05 on both sides, no truncation); aggregation
    seq-mean-token-sum-norm. Diagnostics as dppo-tv."""
    _check_dppo(delta_low, delta_high, ratio_cap)
    log_p, log_q = batch.log_probs()
    log_p = log_p.detach()
    p, q = log_p.exp(), log_q.exp()
    divergence = q * (log_q - log_p) + (1.0 - q) * (torch.log(1.0 - q + DPPO_KL_EPS) - torch.log(1.0 - p + DPPO_KL_EPS))
    return _dppo(batch, (divergence <= delta_high) | (p <= q), (divergence <= delta_low) | (p >= q), ratio_cap)

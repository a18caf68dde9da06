"""Clipped policy losses with explicit ratio bounds, registered by name with one signature.

Every registered loss maps a `TokenBatch` to a per-token loss [B, T] plus the bounds it used
(floats or per-token tensors, for the diagnostics). `policy_loss` validates the inputs, runs the
chosen loss, applies optional importance weights, aggregates, and returns the diagnostics.

Dual-clip: every clipped loss (grpo, clip-higher, bapo, dcpo) takes `dual_clip`, a cap on the
ratio of negative-advantage tokens (verl's clip_ratio_c). Core's own default is off (None): a
method name means its paper's formula, and `dual-clip` is the named baseline (grpo + 3.0). The
frameworks turn it on as verl does: `bapo train` (loss.dual_clip, default 3.0) and verl (the
actor's clip_ratio_c, default 3.0).

Numerics: ratios and per-token losses are computed in float32 (float64 when given) whatever
the input dtype, and positions outside the mask are replaced before any arithmetic, so padding
holding -inf gives neither NaN losses nor NaN gradients.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from bapo.core.batch import TokenBatch
from bapo.core.diagnostics import ClipStats, clip_statistics, compute_dtype
from bapo.core.search import SearchResult
from bapo.core.validation import check_dual_clip, check_normalizer, check_ratio_bounds, check_token_inputs, per_token

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class TokenLoss:
    """What a registered loss returns: loss [B, T], the ratio bounds in effect and the dual-clip
    cap (None = off), so the diagnostics count exactly the tokens the loss clipped.

    ratio: [B, T] the ratio the bounds were compared with when it is not the token ratio (GSPO's
    sequence ratio, repeated on each token of its sequence); None = batch.ratio. dropped: [B, T]
    bool, tokens removed from the gradient by the loss's own rule rather than by a bound
    (Clip-Cov, M2PO); the diagnostics count them in clip_frac/dropped."""

    loss: Tensor
    lower: float | Tensor
    upper: float | Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    dual_clip: float | None = None
    ratio: Tensor | None = None
    dropped: Tensor | None = None


def score(log_prob: Tensor) -> Tensor:
    """exp(log pi - sg(log pi)): value 1, gradient that of log pi (a REINFORCE term's carrier)."""
    return torch.exp(log_prob - log_prob.detach())


# A registered loss: fn(batch: TokenBatch, **its keyword-only parameters) -> TokenLoss.
PolicyLossFn = Callable[..., TokenLoss]


POLICY_LOSSES: dict[str, PolicyLossFn] = {}
# The aggregation each method's paper uses; policy_loss(loss_agg_mode=None) picks it.
PAPER_AGG_MODES: dict[str, str] = {}
# The methods that read TokenBatch.proximal_log_prob (policy_loss(proximal_log_prob=...) required).
PROXIMAL_METHODS: set[str] = set()


def register_policy_loss(
    name: str, agg_mode: str = "token-mean", needs_proximal: bool = False
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: make a loss available to `policy_loss(method=name)` (and the integrations);
    agg_mode: its paper's aggregation (one of LOSS_AGG_MODES); needs_proximal: it reads the
    proximal policy's log-probs (decoupled PPO), which the caller then must pass."""
    if agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"agg_mode: {agg_mode!r} is not one of {LOSS_AGG_MODES}")

    def register(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = fn
        PAPER_AGG_MODES[name] = agg_mode
        if needs_proximal:
            PROXIMAL_METHODS.add(name)
        else:
            PROXIMAL_METHODS.discard(name)
        return fn

    return register


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, lower: float | Tensor, upper: float | Tensor, dual_clip: float | None = None
) -> Tensor:
    """PPO's -min(r*A, clip(r, lower, upper)*A) per token [B, T]; dual_clip caps it at -dual_clip*A for A < 0."""
    unclipped = ratio * advantages
    # as_tensor: clamp takes a float or a per-token tensor bound alike
    clipped = torch.clamp(
        ratio,
        torch.as_tensor(lower, dtype=ratio.dtype, device=ratio.device),
        torch.as_tensor(upper, dtype=ratio.dtype, device=ratio.device),
    )
    clipped = clipped * advantages
    loss = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    return loss


def _fixed_bounds(default_lower: float, default_upper: float, default_dual_clip: float | None = None) -> PolicyLossFn:
    """A clipped surrogate with fixed ratio bounds; the registered baselines differ only in defaults."""

    def loss(
        batch: TokenBatch,
        *,
        lower: float = default_lower,
        upper: float = default_upper,
        dual_clip: float | None = default_dual_clip,
    ) -> TokenLoss:
        check_ratio_bounds(lower, upper)
        check_dual_clip(dual_clip)
        return TokenLoss(
            clipped_surrogate(batch.ratio, batch.advantages, lower, upper, dual_clip), lower, upper, dual_clip=dual_clip
        )

    return loss


register_policy_loss("grpo")(_fixed_bounds(0.8, 1.2))
register_policy_loss("clip-higher")(_fixed_bounds(0.8, 1.28))
register_policy_loss("dual-clip")(_fixed_bounds(0.8, 1.2, 3.0))


@register_policy_loss("bapo")
def bapo_loss(
    batch: TokenBatch,
    *,
    bounds: tuple[float, float] | SearchResult | None = None,
    dual_clip: float | None = None,
) -> TokenLoss:
    """Clipped surrogate with BAPO's adaptive bounds, solved before the loss runs.

    bounds: (lower, upper), or the SearchResult, that `bapo.core.BAPOStep` solved for this
    micro-batch (over the whole update and every rank in scope "step"; for one batch alone:
    `bapo.core.search_bounds`). The loss does no search of its own.
    """
    check_dual_clip(dual_clip)
    if bounds is None:
        raise ValueError(
            "bounds: method 'bapo' needs its ratio bounds: solve them with bapo.core.BAPOStep (bounds_for) "
            "or bapo.core.search_bounds(TokenBatch(ratio=..., advantages=..., mask=...), config) and pass "
            "bounds=(lower, upper)"
        )
    lower, upper = (bounds.lower, bounds.upper) if isinstance(bounds, SearchResult) else bounds
    check_ratio_bounds(lower, upper)
    return TokenLoss(
        clipped_surrogate(batch.ratio, batch.advantages, lower, upper, dual_clip), lower, upper, dual_clip=dual_clip
    )


TOPR_LEVELS = ("sequence", "token")


@register_policy_loss("topr", agg_mode="seq-mean-token-sum")
def topr_loss(batch: TokenBatch, *, level: str = "sequence", negative_ratio_max: float = 1.0) -> TokenLoss:
    """TOPR, tapered off-policy REINFORCE (arXiv 2503.14286, its Eq. for the TOPR gradient):
        grad J = sum_{A >= 0} A * grad log pi(y) + sum_{A < 0} sg(min(pi(y)/mu(y), 1)) * A * grad log pi(y)
    level="sequence" (the paper's): y is the whole response, log pi(y) = sum_t log pi(y_t) over
      masked tokens and pi(y)/mu(y) = prod_t r_t (from unclamped log-ratios; truncated at
      negative_ratio_max, 1 in the paper). Its aggregation is seq-mean-token-sum (a sum of
      log-probs per sequence, averaged over sequences), the default policy_loss picks.
    level="token": the same rule per token, weight sg(min(r_t, negative_ratio_max)) (bapo's earlier form).
    No ratio clips the positive side. The value is -A * weight; exp(log pi - sg(log pi)) = 1
    carries the gradient of log pi.
    """
    if level not in TOPR_LEVELS:
        raise ValueError(f"level: {level!r} is not one of {TOPR_LEVELS}")
    if not negative_ratio_max > 0.0:
        raise ValueError(f"negative_ratio_max: {negative_ratio_max} must be > 0")
    log_prob, old_log_prob = batch.log_probs()
    if level == "token":
        negative_weight = batch.ratio.detach().clamp(max=negative_ratio_max)
    else:
        # prod_t r_t in log space: a long stale response has a log-ratio sum far beyond the
        # per-token clamp, and only its minimum with log(negative_ratio_max) is ever exponentiated.
        counted = batch.mask.to(torch.bool)
        sequence_log_ratio = torch.where(counted, log_prob.detach() - old_log_prob, 0.0).sum(-1, keepdim=True)
        negative_weight = sequence_log_ratio.clamp(max=math.log(negative_ratio_max)).exp().expand_as(batch.ratio)
    weight = torch.where(batch.advantages >= 0, torch.ones_like(batch.ratio), negative_weight)
    # Nothing is clipped to zero gradient: diagnostics see the widest bounds.
    return TokenLoss(-batch.advantages * weight * score(log_prob), 0.0, float("inf"))


@register_policy_loss("dcpo", agg_mode="seq-mean-token-sum")
def dcpo_loss(
    batch: TokenBatch,
    *,
    eps_low: float = 0.16,
    eps_high: float = 0.2,
    ratio_max: float = 10.0,
    dual_clip: float | None = None,
) -> TokenLoss:
    """DCPO's dynamic adaptive clipping (arXiv 2509.02333): per-token ratio bounds from the prior
    probability q = pi_behaviour(y_t), from the constraint |(r - 1) * r| * q <= eps:
        lower = 0.5 + 0.5 * sqrt(max(1 - 4 eps_low / q, 0)),  upper = 0.5 + 0.5 * sqrt(1 + 4 eps_high / q),
    upper capped at ratio_max. At q = 1 they are (0.8, 1.17); they widen as q falls.
    DCPO complete = this loss + its smooth advantage standardisation (bapo.core.advantages.
    smooth_advantages, which needs each prompt's rewards across rollout steps: the caller's job)
    + its aggregation, token sums per response averaged over responses (seq-mean-token-sum, the
    default policy_loss picks) + dual-clip 3.0 as in DCPO's code (dual_clip; core default off).
    """
    for name, value in (("eps_low", eps_low), ("eps_high", eps_high)):
        if not value > 0.0:
            raise ValueError(f"{name}: {value} must be > 0")
    if not ratio_max > 1.0:
        raise ValueError(f"ratio_max: {ratio_max} must be > 1")
    check_dual_clip(dual_clip)
    prior = batch.log_probs()[1].detach().exp().clamp_min(1e-12)
    lower = 0.5 + 0.5 * torch.sqrt((1.0 - 4.0 * eps_low / prior).clamp_min(0.0))
    upper = (0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * eps_high / prior)).clamp(max=ratio_max)
    return TokenLoss(
        clipped_surrogate(batch.ratio, batch.advantages, lower, upper, dual_clip), lower, upper, dual_clip=dual_clip
    )


def off_policy_sequence_mask(
    log_prob: Tensor, sampling_log_prob: Tensor, advantages: Tensor, mask: Tensor, threshold: float
) -> Tensor:
    """Off-policy sequence masking (OPSM, DeepSeek-V3.2, arXiv 2512.02556, Eq. 9; TRL's
    off_policy_mask_threshold): a negative-advantage response whose mean log-ratio of the sampler
    to the current policy, (1/|y|) sum_t (log mu(y_t) - log pi(y_t)) over its masked tokens (a k1
    estimate of KL(mu || pi)), exceeds `threshold` is dropped from the loss:
        keep_t = A_t >= 0 or KL_seq <= threshold.
    log_prob [B, T]: the current policy's (read detached); sampling_log_prob [B, T]: the policy that
    sampled (the inference engine's when there is one, as TRL); advantages [B] or [B, T]; mask [B, T].
    A NaN log-ratio (a token the engine could not score) counts 0, as in TRL. Returns the 0/1 keep
    weights [B, T] (0 outside the mask), in log_prob's compute dtype; the caller multiplies them
    into the token weights the loss and BAPO's search both get."""
    if not threshold > 0.0:
        raise ValueError(f"threshold: {threshold} must be > 0 (DeepSeek-V3.2's delta, e.g. TRL's 0.5)")
    dtype = compute_dtype(log_prob, sampling_log_prob)
    counted = mask.to(torch.bool)
    log_ratio = torch.nan_to_num(sampling_log_prob.detach().to(dtype) - log_prob.detach().to(dtype), nan=0.0)
    log_ratio = torch.where(counted, log_ratio, 0.0)
    sequence_kl = log_ratio.sum(-1, keepdim=True) / counted.sum(-1, keepdim=True).clamp_min(1)
    keep = (per_token(advantages.detach().to(dtype), log_ratio) >= 0) | (sequence_kl <= threshold)
    return (keep & counted).to(dtype)


def aggregate_loss(
    token_loss: Tensor, mask: Tensor, mode: str = "token-mean", normalizer: float | Tensor | None = None
) -> Tensor:
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
    check_normalizer(normalizer)
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


def nearest_name(word: str, options: Any, cutoff: float = 0.6) -> str | None:
    """The option closest to a misspelt `word` (difflib), a transposition of its letters first
    ('gpro' -> 'grpo', not 'gspo'); None when nothing is close."""
    close = difflib.get_close_matches(word, list(options), n=3, cutoff=cutoff)
    close.sort(key=lambda option: sorted(option) != sorted(word))  # stable: difflib's order otherwise
    return close[0] if close else None


def loss_parameters(method: str) -> list[str]:
    """The keyword parameters the registered loss `method` takes (e.g. whether it has dual_clip)."""
    if method not in POLICY_LOSSES:
        near = nearest_name(method, POLICY_LOSSES)
        hint = f"; did you mean {near!r}?" if near else ""
        raise ValueError(f"method: unknown policy loss {method!r}{hint} Registered: {sorted(POLICY_LOSSES)}")
    return [name for name, p in inspect.signature(POLICY_LOSSES[method]).parameters.items() if p.kind is p.KEYWORD_ONLY]


#: Parameters a loss receives per call from BAPOStep, not from a config.
PER_CALL_PARAMETERS = ("bounds",)


def configurable_parameters(method: str) -> list[str]:
    """The keyword parameters of `method` a config may set: loss_parameters without `bounds`
    (BAPO's, which BAPOStep supplies per micro-batch)."""
    return [name for name in loss_parameters(method) if name not in PER_CALL_PARAMETERS]


def resolve_loss_params(method: str, params: dict | None = None, defaults: dict | None = None) -> dict[str, Any]:
    """The one resolution of a method's keyword parameters for policy_loss, with a framework's defaults.

    params: what the user set for this method (each must be one of its configurable
    parameters: ValueError naming the first that is not). defaults: the framework's value for
    parameters many methods share (e.g. {"dual_clip": 3.0}, {"lower": 1 - epsilon}); each one
    the method takes and `params` lacks is added, None values skipped (= the loss's own default).
    """
    accepted = configurable_parameters(method)
    params = dict(params or {})
    unknown = [name for name in params if name not in accepted]
    if unknown:
        raise ValueError(f"{unknown[0]}: not a parameter of the {method!r} loss; it takes {accepted}")
    for name, value in (defaults or {}).items():
        if name in accepted and name not in params and value is not None:
            params[name] = value
    return params


def _check_params(method: str, params: dict) -> PolicyLossFn:
    accepted = loss_parameters(method)
    fn = POLICY_LOSSES[method]
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
    loss_agg_mode: str | None = None,
    normalizer: float | Tensor | None = None,
    importance_weights: Tensor | None = None,
    proximal_log_prob: Tensor | None = None,
    entropy: Tensor | None = None,
    logits: Tensor | None = None,
    stats: ClipStats | None = None,
    validate: bool = True,
    **params: Any,
) -> tuple[Tensor, dict[str, float]]:
    """The policy-gradient loss of `method` and its diagnostics.

    log_prob: [B, T] current log-probs of the sampled tokens (carries grad); old_log_prob: [B, T]
    behaviour log-probs; advantages: [B, T] or [B]; mask: [B, T] 0/1; importance_weights: [B, T]
    optional detached per-token weights (rollout/training mismatch) multiplying the loss;
    proximal_log_prob: [B, T] log-probs of the proximal policy, for the methods in
    PROXIMAL_METHODS (decoupled PPO; required there, refused elsewhere);
    entropy [B, T] / logits [B, T, V]: optional, for the entropy diagnostic and the per-state
    quadrant split. loss_agg_mode: None = the method's paper's (PAPER_AGG_MODES). normalizer:
    the denominator of the whole update (> 0), see aggregate_loss. params: the method's own
    (lower=, upper=, dual_clip=, bounds=, level=, ...).
    stats: when given, this batch's additive diagnostics (ClipStats) are added into it in place
    and the returned metrics hold only "loss" and the method's own metrics (no host sync for
    them); the caller finalizes once per update. Returns (scalar loss in float32, or float64
    for float64 inputs; metrics).
    """
    fn = _check_params(method, params)
    if (proximal_log_prob is None) == (method in PROXIMAL_METHODS):
        raise ValueError(
            f"proximal_log_prob: method {method!r} needs the proximal policy's log-probs [B, T]"
            if proximal_log_prob is None
            else f"proximal_log_prob: method {method!r} does not read it; only {sorted(PROXIMAL_METHODS)} do"
        )
    loss_agg_mode = PAPER_AGG_MODES[method] if loss_agg_mode is None else loss_agg_mode
    if validate:
        named = {"log_prob": log_prob, "old_log_prob": old_log_prob, "advantages": advantages}
        if importance_weights is not None:
            named["importance_weights"] = importance_weights
        if proximal_log_prob is not None:
            named["proximal_log_prob"] = proximal_log_prob
        checks: tuple = ()
        if isinstance(normalizer, Tensor):
            checks = (
                (
                    lambda _: ~(torch.isfinite(normalizer) & (normalizer > 0)).all(),
                    "normalizer: must be finite and > 0 (the update's token or sequence count)",
                ),
            )
        check_token_inputs(named, mask, reference="log_prob", allow_row_vector=("advantages",), extra_checks=checks)
    dtype = compute_dtype(log_prob, old_log_prob)
    counted = mask.to(torch.bool)
    # Padding may hold -inf (or NaN): where() replaces it before any arithmetic and sends it no gradient.
    log_prob = torch.where(counted, log_prob.to(dtype), 0.0)
    old_log_prob = torch.where(counted, old_log_prob.detach().to(dtype), 0.0)
    advantages = torch.where(counted, per_token(advantages.detach().to(dtype), log_prob), 0.0)
    weights = None
    if importance_weights is not None:
        weights = torch.where(counted, importance_weights.detach().to(dtype), 0.0)
    proximal = None
    if proximal_log_prob is not None:
        proximal = torch.where(counted, proximal_log_prob.detach().to(dtype), 0.0)
    batch = TokenBatch.from_log_probs(
        log_prob, old_log_prob, advantages, mask, importance_weights=weights, proximal_log_prob=proximal
    )
    result = fn(batch, **params)
    token_loss = result.loss
    if weights is not None:
        token_loss = token_loss * weights
    loss = aggregate_loss(token_loss, mask, loss_agg_mode, normalizer)
    batch_stats = clip_statistics(
        log_prob,
        old_log_prob,
        advantages,
        mask,
        result.lower,
        result.upper,
        dual_clip=result.dual_clip,
        importance_weights=weights,
        entropy=entropy,
        logits=logits,
        clip_ratio=result.ratio,
        dropped=result.dropped,
    )
    if stats is not None:
        stats.add_(batch_stats)
        metrics = {}
    else:
        metrics = batch_stats.finalize()
    metrics["loss"] = float(loss.detach())
    metrics.update(result.metrics)
    return loss, metrics

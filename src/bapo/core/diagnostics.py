"""The quantities the BAPO paper plots, as additive sums over tokens.

Clipping convention (the paper's X_t): a positive-advantage token is clipped when r > upper, a
negative-advantage one when r < lower or, under dual-clip, r > dual_clip; every other masked token
carries gradient.

`clip_statistics` returns `ClipStats`: sums and counts (plus a few maxima) that add across
micro-batches (`+`) and ranks (`all_reduce`), like the search's `BoundStats`; `finalize` turns
them into shares and means with one host sync. `clip_diagnostics` is both steps for one batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from bapo.core.batch import LOG_RATIO_CLAMP, TokenBatch, compute_dtype, token_ratio
from bapo.core.search import token_contributions
from bapo.core.validation import per_token

QUADRANTS = ("high_pos", "high_neg", "low_pos", "low_neg")

# Slots of ClipStats.sums (added across parts) and ClipStats.maxima (combined by max).
SUM_FIELDS = (
    "parts",
    "entropy_parts",
    "tokens",
    "positive",
    "negative",
    "clipped_upper",
    "clipped_lower",
    "clipped_dual",
    "clipped_dropped",
    "contribution",
    "positive_contribution",
    *(f"{quadrant}/{part}" for quadrant in QUADRANTS for part in ("count", "contribution", "clipped")),
    "weight",
    "weight_log_prob",
    "weight_signal",
    "weight_log_prob_signal",
    "entropy",
    "approx_kl",
    "ratio",
    "lower",
    "upper",
)
MAX_FIELDS = ("ratio_max", "ratio_min_negated", "lower_max", "lower_min_negated", "upper_max", "upper_min_negated")


def k3_kl(log_ratio: Tensor) -> Tensor:
    """Per-token k3 estimate exp(x) - x - 1 >= 0 of KL(p || q), x = log q - log p on samples of p
    ([B, T]); x is clamped like the ratio and computed in float32 so the estimate stays finite."""
    clamped = log_ratio.to(compute_dtype(log_ratio)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return clamped.exp() - clamped - 1.0


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-token entropy [B, T] of the softmax over logits [B, T, V]."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)


@dataclass
class ClipStats:
    """Additive token statistics of the clipped surrogate, by name (SUM_FIELDS / MAX_FIELDS).

    sums: float64 [len(SUM_FIELDS)], added across micro-batches and ranks;
    maxima: float64 [len(MAX_FIELDS)], combined by max (minima are stored negated).
    Each is packed in its fields' order so that adding and all-reducing is one tensor operation;
    `of` packs named values, `named` unpacks them.
    """

    sums: Tensor
    maxima: Tensor

    @classmethod
    def empty(cls, device: torch.device | str | None = None) -> ClipStats:
        return cls(
            torch.zeros(len(SUM_FIELDS), dtype=torch.float64, device=device),
            torch.full((len(MAX_FIELDS),), -torch.inf, dtype=torch.float64, device=device),
        )

    @classmethod
    def of(
        cls,
        sums: dict[str, Tensor | float],
        maxima: dict[str, Tensor | float],
        device: torch.device | str | None = None,
    ) -> ClipStats:
        """Pack named scalars (tensors, or floats made on `device` without a host copy): every
        MAX_FIELDS name is required, a SUM_FIELDS name left out is 0."""
        unknown = (sums.keys() - set(SUM_FIELDS)) | (maxima.keys() - set(MAX_FIELDS))
        if unknown:
            raise KeyError(f"ClipStats.of: unknown fields {sorted(unknown)}")

        def scalar(value: Tensor | float) -> Tensor:
            if isinstance(value, Tensor):
                return value.to(device, torch.float64).reshape(())
            return torch.full((), float(value), dtype=torch.float64, device=device)

        return cls(
            torch.stack([scalar(sums.get(name, 0.0)) for name in SUM_FIELDS]),
            torch.stack([scalar(maxima[name]) for name in MAX_FIELDS]),
        )

    def named(self) -> dict[str, float]:
        """Every sum and maximum by its field name (one host sync)."""
        return {**dict(zip(SUM_FIELDS, self.sums.tolist())), **dict(zip(MAX_FIELDS, self.maxima.tolist()))}

    def __add__(self, other: ClipStats) -> ClipStats:
        other_sums, other_maxima = other.sums.to(self.sums.device), other.maxima.to(self.sums.device)
        return ClipStats(self.sums + other_sums, torch.maximum(self.maxima, other_maxima))

    def add_(self, other: ClipStats) -> ClipStats:
        """Add `other` into this one in place (a running total over micro-batches); returns self."""
        combined = self + other
        self.sums, self.maxima = combined.sums, combined.maxima
        return self

    def all_reduce(self, process_group: dist.ProcessGroup | None = None) -> None:
        """Combine over ranks in place: one SUM and one MAX collective (every rank must call it)."""
        dist.all_reduce(self.sums, op=dist.ReduceOp.SUM, group=process_group)
        dist.all_reduce(self.maxima, op=dist.ReduceOp.MAX, group=process_group)

    def finalize(self) -> dict[str, float]:
        """Shares and means (one host sync).

        Keys: clip_frac/upper (share of positive tokens above upper), clip_frac/lower (share of
        negative tokens below lower), clip_frac/dual (share of negative tokens above dual_clip),
        clip_frac/dropped (share of masked tokens a loss's own rule removed from the gradient:
        Clip-Cov's sampled tokens, M2PO's masked ones),
        clip_frac (all clipped / all masked tokens), positive_share (rho: positive tokens' share of
        sum w*|r*A|*X_t, NaN when no token carries signal), bapo/no_signal (1 when no masked token
        has a non-zero advantage), quadrant/{high,low}_{pos,neg}/{count,loss_share,clip_frac},
        quadrant/split_per_state (share of parts split per state by log pi > -H_t; 0 = batch-mean
        split), premise/{pos,neg}_{clipped,kept}_low_share (the rule's premise: share of
        low-probability tokens among the clipped vs the kept tokens of each sign, NaN when a
        group is empty; a clipped negative token is below lower or above dual_clip),
        entropy_change_estimate, entropy (when given), approx_kl, ratio/{mean,max,min}, lower, upper
        (exact when one value was used throughout, else the token-weighted mean), tokens.
        """
        values = self.named()
        tokens = values["tokens"]
        clipped = values["clipped_upper"] + values["clipped_lower"] + values["clipped_dual"] + values["clipped_dropped"]
        metrics = {
            "clip_frac/upper": _share(values["clipped_upper"], values["positive"]),
            "clip_frac/lower": _share(values["clipped_lower"], values["negative"]),
            "clip_frac/dual": _share(values["clipped_dual"], values["negative"]),
            "clip_frac/dropped": _share(values["clipped_dropped"], tokens),
            "clip_frac": _share(clipped, tokens),
            # sums of core.search.token_contributions (gradient definition, dual-clip included)
            "positive_share": _share(values["positive_contribution"], values["contribution"], float("nan")),
            "bapo/no_signal": float(values["positive"] + values["negative"] == 0),
            **_quadrant_metrics(values),
        }
        metrics["quadrant/split_per_state"] = _share(values["entropy_parts"], values["parts"])
        metrics.update(_premise_metrics(values))
        weight = values["weight"]
        covariance = _share(values["weight_log_prob_signal"], weight) - (
            _share(values["weight_log_prob"], weight) * _share(values["weight_signal"], weight)
        )
        metrics["entropy_change_estimate"] = -covariance
        if values["entropy_parts"] > 0:
            metrics["entropy"] = _share(values["entropy"], tokens)
        metrics["approx_kl"] = _share(values["approx_kl"], tokens)
        metrics["ratio/mean"] = _share(values["ratio"], tokens)
        metrics["ratio/max"] = values["ratio_max"] if tokens > 0 else 0.0
        metrics["ratio/min"] = -values["ratio_min_negated"] if tokens > 0 else 0.0
        for name in ("lower", "upper"):
            highest, lowest = values[f"{name}_max"], -values[f"{name}_min_negated"]
            metrics[name] = highest if highest == lowest else _share(values[name], tokens)
        metrics["tokens"] = tokens
        return metrics


def _share(numerator: float, denominator: float, empty: float = 0.0) -> float:
    return numerator / denominator if denominator > 0 else empty


def _quadrant_metrics(values: dict[str, float]) -> dict[str, float]:
    """quadrant/<quadrant>/{count, loss_share, clip_frac} from the named sums."""
    metrics = {}
    for quadrant in QUADRANTS:
        count = values[f"{quadrant}/count"]
        metrics[f"quadrant/{quadrant}/count"] = count
        metrics[f"quadrant/{quadrant}/loss_share"] = _share(values[f"{quadrant}/contribution"], values["contribution"])
        metrics[f"quadrant/{quadrant}/clip_frac"] = _share(values[f"{quadrant}/clipped"], count)
    return metrics


def _premise_metrics(values: dict[str, float]) -> dict[str, float]:
    """The Entropy-Clip Rule's premise, measured: premise/{pos,neg}_{clipped,kept}_low_share is
    the share of low-probability tokens (the quadrants' split: log pi < -H_t per state when
    entropy is given) among the positive (negative) tokens the clip removed versus those it kept.
    The rule's argument needs pos_clipped_low_share > pos_kept_low_share (the upper clip removes
    entropy-raising updates) and the mirror for negative tokens; NaN where a group is empty."""
    metrics = {}
    for sign, side in (("pos", "positive"), ("neg", "negative")):
        low_clipped, high_clipped = values[f"low_{sign}/clipped"], values[f"high_{sign}/clipped"]
        low_kept = values[f"low_{sign}/count"] - low_clipped
        kept = values[side] - low_clipped - high_clipped
        metrics[f"premise/{sign}_clipped_low_share"] = _share(low_clipped, low_clipped + high_clipped, float("nan"))
        metrics[f"premise/{sign}_kept_low_share"] = _share(low_kept, kept, float("nan"))
    return metrics


def _masked_extremes(values: Tensor, counted: Tensor) -> tuple[Tensor, Tensor]:
    """(max, -min) of values [B, T] over counted positions; -inf each when none."""
    if values.numel() == 0:
        return torch.full((), -torch.inf), torch.full((), -torch.inf)
    return (torch.where(counted, values, -torch.inf).amax(), torch.where(counted, -values, -torch.inf).amax())


def _high_probability(log_prob: Tensor, counted: Tensor, entropy: Tensor | None) -> Tensor:
    """[B, T] True where a token is high-probability: log pi > -H_t per state when the per-token
    entropy is given, else log pi at or above the batch's mean log pi."""
    if entropy is not None:
        return log_prob > -entropy
    return log_prob >= (log_prob * counted).sum() / counted.sum().clamp_min(1)


def _quadrant_sums(
    positive: Tensor, negative: Tensor, high_prob: Tensor, contribution: Tensor, carries_gradient: Tensor
) -> dict[str, Tensor]:
    """<quadrant>/{count, contribution, clipped} of the four quadrants (all masks [B, T])."""
    members_of = {
        "high_pos": positive & high_prob,
        "high_neg": negative & high_prob,
        "low_pos": positive & ~high_prob,
        "low_neg": negative & ~high_prob,
    }
    sums = {}
    for quadrant, members in members_of.items():
        sums[f"{quadrant}/count"] = members.sum()
        sums[f"{quadrant}/contribution"] = torch.where(members, contribution, 0.0).sum()
        sums[f"{quadrant}/clipped"] = (members & ~carries_gradient).sum()
    return sums


def _bound_sums(
    bound: float | Tensor, counted: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor | float, Tensor | float]:
    """(token sum, max, -min) of a bound (float, or per-token [B, T]) over the counted tokens [B, T]."""
    if isinstance(bound, Tensor):  # per-token bounds (DCPO)
        bound = bound.detach().to(dtype).expand_as(counted)
        return (torch.where(counted, bound, 0.0).sum(), *_masked_extremes(bound, counted))
    # An infinite bound (TOPR's upper) stays exact through the extremes; its sum is unused.
    return counted.sum() * (bound if abs(bound) < torch.inf else 0.0), float(bound), -float(bound)


@torch.no_grad()
def clip_statistics(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    lower: float | Tensor,
    upper: float | Tensor,
    *,
    dual_clip: float | None = None,
    importance_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    logits: Tensor | None = None,
    clip_ratio: Tensor | None = None,
    dropped: Tensor | None = None,
) -> ClipStats:
    """Additive statistics of one (micro-)batch; see ClipStats.finalize for what they become.

    log_prob, old_log_prob, mask: [B, T]; advantages: [B, T] or [B]; lower/upper: floats or
    per-token [B, T] bounds; dual_clip: cap on the ratio of negative tokens (None = off);
    importance_weights: optional [B, T] per-token loss multipliers (rollout correction) weighting
    each token's |r*A| and the covariance; entropy: [B, T] or logits: [B, T, V] (optional).
    clip_ratio: [B, T] the ratio the loss compared with its bounds when that is not the token
    ratio (GSPO's sequence ratio on every token of the sequence); clipping and the positive share
    read it, ratio/* and approx_kl stay the token ratio's. dropped: [B, T] bool, tokens the loss
    removed from the gradient by a rule of its own (Clip-Cov, M2PO): X_t = 0, clip_frac/dropped.

    Quadrants split high/low probability per state, log pi(y_t) > -H_t (the paper's split), when
    per-token entropy is given, else at this batch's mean log pi. entropy_change_estimate is
    -Cov_w[log pi, A*X] pooled over every token of every state (weights w = importance weights),
    the sign of one step's entropy change under the Entropy-Clip Rule, not the per-state
    covariance of the theory. Values outside the mask are never read (they may be -inf).
    """
    counted = mask.to(torch.bool)
    dtype = compute_dtype(log_prob, old_log_prob)
    # Padding may hold -inf or NaN: replace it before any arithmetic.
    log_prob = torch.where(counted, log_prob.detach().to(dtype), 0.0)
    old_log_prob = torch.where(counted, old_log_prob.detach().to(dtype), 0.0)
    advantages = torch.where(counted, per_token(advantages.detach().to(dtype), log_prob), 0.0)
    weight = counted.to(dtype)
    if importance_weights is not None:
        weight = torch.where(counted, importance_weights.detach().to(dtype), 0.0)
    ratio = token_ratio(log_prob, old_log_prob)
    bounded = ratio if clip_ratio is None else torch.where(counted, clip_ratio.detach().to(dtype), 1.0)
    removed = counted & dropped.to(torch.bool) if dropped is not None else torch.zeros_like(counted)

    positive = counted & (advantages > 0)
    negative = counted & (advantages < 0)
    # a dropped token counts once, as dropped, whatever its ratio
    clipped_upper = positive & (bounded > upper) & ~removed
    clipped_lower = negative & (bounded < lower) & ~removed
    clipped_dual = negative & (bounded > dual_clip) & ~removed if dual_clip is not None else torch.zeros_like(counted)
    carries_gradient = counted & ~clipped_upper & ~clipped_lower & ~clipped_dual & ~removed
    # w*|r*A|*X_t per token (float64): the search's gradient definition, the one positive share
    positive_part, negative_part = token_contributions(
        TokenBatch(ratio=bounded, advantages=advantages, mask=counted, importance_weights=importance_weights),
        lower,
        upper,
        dual_clip=dual_clip,
    )
    if dropped is not None:
        positive_part, negative_part = (torch.where(removed, 0.0, part) for part in (positive_part, negative_part))
    contribution = positive_part + negative_part
    if logits is not None and entropy is None:
        entropy = entropy_from_logits(logits)
    if entropy is not None:
        entropy = torch.where(counted, entropy.detach().to(dtype), 0.0)

    signal = advantages * carries_gradient
    sums: dict[str, Tensor | float] = {
        "parts": 1.0,
        "entropy_parts": float(entropy is not None),
        "tokens": counted.sum(),
        "positive": positive.sum(),
        "negative": negative.sum(),
        "clipped_upper": clipped_upper.sum(),
        "clipped_lower": clipped_lower.sum(),
        "clipped_dual": clipped_dual.sum(),
        "clipped_dropped": removed.sum(),
        "contribution": contribution.sum(),
        "positive_contribution": positive_part.sum(),
        **_quadrant_sums(
            positive, negative, _high_probability(log_prob, counted, entropy), contribution, carries_gradient
        ),
        "weight": weight.sum(),
        "weight_log_prob": (weight * log_prob).sum(),
        "weight_signal": (weight * signal).sum(),
        "weight_log_prob_signal": (weight * log_prob * signal).sum(),
        "approx_kl": torch.where(counted, k3_kl(log_prob - old_log_prob), 0.0).sum(),
        "ratio": torch.where(counted, ratio, 0.0).sum(),
    }
    if entropy is not None:
        sums["entropy"] = entropy.sum()
    maxima: dict[str, Tensor | float] = dict(zip(("ratio_max", "ratio_min_negated"), _masked_extremes(ratio, counted)))
    for name, bound in (("lower", lower), ("upper", upper)):
        sums[name], maxima[f"{name}_max"], maxima[f"{name}_min_negated"] = _bound_sums(bound, counted, dtype)
    return ClipStats.of(sums, maxima, device=log_prob.device)


def clip_diagnostics(*args: Any, **kwargs: Any) -> dict[str, float]:
    """clip_statistics(*args, **kwargs).finalize() for one batch (the same parameters): clip
    fractions per side, positive share, Entropy-Clip quadrants, entropy-change estimate (see
    ClipStats.finalize for the keys). One host sync."""
    return clip_statistics(*args, **kwargs).finalize()


# Slots of token_kind_sums, added across micro-batches and ranks like ClipStats.sums.
TOKEN_KIND_FIELDS = ("kind_entropy", "kind_tokens", "other_entropy", "other_tokens")


def token_kind_sums(entropy: Tensor, response_mask: Tensor, kind_mask: Tensor) -> Tensor:
    """The sums behind entropy split by token kind, float64 [4] in TOKEN_KIND_FIELDS' order:
    the entropy summed over the masked tokens of the kind and their count, then the same over the
    other masked tokens. entropy [B, T] float, response_mask [B, T] bool, kind_mask [B, T] bool
    (e.g. the tokens that spell digits: the answer of an arithmetic task, against the words
    around it). Additive, so micro-batches and ranks add up before token_kind_metrics."""
    entropy = entropy.detach().to(torch.float64)
    kind = kind_mask & response_mask
    other = ~kind_mask & response_mask
    return torch.stack(
        [(entropy * kind).sum(), kind.sum().to(torch.float64), (entropy * other).sum(), other.sum().to(torch.float64)]
    )


def token_kind_metrics(sums: Tensor, kind: str = "digit") -> dict[str, float]:
    """entropy/<kind> and entropy/other (mean per-token entropy of each kind, NaN when it has no
    token) and tokens/<kind>_share (the kind's share of the masked tokens) from token_kind_sums."""
    kind_entropy, kind_tokens, other_entropy, other_tokens = sums.tolist()
    total = kind_tokens + other_tokens
    return {
        f"entropy/{kind}": kind_entropy / kind_tokens if kind_tokens else float("nan"),
        "entropy/other": other_entropy / other_tokens if other_tokens else float("nan"),
        f"tokens/{kind}_share": kind_tokens / total if total else float("nan"),
    }

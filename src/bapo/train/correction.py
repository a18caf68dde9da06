"""Rollout correction: the gap between the engine that sampled (vLLM) and the trainer's weights.

With `rollout.backend=vllm` every token carries two behaviour log-probs of the same policy
version: `engine` (what vLLM reported while sampling) and `trainer` (the trainer's own no-grad
forward of those weights, the ratio's denominator). They differ by kernels, precision and
the CPU weight packing; this module measures the gap and turns it into per-token loss weights

    w = pi_trainer / pi_engine = exp(trainer - engine)

exactly as verl's rollout correction (`compute_rollout_correction_weights`: token or sequence
level, log-ratio clamped to +-20 before exp; TIS = `clamp(max=cap)`, IcePop/MIS = 0 outside
[lower, cap], "lower_upper" thresholds) and TRL's `vllm_importance_sampling_correction` (`token_truncate`,
`sequence_mask`, ...) compute them. The weights multiply the token loss through
`policy_loss(importance_weights=...)`, and BAPO's bound search gets the same weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

# the clamp bapo.core applies to every log-ratio before exp; verl's SAFETY_BOUND is the same 20
from bapo.core.diagnostics import LOG_RATIO_CLAMP


def correction_weights(
    trainer_log_prob: Tensor,
    engine_log_prob: Tensor,
    mask: Tensor,
    mode: str,
    level: str = "token",
    cap: float = 2.0,
    lower: float = 0.0,
) -> tuple[Tensor | None, Tensor]:
    """(weights [B, T] or None for mode "none", raw ratios [B, T] before truncation/masking).

    level "token": one ratio per token; "sequence": exp(sum over the response of the token
    log-ratios), the same for every token of the row. Padding gets weight 0 and ratio 1.
    """
    counted = mask.to(torch.bool)
    log_ratio = torch.where(counted, trainer_log_prob.double() - engine_log_prob.double(), 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"correction level {level!r}: use token or sequence")
    ratio = torch.where(counted, torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), 1.0)
    if mode == "none":
        return None, ratio.float()
    if mode == "tis":
        weights = ratio.clamp(max=cap)
    elif mode in ("mis", "icepop"):  # icepop: mis with a lower bound > 0 (config: its defaults [0.5, 5])
        weights = torch.where((ratio >= lower) & (ratio <= cap), ratio, 0.0)
    else:
        raise ValueError(f"correction mode {mode!r}: use none, tis, mis or icepop")
    return torch.where(counted, weights, 0.0).float(), ratio.float()


def logp_gap_metrics(gap: Tensor) -> dict[str, float]:
    """rollout/logp_diff/{mean, max} of the |trainer - engine| log-prob gaps [n] (n > 0) of the counted tokens."""
    gap = gap.double()
    return {"rollout/logp_diff/mean": float(gap.mean()), "rollout/logp_diff/max": float(gap.max())}


def mismatch_metrics(
    trainer_log_prob: Tensor, engine_log_prob: Tensor, mask: Tensor, ratio: Tensor, weights: Tensor | None, cap: float
) -> dict[str, float]:
    """rollout/logp_diff/{mean, max} (|trainer - engine| over the tokens), rollout/is_ratio/{mean,
    max, min} of the raw ratio, rollout/is_ratio/above_cap (share of tokens whose ratio exceeds
    the cap: the tail truncation or masking acts on) and rollout/is_weight/{mean, zeroed} when
    a correction is on."""
    counted = mask.to(torch.bool)
    if not bool(counted.any()):
        return {}
    diff = (trainer_log_prob.double() - engine_log_prob.double()).abs()[counted]
    raw = ratio[counted].double()
    out = {
        **logp_gap_metrics(diff),
        "rollout/is_ratio/mean": float(raw.mean()),
        "rollout/is_ratio/max": float(raw.max()),
        "rollout/is_ratio/min": float(raw.min()),
        "rollout/is_ratio/above_cap": float((raw > cap).double().mean()),
    }
    if weights is not None:
        kept = weights[counted].double()
        out["rollout/is_weight/mean"] = float(kept.mean())
        out["rollout/is_weight/zeroed"] = float((kept == 0).double().mean())
    return out

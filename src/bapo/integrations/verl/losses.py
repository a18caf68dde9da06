"""bapo's losses in verl's policy-loss registry (`verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY`).

Each registered function has verl's signature
    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
        -> (loss, metrics)
and computes through `bapo.core.policy_loss`. verl calls it once per micro-batch from
`verl.workers.utils.losses.ppo_loss`, with `config` the actor's `ActorConfig`; the micro-batch's
share of the whole mini-batch is in `config.global_batch_info` (dp_size, batch_num_tokens,
global_batch_size, loss_scale_factor), which `core_aggregation` turns into bapo.core's
(loss_agg_mode, normalizer) so the loss equals verl's `agg_loss` on the same per-token loss.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch
from torch import Tensor
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

from bapo.core import policy_loss
from bapo.core.diagnostics import LOG_RATIO_CLAMP
from bapo.integrations.verl.compat import check_verl_api
from bapo.integrations.verl.config import BAPOPolicyLossConfig

logger = logging.getLogger(__name__)

VERL_LOSSES = ("bapo", "topr", "dcpo")
METRIC_PREFIX = "actor/bapo/"
# bapo.core metrics that verl already logs under its own names (actor/pg_loss) or that do not
# average meaningfully over micro-batches.
DROPPED_METRICS = ("loss", "tokens")


def core_aggregation(
    loss_agg_mode: str,
    response_mask: Tensor,
    dp_size: int = 1,
    batch_num_tokens: Optional[float] = None,
    global_batch_size: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
) -> tuple[str, float | Tensor]:
    """verl's `agg_loss(loss_mat, response_mask, loss_agg_mode, **global_batch_info)` as bapo.core's
    `aggregate_loss(loss_mat, response_mask, mode, normalizer)`: returns (mode, normalizer).

    response_mask: [B, T] of this micro-batch. verl scales every mode by dp_size (DDP/FSDP average
    the gradients over ranks), so the normalizer is the global denominator / dp_size. Without
    global info (one process, no dp) the denominators are this micro-batch's own, as in verl:
    masked tokens, or sequences with at least one masked token.
    """
    counted = response_mask.to(torch.float32)
    if loss_agg_mode == "token-sum":
        return "token-mean", 1.0 / dp_size
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None and dp_size > 1:
            raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
        tokens = batch_num_tokens if batch_num_tokens is not None else counted.sum()
        return "token-mean", tokens / dp_size
    if loss_agg_mode not in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        raise ValueError(f"loss_agg_mode: {loss_agg_mode!r} is not one of verl's modes")
    if global_batch_size is None and dp_size > 1:
        raise ValueError("global_batch_size is required when dp_size > 1")
    sequences = global_batch_size if global_batch_size is not None else (counted.sum(-1) > 0).sum()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        horizon = loss_scale_factor if loss_scale_factor is not None else response_mask.shape[-1]
        return loss_agg_mode, sequences * horizon / dp_size
    return loss_agg_mode, sequences / dp_size


def verl_metrics(core_metrics: dict[str, float], k1_kl: float, policy_loss_config: Any) -> dict[str, float]:
    """bapo.core's diagnostics under verl's metric names.

    actor/pg_clipfrac: share of masked tokens whose clipped term is active (verl's meaning);
    actor/ppo_kl: verl's k1 estimate mean(old_log_prob - log_prob); everything else under
    actor/bapo/... (lower, upper, positive_share, clip_frac/upper, clip_frac/lower, quadrants,
    approx_kl, ...). verl's actor/pg_clipfrac_lower (its dual-clip fraction) is not emitted.
    With bounds solved over the whole mini-batch, positive_share, reached and steps are the
    search's, over all ranks. Non-finite values (TOPR's unbounded upper) are left out.
    """
    metrics = {"actor/pg_clipfrac": core_metrics["clip_frac"], "actor/ppo_kl": k1_kl}
    for name, value in core_metrics.items():
        if name not in DROPPED_METRICS and math.isfinite(value):
            metrics[METRIC_PREFIX + name] = value
    solved = getattr(policy_loss_config, "solved", None)
    if solved is not None:
        metrics[METRIC_PREFIX + "positive_share"] = solved.positive_share
        metrics[METRIC_PREFIX + "reached"] = float(solved.reached)
        metrics[METRIC_PREFIX + "steps"] = float(solved.steps)
    return metrics


def _k1_kl(log_prob: Tensor, old_log_prob: Tensor, response_mask: Tensor) -> Tensor:
    """verl's actor/ppo_kl: masked mean of old_log_prob - log_prob (clamped as verl does)."""
    log_ratio = (log_prob.detach() - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    counted = response_mask.to(log_ratio.dtype)
    return -(log_ratio * counted).sum() / counted.sum().clamp_min(1.0)


_warned_per_micro_batch = False


def _core_params(method: str, policy_loss_config: Any) -> dict[str, Any]:
    """bapo.core parameters from verl's policy_loss config; a plain PolicyLossConfig gives defaults."""
    global _warned_per_micro_batch
    if isinstance(policy_loss_config, BAPOPolicyLossConfig):
        params = policy_loss_config.core_params(method)
    else:
        params = {}
    if method == "bapo" and params.get("bounds") is None and not _warned_per_micro_batch:
        _warned_per_micro_batch = True
        logger.warning(
            "bapo: no bounds solved for this optimizer step, searching on each micro-batch alone. "
            "Set actor_rollout_ref.actor.policy_loss._target_=bapo.integrations.verl.BAPOPolicyLossConfig "
            "so that the bounds are solved over the whole mini-batch and all data-parallel ranks."
        )
    return params


def make_verl_loss(method: str):
    """verl policy-loss function computing bapo.core's `method` (one of VERL_LOSSES)."""

    def verl_policy_loss(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Optional[Tensor] = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """All tensors [B, T] of one micro-batch; config: verl's ActorConfig. Returns (loss, metrics)."""
        if config is None:
            raise ValueError("config: verl's ActorConfig is required (verl passes it from ppo_loss)")
        policy_loss_config = config.policy_loss
        mode, normalizer = core_aggregation(loss_agg_mode, response_mask, **config.global_batch_info)
        loss, core_metrics = policy_loss(
            log_prob,
            old_log_prob,
            advantages,
            response_mask,
            method,
            loss_agg_mode=mode,
            normalizer=normalizer,
            importance_weights=rollout_is_weights,
            **_core_params(method, policy_loss_config),
        )
        k1_kl = float(_k1_kl(log_prob, old_log_prob, response_mask))
        return loss, verl_metrics(core_metrics, k1_kl, policy_loss_config)

    verl_policy_loss.__name__ = verl_policy_loss.__qualname__ = f"verl_{method}_loss"
    return verl_policy_loss


def register_verl_losses() -> None:
    """Put `bapo`, `topr` and `dcpo` into verl's registry (idempotent; warns before replacing another)."""
    check_verl_api()  # fail here, loudly, if this verl calls losses with other arguments
    for method in VERL_LOSSES:
        existing = POLICY_LOSS_REGISTRY.get(method)
        if existing is not None and existing.__module__ == __name__:
            continue
        if existing is not None:
            logger.warning("verl policy loss %r from %s is replaced by bapo's", method, existing.__module__)
        register_policy_loss(method)(make_verl_loss(method))

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

from bapo.core import (
    BALANCE_FIELDS,
    BAPOConfig,
    BAPOStep,
    SearchResult,
    TokenBatch,
    balance_metrics,
    balance_sums,
    policy_loss,
    search_bounds,
    search_metrics,
)
from bapo.core.diagnostics import LOG_RATIO_CLAMP
from bapo.core.losses import resolve_loss_params
from bapo.integrations.verl.compat import check_verl_api
from bapo.integrations.verl.config import BAPOPolicyLossConfig

logger = logging.getLogger(__name__)

# bapo.core losses verl lacks (its own gspo, cispo, sapo, geo_mean, clip_cov, kl_cov are the same formulas)
VERL_LOSSES = ("bapo", "topr", "dcpo", "m2po", "m2po-official")
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


def verl_metrics(
    core_metrics: dict[str, float], k1_kl: float, search: dict[str, float] | None = None
) -> dict[str, float]:
    """bapo.core's diagnostics under verl's metric names.

    actor/pg_clipfrac: share of masked tokens whose clipped term is active (verl's meaning);
    actor/pg_clipfrac_lower: verl's dual-clip fraction (negative tokens with ratio > clip_ratio_c,
    over all masked tokens); actor/ppo_kl: verl's k1 estimate mean(old_log_prob - log_prob);
    everything else under actor/bapo/... (lower, upper, positive_share, clip_frac/upper,
    clip_frac/lower, clip_frac/dual, quadrants, approx_kl, ...; bapo/no_signal as actor/bapo/no_signal).
    search: bapo.core.search_metrics of the bounds in effect, logged as actor/bapo/search/*.
    The key set must not vary between micro-batches (verl aggregates each key over micro-batches
    and data-parallel ranks and refuses unequal counts), so a missing value (no signal: NaN share;
    pos/neg inf when no negative contribution) is logged as NaN; only a method's structurally
    unbounded ratio bound (TOPR's upper, inf in every micro-batch) is left out.
    """
    negative = core_metrics["quadrant/high_neg/count"] + core_metrics["quadrant/low_neg/count"]
    metrics = {
        "actor/pg_clipfrac": core_metrics["clip_frac"],
        "actor/ppo_kl": k1_kl,
        "actor/pg_clipfrac_lower": core_metrics["clip_frac/dual"] * negative / max(core_metrics["tokens"], 1.0),
    }
    for name, value in core_metrics.items():
        if name in DROPPED_METRICS or (name in ("lower", "upper") and math.isinf(value)):
            continue
        metrics[METRIC_PREFIX + name.removeprefix("bapo/")] = value if math.isfinite(value) else math.nan
    for name, value in (search or {}).items():
        metrics["actor/" + name] = value if math.isfinite(value) else math.nan
    return metrics


def _k1_kl(log_prob: Tensor, old_log_prob: Tensor, response_mask: Tensor) -> Tensor:
    """verl's actor/ppo_kl: masked mean of old_log_prob - log_prob (clamped as verl does)."""
    log_ratio = (log_prob.detach() - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    counted = response_mask.to(log_ratio.dtype)
    return -(log_ratio * counted).sum() / counted.sum().clamp_min(1.0)


_warned_per_micro_batch = False


def _core_params(method: str, config: Any) -> dict[str, Any]:
    """bapo.core parameters from verl's config (ActorConfig): its policy_loss (a plain
    PolicyLossConfig gives core's defaults) and, for bapo and dcpo, the dual-clip cap
    clip_ratio_c read as vanilla reads it (default 3.0; BAPOPolicyLossConfig.dual_clip overrides)."""
    policy_loss_config = getattr(config, "policy_loss", None)
    if policy_loss_config is None and method == "bapo":
        # verl's distillation path passes its DistillationLossConfig, which has no policy_loss.
        raise ValueError(
            f"policy_loss_mode: 'bapo' needs the actor's policy_loss config (actor_rollout_ref.actor.policy_loss, "
            f"a BAPOPolicyLossConfig), which this caller's {type(config).__name__} lacks (verl's distillation "
            f"loss); set its policy_loss_mode to 'vanilla'"
        )
    getter = config.get if hasattr(config, "get") else lambda name, default: getattr(config, name, default)
    clip_ratio_c = getter("clip_ratio_c", 3.0)
    if isinstance(policy_loss_config, BAPOPolicyLossConfig):
        return policy_loss_config.core_params(method, clip_ratio_c)
    return resolve_loss_params(method, {}, {"dual_clip": clip_ratio_c})


def _active_step(config: Any) -> BAPOStep | None:
    """The BAPOStep of the optimizer update in progress, attached to config.policy_loss by
    BAPOTrainingWorker; None outside one (another actor worker, or a call outside verl's update)."""
    policy_loss_config = getattr(config, "policy_loss", None)
    step = policy_loss_config.step if isinstance(policy_loss_config, BAPOPolicyLossConfig) else None
    return step if step is not None and step.in_update else None


def _bapo_bounds(config: Any, batch: TokenBatch) -> tuple[SearchResult, dict[str, float]]:
    """This micro-batch's bounds and their bapo/search/* metrics and bapo/target: from the
    worker's BAPOStep (scope step: the step's bounds; scope micro_batch: searched on this
    micro-batch, one all-reduce over the data-parallel group), or, without a BAPOTrainingWorker,
    searched on this micro-batch alone (with a one-time warning)."""
    global _warned_per_micro_batch
    step = _active_step(config)
    if step is not None:
        found = step.bounds_for(batch)
        return found, step.metrics(step.searches[-1:])
    search_config = _search_config(config)
    if search_config.target_mode == "entropy":
        raise ValueError(
            "policy_loss.target_mode: 'entropy' needs bapo's actor worker (BAPOTrainingWorker), which feeds "
            "the entropy controller, and this loss runs outside it (another ActorRolloutRefWorker.actor_worker_cls, "
            "or a call outside verl's actor update): use BAPOTrainingWorker or set policy_loss.target_mode=fixed"
        )
    if not _warned_per_micro_batch:
        _warned_per_micro_batch = True
        logger.warning(
            "bapo: no bounds solved for this optimizer step, searching on each micro-batch alone. "
            "Set actor_rollout_ref.actor.policy_loss._target_=bapo.integrations.verl.BAPOPolicyLossConfig "
            "so that the bounds are solved over the whole mini-batch and all data-parallel ranks."
        )
    found = search_bounds(batch, search_config, validate=False)
    return found, {
        **search_metrics([(found, int(batch.mask.sum()))], "micro_batch"),
        "bapo/target": search_config.target,
    }


def _search_config(config: Any) -> BAPOConfig:
    """The BAPOConfig of the actor's policy_loss (a BAPOPolicyLossConfig), else bapo's defaults."""
    policy_loss_config = getattr(config, "policy_loss", None)
    if isinstance(policy_loss_config, BAPOPolicyLossConfig):
        return policy_loss_config.bapo_config()
    return BAPOConfig()


def balance(batch: TokenBatch, search_config: BAPOConfig) -> dict[str, float]:
    """bapo.core.balance_metrics of one micro-batch (batch: what the search reads, mask bool):
    response_length/{rewarded, unrewarded}, a response counting as rewarded when its advantage is
    > 0 (verl's loss sees no rewards), and positive_share/start_bounds, plus its sums as
    balance/<field>. verl averages every key over micro-batches and ranks, so the three named
    values are means of micro-batch values (NaN where a micro-batch has no response of a kind),
    while the ratio of two balance/* sums (e.g. balance/rewarded_tokens /
    balance/rewarded_responses) is exactly the mini-batch's value."""
    rewarded = (batch.advantages.detach() * batch.mask).sum(-1) > 0  # [B] (verl's advantages are [B, T])
    sums = balance_sums(batch, rewarded, search_config)
    return {**balance_metrics(sums), **{f"balance/{name}": value for name, value in zip(BALANCE_FIELDS, sums.tolist())}}


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
        params = _core_params(method, config)
        mode, normalizer = core_aggregation(loss_agg_mode, response_mask, **config.global_batch_info)
        search = None
        search_batch = TokenBatch.from_log_probs(  # what BAPO's search and the balance metrics read
            log_prob.detach(),
            old_log_prob,
            advantages,
            response_mask.to(torch.bool),
            importance_weights=rollout_is_weights,
        )
        if method == "bapo":
            params["bounds"], search = _bapo_bounds(config, search_batch)
        loss, core_metrics = policy_loss(
            log_prob,
            old_log_prob,
            advantages,
            response_mask,
            method,
            loss_agg_mode=mode,
            normalizer=normalizer,
            importance_weights=rollout_is_weights,
            **params,
        )
        k1_kl = float(_k1_kl(log_prob, old_log_prob, response_mask))
        core_metrics.update(balance(search_batch, _search_config(config)))
        return loss, verl_metrics(core_metrics, k1_kl, search)

    verl_policy_loss.__name__ = verl_policy_loss.__qualname__ = f"verl_{method}_loss"
    return verl_policy_loss


def register_verl_losses() -> None:
    """Put VERL_LOSSES into verl's registry (idempotent; warns before replacing another)."""
    check_verl_api()  # fail here, loudly, if this verl calls losses with other arguments
    for method in VERL_LOSSES:
        existing = POLICY_LOSS_REGISTRY.get(method)
        if existing is not None and existing.__module__ == __name__:
            continue
        if existing is not None:
            logger.warning("verl policy loss %r from %s is replaced by bapo's", method, existing.__module__)
        register_policy_loss(method)(make_verl_loss(method))

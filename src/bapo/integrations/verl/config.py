"""`BAPOPolicyLossConfig`: the parameters of bapo's losses inside verl's actor config.

verl's `PolicyLossConfig` is a fixed dataclass; verl builds it with Hydra from the `_target_` of
`actor_rollout_ref.actor.policy_loss`, so a subclass named there carries new fields without
patching verl:

    actor_rollout_ref.actor.policy_loss._target_=bapo.integrations.verl.BAPOPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=bapo
    +actor_rollout_ref.actor.policy_loss.target=0.5

This module is the dataclass only; it imports nothing of bapo's verl worker. The worker
(`bapo.integrations.verl.worker.BAPOTrainingWorker`) attaches the run's `bapo.core.BAPOStep` to
this config (`attach_step`), and the registered loss reads it from the `config` argument verl
passes it (`config.policy_loss.step`): the bounds of each micro-batch come from that step.
Registration and the worker's installation live in `bapo.integrations.verl.plugin`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from verl.workers.config import PolicyLossConfig

from bapo.core import BAPOConfig, BAPOStep

# The losses whose bounds BAPOTrainingWorker solves (BAPOStep), per optimizer step or micro-batch.
BOUND_SEARCH_LOSSES = ("bapo",)


@dataclass
class BAPOPolicyLossConfig(PolicyLossConfig):
    """verl's PolicyLossConfig plus the parameters of bapo's `bapo`, `topr` and `dcpo` losses.

    bapo (defaults: bapo.core.BAPOConfig, bapo's gradient share; every BAPOConfig field, see its
      docstring): target, target_kind ("share" = rho0 | "pos_neg"), order, contribution,
      weighting, stepping, pos_neg_eps, lower_start/lower_max/lower_step and
      upper_start/upper_max/upper_step (ratio bounds, not epsilons), target_mode and the
      target_* fields of the entropy controller (target_mode=entropy: rho0 set each optimizer
      step by BAPOTrainingWorker from the policy entropy, see bapo.core.target); dual_clip
      (optional cap on the loss of negative tokens, > 1). BAPOConfig.paper() / .recipe() give
      the values of the paper and the recipe.
    topr: negative_ratio_max (truncation of the IS ratio of negative tokens).
    dcpo: eps_low, eps_high, ratio_max.
    None means bapo.core's default for that loss.

    scope: "step" (bounds over the mini-batch and all ranks, solved by BAPOTrainingWorker) or
      "micro_batch" (each micro-batch's loss solves its own, one all-reduce per micro-batch;
      needs actor.use_dynamic_bsz=False so that every rank runs the same number of micro-batches).
    """

    loss_mode: str = "bapo"
    target: float = BAPOConfig.target
    target_kind: str = BAPOConfig.target_kind
    scope: str = BAPOConfig.scope
    order: str = BAPOConfig.order
    lower_start: float = BAPOConfig.lower_start
    lower_max: float = BAPOConfig.lower_max
    lower_step: float = BAPOConfig.lower_step
    upper_start: float = BAPOConfig.upper_start
    upper_max: float = BAPOConfig.upper_max
    upper_step: float = BAPOConfig.upper_step
    contribution: str = BAPOConfig.contribution
    weighting: str = BAPOConfig.weighting
    stepping: str = BAPOConfig.stepping
    pos_neg_eps: float = BAPOConfig.pos_neg_eps
    target_mode: str = BAPOConfig.target_mode
    target_entropy: float = BAPOConfig.target_entropy
    target_hold_updates: int = BAPOConfig.target_hold_updates
    target_min: float = BAPOConfig.target_min
    target_max: float = BAPOConfig.target_max
    target_gain: float = BAPOConfig.target_gain
    target_integral_gain: float = BAPOConfig.target_integral_gain
    dual_clip: Optional[float] = None
    negative_ratio_max: Optional[float] = None
    eps_low: Optional[float] = None
    eps_high: Optional[float] = None
    ratio_max: Optional[float] = None

    def __post_init__(self) -> None:
        getattr(super(), "__post_init__", lambda: None)()
        self.bapo_config()  # a bad search space or target fails here, when Hydra builds the config

    def bapo_config(self) -> BAPOConfig:
        """The search space and target as bapo.core's BAPOConfig."""
        return BAPOConfig(**{spec.name: getattr(self, spec.name) for spec in fields(BAPOConfig)})

    @property
    def searches_bounds(self) -> bool:
        """True when the selected loss needs bounds solved by BAPOTrainingWorker's BAPOStep."""
        return self.loss_mode in BOUND_SEARCH_LOSSES

    @property
    def step(self) -> BAPOStep | None:
        """The run's BAPOStep, attached by BAPOTrainingWorker; None when another worker runs the loss."""
        return self.__dict__.get("_bapo_step")

    def attach_step(self, step: BAPOStep) -> None:
        """Give the loss the worker's BAPOStep. Not a dataclass field (verl's frozen BaseConfig
        refuses to reassign those, and a step is run state, not configuration)."""
        object.__setattr__(self, "_bapo_step", step)

    def core_params(self, method: str) -> dict[str, Any]:
        """Keyword parameters of bapo.core.policy_loss(method=...) taken from this config (bapo's
        bounds come from `step`)."""
        if method == "bapo":
            return {"dual_clip": self.dual_clip}
        names = {"topr": ("negative_ratio_max",), "dcpo": ("eps_low", "eps_high", "ratio_max")}[method]
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

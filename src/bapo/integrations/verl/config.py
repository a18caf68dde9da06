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

from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Optional

from verl.workers.config import PolicyLossConfig

from bapo.core import BAPOConfig, BAPOStep
from bapo.core.losses import resolve_loss_params

# The losses whose bounds BAPOTrainingWorker solves (BAPOStep), per optimizer step or micro-batch.
BOUND_SEARCH_LOSSES = ("bapo",)
# This config's fields that are parameters of bapo.core losses (each goes to the methods that take it).
LOSS_PARAMETERS = ("negative_ratio_max", "eps_low", "eps_high", "ratio_max", "budget")


#: Every BAPOConfig field, generated (its help text as metadata); None = the value of `preset`.
_BAPOConfigFields = make_dataclass(
    "_BAPOConfigFields",
    [
        (spec.name, Optional[type(spec.default)], field(default=None, metadata={"help": spec.metadata["help"]}))
        for spec in fields(BAPOConfig)
    ],
)


@dataclass
class BAPOPolicyLossConfig(_BAPOConfigFields, PolicyLossConfig):
    """verl's PolicyLossConfig plus the parameters of bapo's `bapo`, `topr`, `dcpo`, `m2po` and `m2po-official` losses.

    bapo: preset (one of bapo.core.PRESETS: "default" = bapo's gradient share, "paper" = Eq. 8
      literally, "recipe" = the public verl recipe's loop) and every BAPOConfig field (generated
      from it, help text included: target, target_kind, order, scope, contribution, weighting,
      stepping, pos_neg_eps, lower_*/upper_* ratio bounds, target_mode and the target_* fields
      of the entropy controller); a field left None takes the preset's value. dual_clip:
      optional cap on the loss of negative tokens (> 1; None = the actor's clip_ratio_c, 3.0).
      scope=micro_batch needs actor.use_dynamic_bsz=False (the same micro-batch count per rank).
    topr: negative_ratio_max (truncation of the IS ratio of negative tokens).
    dcpo: eps_low, eps_high, ratio_max.
    m2po, m2po-official: budget (the second-moment budget, 0.04; m2po-official's floors keep the
      official code's 0.7 / 1.5, since lower_max / upper_min here are BAPO's search bounds).
    None means bapo.core's default for that loss.
    """

    loss_mode: str = "bapo"
    preset: str = "default"
    dual_clip: Optional[float] = None
    negative_ratio_max: Optional[float] = None
    eps_low: Optional[float] = None
    eps_high: Optional[float] = None
    ratio_max: Optional[float] = None
    budget: Optional[float] = None

    def __post_init__(self) -> None:
        getattr(super(), "__post_init__", lambda: None)()
        self.bapo_config()  # a bad search space or target fails here, when Hydra builds the config

    def bapo_config(self) -> BAPOConfig:
        """The search space and target as bapo.core's BAPOConfig: `preset`, then the fields set."""
        given = {spec.name: getattr(self, spec.name) for spec in fields(BAPOConfig)}
        return BAPOConfig.preset(self.preset, **{name: value for name, value in given.items() if value is not None})

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

    def core_params(self, method: str, dual_clip: float | None = None) -> dict[str, Any]:
        """Keyword parameters of bapo.core.policy_loss(method=...) from this config (bapo's bounds
        come from `step`): the loss parameters set here, dual_clip defaulting to `dual_clip`
        (verl's clip_ratio_c) for a method that takes one."""
        own = {name: getattr(self, name) for name in LOSS_PARAMETERS}
        return resolve_loss_params(
            method, {}, {**own, "dual_clip": self.dual_clip if self.dual_clip is not None else dual_clip}
        )

"""`BAPOPolicyLossConfig`: the parameters of bapo's losses inside verl's actor config.

verl's `PolicyLossConfig` is a fixed dataclass; verl builds it with Hydra from the `_target_` of
`actor_rollout_ref.actor.policy_loss`, so a subclass named there carries new fields without
patching verl:

    actor_rollout_ref.actor.policy_loss._target_=bapo.integrations.verl.BAPOPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=bapo
    +actor_rollout_ref.actor.policy_loss.target=0.5

Building it (verl does so in every actor worker, in `ActorRolloutRefWorker.init_model`, just
before it builds its inner `TrainingWorker`) also installs the per-mini-batch bound search; see
`bapo.integrations.verl.worker`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import Any, Optional

from verl.workers.config import PolicyLossConfig

from bapo.core import BAPOConfig, SearchResult

# The losses whose bounds are solved once per optimizer step, before the first micro-batch.
BOUND_SEARCH_LOSSES = ("bapo",)


@dataclass
class BAPOPolicyLossConfig(PolicyLossConfig):
    """verl's PolicyLossConfig plus the parameters of bapo's `bapo`, `topr` and `dcpo` losses.

    bapo (defaults: bapo.core.BAPOConfig, the paper's): target, target_kind ("share" = rho0,
      "pos_neg" = the public recipe's pos/neg ratio), order ("upper-first" | "lower-first"),
      lower_start/lower_max/lower_step and upper_start/upper_max/upper_step (ratio bounds, not
      epsilons), dual_clip (optional cap on the loss of negative tokens, > 1).
    topr: negative_ratio_max (truncation of the IS ratio of negative tokens).
    dcpo: eps_low, eps_high, ratio_max.
    None means bapo.core's default for that loss.

    `solved` is runtime state, not configuration: the bounds searched over the current
    mini-batch on all ranks (a `SearchResult`), set by `BAPOTrainingWorker` for one optimizer
    step and read by the registered `bapo` loss.
    """

    _mutable_fields = PolicyLossConfig._mutable_fields | {"solved"}

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
    dual_clip: Optional[float] = None
    negative_ratio_max: Optional[float] = None
    eps_low: Optional[float] = None
    eps_high: Optional[float] = None
    ratio_max: Optional[float] = None

    def __post_init__(self) -> None:
        getattr(super(), "__post_init__", lambda: None)()
        self.solved: SearchResult | None = None
        self.bapo_config()  # fail at config time, with bapo.core's message, on a bad search space
        _install_worker_hook()

    def bapo_config(self) -> BAPOConfig:
        """The search space and target as bapo.core's BAPOConfig."""
        return BAPOConfig(**{spec.name: getattr(self, spec.name) for spec in fields(BAPOConfig)})

    @property
    def searches_bounds(self) -> bool:
        """True when the selected loss needs bounds solved over the whole mini-batch."""
        return self.loss_mode in BOUND_SEARCH_LOSSES

    def core_params(self, method: str) -> dict[str, Any]:
        """Keyword parameters of bapo.core.policy_loss(method=...) taken from this config."""
        if method == "bapo":
            bounds = None if self.solved is None else (self.solved.lower, self.solved.upper)
            return {"bapo": self.bapo_config(), "bounds": bounds, "dual_clip": self.dual_clip}
        names = {"topr": ("negative_ratio_max",), "dcpo": ("eps_low", "eps_high", "ratio_max")}[method]
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def _install_worker_hook() -> None:
    """Install the bound-search worker where verl's actor workers live (their module is loaded).

    In an actor worker, `verl.workers.engine_workers` is always imported by the time verl builds
    this config; elsewhere (a driver validating configs, a unit test) nothing is installed and
    nothing heavy is imported.
    """
    if "verl.workers.engine_workers" in sys.modules:
        from bapo.integrations.verl.worker import install

        install()

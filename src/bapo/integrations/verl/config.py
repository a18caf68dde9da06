"""`BAPOPolicyLossConfig`: the parameters of bapo's losses inside verl's actor config.

verl's `PolicyLossConfig` is a fixed dataclass; verl builds it with Hydra from the `_target_` of
`actor_rollout_ref.actor.policy_loss`, so a subclass named there carries new fields without
patching verl:

    actor_rollout_ref.actor.policy_loss._target_=bapo.integrations.verl.BAPOPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=bapo
    +actor_rollout_ref.actor.policy_loss.target=0.5

The config holds configuration only. What the worker solves for one optimizer step reaches the
loss through `step_bounds`, a context variable the worker sets around that step
(`optimizer_step_bounds`); the worker itself is installed from the plugin entry point
(`install_worker_hook`, run when `bapo.integrations.verl` is imported); see
`bapo.integrations.verl.worker`.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import Any, Optional

from verl.workers.config import PolicyLossConfig

from bapo.core import BAPOConfig, SearchResult

# The losses whose bounds are solved once per optimizer step, before the first micro-batch.
BOUND_SEARCH_LOSSES = ("bapo",)
WORKER_MODULE = "verl.workers.engine_workers"


@dataclass(frozen=True)
class StepBounds:
    """What the worker hands the loss for one optimizer step.

    solved: scope "step": the bounds searched over the whole mini-batch on all ranks.
    process_group: scope "micro_batch": the data-parallel group each micro-batch's loss
      all-reduces its bucket sums over (None: the default group).
    config: the search config of this step (the policy_loss's, with rho0 set by the worker's
      entropy controller under target_mode=entropy); None: the policy_loss's own.
    """

    scope: str
    solved: SearchResult | None = None
    tokens: int = 0  # tokens the step search saw (this rank)
    process_group: Any = None
    config: BAPOConfig | None = None


_step_bounds: ContextVar[StepBounds | None] = ContextVar("bapo_verl_step_bounds", default=None)


@contextmanager
def optimizer_step_bounds(bounds: StepBounds) -> Iterator[StepBounds]:
    """Make `bounds` visible to the bapo loss for the optimizer step run inside this block."""
    token = _step_bounds.set(bounds)
    try:
        yield bounds
    finally:
        _step_bounds.reset(token)


def step_bounds() -> StepBounds | None:
    """The bounds of the optimizer step in progress (None outside BAPOTrainingWorker.train_batch)."""
    return _step_bounds.get()


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
        """True when the selected loss needs bounds solved over the whole mini-batch."""
        return self.loss_mode in BOUND_SEARCH_LOSSES

    def core_params(self, method: str) -> dict[str, Any]:
        """Keyword parameters of bapo.core.policy_loss(method=...) taken from this config (bounds: see step_bounds)."""
        if method == "bapo":
            return {"bapo": self.bapo_config(), "dual_clip": self.dual_clip}
        names = {"topr": ("negative_ratio_max",), "dcpo": ("eps_low", "eps_high", "ratio_max")}[method]
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class _InstallAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs `install()` right after verl's worker module has been imported (one shot)."""

    def find_spec(self, name, path, target=None):
        if name != WORKER_MODULE:
            return None
        sys.meta_path.remove(self)  # find the real module below us, and never fire twice
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        self.real_loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.real_loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.real_loader.exec_module(module)
        from bapo.integrations.verl.worker import install

        install()


def install_worker_hook() -> None:
    """Make verl's actor workers build `BAPOTrainingWorker`: now when verl's worker module is
    loaded, else right after it is first imported. Called by `bapo.integrations.verl`, which verl
    imports in every process through the `verl.plugins` entry point; imports nothing heavy itself."""
    if WORKER_MODULE in sys.modules:
        from bapo.integrations.verl.worker import install

        install()
    elif not any(isinstance(finder, _InstallAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _InstallAfterImport())

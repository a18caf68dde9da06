"""`BAPOGRPOConfig`: TRL's `GRPOConfig` plus the fields that choose and tune a `bapo.core` loss.

Every field is prefixed `bapo_` so that it cannot collide with TRL's or Transformers' arguments
and reads unambiguously on a command line (`--bapo_method bapo --bapo_target 0.4`).
The `bapo_<name>` fields mirror `bapo.core.BAPOConfig.<name>` one to one (same defaults, read
from BAPOConfig itself), and `bapo_config()` builds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from trl import GRPOConfig

from bapo.core import POLICY_LOSSES, BAPOConfig

_BAPO_DEFAULTS = BAPOConfig()

#: TRL `loss_type` -> `bapo.core` `loss_agg_mode`. The normalizer of each (so that the summed
#: micro-batch losses equal TRL's loss of the whole optimizer step) is set by the trainer.
LOSS_TYPE_TO_AGG_MODE = {
    "dapo": "token-mean",  # tokens of the global accumulated batch (TRL's default)
    "bnpo": "token-mean",  # tokens of the local micro-batch
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",  # fixed denominator: sequences x max_completion_length
}


def _bapo_field(name: str, help_text: str) -> Any:
    """A dataclass field whose default is `BAPOConfig().<name>` (no second copy of the defaults)."""
    return field(default=getattr(_BAPO_DEFAULTS, name), metadata={"help": help_text})


@dataclass
class BAPOGRPOConfig(GRPOConfig):
    """`GRPOConfig` whose clipped surrogate is replaced by `bapo.core.policy_loss(method=bapo_method)`.

    TRL's `loss_type` keeps choosing the aggregation (see LOSS_TYPE_TO_AGG_MODE); TRL's
    `epsilon` / `epsilon_high` give the fixed bounds of the non-adaptive methods unless
    `bapo_lower` / `bapo_upper` are set. Options of TRL's own loss that `bapo.core` has no
    counterpart for are refused here, before any model is loaded.
    """

    bapo_method: str = field(
        default="bapo",
        metadata={"help": f"bapo.core policy loss: one of {sorted(POLICY_LOSSES)}."},
    )
    bapo_lower: float | None = field(
        default=None,
        metadata={
            "help": "Lower ratio bound of the fixed-bound methods (grpo, clip-higher, dual-clip); "
            "None = 1 - epsilon. A ratio, not an epsilon."
        },
    )
    bapo_upper: float | None = field(
        default=None,
        metadata={
            "help": "Upper ratio bound of the fixed-bound methods; None = 1 + epsilon_high "
            "(or 1 + epsilon). A ratio, not an epsilon."
        },
    )
    bapo_method_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": 'Other parameters of the chosen loss, e.g. {"dual_clip": 3.0} or '
            '{"negative_ratio_max": 1.0} (a dict, or a JSON string on the command line).'
        },
    )
    bapo_target: float = _bapo_field("target", "BAPO target: positive share rho0, or pos/neg with target_kind=pos_neg.")
    bapo_lower_start: float = _bapo_field("lower_start", "BAPO: lower ratio bound the search starts from.")
    bapo_lower_max: float = _bapo_field("lower_max", "BAPO: largest lower ratio bound.")
    bapo_lower_step: float = _bapo_field("lower_step", "BAPO: step of the lower bound.")
    bapo_upper_start: float = _bapo_field("upper_start", "BAPO: upper ratio bound the search starts from.")
    bapo_upper_max: float = _bapo_field("upper_max", "BAPO: largest upper ratio bound.")
    bapo_upper_step: float = _bapo_field("upper_step", "BAPO: step of the upper bound.")
    bapo_order: str = _bapo_field(
        "order",
        "BAPO: 'upper-first' (paper) or 'lower-first' (the recipe's order only; "
        "the whole recipe is BAPOConfig.recipe()).",
    )
    bapo_target_kind: str = _bapo_field(
        "target_kind",
        "BAPO: 'share' (rho0) or 'pos_neg' (the recipe's kind of target; the whole recipe is BAPOConfig.recipe()).",
    )
    bapo_scope: str = _bapo_field(
        "scope", "BAPO: bounds per optimizer 'step' (exact) or per 'micro_batch' (no extra forward)."
    )
    bapo_contribution: str = _bapo_field(
        "contribution",
        "BAPO: 'gradient' (|r*A| of unclipped tokens) or 'clamped' (clipped-surrogate values: paper Eq. 8, recipe).",
    )
    bapo_weighting: str = _bapo_field(
        "weighting", "BAPO: 'none' or 'behaviour_prob' (paper Eq. 8: tokens weighted by pi_old)."
    )
    bapo_stepping: str = _bapo_field(
        "stepping", "BAPO: 'grid' (start + k*step) or 'add_clamped' (recipe: min(cur + step, max))."
    )
    bapo_pos_neg_eps: float = _bapo_field(
        "pos_neg_eps", "BAPO: pos/(neg + eps) for target_kind=pos_neg (recipe: 1e-8)."
    )
    bapo_target_mode: str = _bapo_field(
        "target_mode", "BAPO: 'fixed' rho0 or 'entropy' (rho0 steered so entropy tracks a target)."
    )
    bapo_target_entropy: float = _bapo_field(
        "target_entropy",
        "BAPO entropy mode: entropy to track; <= 0 holds the mean of the first target_hold_updates updates.",
    )
    bapo_target_hold_updates: int = _bapo_field(
        "target_hold_updates", "BAPO entropy mode: updates averaged for the held target."
    )
    bapo_target_min: float = _bapo_field("target_min", "BAPO entropy mode: smallest rho0.")
    bapo_target_max: float = _bapo_field("target_max", "BAPO entropy mode: largest rho0.")
    bapo_target_gain: float = _bapo_field("target_gain", "BAPO entropy mode: proportional gain on log(target/entropy).")
    bapo_target_integral_gain: float = _bapo_field("target_integral_gain", "BAPO entropy mode: integral gain.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.bapo_method_kwargs, str):
            self.bapo_method_kwargs = json.loads(self.bapo_method_kwargs)
        self._refuse_unsupported()
        self.bapo_config()  # validates the search space now rather than at the first step

    def bapo_config(self) -> BAPOConfig:
        """The `bapo.core.BAPOConfig` of the `bapo_<name>` fields."""
        return BAPOConfig(**{spec.name: getattr(self, f"bapo_{spec.name}") for spec in fields(BAPOConfig)})

    @property
    def bapo_loss_agg_mode(self) -> str:
        """The `bapo.core` aggregation TRL's `loss_type` stands for."""
        return LOSS_TYPE_TO_AGG_MODE[self.loss_type]

    def bapo_loss_params(self) -> dict[str, Any]:
        """Keyword parameters of `policy_loss` for `bapo_method` (BAPO's bounds come per micro-batch from
        the trainer's BAPOStep, built from `bapo_config()`)."""
        params = dict(self.bapo_method_kwargs or {})
        if self.bapo_method in ("grpo", "clip-higher", "dual-clip"):
            epsilon_high = self.epsilon_high if self.epsilon_high is not None else self.epsilon
            params.setdefault("lower", self.bapo_lower if self.bapo_lower is not None else 1.0 - self.epsilon)
            params.setdefault("upper", self.bapo_upper if self.bapo_upper is not None else 1.0 + epsilon_high)
        return params

    def _refuse_unsupported(self) -> None:
        """Raise ValueError, naming the field, for TRL options bapo's losses do not implement."""
        if self.bapo_method not in POLICY_LOSSES:
            raise ValueError(f"bapo_method: {self.bapo_method!r} is not one of {sorted(POLICY_LOSSES)}")
        if self.loss_type not in LOSS_TYPE_TO_AGG_MODE:
            raise ValueError(
                f"loss_type: {self.loss_type!r} is TRL's own surrogate, not an aggregation; with bapo use one of "
                f"{sorted(LOSS_TYPE_TO_AGG_MODE)} (or TRL's GRPOTrainer for {self.loss_type!r})"
            )
        refused = {
            "importance_sampling_level": (
                self.importance_sampling_level != "token",
                "bapo's losses clip token ratios; use 'token'",
            ),
            "delta": (self.delta is not None, "TRL's two-sided clip; use bapo_method='dual-clip' instead"),
            "entropy_coef": (
                self.entropy_coef != 0.0 or self.use_adaptive_entropy,
                "the entropy bonus is not supported with bapo losses",
            ),
        }
        for name, (is_set, reason) in refused.items():
            if is_set:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not supported by BAPOGRPOTrainer: {reason}")
        uses_fixed_bounds = self.bapo_method in ("grpo", "clip-higher", "dual-clip")
        if not uses_fixed_bounds and (self.bapo_lower is not None or self.bapo_upper is not None):
            raise ValueError(f"bapo_lower/bapo_upper: only the fixed-bound methods take them, not {self.bapo_method!r}")

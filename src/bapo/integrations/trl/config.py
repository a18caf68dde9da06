"""`BAPOGRPOConfig`: TRL's `GRPOConfig` plus the fields that choose and tune a `bapo.core` loss.

Every field is prefixed `bapo_` so that it cannot collide with TRL's or Transformers' arguments
and reads unambiguously on a command line (`--bapo_method bapo --bapo_target 0.4`).
The `bapo_<name>` fields are generated from `bapo.core.BAPOConfig.<name>` (its help text; None =
the value of the preset `bapo_preset`, bapo's defaults unless set), and `bapo_config()` builds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

from trl import GRPOConfig

from bapo.core import POLICY_LOSSES, PROXIMAL_METHODS, BAPOConfig
from bapo.core.losses import configurable_parameters, resolve_loss_params
from bapo.core.search_config import PRESETS

#: TRL `loss_type` -> `bapo.core` `loss_agg_mode`. The normalizer of each (so that the summed
#: micro-batch losses equal TRL's loss of the whole optimizer step) is set by the trainer.
LOSS_TYPE_TO_AGG_MODE = {
    "dapo": "token-mean",  # tokens of the global accumulated batch (TRL's default)
    "bnpo": "token-mean",  # tokens of the local micro-batch
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",  # fixed denominator: sequences x max_completion_length
}
#: The dual-clip cap of bapo_method=bapo when bapo_dual_clip is None: `bapo train`'s loss.dual_clip
#: and verl's clip_ratio_c default. The fixed-bound methods stay without one, as TRL's own GRPO.
BAPO_DUAL_CLIP = 3.0

#: `bapo_<name>` for every BAPOConfig field, generated: the help text is BAPOConfig's own.
_BAPOConfigFields = make_dataclass(
    "_BAPOConfigFields",
    [
        (
            f"bapo_{spec.name}",
            type(spec.default) | None,
            field(
                default=None,
                metadata={"help": f"BAPO: {spec.metadata['help']}. None = the preset's ({spec.default!r} by default)."},
            ),
        )
        for spec in fields(BAPOConfig)
    ],
)


@dataclass
class BAPOGRPOConfig(_BAPOConfigFields, GRPOConfig):
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
    bapo_preset: str = field(
        default="default",
        metadata={
            "help": f"BAPO preset, one of {tuple(PRESETS)}: bapo's default, the paper's Eq. 8, the public verl "
            "recipe; every bapo_<field> given overrides it."
        },
    )
    bapo_dual_clip: float | None = field(
        default=None,
        metadata={
            "help": f"Cap on the ratio of negative-advantage tokens for a loss that takes one; None = "
            f"{BAPO_DUAL_CLIP} for bapo_method=bapo (as bapo train and verl), off for the others (TRL's GRPO "
            "has none); bapo_method_kwargs={'dual_clip': null} turns it off."
        },
    )

    bapo_minibatch_split: str = field(
        default="groups",
        metadata={
            "help": "How a generation batch is shuffled before TRL splits it into steps_per_generation "
            "micro-batches: groups (whole prompt groups, so an optimizer step holds all num_generations "
            "completions of its prompts where the batch sizes allow; bapo train's offpolicy.minibatch_split) "
            "| rows (TRL's own row shuffle, which splits groups across optimizer steps)."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bapo_minibatch_split not in ("groups", "rows"):
            raise ValueError(f"bapo_minibatch_split: {self.bapo_minibatch_split!r} is not one of groups, rows")
        if isinstance(self.bapo_method_kwargs, str):
            self.bapo_method_kwargs = json.loads(self.bapo_method_kwargs)
        self._refuse_unsupported()
        self.bapo_config()  # validates the search space now rather than at the first step
        self.bapo_loss_params()  # and the method's parameters

    def bapo_config(self) -> BAPOConfig:
        """The `bapo.core.BAPOConfig` of `bapo_preset` and the `bapo_<name>` fields that are set."""
        given = {spec.name: getattr(self, f"bapo_{spec.name}") for spec in fields(BAPOConfig)}
        return BAPOConfig.preset(
            self.bapo_preset, **{name: value for name, value in given.items() if value is not None}
        )

    @property
    def bapo_loss_agg_mode(self) -> str:
        """The `bapo.core` aggregation TRL's `loss_type` stands for."""
        return LOSS_TYPE_TO_AGG_MODE[self.loss_type]

    def bapo_loss_params(self) -> dict[str, Any]:
        """Keyword parameters of `policy_loss` for `bapo_method` (BAPO's bounds come per micro-batch from
        the trainer's BAPOStep, built from `bapo_config()`): bapo_method_kwargs, then TRL's defaults."""
        epsilon_high = self.epsilon_high if self.epsilon_high is not None else self.epsilon
        defaults = {
            "lower": self.bapo_lower if self.bapo_lower is not None else 1.0 - self.epsilon,
            "upper": self.bapo_upper if self.bapo_upper is not None else 1.0 + epsilon_high,
            "dual_clip": BAPO_DUAL_CLIP
            if self.bapo_dual_clip is None and self.bapo_method == "bapo"
            else self.bapo_dual_clip,
        }
        try:
            return resolve_loss_params(self.bapo_method, self.bapo_method_kwargs, defaults)
        except ValueError as err:
            raise ValueError(f"bapo_method_kwargs: {err}") from None

    def _refuse_unsupported(self) -> None:
        """Raise ValueError, naming the field, for TRL options bapo's losses do not implement."""
        if self.bapo_method not in POLICY_LOSSES:
            raise ValueError(f"bapo_method: {self.bapo_method!r} is not one of {sorted(POLICY_LOSSES)}")
        if self.bapo_method in PROXIMAL_METHODS:
            raise ValueError(
                f"bapo_method: {self.bapo_method!r} needs a proximal policy's log-probs, which this trainer "
                "does not compute; use `bapo train` for it"
            )
        if self.loss_type not in LOSS_TYPE_TO_AGG_MODE:
            raise ValueError(
                f"loss_type: {self.loss_type!r} is TRL's own surrogate, not an aggregation; with bapo use one of "
                f"{sorted(LOSS_TYPE_TO_AGG_MODE)}"
                + (
                    f" and bapo_method={self.loss_type!r} (bapo.core's, tested equal to TRL's)"
                    if self.loss_type in POLICY_LOSSES
                    else f" (or TRL's GRPOTrainer for {self.loss_type!r})"
                )
            )
        refused = {
            "importance_sampling_level": (
                self.importance_sampling_level != "token",
                "bapo's losses take token ratios; use 'token', and bapo_method='gspo' for GSPO's sequence ratio",
            ),
            "delta": (self.delta is not None, "TRL's two-sided clip; use bapo_method='dual-clip' instead"),
            "entropy_coef": (
                self.entropy_coef != 0.0,
                "the entropy bonus is not supported with bapo losses; set entropy_coef=0.0 "
                "(bapo train has one: loss.entropy_coef)",
            ),
            "use_adaptive_entropy": (
                self.use_adaptive_entropy,
                "the entropy bonus is not supported with bapo losses; set use_adaptive_entropy=False "
                "(bapo_target_mode='entropy' steers BAPO's target share by entropy instead)",
            ),
        }
        for name, (is_set, reason) in refused.items():
            if is_set:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not supported by BAPOGRPOTrainer: {reason}")
        uses_fixed_bounds = {"lower", "upper"} <= set(configurable_parameters(self.bapo_method))
        if not uses_fixed_bounds and (self.bapo_lower is not None or self.bapo_upper is not None):
            raise ValueError(f"bapo_lower/bapo_upper: only the fixed-bound methods take them, not {self.bapo_method!r}")

"""What BAPO's bound search searches (arXiv 2510.18927, Algorithm 1): BAPOConfig (target, start
bounds, steps, maxima, path order, the share definition), its presets (the paper's settings, the
public verl recipe's) and the candidate grid of each bound. How it searches: bapo.core.search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Tolerance for "start + k*step <= max" so that a grid meant to end on max (3.0) keeps it
# despite float rounding (1.2 + 36*0.05 = 3.0000000000000004).
GRID_TOLERANCE = 1e-9
ORDERS = ("upper-first", "lower-first")
TARGET_KINDS = ("share", "pos_neg")
SCOPES = ("step", "micro_batch")
CONTRIBUTIONS = ("gradient", "clamped")
WEIGHTINGS = ("none", "behaviour_prob")
STEPPINGS = ("grid", "add_clamped")
TARGET_MODES = ("fixed", "entropy")
# arXiv 2510.18927: Eq. 8 literally, Algorithm 1's order, the paper's rho0 and ranges.
PAPER_SETTINGS = {
    "target": 0.4,
    "target_kind": "share",
    "contribution": "clamped",
    "weighting": "behaviour_prob",
    "lower_start": 0.6,
    "lower_max": 0.9,
    "lower_step": 0.02,
    "upper_start": 1.2,
    "upper_max": 3.0,
    "upper_step": 0.05,
    "order": "upper-first",
    "stepping": "grid",
    "pos_neg_eps": 0.0,
}
# The public verl recipe: recipe/bapo/policy_loss.py (loop, pos/(neg + eps)) and config/bapo_trainer.yaml.
RECIPE_SETTINGS = {
    "target": 1.0,
    "target_kind": "pos_neg",
    "contribution": "clamped",
    "weighting": "none",
    "lower_start": 0.6,
    "lower_max": 0.8,
    "lower_step": 0.05,
    "upper_start": 1.2,
    "upper_max": 2.0,
    "upper_step": 0.05,
    "order": "lower-first",
    "stepping": "add_clamped",
    "pos_neg_eps": 1e-8,
}


def _field(default: Any, help_text: str) -> Any:
    """A BAPOConfig field with its help text: written once here, shown by `bapo train
    --print-config`, TRL's generated `bapo_*` arguments and verl's policy-loss config."""
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class BAPOConfig:
    """Search space, positive-share definition and target of the BAPO bounds.

    The defaults are bapo's own reading (gradient share, paper's search space and rho0);
    `BAPOConfig.paper()` is the paper's Eq. 8 taken literally, `BAPOConfig.recipe()` the public
    verl recipe's loop. Fields:

    target: rho0, the positive share to reach (target_kind="share", in (0, 1)), or a pos/neg ratio
      (target_kind="pos_neg", > 0); a share rho0 equals pos/neg rho0/(1-rho0) only within one
      contribution/weighting definition.
    contribution: how a token counts at bounds (lower, upper), with a = |A| (times weights):
      "gradient": r*a while it still carries gradient (A>0: r <= upper; A<0: r >= lower), else 0;
      "clamped": its clipped-surrogate magnitude, A>0: min(r, upper)*a, A<0: max(r, lower)*a.
    weighting: "none", or "behaviour_prob": each token's a times pi_behaviour(y_t) (paper Eq. 8).
    pos_neg_eps: pos/neg is pos / (neg + pos_neg_eps) (the recipe's 1e-8), infinite when neg == 0.
    lower_*: the lower ratio bound starts at lower_start and rises by lower_step up to lower_max.
    upper_*: the upper ratio bound starts at upper_start and rises by upper_step up to upper_max.
    stepping: candidates "grid" (start + k*step <= max) or "add_clamped" (the recipe's
      current = min(current + step, max) by repeated addition, so max is always the last one).
    order: "upper-first" (paper: admit more positive tokens first) or "lower-first" (recipe).
    scope: "step" (bounds solved once over every micro-batch of the optimizer step and every rank)
      or "micro_batch" (solved on each micro-batch from the forward it already runs, one
      all-reduce per micro-batch, no extra forward).
    target_mode: "fixed" (rho0 = target) or "entropy" (bapo.core.target.EntropyTargetController
      moves rho0 within [target_min, target_max] each update so that the policy entropy tracks
      target_entropy; target_entropy <= 0 holds the mean entropy of the first target_hold_updates
      updates); target_gain / target_integral_gain: its proportional and integral gains on
      log(target entropy / entropy).
    """

    target: float = _field(
        0.4, "rho0: the positive share to reach (in (0, 1)), or the pos/neg ratio with target_kind=pos_neg (> 0)"
    )
    lower_start: float = _field(0.6, "lower ratio bound at the start of every search (a ratio, not an epsilon)")
    lower_max: float = _field(0.9, "largest lower bound the search may reach (< 1)")
    lower_step: float = _field(0.02, "lower bound increment")
    upper_start: float = _field(1.2, "upper ratio bound at the start of every search (> 1)")
    upper_max: float = _field(3.0, "largest upper bound the search may reach")
    upper_step: float = _field(0.05, "upper bound increment")
    order: str = _field("upper-first", "upper-first (paper: admit positive tokens first) | lower-first (recipe)")
    target_kind: str = _field("share", "share (rho = pos/(pos+neg), the paper's) | pos_neg (pos/neg, the recipe's)")
    scope: str = _field(
        "step",
        "step (bounds solved once over every micro-batch and rank of the optimizer update) | "
        "micro_batch (each micro-batch from its own forward: no extra forward, one all-reduce each)",
    )
    contribution: str = _field(
        "gradient",
        "how a token counts: gradient (|r*A| while it still carries gradient, bapo's) | "
        "clamped (its clipped-surrogate magnitude: paper Eq. 8, recipe)",
    )
    weighting: str = _field("none", "none | behaviour_prob (each token times pi_behaviour(y_t): paper Eq. 8)")
    stepping: str = _field(
        "grid", "candidates: grid (start + k*step <= max) | add_clamped (recipe: min(current + step, max))"
    )
    pos_neg_eps: float = _field(0.0, "pos/neg is pos / (neg + eps) (recipe: 1e-8); infinite when neg == 0")
    target_mode: str = _field(
        "fixed", "fixed (rho0 = target) | entropy (rho0 steered each update so that entropy tracks target_entropy)"
    )
    target_entropy: float = _field(
        0.0, "entropy mode: the entropy to track; <= 0 holds the mean of the first target_hold_updates updates"
    )
    target_hold_updates: int = _field(5, "entropy mode: updates averaged for the held set point")
    target_min: float = _field(0.2, "entropy mode: smallest rho0")
    target_max: float = _field(0.8, "entropy mode: largest rho0")
    target_gain: float = _field(0.5, "entropy mode: proportional gain on log(target entropy / entropy)")
    target_integral_gain: float = _field(0.1, "entropy mode: integral gain (no wind-up at the limits)")

    def __post_init__(self) -> None:
        for name, allowed in (
            ("scope", SCOPES),
            ("target_kind", TARGET_KINDS),
            ("order", ORDERS),
            ("contribution", CONTRIBUTIONS),
            ("weighting", WEIGHTINGS),
            ("stepping", STEPPINGS),
            ("target_mode", TARGET_MODES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not one of {allowed}")
        if self.target_kind == "share" and not 0.0 < self.target < 1.0:
            raise ValueError(
                f"target: {self.target} must lie in (0, 1) for target_kind='share'; "
                f"for a pos/neg ratio pass target_kind='pos_neg'"
            )
        if self.target_kind == "pos_neg" and not self.target > 0.0:
            raise ValueError(f"target: {self.target} must be > 0 for target_kind='pos_neg'")
        if not self.pos_neg_eps >= 0.0:
            raise ValueError(f"pos_neg_eps: {self.pos_neg_eps} must be >= 0 (the recipe uses 1e-8)")
        for side, start, maximum, step, ok in (
            (
                "lower",
                self.lower_start,
                self.lower_max,
                self.lower_step,
                0.0 <= self.lower_start <= self.lower_max < 1.0,
            ),
            ("upper", self.upper_start, self.upper_max, self.upper_step, 1.0 < self.upper_start <= self.upper_max),
        ):
            if not ok:
                rule = "0 <= lower_start <= lower_max < 1" if side == "lower" else "1 < upper_start <= upper_max"
                raise ValueError(f"{side}_start/{side}_max: ({start}, {maximum}) break the rule {rule}")
            if not step > 0.0:
                raise ValueError(f"{side}_step: {step} must be > 0")
        if self.target_mode == "entropy":
            if not self.target_min <= self.target <= self.target_max:
                raise ValueError(
                    f"target_min/target_max: [{self.target_min}, {self.target_max}] must contain "
                    f"target {self.target} (the controller starts there)"
                )
            if self.target_kind == "share" and not 0.0 < self.target_min <= self.target_max < 1.0:
                raise ValueError(
                    f"target_min/target_max: ({self.target_min}, {self.target_max}) must lie in (0, 1) "
                    f"for target_kind='share'"
                )
            if not (self.target_gain >= 0.0 and self.target_integral_gain >= 0.0):
                raise ValueError(
                    f"target_gain/target_integral_gain: ({self.target_gain}, {self.target_integral_gain}) must be >= 0"
                )
            if self.target_entropy <= 0.0 and not self.target_hold_updates >= 1:
                raise ValueError(
                    f"target_hold_updates: {self.target_hold_updates} must be >= 1 when "
                    f"target_entropy <= 0 (hold the entropy of the first updates)"
                )

    @classmethod
    def preset(cls, name: str = "default", **overrides: Any) -> BAPOConfig:
        """The preset `name` (one of PRESETS: default = bapo's reading, paper, recipe) with `overrides`."""
        if name not in PRESETS:
            raise ValueError(f"preset: {name!r} is not one of {tuple(PRESETS)} (bapo's default, the paper, the recipe)")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def paper(cls, **overrides: Any) -> BAPOConfig:
        """arXiv 2510.18927 taken literally: Eq. 8's share (clamped clipped-surrogate magnitudes,
        each token weighted by pi_behaviour(y_t)), rho0 0.4, lower [0.6, 0.9] step 0.02, upper
        [1.2, 3.0] step 0.05, Algorithm 1's upper-first order on the grid start + k*step."""
        return cls(**{**PAPER_SETTINGS, **overrides})

    @classmethod
    def recipe(cls, **overrides: Any) -> BAPOConfig:
        """The public verl recipe (recipe/bapo: policy_loss.py and config/bapo_trainer.yaml):
        pos/(neg + 1e-8) >= 1.0 of clamped contributions without probability weight, lower
        [0.6, 0.8] then upper [1.2, 2.0], steps 0.05, each step min(current + step, max).
        Its loss also always applies dual-clip 3.0; that is the loss's setting, not the search's."""
        return cls(**{**RECIPE_SETTINGS, **overrides})

    @property
    def lower_grid(self) -> list[float]:
        return candidate_grid(self.lower_start, self.lower_step, self.lower_max, self.stepping)

    @property
    def upper_grid(self) -> list[float]:
        return candidate_grid(self.upper_start, self.upper_step, self.upper_max, self.stepping)


#: The presets selectable by name (BAPOConfig.preset; `loss.bapo.preset`, TRL's `bapo_preset`,
#: verl's `policy_loss.preset`): the settings each one changes from BAPOConfig's defaults.
PRESETS: dict[str, dict[str, Any]] = {"default": {}, "paper": PAPER_SETTINGS, "recipe": RECIPE_SETTINGS}


def candidate_grid(start: float, step: float, maximum: float, stepping: str = "grid") -> list[float]:
    """The candidates of one bound, increasing.

    "grid": [start + k*step for k = 0..K], K the largest with start + K*step <= maximum (by
    multiplication); "add_clamped": start, then current = min(current + step, maximum) while
    current < maximum (the recipe's loop, float additions included).
    """
    if stepping == "add_clamped":
        grid = [start]
        while grid[-1] < maximum:
            grid.append(min(grid[-1] + step, maximum))
        return grid
    count = int(math.floor((maximum - start) / step + GRID_TOLERANCE)) + 1
    while count > 1 and start + (count - 1) * step > maximum + GRID_TOLERANCE:
        count -= 1
    return [start + k * step for k in range(count)]

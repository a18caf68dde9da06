"""An adaptive BAPO target: rho0 steered by feedback so that policy entropy tracks a set point.

The paper's stated limitation is a hand-set rho0. By the Entropy-Clip Rule, admitting more
low-probability positive tokens (a higher rho0: the search raises c_high first) raises entropy,
and a lower rho0 lets it fall. `EntropyTargetController` closes that loop once per optimizer
update with a proportional-integral law on log entropy (documented on the class). It is pure
(floats in, floats out) and rank-consistent when every rank feeds it the same all-reduced,
token-weighted entropy (`token_mean_over_ranks`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from bapo.core.search_config import BAPOConfig


class EntropyTargetController:
    """rho0 for the next update from the entropy of the last one (BAPOConfig.target_mode="entropy").

    Law, per update t with token-weighted policy entropy H_t > 0 and set point H*
    (config.target_entropy, or for target_entropy <= 0 the mean of the first
    config.target_hold_updates entropies, during which rho0 stays at config.target):
        e_t   = log(H* / H_t)                      (> 0: entropy below the set point)
        I_t   = I_{t-1} + e_t                      (not when the output is saturated in e_t's direction)
        rho_t = clip(target + target_gain * e_t + target_integral_gain * I_t, target_min, target_max)
    A higher rho0 admits more low-probability positive tokens, which raise entropy. The
    integral is frozen while the output sits at a limit and the error pushes it further
    (conditional integration: no wind-up). Non-finite or non-positive entropies (a skipped
    update, an empty batch) leave everything unchanged. In target_mode="fixed" rho0 stays at
    config.target and only the update count moves.
    """

    def __init__(self, config: BAPOConfig) -> None:
        self.config = config
        self.target = config.target
        self.integral = 0.0
        self.set_point = config.target_entropy if config.target_entropy > 0 else None
        self.held_sum = 0.0
        self.held_count = 0
        self.updates = 0

    def update(self, entropy: float) -> float:
        """Feed the entropy measured at the update just done; returns rho0 for the next update."""
        cfg = self.config
        if cfg.target_mode != "entropy" or not (math.isfinite(entropy) and entropy > 0):
            self.updates += cfg.target_mode != "entropy"
            return self.target
        self.updates += 1
        if self.set_point is None:  # hold the entropy of the first updates
            self.held_sum += entropy
            self.held_count += 1
            if self.held_count >= cfg.target_hold_updates:
                self.set_point = self.held_sum / self.held_count
            return self.target
        error = math.log(self.set_point / entropy)
        integral = self.integral + error
        output = cfg.target + cfg.target_gain * error + cfg.target_integral_gain * integral
        if (output > cfg.target_max and error > 0) or (output < cfg.target_min and error < 0):
            output = cfg.target + cfg.target_gain * error + cfg.target_integral_gain * self.integral
        else:
            self.integral = integral
        self.target = min(max(output, cfg.target_min), cfg.target_max)
        return self.target

    def search_config(self) -> BAPOConfig:
        """The BAPOConfig the next search runs with (config with target = the current rho0)."""
        if self.target == self.config.target:
            return self.config
        return dataclasses.replace(self.config, target=self.target)

    def state_dict(self) -> dict:
        return {
            "target": self.target,
            "integral": self.integral,
            "set_point": self.set_point,
            "held_sum": self.held_sum,
            "held_count": self.held_count,
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict) -> None:
        self.target, self.integral, self.set_point = state["target"], state["integral"], state["set_point"]
        self.held_sum, self.held_count, self.updates = state["held_sum"], state["held_count"], state["updates"]


def token_mean_over_ranks(
    total: float,
    count: float,
    *,
    device: torch.device | str | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> float:
    """sum / count over every rank (one all-reduce when torch.distributed is initialised, every
    rank must call it); NaN when no rank has a token. total: e.g. sum of entropy over masked tokens."""
    values = torch.tensor([total, count], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=process_group)
    total, count = values.tolist()
    return total / count if count > 0 else math.nan

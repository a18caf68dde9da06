"""Fixed synthetic lab cells (seeded random series, no training) for the claims golden test.

Every series a lab claim reads is present; rewards rise from the start policy's, some seeds never
reach the matched reward, shares have no-signal NaNs, and bapo E=0 is grpo E=0 exactly (the
EFFECT_RESOLUTION case)."""

from __future__ import annotations

import torch

from bapo.lab.run import Cell, CellRun

SEEDS = 5
ROLLOUT_STEPS = 6
STALENESS_E = (0, 2, 4)
DELAYS = (2,)
CLAIM2_STALENESS_E = (4,)


def _cells() -> list[Cell]:
    methods = ("grpo", "clip-higher", "bapo", "bapo-entropy")
    cells = [Cell(m, e) for e in STALENESS_E for m in methods]
    cells += [Cell(m, e) for e in CLAIM2_STALENESS_E for m in ("grpo-c_high=2.0", "grpo-c_low=0.6")]
    cells += [Cell(m, 0, k) for k in DELAYS for m in ("grpo", "bapo", "bapo-entropy")]
    return cells


def synthetic_runs(reached_key: str = "bapo/search/reached") -> list[CellRun]:
    """One CellRun per cell of the plan above, each [SEEDS, updates] series drawn from its own seed."""
    runs = []
    for index, cell in enumerate(_cells()):
        generator = torch.Generator().manual_seed(1000 + index)

        def draw(*shape: int, generator: torch.Generator = generator) -> torch.Tensor:
            return torch.rand(*shape, generator=generator, dtype=torch.float64)

        updates = ROLLOUT_STEPS * (cell.staleness_e + 1)
        speed = 0.02 + 0.05 * draw(SEEDS, 1)
        reward = (0.15 + (speed * draw(SEEDS, updates)).cumsum(1) - 0.02 * draw(SEEDS, updates)).clamp(0, 1)
        entropy = 1.5 - (0.04 * draw(SEEDS, updates)).cumsum(1)
        share = 0.3 + 0.2 * draw(SEEDS, updates)
        share[draw(SEEDS, updates) < 0.1] = float("nan")
        estimate = draw(SEEDS, updates) - 0.5
        estimate[share.isnan()] = float("nan")
        series = {
            "exact/reward": reward,
            "exact/entropy": entropy,
            "grad_norm": 1.0 + draw(SEEDS, updates),
            "positive_share": share,
            reached_key: (draw(SEEDS, updates) < 0.7).double(),
            "entropy/batch": entropy + 0.05 * draw(SEEDS, updates),
            "entropy/batch_change": estimate + 0.3 * (draw(SEEDS, updates) - 0.5),
            "bapo/set_point": 1.3 + 0.01 * draw(SEEDS, updates),
            "bapo/target": 0.4 + 0.1 * draw(SEEDS, updates),
        }
        if cell.method != "bapo-entropy":
            del series["bapo/set_point"], series["bapo/target"]
        if cell.name in ("grpo E=0", "bapo E=4"):
            series["entropy_change_estimate"] = estimate
        start = {"reward": torch.full((SEEDS,), 0.15, dtype=torch.float64), "entropy": torch.full((SEEDS,), 1.5)}
        runs.append(CellRun(cell, list(range(SEEDS)), series, start, list(range(updates))))
    by_name = {run.cell.name: run for run in runs}
    by_name["bapo E=0"].updates = dict(by_name["grpo E=0"].updates)  # fixed-target BAPO = GRPO at E=0
    by_name["bapo E=0"].updates[reached_key] = torch.ones(SEEDS, ROLLOUT_STEPS, dtype=torch.float64)
    return runs

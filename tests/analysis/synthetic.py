"""Fixed synthetic metrics.jsonl runs (seeded random rows, no training) for the claims golden test."""

from __future__ import annotations

import random
from pathlib import Path

from bapo.analysis.runs import Run

SETTINGS = ("E=0", "E=2", "E=4", "E=0, async delay 4")
METHODS = ("grpo", "clip-higher", "bapo")
SEEDS = 4


def synthetic_runs() -> list[Run]:
    """One Run per setting, method and seed: 20 updates of entropy, share, grad norm, reward and
    held-out scores (start and final) drawn from random.Random(its index)."""
    runs = []
    for index, (setting, method, seed) in enumerate(
        (setting, method, seed) for setting in SETTINGS for method in METHODS for seed in range(SEEDS)
    ):
        if (setting, method, seed) == ("E=2", "bapo", 3):
            continue  # one seed missing: claims pair by seed, details show every seed
        draw = random.Random(index).random
        rows = [
            {
                "update": update + 1,
                "rollout_step": update,
                "entropy": 1.0 - 0.03 * update * draw(),
                "reward/mean": 0.2 + 0.02 * update * draw(),
                "positive_share": 0.3 + 0.2 * draw(),
                "grad_norm": 1.0 + 3 * draw() ** 4,
                "lower": 0.8,
                "upper": 1.2,
            }
            for update in range(20)
        ]
        rows[0].update({"heldout/start/avg@8": 0.25, "heldout/start/pass@8": 0.6})
        rows[-1].update({"heldout/avg@8": 0.2 + 0.3 * draw(), "heldout/pass@8": 0.5 + 0.4 * draw()})
        runs.append(Run(Path(f"{method}-{setting}-{seed}"), method, setting, seed, rows))
    return runs

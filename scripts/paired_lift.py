"""The held-out lift of two study folders' on-policy GRPO runs, paired by seed: each folder's lifts
(bapo.analysis.regime.heldout_lift: the final avg@k minus the start policy's), their means with 95%
Student-t intervals, and the mean difference A - B over the seeds both finished, with its interval
(bapo.analysis.claims.mean_interval, as the study's claims).

    .venv/bin/python scripts/paired_lift.py docs/study/regime-lora-r1-lr1e-4 docs/study/regime-lr1e-5
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bapo.analysis.claims import mean_interval
from bapo.analysis.regime import heldout_lift
from bapo.analysis.runs import find_runs
from bapo.experiments.study import finished_runs, load_plan


def lifts(study_dir: Path) -> dict[int, float]:
    """{seed: held-out lift} of the folder's finished on-policy (E=0, no delay) grpo runs."""
    runs = find_runs(finished_runs(load_plan(study_dir), study_dir))
    return {run.seed: heldout_lift(run) for run in runs if run.method == "grpo" and run.setting == "E=0"}


def interval(values) -> str:
    mean, low, high = mean_interval(list(values))
    return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="a study folder (its study.json)")
    parser.add_argument("b", type=Path, help="the study folder A is compared with")
    args = parser.parse_args()
    for folder in (args.a, args.b):
        if not (folder / "study.json").exists():
            parser.error(f"{folder}: no study.json there (a `bapo study --out` folder is expected)")
    by_seed = {folder: lifts(folder) for folder in (args.a, args.b)}
    for folder, seeds in by_seed.items():
        listed = ", ".join(f"seed {seed} {lift:+.3f}" for seed, lift in sorted(seeds.items()))
        print(f"{folder}: {listed}; mean {interval(seeds.values())}")
    paired = sorted(set(by_seed[args.a]) & set(by_seed[args.b]))
    differences = [by_seed[args.a][seed] - by_seed[args.b][seed] for seed in paired]
    print(f"A - B, paired over seeds {', '.join(map(str, paired)) or 'none'}: {interval(differences)}")


if __name__ == "__main__":
    main()

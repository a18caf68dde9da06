"""`bapo lab --regimes`: the lab over a map of regimes instead of one point, and the Entropy-Clip
Rule's premise measured in each (docs/LAB_REGIMES.md).

A regime is a task and a training setup (`Regime`): filler positions k per guess step, the start
logits' spread (peakedness), SGD or Adam, the table or shared parameters, and staleness as E + 1
mini-batches or E + 1 full-batch epochs. Every regime runs the same cells (REGIME_CELLS: on-policy
GRPO, GRPO / BAPO at E = 4 and BAPO's two search stages apart) with the premise diagnostic and the
first-order split at every update, and is judged with the same claims (claims 1, 2, 4 at the end
and at matched reward, the premise, first-order vs remainder). Every regime of the plan runs and
is reported; none is chosen by its outcome.

Learning rates: one per (optimizer, parameters), chosen on on-policy GRPO (E = 0) only, on the base
task (k = 0, prior std 1.0), by `choose_learning_rates`: the grid value whose end reward is nearest
that of the default lab's on-policy GRPO (lr 100, SGD, table; itself chosen on on-policy GRPO, see
docs/LAB.md), so every setup makes the same on-policy progress. LEARNING_RATES holds the values
that rule chose (docs/LAB_REGIMES.md has the grid's numbers). The filler and prior axes keep them
(the task changes, not the optimizer; SGD's step is scaled by k + 1, see LabConfig).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from bapo.analysis.claims import Arm, Claim, ClaimSpec, claims_json, claims_markdown, format_interval, mean_interval
from bapo.lab.claims import (
    EFFECT_RESOLUTION,
    MATCHED_REWARD,
    at_matched_reward,
    cell_arm,
    cell_values,
    lab_claims,
    lab_measures,
)
from bapo.lab.lab import run_jobs, write_metrics
from bapo.lab.run import STAGE_BOTH, STAGE_C_HIGH, STAGE_C_LOW, Cell, CellRun, LabConfig

STALE_E = 4  # the staleness of the compared cells (the default lab's claim-2 E)
REGIME_CELLS = (
    Cell("grpo", 0),
    Cell("grpo", STALE_E),
    Cell("bapo", STALE_E),
    Cell(STAGE_C_HIGH, STALE_E),
    Cell(STAGE_C_LOW, STALE_E),
    Cell(STAGE_BOTH, STALE_E),
)
FILLERS = (0, 2, 6)  # filler positions per guess step
# start logits' std: start entropy ~3.0 (today's), ~1.5 and ~0.7 nats per state at V = 32
PRIOR_SCALES = (1.0, 3.0, 6.0)
LR_GRIDS = {  # about 1.5x apart
    "sgd": (5.0, 7.0, 10.0, 15.0, 20.0, 30.0, 50.0, 70.0, 100.0, 150.0, 200.0),
    "adam": (0.01, 0.015, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2),
}
# chosen by choose_learning_rates (20 seeds, 24 rollout steps; the numbers: docs/LAB_REGIMES.md)
LEARNING_RATES: dict[tuple[str, str], float] = {
    ("sgd", "table"): 100.0,
    ("adam", "table"): 0.1,
    ("sgd", "shared"): 15.0,
    ("adam", "shared"): 0.03,
}


@dataclass(frozen=True)
class Regime:
    """One point of the map: the task's filler positions and start spread, and the training setup
    (LabConfig's optimizer / parameters / split)."""

    filler: int = 0
    prior_scale: float = 1.0
    optimizer: str = "sgd"
    parameters: str = "table"
    split: str = "mini-batches"

    @property
    def name(self) -> str:
        return f"k={self.filler} prior={self.prior_scale:g} {self.optimizer} {self.parameters} {self.split}"

    def config(self, base: LabConfig) -> LabConfig:
        """base with this regime's task, optimizer, parameters, split, its learning rate and the
        premise diagnostic on (every update of every cell)."""
        task = replace(base.task, filler=self.filler, prior_scale=self.prior_scale)
        return replace(
            base,
            task=task,
            lr=LEARNING_RATES[(self.optimizer, self.parameters)],
            optimizer=self.optimizer,
            parameters=self.parameters,
            split=self.split,
            premise=True,
            share_methods=("grpo", "bapo", STAGE_C_HIGH, STAGE_C_LOW, STAGE_BOTH),
            check_cells=(),
        )


def regime_map(quick: bool = False) -> list[Regime]:
    """The regimes run by `bapo lab --regimes`: the task grid (every filler count x every prior
    spread) with SGD on the table and mini-batches; then each other training setup (Adam; shared
    parameters with SGD and with Adam; full-batch epochs) at the task grid's four corners. --quick:
    k 0 / 2 x prior 1 / 6 with SGD, plus Adam, shared and epochs at the base task."""
    if quick:
        tasks = [Regime(k, s) for k in (0, 2) for s in (1.0, 6.0)]
        return tasks + [Regime(optimizer="adam"), Regime(parameters="shared"), Regime(split="epochs")]
    tasks = [Regime(k, s) for k in FILLERS for s in PRIOR_SCALES]
    corners = [(k, s) for k in (FILLERS[0], FILLERS[-1]) for s in (PRIOR_SCALES[0], PRIOR_SCALES[-1])]
    setups = (
        {"optimizer": "adam"},
        {"parameters": "shared"},
        {"optimizer": "adam", "parameters": "shared"},
        {"split": "epochs"},
    )
    return tasks + [Regime(k, s, **setup) for setup in setups for k, s in corners]


def choose_learning_rates(
    base: LabConfig | None = None, jobs: int | None = None
) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], list[tuple[float, float, float, float]]]]:
    """The learning-rate rule: per (optimizer, parameters), on-policy GRPO (E = 0) on the base task
    at every lr of LR_GRIDS; chosen: the end reward (mean over seeds) nearest the target, the end
    reward of on-policy GRPO in `base` itself (the default lab: SGD on the table at lr 100, which
    is kept). Returns (chosen, grid: (lr, mean, low, high) of the end reward per lr, and under
    ("target", "") the target's (lr, mean, low, high))."""
    base = replace(base or LabConfig(), check_cells=(), share_methods=())
    setups = [(o, p) for o in LR_GRIDS for p in ("table", "shared") if (o, p) != ("sgd", "table")]
    work = [(Cell("grpo"), base)] + [
        (Cell("grpo"), replace(base, lr=lr, optimizer=o, parameters=p)) for o, p in setups for lr in LR_GRIDS[o]
    ]
    runs = iter(run_jobs(work, jobs))
    target = next(runs).updates["exact/reward"][:, -1].tolist()
    target_row = (base.lr, *mean_interval(target))
    chosen: dict[tuple[str, str], float] = {(base.optimizer, base.parameters): base.lr}
    grid: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {("target", ""): [target_row]}
    for o, p in setups:
        rows = []
        for lr in LR_GRIDS[o]:
            end = next(runs).updates["exact/reward"][:, -1].tolist()
            rows.append((lr, *mean_interval(end)))
        grid[(o, p)] = rows
        chosen[(o, p)] = min(rows, key=lambda row: abs(row[1] - target_row[1]))[0]
    return chosen, grid


def _at_matched_reward(key: str) -> Callable[[CellRun], Tensor]:
    """exact/<key> [S] after the first update whose exact reward reaches MATCHED_REWARD (NaN: never)."""
    return lambda run: at_matched_reward(run, key)


def _premise_gap(sign: str) -> Callable[[CellRun], Tensor]:
    """Per seed, the mean over updates of <sign>_clipped_low_share - <sign>_kept_low_share (NaN
    updates skipped: nothing clipped). > 0: the clip removes low-probability tokens more often
    than it keeps them, the rule's premise."""

    def measure(run: CellRun) -> Tensor:
        u = run.updates
        return (u[f"premise/{sign}_clipped_low_share"] - u[f"premise/{sign}_kept_low_share"]).nanmean(1)

    return measure


def _last(key: str) -> Callable[[CellRun], Tensor]:
    return lambda run: run.updates[key][:, -1]


def _nanmean(key: str) -> Callable[[CellRun], Tensor]:
    return lambda run: run.updates[key].nanmean(1)


def regime_measures(runs: list[CellRun], rollout_steps: int) -> dict[str, Callable[[CellRun], Tensor]]:
    """lab_measures plus the regime lab's own (per seed [S])."""
    measures: dict[str, Callable[[CellRun], Tensor]] = dict(lab_measures(runs, rollout_steps))
    for part in ("guess", "filler"):  # only cells with filler record them (KeyError otherwise)
        measures[f"{part} entropy at the end"] = _last(f"exact/entropy/{part}")
        measures[f"{part} entropy at matched reward"] = _at_matched_reward(f"exact/entropy/{part}")
    for sign in ("pos", "neg"):
        measures[f"premise gap {sign}"] = _premise_gap(sign)
        for kind in ("clipped", "kept"):
            measures[f"{sign} {kind} low share"] = _nanmean(f"premise/{sign}_{kind}_low_share")
    measures["first-order sum"] = lambda run: run.updates["entropy/first_order"].sum(1)
    measures["remainder sum"] = lambda run: run.updates["entropy/remainder"].sum(1)
    measures["remainder fraction"] = lambda run: (
        run.updates["entropy/remainder"].abs().sum(1)
        / (run.updates["entropy/first_order"].abs().sum(1) + run.updates["entropy/remainder"].abs().sum(1)).clamp_min(
            1e-30
        )
    )
    return measures


# claim ids of lab_claims reported per regime (the rest of its table is in each regime's claims.json)
LAB_CLAIM_IDS = (
    f"1-entropy-E{STALE_E}-samples",
    f"1-entropy-E{STALE_E}-at-reward",
    f"4-entropy-E={STALE_E}",
    f"4-entropy-at-reward-E={STALE_E}",
    f"4-reward-E={STALE_E}",
    f"4-share-E={STALE_E}",
)
STAGES = (
    (STAGE_C_HIGH, "c_high", "raising c_high alone (BAPO's first stage: admit positive tokens)"),
    (STAGE_C_LOW, "c_low", "raising c_low alone (BAPO's second stage: filter negative tokens)"),
    (STAGE_BOTH, "both", "both bounds at BAPO's maxima"),
)


def regime_claim_specs() -> list[ClaimSpec]:
    """The regime lab's own claims (beside LAB_CLAIM_IDS of lab_claims), effect > 0 = the paper's
    direction / the premise held: claim 2 and the stages (each GRPO variant at E = 4 vs GRPO:
    entropy at the end and at matched reward, mean reward), the premise per E = 4 cell
    (clipped-low minus kept-low share > 0), and BAPO vs GRPO's entropy change split into the
    first-order term and the remainder (summed over updates)."""
    grpo, bapo = cell_arm(Cell("grpo", STALE_E)), cell_arm(Cell("bapo", STALE_E))
    specs = []
    for method, tag, what in STAGES:
        arm = cell_arm(Cell(method, STALE_E))
        for suffix, metric, where in (
            ("", "entropy at the end", "equal samples"),
            ("-at-reward", "entropy at matched reward", f"matched reward {MATCHED_REWARD}"),
        ):
            specs.append(
                ClaimSpec(
                    f"2-{tag}-E{STALE_E}{suffix}",
                    f"{what} keeps more entropy than GRPO",
                    f"E={STALE_E}, {where}",
                    metric,
                    arm,
                    grpo,
                    detail=f"H({method}) {{treatment}} vs H(grpo) {{baseline}}",
                )
            )
        specs.append(
            ClaimSpec(
                f"2-{tag}-E{STALE_E}-reward",
                f"{what} learns faster than GRPO (mean reward)",
                f"E={STALE_E}, equal samples",
                "mean reward",
                arm,
                grpo,
                detail=f"{method} {{treatment}} vs grpo {{baseline}}",
            )
        )
    for method in ("grpo", "bapo"):
        arm = cell_arm(Cell(method, STALE_E))
        for sign, side, clip in (("pos", "positive", "upper"), ("neg", "negative", "lower")):
            specs.append(
                ClaimSpec(
                    f"P-{sign}-{method}-E{STALE_E}",
                    f"premise: the {clip} clip removes low-probability {side} tokens (log pi < -H) more often "
                    "than it keeps them",
                    f"{method} E={STALE_E}, mean over updates",
                    f"premise gap {sign}",
                    arm,
                    detail="low share clipped {clipped} vs kept {kept}",
                    shows=(("clipped", arm, f"{sign} clipped low share"), ("kept", arm, f"{sign} kept low share")),
                )
            )
    for part in ("guess", "filler"):  # where BAPO's entropy goes (filler regimes only)
        for suffix, metric, where in (
            ("", f"{part} entropy at the end", "equal samples"),
            ("-at-reward", f"{part} entropy at matched reward", f"matched reward {MATCHED_REWARD}"),
        ):
            specs.append(
                ClaimSpec(
                    f"4-{part}-entropy-E={STALE_E}{suffix}",
                    f"BAPO keeps more entropy than GRPO on the {part} positions",
                    f"E={STALE_E}, {where}",
                    metric,
                    bapo,
                    grpo,
                    detail="BAPO {treatment} vs GRPO {baseline}",
                )
            )
    for tag, metric, what in (
        ("first-order", "first-order sum", "its first-order term (the rule's mechanism)"),
        ("remainder", "remainder sum", "the higher-order remainder (large steps)"),
    ):
        specs.append(
            ClaimSpec(
                f"F-{tag}-E{STALE_E}",
                f"BAPO raises entropy more than GRPO through {what}",
                f"E={STALE_E}, summed over updates (mini-batch tokens)",
                metric,
                bapo,
                grpo,
                detail="BAPO {treatment} vs GRPO {baseline}; remainder fraction BAPO {bapo_frac}, GRPO {grpo_frac}",
                shows=(("bapo_frac", bapo, "remainder fraction"), ("grpo_frac", grpo, "remainder fraction")),
            )
        )
    return specs


def regime_claims(runs: list[CellRun], rollout_steps: int) -> list[Claim]:
    """The claims of one regime's runs: LAB_CLAIM_IDS of lab_claims, then regime_claim_specs."""
    from bapo.analysis.claims import evaluate_claims

    chosen = [claim for claim in lab_claims(runs, rollout_steps) if claim.id in LAB_CLAIM_IDS]
    chosen.sort(key=lambda claim: LAB_CLAIM_IDS.index(claim.id))
    values = cell_values(runs, regime_measures(runs, rollout_steps))
    own = evaluate_claims(regime_claim_specs(), values, resolution=EFFECT_RESOLUTION, min_seeds=2)
    return chosen + own


def entropy_parts(runs: list[CellRun], rollout_steps: int) -> list[tuple[str, ...]]:
    """Per cell: (cell, whole / guess / filler entropy at the end, the same at matched reward),
    each 'mean [95% interval]' ('-' where the cell has no filler)."""
    values = cell_values(runs, regime_measures(runs, rollout_steps))
    rows: list[tuple[str, ...]] = []
    for run in runs:
        arm = cell_arm(run.cell)

        def shown(metric: str, arm: Arm = arm) -> str:
            got = values(arm, metric)
            if not got:
                return "-"
            finite = [v for v in got.values() if math.isfinite(v)]
            if len(finite) < 2:  # at matched reward: seeds that never reached it are left out
                return f"{finite[0]:.3f} (1/{len(got)} seeds)" if finite else f"n/a (0/{len(got)} seeds)"
            return format_interval(finite) + ("" if len(finite) == len(got) else f" ({len(finite)}/{len(got)} seeds)")

        rows.append(
            (
                run.cell.name,
                shown("entropy at the end"),
                shown("guess entropy at the end"),
                shown("filler entropy at the end"),
                shown("entropy at matched reward"),
                shown("guess entropy at matched reward"),
                shown("filler entropy at matched reward"),
            )
        )
    return rows


def plan_regimes(quick: bool = False, seeds: int | None = None) -> tuple[list[Regime], LabConfig]:
    """The regimes and the base config of `bapo lab --regimes` (20 seeds, 24 rollout steps by
    default; --quick: 4 seeds, 8 rollout steps, regime_map(quick=True))."""
    base = LabConfig(seeds=4, rollout_steps=8) if quick else LabConfig()
    if seeds is not None:
        if seeds < 2:
            raise ValueError(f"seeds: {seeds} gives no interval; use --seeds 2 or more")
        base = replace(base, seeds=seeds)
    return regime_map(quick), base


def run_regimes(
    out_dir: str | Path | None = None,
    *,
    quick: bool = False,
    seeds: int | None = None,
    rollout_steps: int | None = None,
    jobs: int | None = None,
    regimes: list[Regime] | None = None,
    base: LabConfig | None = None,
    metrics: bool = True,
) -> tuple[dict[str, list[Claim]], Path]:
    """Run every cell of every regime; write regimes.json (every regime's claims and entropy
    parts), regimes.md (the tables), claims/<regime>.json, lab.json and (metrics=True)
    cells/<regime>/<cell>/metrics.jsonl, the default lab's rows per seed and update (the full map's
    are ~0.3 GB). Returns ({regime name: claims}, out_dir). regimes / base: instead of plan_regimes' (tests)."""
    planned, planned_base = plan_regimes(quick, seeds)
    regimes = regimes or planned
    base = base or planned_base
    if rollout_steps is not None:
        base = replace(base, rollout_steps=rollout_steps)
    out = Path(out_dir) if out_dir is not None else Path("runs") / f"lab-regimes-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    work = [(cell, regime.config(base)) for regime in regimes for cell in REGIME_CELLS]
    done = run_jobs(work, jobs)
    train_s = time.perf_counter() - start
    claims: dict[str, list[Claim]] = {}
    parts: dict[str, list[tuple[str, ...]]] = {}
    starts: dict[str, tuple[float, float]] = {}
    for index, regime in enumerate(regimes):
        runs = done[index * len(REGIME_CELLS) : (index + 1) * len(REGIME_CELLS)]
        claims[regime.name] = regime_claims(runs, base.rollout_steps)
        parts[regime.name] = entropy_parts(runs, base.rollout_steps)
        starts[regime.name] = (
            statistics.fmean(runs[0].start["reward"].tolist()),
            statistics.fmean(runs[0].start["entropy"].tolist()),
        )
        name = regime.name.replace(" ", "_").replace("=", "")
        (out / "claims").mkdir(exist_ok=True)
        (out / "claims" / f"{name}.json").write_text(claims_json(claims[regime.name]) + "\n")
        if metrics:  # every update's series, premise/* and entropy/first_order|remainder included
            for run in runs:
                write_metrics(run, out / "cells" / name / run.cell.name.replace(" ", "_") / "metrics.jsonl")
    (out / "regimes.md").write_text(regimes_markdown(regimes, claims, parts, starts, base))
    info = {
        "regimes": [asdict(r) | {"name": r.name, "lr": LEARNING_RATES[(r.optimizer, r.parameters)]} for r in regimes],
        "cells": [c.name for c in REGIME_CELLS],
        "config": asdict(base),
        "train_s": round(train_s, 2),
        "jobs": jobs or os.cpu_count(),
        "torch": torch.__version__,
    }
    (out / "lab.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    summary = {
        name: {
            "start": {"reward": starts[name][0], "entropy": starts[name][1]},
            "claims": json.loads(claims_json(regime_claims_list)),
            "entropy_parts": [dict(zip(PART_NAMES, row)) for row in parts[name]],
        }
        for name, regime_claims_list in claims.items()
    }
    (out / "regimes.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    return claims, out


PART_NAMES = ("cell", "whole, end", "guess, end", "filler, end", "whole, matched", "guess, matched", "filler, matched")


def _effect(claims: list[Claim], claim_id: str) -> Claim | None:
    return next((claim for claim in claims if claim.id == claim_id), None)


def _cell(claim: Claim | None) -> str:
    if claim is None:
        return "-"
    mark = {"held": "held", "not held": "NOT", "mixed": "mixed"}[claim.verdict]
    return f"{claim.effect:+.3f} [{claim.low:+.3f}, {claim.high:+.3f}] {mark}"


# (column title, claim id) of the compact per-regime tables in regimes.md
SUMMARY_COLUMNS = (
    ("1: H E0 - H E4, end", f"1-entropy-E{STALE_E}-samples"),
    ("1: at matched reward", f"1-entropy-E{STALE_E}-at-reward"),
    ("4: H BAPO - H GRPO, end", f"4-entropy-E={STALE_E}"),
    ("4: at matched reward", f"4-entropy-at-reward-E={STALE_E}"),
    ("4: mean reward BAPO - GRPO", f"4-reward-E={STALE_E}"),
)
STAGE_COLUMNS = tuple(
    (f"{tag}: {what}", f"2-{tag}-E{STALE_E}{suffix}")
    for _, tag, _ in STAGES
    for suffix, what in (("", "H end"), ("-at-reward", "H matched"), ("-reward", "mean reward"))
)
PREMISE_COLUMNS = (
    ("pos gap GRPO", f"P-pos-grpo-E{STALE_E}"),
    ("pos gap BAPO", f"P-pos-bapo-E{STALE_E}"),
    ("neg gap GRPO", f"P-neg-grpo-E{STALE_E}"),
    ("neg gap BAPO", f"P-neg-bapo-E{STALE_E}"),
)
PART_COLUMNS = tuple(
    (f"{part}: {what}", f"4-{part}-entropy-E={STALE_E}{suffix}")
    for part in ("guess", "filler")
    for suffix, what in (("", "end"), ("-at-reward", "matched"))
)
SPLIT_COLUMNS = (
    ("first-order: BAPO - GRPO", f"F-first-order-E{STALE_E}"),
    ("remainder: BAPO - GRPO", f"F-remainder-E{STALE_E}"),
)


def _table(regimes: list[Regime], claims: dict[str, list[Claim]], columns: tuple[tuple[str, str], ...]) -> list[str]:
    """One row per regime, one column per (title, claim id): effect [95% interval] verdict."""
    titles = ["regime", *(title for title, _ in columns)]
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    for regime in regimes:
        row = [regime.name, *(_cell(_effect(claims[regime.name], claim_id)) for _, claim_id in columns)]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def axis_summary(regimes: list[Regime], claims: dict[str, list[Claim]], claim_id: str) -> list[str]:
    """Per value of every axis, the mean effect of claim_id over the regimes with that value and
    how many of them held / not held / mixed (a table)."""
    lines = ["| axis | value | regimes | mean effect | held / not held / mixed |", "|---|---|---|---|---|"]
    for axis in ("filler", "prior_scale", "optimizer", "parameters", "split"):
        for value in dict.fromkeys(getattr(r, axis) for r in regimes):
            found = [_effect(claims[r.name], claim_id) for r in regimes if getattr(r, axis) == value]
            judged = [c for c in found if c is not None]
            if not judged:
                continue
            counts = [sum(c.verdict == v for c in judged) for v in ("held", "not held", "mixed")]
            mean = statistics.fmean(c.effect for c in judged)
            lines.append(f"| {axis} | {value} | {len(judged)} | {mean:+.4f} | {' / '.join(map(str, counts))} |")
    return lines


def regimes_markdown(
    regimes: list[Regime],
    claims: dict[str, list[Claim]],
    parts: dict[str, list[tuple[str, ...]]],
    starts: dict[str, tuple[float, float]],
    base: LabConfig,
) -> str:
    """regimes.md: the compact tables (claims 1 and 4, the stages, the premise, the first-order
    split, the entropy parts), the axis summaries, then every regime's full claims table."""
    header = (
        f"{len(regimes)} regimes x {len(REGIME_CELLS)} cells ({', '.join(c.name for c in REGIME_CELLS)}), "
        f"{base.seeds} seeds, {base.rollout_steps} rollout steps, {base.task.prompts} prompts x "
        f"{base.group_size} responses, V = {base.task.vocab}, budget {base.task.budget} guesses. Cells: "
        "effect [95% interval] over seeds, paired by seed, > 0 = the paper's direction (premise: held); "
        "held / NOT (held in the other direction) / mixed; '-' = not computed (fewer than 2 seeds with a "
        "value in both cells, e.g. a matched reward not reached, or no filler positions)."
    )
    text = ["# bapo lab --regimes", "", header, ""]
    text += ["## Start policy per regime", "", "| regime | lr | start reward | start entropy |", "|---|---|---|---|"]
    for r in regimes:
        lr = LEARNING_RATES[(r.optimizer, r.parameters)]
        text.append(f"| {r.name} | {lr:g} | {starts[r.name][0]:.3f} | {starts[r.name][1]:.3f} |")
    sections = (
        ("Claims 1 and 4", SUMMARY_COLUMNS),
        ("BAPO's stages apart (claim 2): GRPO variants at E=4 minus GRPO E=4", STAGE_COLUMNS),
        (
            "The premise: clipped-low share minus kept-low share (low = log pi < -H of its state), E=4",
            PREMISE_COLUMNS,
        ),
        ("Claim 4 on the guess and the filler positions: H BAPO - H GRPO, E=4", PART_COLUMNS),
        ("First-order vs remainder: BAPO minus GRPO, entropy change summed over updates", SPLIT_COLUMNS),
    )
    for title, columns in sections:
        text += ["", f"## {title}", "", *_table(regimes, claims, columns)]
    text += ["", "## BAPO keeps entropy (4-entropy at the end), by axis", ""]
    text += axis_summary(regimes, claims, f"4-entropy-E={STALE_E}")
    text += ["", "## BAPO keeps entropy at matched reward, by axis", ""]
    text += axis_summary(regimes, claims, f"4-entropy-at-reward-E={STALE_E}")
    text += ["", "## Entropy: whole response, guess and filler positions, at the end and at matched reward", ""]
    text += [
        f"'-' = no filler positions in the regime; at matched reward a seed that never reaches exact reward "
        f"{MATCHED_REWARD} is left out ('k/N seeds'; 'n/a' when none reached it).",
        "",
    ]
    text += ["| regime | " + " | ".join(PART_NAMES) + " |", "|---" * (len(PART_NAMES) + 1) + "|"]
    for r in regimes:
        for row in parts[r.name]:
            text.append(f"| {r.name} | " + " | ".join(row) + " |")
    text += ["", "## Every regime's claims", ""]
    for r in regimes:
        text += [f"### {r.name}", "", claims_markdown(claims[r.name]), ""]
    return "\n".join(text) + "\n"

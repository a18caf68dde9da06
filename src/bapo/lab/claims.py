"""The paper's claims judged from the lab's runs, as data for the one claims engine
(bapo.analysis.claims): one effect per seed (positive = as the paper claims), verdict from its 95%
interval over seeds.

Paired by seed: every cell of a seed starts from the same task instance and the same rollout
draws, so an effect is a difference between two cells of the same seed. Cells missing from the
runs (a --quick lab) skip the claims that need them.

Measures (`lab_measures`, all per seed):
  entropy      exact on-policy token entropy (closed form, see bapo.lab.policy.exact_stats)
  reward       exact expected reward (closed form)
  at matched reward: after the first update whose exact reward reaches MATCHED_REWARD (a seed that
    never reaches it is left out, so `seeds` can be below the run's count);
  at the end (equal samples): after the last update (every cell saw `rollout_steps` rollout batches);
  at equal updates: after update `rollout_steps` (the last update of E = 0; E > 0 cells have then seen
    rollout_steps / (E + 1) batches).
  mean reward: the exact reward after each rollout step, averaged over the run (learning speed);
    early reward: the same over the first quarter of the rollout steps.
  reward drawdown: sum of the falls of the exact reward between consecutive points
    (rollout steps at equal samples, updates at equal updates): how much learning was undone.
  grad-norm CV: std / mean of the per-update gradient norm (over the compared updates).
  positive share, target reached, entropy-change estimate: over the updates with signal (a
    mini-batch whose advantages are all zero has none; its values are NaN and skipped).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from bapo.analysis.claims import Arm, Claim, ClaimSpec, SeedValues, evaluate_claims
from bapo.analysis.runs import setting_name
from bapo.core import BAPOConfig
from bapo.lab.run import Cell, CellRun

TARGET = BAPOConfig().target
# The reward at which entropies are also compared "at matched reward": staleness E speeds learning, and
# entropy falls as a policy learns, so an end-of-run gap mixes the two. On-policy GRPO goes from
# 0.15 to about 0.5 in the default run; 0.4 is reached by nearly every seed of every cell.
MATCHED_REWARD = 0.4
# Below it a difference is float rounding (float32 advantages), not an effect: two cells that ran
# identical updates must not get "held" from 1e-9 noise.
EFFECT_RESOLUTION = 1e-6
# The variants compared with GRPO in claim 4: (method, id suffix, name in the text)
BAPO_VARIANTS = (("bapo", "", "BAPO"), ("bapo-entropy", "-adaptive", "BAPO (adaptive target)"))
C_HIGH, C_LOW = "grpo-c_high=2.0", "grpo-c_low=0.6"  # claim 2's bound variants of GRPO
CLAIM2_METHODS = (C_HIGH, C_LOW)

Measure = Callable[[CellRun], Tensor]  # one cell's per-seed values [S]; KeyError: a series it lacks


def cell_arm(cell: Cell) -> Arm:
    """The engine's arm of a cell: its method in bapo.analysis.runs.setting_name's setting."""
    return Arm(cell.method, setting_name(cell.staleness_e, cell.async_delay))


def _drawdown(series: Tensor) -> Tensor:
    """Sum of the falls between consecutive points, per seed: series [S, n] -> [S]."""
    return (series[:, :-1] - series[:, 1:]).clamp_min(0).sum(1)


def _cv(series: Tensor) -> Tensor:
    return series.std(1) / series.mean(1).clamp_min(1e-30)


def _pearson(x: Tensor, y: Tensor) -> Tensor:
    """Correlation over updates per seed, skipping NaN (no-signal) updates: x, y [S, U] -> [S]."""
    out = []
    for xs, ys in zip(x, y):
        keep = xs.isfinite() & ys.isfinite()
        xc, yc = xs[keep] - xs[keep].mean(), ys[keep] - ys[keep].mean()
        out.append((xc * yc).sum() / (xc.norm() * yc.norm()))
    return torch.stack(out)


def at_matched_reward(run: CellRun, key: str = "exact/entropy", level: float = MATCHED_REWARD) -> Tensor:
    """run.updates[key] [S] after the first update whose exact reward is >= level (NaN: never)."""
    reward, values = run.updates["exact/reward"], run.updates[key]
    reached = reward >= level
    first = reached.to(torch.int64).argmax(1, keepdim=True)
    missing = torch.full_like(values[:, 0], math.nan)
    return torch.where(reached.any(1), values.gather(1, first).squeeze(1), missing)


def _sign_agreement(run: CellRun) -> Tensor:
    estimate, actual = run.updates["entropy_change_estimate"], run.updates["entropy/batch_change"]
    signal = estimate.isfinite()
    return (((estimate > 0) == (actual > 0)) & signal).double().sum(1) / signal.double().sum(1)


def lab_measures(runs: list[CellRun], rollout_steps: int) -> dict[str, Measure]:
    """Measure name -> per-seed values of a cell (see the module doc)."""
    by_name = {run.cell.name: run for run in runs}

    def per_step(run: CellRun, key: str) -> Tensor:
        """exact/<key> at the start and after each rollout step's last update: [S, rollout_steps + 1]."""
        per_update = run.updates[f"exact/{key}"]
        every = per_update.shape[1] // rollout_steps
        return torch.cat([run.start[key][:, None], per_update[:, every - 1 :: every]], 1)

    def off_set_point(run: CellRun) -> Tensor:
        """|batch entropy - H*| over the second half of the updates, H* the final set point of the
        adaptive-target cell of the same setting (for that cell and for fixed-target BAPO alike)."""
        adaptive = by_name[Cell("bapo-entropy", run.cell.staleness_e, run.cell.async_delay).name].updates
        set_point, half = adaptive["bapo/set_point"][:, -1:], adaptive["entropy/batch"].shape[1] // 2
        return (run.updates["entropy/batch"][:, half:] - set_point).abs().mean(1)

    return {
        "entropy at the end": lambda run: run.updates["exact/entropy"][:, -1],
        "reward at the end": lambda run: run.updates["exact/reward"][:, -1],
        "entropy at matched reward": at_matched_reward,
        "entropy at equal updates": lambda run: run.updates["exact/entropy"][:, rollout_steps - 1],
        "reward drawdown": lambda run: _drawdown(per_step(run, "reward")),
        "reward drawdown at equal updates": lambda run: _drawdown(run.updates["exact/reward"][:, :rollout_steps]),
        "grad-norm CV": lambda run: _cv(run.updates["grad_norm"]),
        "grad-norm CV at equal updates": lambda run: _cv(run.updates["grad_norm"][:, :rollout_steps]),
        "mean reward": lambda run: per_step(run, "reward")[:, 1:].mean(1),
        "early reward": lambda run: per_step(run, "reward")[:, 1 : 1 + max(1, rollout_steps // 4)].mean(1),
        "first positive share": lambda run: run.updates["positive_share"][:, 0],
        "positive share": lambda run: run.updates["positive_share"].nanmean(1),
        "share distance": lambda run: (run.updates["positive_share"] - TARGET).abs().nanmean(1),
        "target reached": lambda run: run.updates["bapo/search/reached"].nanmean(1),
        "entropy off the set point": off_set_point,
        "set point at the end": lambda run: run.updates["bapo/set_point"][:, -1],
        "target at the end": lambda run: run.updates["bapo/target"][:, -1],
        "estimate correlation": lambda run: _pearson(
            run.updates["entropy_change_estimate"], run.updates["entropy/batch_change"]
        ),
        "estimate sign agreement": _sign_agreement,
    }


def cell_values(runs: list[CellRun], measures: dict[str, Measure]) -> SeedValues:
    """The loader for the lab's cells: per arm (cell_arm) and measure, {seed: value}; None for a
    cell not run or a series the cell did not record."""
    by_arm = {cell_arm(run.cell): run for run in runs}

    def values(arm: Arm, metric: str) -> dict[int, float] | None:
        run = by_arm.get(arm)
        if run is None:
            return None
        try:
            per_seed = measures[metric](run)
        except KeyError:  # a series this cell does not record (e.g. no positive share)
            return None
        return dict(zip(run.seeds, per_seed.tolist()))

    return values


def _staleness_claims(
    staleness_e: list[int], delays: list[int], top: int | None, rollout_steps: int
) -> list[ClaimSpec]:
    """Claim 1: growing staleness E (or an async delay), GRPO's entropy falls faster, its reward
    and gradient norm are less stable."""
    base = cell_arm(Cell("grpo"))
    specs = []
    for stale_e in staleness_e:
        if stale_e == 0:
            continue
        stale = cell_arm(Cell("grpo", stale_e))
        for suffix, metric, where in (
            ("samples", "entropy at the end", "equal samples"),
            ("at-reward", "entropy at matched reward", f"matched reward {MATCHED_REWARD}"),
            ("updates", "entropy at equal updates", f"equal updates ({rollout_steps})"),
        ):
            specs.append(
                ClaimSpec(
                    f"1-entropy-E{stale_e}-{suffix}",
                    "GRPO entropy falls faster as staleness E grows",
                    f"{where}, E=0 vs E={stale_e}",
                    metric,
                    stale,
                    base,
                    sign=-1,
                    detail=f"H(E=0) {{baseline}} vs H(E={stale_e}) {{treatment}}",
                )
            )
    if top is not None:
        stale = cell_arm(Cell("grpo", top))
        for kind, metric, text, label in (
            ("reward", "reward drawdown", "GRPO reward less stable as E grows (reward drawdown)", "drawdown"),
            ("gradnorm", "grad-norm CV", "GRPO grad norm less stable as E grows (CV over updates)", "CV"),
        ):
            for suffix, where in (("samples", "equal samples"), ("updates", f"equal updates ({rollout_steps})")):
                specs.append(
                    ClaimSpec(
                        f"1-{kind}-unstable-E{top}-{suffix}",
                        text,
                        f"{where}, E=0 vs E={top}",
                        metric + (" at equal updates" if suffix == "updates" else ""),
                        stale,
                        base,
                        detail=f"{label} E=0 {{baseline}} vs E={top} {{treatment}}",
                    )
                )
    specs += [
        ClaimSpec(
            f"1-entropy-delay{delay}",
            "GRPO entropy falls faster with an async delay",
            f"delay 0 vs {delay} (equal samples = equal updates)",
            "entropy at the end",
            cell_arm(Cell("grpo", 0, delay)),
            base,
            sign=-1,
            detail=f"H(0) {{baseline}} vs H(delay {delay}) {{treatment}}",
        )
        for delay in delays
    ]
    return specs


def _clip_bound_claims(claim2_staleness_e: list[int]) -> list[ClaimSpec]:
    """Claim 2: raising c_high slows the entropy fall; lowering c_low speeds it."""
    # (bound, variant cell, sign, text, the change, detail): the detail names c_high 2.0 / c_low 0.8 first
    variants = (
        (
            "c_high",
            C_HIGH,
            1,
            "raising c_high slows the entropy fall",
            "c_high 1.2 -> 2.0",
            "(c_low 0.8)",
            "H(c_high 2.0) {treatment} vs H(1.2) {baseline}",
        ),
        (
            "c_low",
            C_LOW,
            -1,
            "lowering c_low speeds the entropy fall",
            "c_low 0.8 -> 0.6",
            "(c_high 1.2)",
            "H(c_low 0.8) {baseline} vs H(0.6) {treatment}",
        ),
    )
    specs = []
    for stale_e in claim2_staleness_e:
        grpo = cell_arm(Cell("grpo", stale_e))
        for bound, variant, sign, text, change, fixed, detail in variants:
            for suffix, metric, where in (
                ("", "entropy at the end", f"E={stale_e}, {change} {fixed}"),
                ("-at-reward", "entropy at matched reward", f"E={stale_e}, {change}, matched reward {MATCHED_REWARD}"),
            ):
                specs.append(
                    ClaimSpec(
                        f"2-{bound}-E{stale_e}{suffix}",
                        text,
                        where,
                        metric,
                        cell_arm(Cell(variant, stale_e)),
                        grpo,
                        sign=sign,
                        detail=detail,
                    )
                )
    return specs


def _bapo_claims(settings: list[tuple[int, int]]) -> list[ClaimSpec]:
    """Claim 4: BAPO holds the share at its target and keeps entropy, beating GRPO at every
    setting (E, async delay); the adaptive target (bapo-entropy, where present) on the same rows, plus its tracking."""
    specs = []
    for variant, tag, name in BAPO_VARIANTS:
        for stale_e, delay in settings:
            grpo, bapo = cell_arm(Cell("grpo", stale_e, delay)), cell_arm(Cell(variant, stale_e, delay))
            where = f"E={stale_e}" + (f" delay={delay}" if delay else "")
            key = where.replace(" ", "-") + tag
            if not tag:
                specs.append(
                    ClaimSpec(
                        f"4-share-{key}",
                        f"{name} holds the positive share nearer its target {TARGET} than GRPO",
                        where,
                        "share distance",
                        bapo,
                        grpo,
                        sign=-1,
                        detail="share BAPO {bapo} vs GRPO {grpo}; target reached in {reached} of updates with signal",
                        shows=(
                            ("bapo", bapo, "positive share"),
                            ("grpo", grpo, "positive share"),
                            ("reached", bapo, "target reached"),
                        ),
                    )
                )
            versus = f"{name} {{treatment}} vs GRPO {{baseline}}"
            entropy = f"{name} keeps more entropy than GRPO"
            at_end = ClaimSpec(f"4-entropy-{key}", entropy, f"{where}, equal samples", "entropy at the end", bapo, grpo)
            specs.append(replace(at_end, detail=versus))
            if stale_e or delay or tag:  # at E=0 without delay, fixed-target BAPO and GRPO are the same run
                at_reward = replace(at_end, id=f"4-entropy-at-reward-{key}", metric="entropy at matched reward")
                specs.append(replace(at_reward, setting=f"{where}, matched reward {MATCHED_REWARD}", detail=versus))
            # Mean over the run, not the end: off-policy cells reach the reward ceiling (~0.999)
            # before the end, where an end value can no longer tell two methods apart.
            specs.append(
                ClaimSpec(
                    f"4-reward-{key}",
                    f"{name} learns faster than GRPO (mean reward over the run)",
                    where + ", equal samples",
                    "mean reward",
                    bapo,
                    grpo,
                    detail=versus + "; at the end {bapo_end} vs GRPO {grpo_end}",
                    shows=(("bapo_end", bapo, "reward at the end"), ("grpo_end", grpo, "reward at the end")),
                )
            )
            if tag:  # tracking: the adaptive run against fixed-target BAPO from the same set point
                specs.append(
                    ClaimSpec(
                        f"4-tracks-{key}",
                        "with the adaptive target, entropy tracks its set point (closer than fixed-target BAPO)",
                        where + ", second half of the updates",
                        "entropy off the set point",
                        bapo,
                        cell_arm(Cell("bapo", stale_e, delay)),
                        sign=-1,
                        detail="|H - H*| adaptive {treatment} vs fixed {baseline}; H* {set_point}; "
                        "rho0 at the end {target}",
                        shows=(("set_point", bapo, "set point at the end"), ("target", bapo, "target at the end")),
                    )
                )
    return specs


def lab_claim_specs(cells: list[Cell], rollout_steps: int) -> list[ClaimSpec]:
    """Every claim of these cells, in the order of the paper's claims 1-4, then the check of the
    entropy-change diagnostic (one per cell; evaluated where the cell records the estimate)."""
    staleness_e = sorted({cell.staleness_e for cell in cells if not cell.async_delay})
    delays = sorted({cell.async_delay for cell in cells if cell.async_delay})
    present = {cell.name for cell in cells}
    top = max((e for e in staleness_e if e > 0 and Cell("grpo", e).name in present), default=None)
    claim2 = sorted({cell.staleness_e for cell in cells if cell.method in CLAIM2_METHODS})
    base = cell_arm(Cell("grpo"))
    first_share = ClaimSpec(
        "3-negative-dominate",
        "negative tokens dominate the loss early (positive share < 0.5)",
        "first rollout batch, on-policy GRPO",
        "first positive share",
        base,
        sign=-1,
        reference=0.5,
        detail="share {treatment}; over the whole run {whole}",
        shows=(("whole", base, "positive share"),),
    )
    diagnostics = [
        ClaimSpec(
            f"D-estimate-{cell.name.replace(' ', '-')}",
            "entropy_change_estimate tracks the actual entropy change of its update (correlation > 0)",
            cell.name,
            "estimate correlation",
            cell_arm(cell),
            detail="correlation {treatment}; sign agreement {agreement}",
            shows=(("agreement", cell_arm(cell), "estimate sign agreement"),),
        )
        for cell in cells
    ]
    settings = [(e, 0) for e in staleness_e] + [(0, delay) for delay in delays]
    return [
        *_staleness_claims(staleness_e, delays, top, rollout_steps),
        *_clip_bound_claims(claim2),
        first_share,
        *_bapo_claims(settings),
        *diagnostics,
    ]


def lab_claims(runs: list[CellRun], rollout_steps: int) -> list[Claim]:
    """Every claim whose cells are present and that at least 2 seeds measure (see lab_claim_specs)."""
    specs = lab_claim_specs([run.cell for run in runs], rollout_steps)
    values = cell_values(runs, lab_measures(runs, rollout_steps))
    return evaluate_claims(specs, values, resolution=EFFECT_RESOLUTION, min_seeds=2)

"""`run_lab`: the plan of cells, run in parallel processes, judged, written to a folder.

Output folder: cells/<cell>/metrics.jsonl (one row per seed and optimizer update), claims.json,
report.md with plots/*.png, lab.json (the plan, the regime and the wall time).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from bapo.analysis.claims import Claim, Standing, claims_json, leaderboard, leaderboard_markdown
from bapo.analysis.runs import setting_name
from bapo.core import POLICY_LOSSES
from bapo.lab.claims import CLAIM2_METHODS, EFFECT_RESOLUTION, cell_values, lab_claims, lab_measures
from bapo.lab.run import METHODS, WEIGHTED_METHODS, Cell, CellRun, LabConfig, run_cell


def compared_methods() -> tuple[str, ...]:
    """Every method of METHODS but claim 2's bound variants, in METHODS order: a method added
    there runs at every E of the default plan and joins the report's leaderboards."""
    return tuple(method for method in METHODS if method not in CLAIM2_METHODS)


def peer_methods() -> tuple[str, ...]:
    """`bapo lab --peers`' methods: grpo, clip-higher, dual-clip and bapo (their METHODS entries),
    then every other registered loss the lab runs (topr, dcpo and the peers of bapo.core.peers, in
    POLICY_LOSSES order, each with its own defaults; decoupled-ppo's proximal policy is the one
    before each rollout batch's first update), then the weights on GRPO of WEIGHTED_METHODS (IcePop
    in verl's decoupled mode, TRL's OPSM). The adaptive-target variant bapo-entropy is left out
    (not a paper default)."""
    own = ("grpo", "clip-higher", "dual-clip", "bapo")
    rest = [m for m in POLICY_LOSSES if m not in METHODS]
    return own + tuple(rest) + tuple(WEIGHTED_METHODS)


# (lab measure, sign: +1 = higher is better, what it ranks) of `bapo lab --peers`' leaderboards
PEER_LEADERBOARDS: tuple[tuple[str, int, str], ...] = (
    ("reward at the end", 1, "exact expected reward after the last update (equal samples)"),
    ("mean reward", 1, "exact reward averaged over the run's rollout steps (learning speed)"),
    ("entropy at the end", 1, "exact on-policy entropy after the last update (equal samples)"),
    (
        "entropy at matched reward",
        1,
        "exact entropy after the first update whose exact reward reaches 0.4 (seeds: those that reached it)",
    ),
    ("grad-norm CV", -1, "std / mean of the per-update gradient norm (lower = more stable)"),
    (
        "share distance",
        -1,
        "|positive share - 0.4| averaged over the updates, clipped methods only (lower = nearer BAPO's target)",
    ),
)
# where the positive share (of the loss, at the method's clip bounds) is meaningful: fixed or searched bounds
PEER_SHARE_METHODS = ("grpo", "clip-higher", "dual-clip", "bapo")
PEER_STALENESS_E = (0, 2, 4, 8)
PEER_DELAYS = (2, 8)
PEER_LONG_DELAYS = (0, 4, 16, 64)  # the long async-delay sweep; k = 0 is the E = 0 cell
# `bapo lab --async-delays`: the async delay k run long enough that every k reaches its steady lag
# (k rollout steps) for most of the run: grpo, an unclipped surrogate (M2PO's paper: it first beats
# clipped GRPO on stale data, then collapses), both M2PO variants, bapo and decoupled PPO
ASYNC_DELAY_METHODS = ("grpo", "unclipped", "m2po", "m2po-official", "bapo", "decoupled-ppo")
ASYNC_DELAYS = (4, 16, 64, 256)
ASYNC_DELAY_ROLLOUT_STEPS = 384  # k = 256 trains at its steady lag for the last 128 rollout steps
ASYNC_DELAY_LEADERBOARDS: tuple[tuple[str, int, str], ...] = (
    ("early reward", 1, "exact reward averaged over the first quarter of the rollout steps"),
    ("reward at the end", 1, "exact expected reward after the last update"),
    ("reward drawdown", -1, "sum of the falls of the exact reward between rollout steps (lower = less undone)"),
    ("entropy at the end", 1, "exact on-policy entropy after the last update"),
    ("entropy at matched reward", 1, "exact entropy after the first update whose exact reward reaches 0.4"),
)


@dataclass(frozen=True)
class LabPlan:
    """Which cells run. staleness_e: the paper's staleness E values (E + 1 updates per rollout batch) for
    every method in `methods` (default: compared_methods()); delays: async delays k for grpo and
    the bapo variants; claim2_staleness_e: E values of the c_high / c_low variants."""

    config: LabConfig = field(default_factory=LabConfig)
    methods: tuple[str, ...] = field(default_factory=compared_methods)
    staleness_e: tuple[int, ...] = (0, 2, 4, 8)
    delays: tuple[int, ...] = (2, 8)
    claim2_staleness_e: tuple[int, ...] = (4,)
    # methods run at every async delay (None: grpo and the bapo variants, the default plan's)
    delay_methods: tuple[str, ...] | None = None
    # (measure, sign, what) leaderboards over `methods` vs grpo, printed and written to report.md and
    # claims.json (empty: the default report's leaderboards only)
    leaderboards: tuple[tuple[str, int, str], ...] = ()

    def cells(self) -> list[Cell]:
        cells = [Cell(m, e) for e in self.staleness_e for m in self.methods]
        cells += [Cell(m, e) for e in self.claim2_staleness_e for m in CLAIM2_METHODS]
        delayed = self.delay_methods if self.delay_methods is not None else ("grpo", "bapo", "bapo-entropy")
        cells += [Cell(m, 0, k) for k in self.delays for m in delayed if m in self.methods]
        return cells

    def settings(self) -> list[str]:
        """The settings of the cells (bapo.analysis.runs.setting_name), in plan order."""
        return list(dict.fromkeys(setting_name(c.staleness_e, c.async_delay) for c in self.cells()))


def peers_plan(
    config: LabConfig | None = None,
    methods: tuple[str, ...] | None = None,
    staleness_e: tuple[int, ...] = PEER_STALENESS_E,
    delays: tuple[int, ...] = tuple(sorted(set(PEER_DELAYS) | set(PEER_LONG_DELAYS) - {0})),
) -> LabPlan:
    """`bapo lab --peers`: every method of peer_methods() at staleness E 0, 2, 4, 8 and async delay
    2 and 8 plus the long sweep k 4, 16, 64 (k = 0 is E = 0), the default regime and 20 seeds, each
    method at its defaults (nothing tuned), ranked per setting by PEER_LEADERBOARDS against grpo.
    The arguments (a subset) are for tests."""
    config = config or LabConfig()
    config = replace(config, share_methods=PEER_SHARE_METHODS)
    methods = methods or peer_methods()
    return LabPlan(
        config,
        methods=methods,
        staleness_e=staleness_e,
        delays=delays,
        claim2_staleness_e=(),
        delay_methods=methods,
        leaderboards=PEER_LEADERBOARDS,
    )


def async_delay_plan(
    config: LabConfig | None = None, seeds: int = 10, delays: tuple[int, ...] = ASYNC_DELAYS
) -> LabPlan:
    """`bapo lab --async-delays` (the axis M2PO's paper calls stale-k): ASYNC_DELAY_METHODS at E = 0
    and async delay k in `delays`, each for ASYNC_DELAY_ROLLOUT_STEPS rollout steps (10 seeds: 16x
    the default run's steps), ranked by ASYNC_DELAY_LEADERBOARDS against grpo. Each method at its
    defaults; nothing tuned. A `config` given (tests) is used as it is: `seeds` and
    ASYNC_DELAY_ROLLOUT_STEPS apply to the default only."""
    config = config or replace(LabConfig(), rollout_steps=ASYNC_DELAY_ROLLOUT_STEPS, seeds=seeds)
    config = replace(config, share_methods=("grpo", "bapo"), check_cells=())
    return LabPlan(
        config,
        methods=ASYNC_DELAY_METHODS,
        staleness_e=(0,),
        delays=delays,
        claim2_staleness_e=(),
        delay_methods=ASYNC_DELAY_METHODS,
        leaderboards=ASYNC_DELAY_LEADERBOARDS,
    )


def plan_leaderboards(runs: list[CellRun], plan: LabPlan) -> list[tuple[str, str, list[Standing]]]:
    """plan.leaderboards computed from the runs: (measure, what, standings) each, every method of
    plan.methods in every setting (best first), with its paired effect vs grpo (sign: better > 0)."""
    values = cell_values(runs, lab_measures(runs, plan.config.rollout_steps))
    boards = []
    for metric, sign, what in plan.leaderboards:
        standings = leaderboard(
            list(plan.methods),
            plan.settings(),
            metric,
            values,
            baseline="grpo",
            sign=sign,
            resolution=EFFECT_RESOLUTION,
        )
        boards.append((metric, what, standings))
    return boards


def leaderboards_markdown(boards: list[tuple[str, str, list[Standing]]]) -> str:
    """One section per leaderboard (### measure: what, then the table); '' for none."""
    text = []
    for metric, what, standings in boards:
        text += [f"### {metric}: {what}", "", leaderboard_markdown(standings), ""]
    return "\n".join(text)


def plan_for(quick: bool = False, seeds: int | None = None, peers: bool = False, async_delays: bool = False) -> LabPlan:
    """The default plan, or --quick: fewer seeds, steps and cells (E 0 and 4, delay 4), or --peers
    (peers_plan), or --async-delays (async_delay_plan)."""
    if quick + peers + async_delays > 1:
        raise ValueError("--quick, --peers and --async-delays: choose one (--seeds N for a smaller run)")
    plan = peers_plan() if peers else async_delay_plan() if async_delays else LabPlan()
    if quick:
        plan = LabPlan(
            replace(plan.config, seeds=6, rollout_steps=12, check_cells=("grpo E=4",)),
            methods=("grpo", "bapo"),
            staleness_e=(0, 4),
            delays=(4,),
        )
    if seeds is not None:
        if seeds < 2:
            raise ValueError(f"seeds: {seeds} gives no interval; use --seeds 2 or more (20 for the default)")
        plan = replace(plan, config=replace(plan.config, seeds=seeds))
    return plan


def _run_one(args: tuple[Cell, LabConfig]) -> CellRun:
    torch.set_num_threads(1)  # one process per core: tiny tensors gain nothing from threads
    return run_cell(*args)


def run_jobs(work: list[tuple[Cell, LabConfig]], jobs: int | None = None) -> list[CellRun]:
    """run_cell of every (cell, config) of `work`, in `jobs` processes (default: one per CPU
    core), returned in the order of `work`."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work)))
    if jobs == 1:
        return [_run_one(job) for job in work]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return pool.map(_run_one, work, chunksize=1)


def run_cells(plan: LabPlan, jobs: int | None = None) -> list[CellRun]:
    """Run every cell of the plan, `jobs` processes (default: one per CPU core), biggest first."""
    cells = plan.cells()
    order = sorted(cells, key=lambda c: -(c.staleness_e + 1))
    by_name = {r.cell.name: r for r in run_jobs([(c, plan.config) for c in order], jobs)}
    return [by_name[c.name] for c in cells]


def write_metrics(run: CellRun, path: Path) -> None:
    """metrics.jsonl-style rows: one per seed and optimizer update (update = optimizer updates done; E and
    async_delay name the cell; policy_lag/mean is the update's lag in optimizer updates)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = sorted(run.updates)
    values = torch.stack([run.updates[k] for k in keys], -1).tolist()  # [S, U, K]
    updates_per_batch = run.cell.staleness_e + 1
    with path.open("w") as f:
        for seed, per_seed in zip(run.seeds, values):
            for update, row in enumerate(per_seed):
                f.write(
                    json.dumps(
                        {
                            "cell": run.cell.name,
                            "method": run.cell.method,
                            "E": run.cell.staleness_e,
                            "async_delay": run.cell.async_delay,
                            "seed": seed,
                            "update": update + 1,
                            "rollout_step": update // updates_per_batch,
                            "batch_version": run.versions[update],
                            **dict(zip(keys, row)),
                        }
                    )
                    + "\n"
                )


def run_lab(
    out_dir: str | Path | None = None,
    *,
    quick: bool = False,
    seeds: int | None = None,
    jobs: int | None = None,
    plots: bool = True,
    plan: LabPlan | None = None,
) -> tuple[list[Claim], Path]:
    """Run the lab and write its folder; returns (claims, out_dir). `bapo demo` calls this first."""
    plan = plan or plan_for(quick, seeds)
    out = Path(out_dir) if out_dir is not None else Path("runs") / f"lab-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    runs = run_cells(plan, jobs)
    train_s = time.perf_counter() - start
    claims = lab_claims(runs, plan.config.rollout_steps)
    boards = plan_leaderboards(runs, plan) if plan.leaderboards else []
    # each method's verdict against grpo joins claims.json (id: "<measure>-<method>-vs-grpo-<setting>")
    claims_out = claims + [row.versus for _, _, standings in boards for row in standings if row.versus is not None]
    for run in runs:
        write_metrics(run, out / "cells" / run.cell.name.replace(" ", "_") / "metrics.jsonl")
    (out / "claims.json").write_text(claims_json(claims_out) + "\n")
    if boards:
        (out / "leaderboards.md").write_text(leaderboards_markdown(boards))
    info = {
        "plan": asdict(plan),
        "cells": [c.name for c in plan.cells()],
        "train_s": round(train_s, 2),
        "jobs": jobs or os.cpu_count(),
        "torch": torch.__version__,
    }
    from bapo.lab.report import write_report  # matplotlib only when a report is written

    write_report(out, runs, claims, plan, info, plots=plots, boards=leaderboards_markdown(boards))
    info["total_s"] = round(time.perf_counter() - start, 2)
    (out / "lab.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    return claims, out

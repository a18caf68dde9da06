"""report.md and plots of a lab run, drawn by the analysis stack from the cells' metrics.jsonl
(bapo.analysis.runs.find_runs gives one run per cell and seed): the claims table first, the
leaderboards of every method, one figure per quantity with one panel per setting (mean over
seeds, shaded 95% t interval, x = optimizer updates) and one of GRPO over E (x = rollout
batches), then the per-cell table."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bapo.analysis.claims import Claim, claims_markdown, leaderboard, leaderboard_markdown, mean_interval
from bapo.analysis.plots import Figures, plot_runs
from bapo.analysis.report import markdown_table, summary
from bapo.analysis.runs import Run, find_runs, group_runs
from bapo.lab.claims import EFFECT_RESOLUTION, TARGET, cell_values, lab_measures
from bapo.lab.run import METHODS, CellRun

# file name -> (title, [(series key, line style)]); exact/* are closed-form values after each update
FIGURES: Figures = {
    "entropy": ("exact on-policy entropy (nats / token)", [("exact/entropy", "-")]),
    "positive_share": ("positive share of the loss (gradient definition)", [("positive_share", "-")]),
    "reward": ("exact expected reward", [("exact/reward", "-")]),
}
# column -> one seed's value in the per-cell table
CELL_COLUMNS = {
    "entropy end": lambda run: run.values("exact/entropy")[-1],
    "reward end": lambda run: run.values("exact/reward")[-1],
    "positive share (mean)": lambda run: run.mean("positive_share"),
    "grad norm (mean)": lambda run: run.mean("grad_norm"),
}
# (lab measure, what it ranks) of the leaderboards: every method of every setting against GRPO
LEADERBOARDS = (
    ("mean reward", "exact reward averaged over the run's rollout steps (learning speed)"),
    ("entropy at the end", "exact entropy after the last update (equal samples)"),
)


def _leaderboards(runs: list[CellRun], cells: list[Run], rollout_steps: int) -> list[str]:
    """The LEADERBOARDS sections: every method (METHODS order) in every setting, best first."""
    values = cell_values(runs, lab_measures(runs, rollout_steps))
    settings = list(group_runs(cells))
    text = []
    for metric, what in LEADERBOARDS:
        standings = leaderboard(list(METHODS), settings, metric, values, baseline="grpo", resolution=EFFECT_RESOLUTION)
        text += [f"### {metric}: {what}", "", leaderboard_markdown(standings), ""]
    return text


def _plots(cells: list[Run], out: Path) -> list[Path]:
    """FIGURES per setting (x = optimizer updates), then GRPO's sweep over E at equal samples (one
    line per E, x = rollout batches, the last update of each)."""
    images = plot_runs(cells, out, TARGET, smooth=1, figures=FIGURES, x="update", dpi=90)
    sweep = [
        replace(run, method=run.setting, setting="GRPO over E")
        for run in cells
        if run.method == "grpo" and "delay" not in run.setting
    ]
    if len({run.method for run in sweep}) > 1:
        over_e = {f"{name}_grpo_over_E": (title, keys) for name, (title, keys) in FIGURES.items()}
        images += plot_runs(sweep, out, TARGET, smooth=1, figures=over_e, dpi=90)
    return images


def write_report(
    out: Path, runs: list[CellRun], claims: list[Claim], plan, info: dict, plots: bool = True, boards: str = ""
) -> Path:
    """report.md: regime, claims table, leaderboards (`boards`, the plan's own in Markdown, where
    given: `bapo lab --peers`), plots, per-cell table (reads OUT/cells)."""
    cfg = plan.config
    task = cfg.task
    cells = find_runs([out / "cells"])
    images = _plots(cells, out / "plots") if plots else []
    start = runs[0].start
    reward0, entropy0 = (mean_interval(start[k].tolist())[0] for k in ("reward", "entropy"))
    regime = (
        f"Regime: {task.prompts} prompts x {cfg.group_size} responses per rollout batch, vocabulary "
        f"{task.vocab}, budget {task.budget} guesses (a response stops at the first correct guess), start "
        f"answer probability {task.answer_prob[0]}-{task.answer_prob[1]} per state, SGD lr {cfg.lr} on the "
        f"logits, {cfg.rollout_steps} rollout batches per cell, {cfg.seeds} seeds (paired: the same task instance "
        f"and draws per seed in every cell). Start policy: reward {reward0:.3f}, entropy {entropy0:.3f} "
        "nats/token."
    )
    axes = (
        "Staleness E (the paper's Algorithm 1): E+1 optimizer updates per rollout batch, the batch split "
        "into E+1 mini-batches, bounds re-searched before each. Async delay k: each batch trained once, k "
        "rollout steps after it was generated."
    )
    verdicts = (
        "Effect > 0 means the paper's direction; verdict from the 95% t interval over seeds (held: all "
        "above 0, not held: all below 0, mixed: contains 0). D-* rows check the diagnostic: the "
        "correlation over updates between policy_loss's entropy_change_estimate and the exact entropy "
        "change of that update on its mini-batch's tokens."
    )
    text = [
        "# bapo lab: the paper's claims under an exact tabular softmax policy",
        "",
        regime,
        "",
        axes,
        "",
        f"Wall time: {info['train_s']} s for {len(runs)} cells on {info['jobs']} process(es).",
        "",
        "## Claims",
        "",
        claims_markdown(claims),
        "",
        verdicts,
        "",
        "## Leaderboards (mean [95% interval] over seeds; vs GRPO: paired by seed, > 0 = higher)",
        "",
        *([boards] if boards else _leaderboards(runs, cells, cfg.rollout_steps)),
    ]
    if images:
        text += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in images] + [""]
    text += ["## Cells (mean [95% interval] over seeds)", "", markdown_table(summary(cells, CELL_COLUMNS)), ""]
    path = out / "report.md"
    path.write_text("\n".join(text))
    return path

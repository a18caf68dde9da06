"""report.md and plots of a lab run: the claims table first, then one figure per quantity with one
panel per setting (mean over seeds, shaded 95% t interval), then a per-cell table."""

from __future__ import annotations

from pathlib import Path

from bapo.analysis.claims import Claim, claims_markdown, mean_interval
from bapo.analysis.plots import save_figure
from bapo.lab.run import CellRun

# file name -> (title, series key); exact/* are closed-form values after each update
FIGURES = {
    "entropy": ("exact on-policy entropy (nats / token)", "exact/entropy"),
    "positive_share": ("positive share of the loss (gradient definition)", "positive_share"),
    "reward": ("exact expected reward", "exact/reward"),
}
COLORS = {
    "grpo": "tab:blue",
    "clip-higher": "tab:orange",
    "dual-clip": "tab:gray",
    "bapo": "tab:green",
    "grpo-c_high=2.0": "tab:red",
    "grpo-c_low=0.6": "tab:purple",
}


def _band(values: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Mean and 95% interval over seeds at every x: values [S][n]."""
    stats = [mean_interval(column) for column in zip(*values)]
    return [s[0] for s in stats], [s[1] for s in stats], [s[2] for s in stats]


def _panels(runs: list[CellRun]) -> list[tuple[str, list[CellRun], str]]:
    """(title, runs, x axis) of each panel: one per staleness E (all methods there), the GRPO E
    sweep over samples, one per async delay."""
    panels: list[tuple[str, list[CellRun], str]] = []
    for e in sorted({r.cell.staleness for r in runs}):
        members = [r for r in runs if r.cell.staleness == e and not r.cell.delay]
        panels.append((f"staleness E={e} ({e + 1} updates / batch)", members, "update"))
    sweep = [r for r in runs if r.cell.method == "grpo" and not r.cell.delay]
    if len(sweep) > 1:
        panels.append(("GRPO over E (x = rollout batches)", sweep, "samples"))
    delayed = sorted({r.cell.delay for r in runs if r.cell.delay})
    if delayed:
        members = [
            r
            for r in runs
            if r.cell.staleness == 0
            and r.cell.method in ("grpo", "bapo")
            and (r.cell.delay in delayed or r.cell.delay == 0)
        ]
        panels.append(("async delay k (each batch trained once)", members, "update"))
    return panels


def plot_lab(runs: list[CellRun], out_dir: Path, target_share: float | None = None) -> list[Path]:
    """One PNG per quantity in FIGURES, one panel per setting; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    panels = _panels(runs)
    written = []
    for name, (title, key) in FIGURES.items():
        columns = min(3, len(panels))
        rows = -(-len(panels) // columns)
        fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.4 * rows), squeeze=False)
        for ax in axes.flat[len(panels) :]:
            ax.set_visible(False)
        for ax, (panel_title, members, x_axis) in zip(axes.flat, panels):
            for index, run in enumerate(members):
                if key not in run.updates:
                    continue
                values = run.updates[key].tolist()
                mean, low, high = _band(values)
                per_batch = run.cell.staleness + 1
                xs = [(update + 1) / per_batch if x_axis == "samples" else update + 1 for update in range(len(mean))]
                label = (
                    run.cell.name
                    if x_axis == "samples" or run.cell.delay or panel_title.startswith("async")
                    else run.cell.method
                )
                color = COLORS.get(run.cell.method) if x_axis == "update" and not run.cell.delay else f"C{index}"
                style = "--" if run.cell.delay else "-"
                ax.plot(xs, mean, style, color=color, label=label, lw=1.3)
                ax.fill_between(xs, low, high, color=color, alpha=0.2, lw=0)
            if key == "positive_share" and target_share is not None:
                ax.axhline(target_share, color="k", lw=0.6, ls=":")
            ax.set_title(panel_title, fontsize=9)
            ax.set_xlabel("rollout batches" if x_axis == "samples" else "optimizer updates", fontsize=8)
            ax.legend(fontsize=6)
        fig.suptitle(title + " - mean and 95% interval over seeds", fontsize=10)
        written.append(save_figure(fig, out_dir, name, dpi=90))
    return written


def _cell_table(runs: list[CellRun]) -> str:
    lines = [
        "| cell | updates | entropy end | reward end | positive share (mean) | grad norm (mean) |",
        "|---|---|---|---|---|---|",
    ]

    def fmt(values) -> str:
        mean, low, high = mean_interval(values)
        return f"{mean:.3f} [{low:.3f}, {high:.3f}]"

    for run in runs:
        u = run.updates
        share = fmt(u["positive_share"].nanmean(1).tolist()) if "positive_share" in u else "-"
        lines.append(
            f"| {run.cell.name} | {u['grad_norm'].shape[1]} | {fmt(u['exact/entropy'][:, -1].tolist())} | "
            f"{fmt(u['exact/reward'][:, -1].tolist())} | {share} | {fmt(u['grad_norm'].mean(1).tolist())} |"
        )
    return "\n".join(lines)


def write_report(out: Path, runs: list[CellRun], claims: list[Claim], plan, info: dict, plots: bool = True) -> Path:
    """report.md: regime, claims table, the diagnostic check, plots, per-cell table."""
    cfg = plan.config
    task = cfg.task
    images = plot_lab(runs, out / "plots", target_share=0.4) if plots else []
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
    ]
    if images:
        text += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in images] + [""]
    text += ["## Cells (end of run, mean [95% interval] over seeds)", "", _cell_table(runs), ""]
    path = out / "report.md"
    path.write_text("\n".join(text))
    return path

"""PNG plots from metrics.jsonl: one figure per quantity, one panel per setting (staleness E,
async delay, partial rollout), one line per method (mean over seeds, shaded 95% interval when
there are several). The demo's runs and the lab's cells (its own figures) are drawn alike."""

from __future__ import annotations

from pathlib import Path

from bapo.analysis.claims import mean_interval
from bapo.analysis.runs import Run, group_runs

# file name -> (title, [(metrics key, line style)]); two keys share a panel (solid, dashed)
FIGURES = {
    "reward": ("training reward (mean)", [("reward/mean", "-")]),
    "heldout_accuracy": ("held-out accuracy (avg@k, sampled)", [("heldout/accuracy", "-")]),
    "entropy": ("policy entropy (nats / token)", [("entropy", "-")]),
    "positive_share": ("positive-advantage share of the loss", [("positive_share", "-")]),
    "grad_norm": ("gradient norm (before clipping)", [("grad_norm", "-")]),
    "bounds": ("clip bounds: upper (solid), lower (dashed)", [("upper", "-"), ("lower", "--")]),
    "clip_fraction": (
        "clipped tokens: upper (solid), lower (dashed)",
        [("clip_frac/upper", "-"), ("clip_frac/lower", "--")],
    ),
}
Figures = dict[str, tuple[str, list[tuple[str, str]]]]
COLORS = {
    "grpo": "tab:blue",
    "clip-higher": "tab:orange",
    "bapo": "tab:green",
    "topr": "tab:purple",
    "dcpo": "tab:brown",
    "dual-clip": "tab:gray",
    "bapo-entropy": "tab:olive",
    "grpo-c_high=2.0": "tab:red",
    "grpo-c_low=0.6": "tab:pink",
}
X_LABELS = {"rollout_step": "rollout step", "update": "optimizer update"}


def save_figure(fig, out_dir: Path, name: str, dpi: int) -> Path:
    """Lay out `fig`, write it to OUT_DIR/<name>.png, close it (pyplot keeps open figures alive);
    returns the file."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(out_dir) / f"{name}.png"
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def _seed_band(runs: list[Run], key: str, window: int, x: str = "rollout_step"):
    """(x values, mean, low, high): mean over seeds and its 95% interval at the x values (rollout
    steps or updates) every seed logged; None when no data."""
    # {x: value of its last update}, per seed
    per_seed = [dict(zip(*run.series(key, x=x))) for run in runs]
    points = sorted(set.intersection(*(set(seed_values) for seed_values in per_seed)))
    if not points:
        return None
    curves = [_smooth([seed_values[step] for step in points], window) for seed_values in per_seed]
    bands = [mean_interval([curve[index] for curve in curves]) for index in range(len(points))]
    return points, *([band[part] for band in bands] for part in range(3))


def plot_runs(
    runs: list[Run],
    out_dir: Path,
    target_share: float | None = None,
    smooth: int | None = None,
    figures: Figures = FIGURES,
    x: str = "rollout_step",
    dpi: int = 110,
) -> list[Path]:
    """Write one PNG per entry of `figures` that has data into `out_dir`; returns their paths.
    x: "rollout_step" (the last update of each) or "update" (every optimizer update)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs)
    longest = max(len({row.get(x) for row in run.rows}) for run in runs)
    window = smooth or max(1, longest // 12)
    written = []
    for name, (title, keys) in figures.items():
        if not any(key in row for run in runs for key, _ in keys for row in run.rows):
            continue  # nothing logs this quantity (e.g. no held-out checks)
        # logged but never finite (positive share without any learning signal): an empty panel says so
        no_values = not any(run.series(key)[0] for run in runs for key, _ in keys)
        fig, axes = plt.subplots(1, len(groups), figsize=(4.6 * len(groups), 3.4), sharey=True, squeeze=False)
        for ax, (setting, by_method) in zip(axes[0], groups.items()):
            for rank, (method, method_runs) in enumerate(by_method.items()):
                color = COLORS.get(method)
                width = max(0.8, 2.6 - 0.6 * rank)  # identical curves stay visible
                for key, style in keys:
                    band = _seed_band(method_runs, key, 1 if key.startswith("heldout") else window, x)
                    if band is None:
                        continue
                    points, mean, low, high = band
                    label = method if style == "-" or len(keys) == 1 else None
                    (line,) = ax.plot(points, mean, style, color=color, label=label, lw=width)
                    if len(method_runs) > 1:
                        ax.fill_between(points, low, high, color=line.get_color(), alpha=0.15, lw=0)
            if no_values:
                ax.text(
                    0.5,
                    0.5,
                    "no finite values\n(no learning signal)",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    fontsize=9,
                    color="gray",
                )
            if name == "positive_share" and target_share is not None:
                ax.axhline(target_share, color="k", ls=":", lw=1, label="bapo target")
            ax.set_title(setting)
            ax.set_xlabel(X_LABELS.get(x, x))
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(name.replace("_", " "))
        legend = {}  # one legend for the figure: every method of every panel, once
        for ax in axes[0]:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                legend.setdefault(label, handle)
        axes[0][-1].legend(legend.values(), legend.keys(), fontsize=8, loc="best")
        fig.suptitle(
            title
            + (
                f"  (moving average over {window} {X_LABELS.get(x, x)}s)"
                if window > 1 and not name.startswith("heldout")
                else ""
            ),
            fontsize=10,
        )
        written.append(save_figure(fig, out_dir, name, dpi=dpi))
    return written

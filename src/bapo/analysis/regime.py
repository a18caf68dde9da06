"""The regime gate: does a task hold BAPO's premise for GRPO itself, before any other method runs?

Read from GRPO runs' metrics.jsonl (every optimizer update logs response_length/{rewarded,
unrewarded}, positive_share/start_bounds and positive_share; held-out scores from the study's hook):

    (a) lift      on-policy GRPO's held-out avg@k, end minus start, with a 95% interval over seeds:
                  passes when the interval lies above 0 (a lift beyond seed spread)
    (b) lengths   unrewarded / rewarded mean response length in each third of training (seed mean):
                  passes when every third of every setting is >= LENGTH_RATIO, not only the first
    (c) share     in each stale setting, the fraction of updates whose positive share at the bounds
                  used is below the target: passes when it is more than half (seeds pooled)
    (d) staleness what each setting does to GRPO, seed means: held-out lift, entropy and reward in
                  the first and last third of updates, gradient norm median and max (measured, no verdict)

With group-normalised advantages and ratio 1 the share is Lc / (Lc + Lw) per mixed group, so (b) and (c)
are one premise seen twice: (b) from the lengths of all responses, (c) from the loss itself.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from bapo.analysis.claims import mean_interval
from bapo.analysis.runs import Run

LENGTH_RATIO = 1.3  # test (b): failing replies at least this much longer than correct ones (docs/STUDY.md)
THIRDS = ("first", "middle", "last")


def _thirds(values: Sequence[float]) -> list[float]:
    """Means of the first, middle and last third of `values` (nan for an empty third)."""
    size = len(values)
    cuts = [0, size // 3, (2 * size) // 3, size]
    return [statistics.fmean(values[a:b]) if b > a else math.nan for a, b in zip(cuts, cuts[1:], strict=False)]


def length_ratios(run: Run) -> list[float]:
    """Unrewarded / rewarded mean response length per third of the run's updates (updates with both
    kinds only; each third's ratio is the ratio of its mean lengths)."""
    keys = ("response_length/rewarded", "response_length/unrewarded")
    both = set(run.series(keys[0])[0]) & set(run.series(keys[1])[0])  # the updates that logged both finite
    rewarded, unrewarded = (
        _thirds([value for update, value in zip(*run.series(key), strict=True) if update in both]) for key in keys
    )
    return [u / r if r > 0 else math.nan for u, r in zip(unrewarded, rewarded, strict=True)]


def share_below(run: Run, target: float, key: str = "positive_share") -> tuple[int, int]:
    """(updates whose `key` is below target, updates that logged it)."""
    values = run.values(key)
    return sum(value < target for value in values), len(values)


def heldout_lift(run: Run) -> float:
    """End minus start held-out avg@k of one run (nan without both)."""
    start, end = run.heldout("heldout/start/"), run.final
    if not start or not end or start["k"] != end["k"]:
        return math.nan
    return end[f"avg@{end['k']}"] - start[f"avg@{start['k']}"]


def staleness_effects(by_setting: dict[str, list[Run]]) -> list[str]:
    """(d), the paper's Figure 2 question for GRPO alone: a markdown table, one row per setting of
    `by_setting` (setting -> its runs, one per seed). Each cell is a mean over the seeds that have the
    measure (held-out start and end at one k, >= 3 updates for thirds), "(n of m seeds)" where some
    lack it; the gradient norm (before clipping) is each seed's median, averaged, and the largest over
    all seeds, beside the count of updates whose norm was not finite (which the median hides)."""
    from collections.abc import Callable

    def seed_mean(group: list[Run], measure: Callable[[Run], float], fmt: str) -> str:
        values = [value for value in map(measure, group) if math.isfinite(value)]
        if not values:
            return "-"
        text = format(statistics.fmean(values), fmt)
        return text if len(values) == len(group) else f"{text} ({len(values)} of {len(group)} seeds)"

    def third_mean(key: str, index: int) -> Callable[[Run], float]:
        def measure(run: Run) -> float:
            values = run.values(key)
            return _thirds(values)[index] if len(values) >= 3 else math.nan

        return measure

    def median_grad_norm(run: Run) -> float:
        norms = run.values("grad_norm")
        return statistics.median(norms) if norms else math.nan

    def non_finite_grad_norms(run: Run) -> int:
        logged = [row["grad_norm"] for row in run.rows if isinstance(row.get("grad_norm"), (int, float))]
        return sum(not math.isfinite(value) for value in logged)

    lines = [
        "| setting | seeds | held-out lift | entropy (first -> last third) | reward (first -> last third) "
        "| gradient norm (median; max over seeds) | non-finite gradient norms |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting, group in by_setting.items():
        entropy, reward = (
            " -> ".join(seed_mean(group, third_mean(key, index), ".3f") for index in (0, 2))
            for key in ("entropy", "reward/mean")
        )
        norms = [value for run in group for value in run.values("grad_norm")]
        largest = f"{max(norms):.3f}" if norms else "-"
        lines.append(
            f"| {setting} | {len(group)} | {seed_mean(group, heldout_lift, '+.3f')} | {entropy} | {reward} "
            f"| {seed_mean(group, median_grad_norm, '.3f')}; {largest} | {sum(map(non_finite_grad_norms, group))} |"
        )
    return lines


def gate_section(runs: list[Run], target: float, on_policy: str = "E=0") -> list[str]:
    """The gate's markdown: a per-run table, (a)-(c) with their verdicts, then (d)'s table ([] without
    grpo runs)."""
    runs = [run for run in runs if run.method == "grpo"]
    if not runs:
        return []
    thirds = ", ".join(THIRDS)
    lines = [
        f"| setting | seed | updates | held-out lift (avg@k) | unrewarded / rewarded length ({thirds} third) "
        f"| share at start bounds ({thirds} third) | updates with share < {target} |",
        "|---|---|---|---|---|---|---|",
    ]
    by_setting: dict[str, list[Run]] = {}
    for run in sorted(runs, key=lambda run: (run.setting != on_policy, run.setting, run.seed)):
        by_setting.setdefault(run.setting, []).append(run)
        below, counted = share_below(run, target)
        starts = _thirds(run.values("positive_share/start_bounds"))
        lines.append(
            f"| {run.setting} | {run.seed} | {counted} | {heldout_lift(run):+.3f} | "
            + " / ".join(f"{value:.2f}" for value in length_ratios(run))
            + " | "
            + " / ".join(f"{value:.2f}" for value in starts)
            + f" | {below}/{counted} |"
        )
    lines.append("")
    verdict = {True: "**passes**", False: "**fails**"}
    lifts = [lift for lift in map(heldout_lift, by_setting.get(on_policy, [])) if math.isfinite(lift)]
    if len(lifts) >= 2:
        mean, low, high = mean_interval(lifts)
        lines.append(
            f"- (a) on-policy held-out lift {mean:+.3f} [{low:+.3f}, {high:+.3f}] over {len(lifts)} seeds: "
            f"{verdict[low > 0]}"
        )
    else:
        lines.append(f"- (a) on-policy held-out lift: {len(lifts)} finished seed(s), at least 2 needed for an interval")
    worst = []
    for setting, group in by_setting.items():
        per_third = [statistics.fmean(values) for values in zip(*map(length_ratios, group), strict=True)]
        worst.append(min(per_third))
        lines.append(
            f"- (b) {setting}: unrewarded / rewarded length by third "
            + " / ".join(f"{value:.2f}" for value in per_third)
            + f" (seed mean; {len(group)} seed{'s' * (len(group) != 1)})"
        )
    if all(math.isnan(value) for value in worst):
        lines.append("- (b) not measured: these runs predate response_length/{rewarded, unrewarded}")
    else:
        passed = all(value >= LENGTH_RATIO for value in worst)
        lines.append(f"- (b) every third of every setting >= {LENGTH_RATIO}: {verdict[passed]}")
    for setting, group in by_setting.items():
        if setting == on_policy:
            continue
        below, counted = (sum(column) for column in zip(*(share_below(run, target) for run in group), strict=True))
        if not counted:
            lines.append(f"- (c) {setting}: no update logged a positive share (no mixed group)")
            continue
        lines.append(
            f"- (c) {setting}: positive share < {target} in {below} of {counted} updates ({below / counted:.0%}): "
            f"{verdict[below / counted > 0.5]}"
        )
    lines += ["", "(d) What each setting does to GRPO (seed means; no verdict, the measurement the plan reports):", ""]
    return lines + staleness_effects(by_setting)

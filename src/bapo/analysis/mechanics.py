"""What the runs' updates actually did, read from metrics.jsonl: which methods trained identically,
how often BAPO's bound search met its target, and the share and bounds before and after it.

Both answer a reader's first question about a comparison that shows no difference: did the two
methods differ at all in this setting? Two methods whose every update logged exactly the same loss
and gradient norm, in every shared seed, almost surely trained the same weights: equal logs are
necessary for identical training, not proof of it (e.g. decoupled PPO and GRPO without an async
delay, where the proximal policy is the behaviour policy, which tests/experiments/test_study.py checks
weight for weight; or BAPO's two presets where the search never left their common start bounds).
Exact equality: on a non-deterministic device identical methods may not be found. A BAPO run
whose search met the target at its start bounds in most updates is a fixed clip at those bounds.
metrics.jsonl writes NaN and infinities as strings ("nan"); they are read back as floats here.
"""

from __future__ import annotations

import math
import statistics

from bapo.analysis.runs import Run, group_runs

# the per-update values that decide whether two runs trained the same weights
IDENTITY_KEYS = ("loss", "grad_norm")
# a search outcome per update (bapo/search/* of bapo.core.search_metrics)
OUTCOMES = ("no signal", "met at start bounds", "met after moving", "not met")


def _number(value) -> float | None:
    """A logged number as a float ("nan", "inf", "-inf" as metrics.jsonl writes them), else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf"):
        return float(value)
    return None


def _trained_alike(a: Run, b: Run, keys=IDENTITY_KEYS) -> bool:
    """Every update of `a` and `b` logged exactly the same `keys` (and they have the same updates);
    a key neither logged is skipped, one logged by only one of them differs."""
    if len(a.rows) != len(b.rows) or not a.rows:
        return False
    compared = 0
    for row_a, row_b in zip(a.rows, b.rows, strict=True):
        for key in keys:
            if key not in row_a and key not in row_b:
                continue
            value_a, value_b = _number(row_a.get(key)), _number(row_b.get(key))
            if value_a is None or value_b is None:
                return False
            if not (value_a == value_b or (math.isnan(value_a) and math.isnan(value_b))):
                return False
            compared += 1
    return compared > 0


def identical_methods(runs: list[Run]) -> list[tuple[str, str, str, int]]:
    """(setting, method, other method, seeds) for every pair of methods that trained alike in every
    seed they share (at least one), in group_runs' order; each pair once."""
    pairs = []
    for setting, by_method in group_runs(runs).items():
        methods = list(by_method)
        for i, method in enumerate(methods):
            for other in methods[i + 1 :]:
                seeds = {run.seed: run for run in by_method[method]}
                shared = [(seeds[run.seed], run) for run in by_method[other] if run.seed in seeds]
                if shared and all(_trained_alike(a, b) for a, b in shared):
                    pairs.append((setting, method, other, len(shared)))
    return pairs


def _outcome(row: dict) -> str | None:
    """One update's search outcome, or None when the row has no search (another method). With
    BAPOConfig.scope "micro_batch" the row holds means over the update's searches: the update
    counts as "no signal" when half of them had none or `reached` is NaN (then some had none), as
    "not met" when fewer than half met the target, and as "met after moving" when any moved."""
    reached = _number(row.get("bapo/search/reached"))
    if reached is None:
        return None
    no_signal = _number(row.get("bapo/search/no_signal")) or 0.0
    if no_signal >= 0.5 or math.isnan(reached):
        return "no signal"
    if reached < 0.5:
        return "not met"
    steps = _number(row.get("bapo/search/steps")) or 0.0
    return "met after moving" if steps > 0 else "met at start bounds"


def search_outcomes(runs: list[Run]) -> list[dict]:
    """One row per (setting, method) whose runs searched bounds: the share of its updates (all
    seeds pooled) in each of OUTCOMES, and the number of updates."""
    table = []
    for setting, by_method in group_runs(runs).items():
        for method, group in by_method.items():
            outcomes = [outcome for run in group for outcome in map(_outcome, run.rows) if outcome]
            if outcomes:
                shares = {name: outcomes.count(name) / len(outcomes) for name in OUTCOMES}
                table.append({"setting": setting, "method": method, "updates": len(outcomes), **shares})
    return table


def _finite(rows: list[dict], key: str) -> list[float]:
    values = [_number(row.get(key)) for row in rows]
    return [value for value in values if value is not None and math.isfinite(value)]


def search_bounds(runs: list[Run]) -> list[dict]:
    """One row per (setting, method) whose runs searched bounds, seeds pooled, over the updates with
    signal (a no-signal update keeps its start bounds and has no share): their number, the mean
    positive share at BAPO's start bounds (`positive_share/start_bounds`, before the search; NaN
    where not logged) and at the bounds the search chose (`bapo/search/share`), and the bounds used,
    each as (median, min, max): what BAPO reduced to (a fixed clip when min = max).

    The updates whose search moved the bounds ("met after moving" or "not met") also get their own
    means: "moved" (their share of the updates with signal), "moved_share_start" /
    "moved_share_used" (the share before and after the search there), and "clip_lower" /
    "clip_upper" as (at the start bounds, moved): the share of negative tokens below the lower bound
    and of positive tokens above the upper one (clip_frac/*), which says how many tokens the moved
    bounds acted on."""
    table = []
    for setting, by_method in group_runs(runs).items():
        for method, group in by_method.items():
            # classify each update once: (outcome, row) for the rows that searched
            searched = [(outcome, row) for run in group for row in run.rows if (outcome := _outcome(row))]
            if not searched:
                continue
            rows = [row for outcome, row in searched if outcome != "no signal"]
            at_start = [row for outcome, row in searched if outcome == "met at start bounds"]
            moved = [row for outcome, row in searched if outcome in ("met after moving", "not met")]
            bounds: dict[str, tuple[float, float, float] | None] = {}
            clipped: dict[str, tuple[float, float]] = {}
            for side in ("lower", "upper"):
                values = _finite(rows, f"bapo/search/{side}")
                bounds[side] = (statistics.median(values), min(values), max(values)) if values else None
                clipped[f"clip_{side}"] = (_mean(at_start, f"clip_frac/{side}"), _mean(moved, f"clip_frac/{side}"))
            table.append(
                {
                    "setting": setting,
                    "method": method,
                    "updates": len(rows),
                    "share_start": _mean(rows, "positive_share/start_bounds"),
                    "share_used": _mean(rows, "bapo/search/share"),
                    "moved": len(moved) / len(rows) if rows else math.nan,
                    "moved_share_start": _mean(moved, "positive_share/start_bounds"),
                    "moved_share_used": _mean(moved, "bapo/search/share"),
                    **bounds,
                    **clipped,
                }
            )
    return table


def _mean(rows: list[dict], key: str) -> float:
    """The mean of `key`'s finite values over `rows`; NaN when there are none."""
    values = _finite(rows, key)
    return statistics.fmean(values) if values else math.nan


def _share(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def _pair(values: tuple[float, float]) -> str:
    return " / ".join(_share(value) for value in values)


def _spread(bound: tuple[float, float, float] | None) -> str:
    if bound is None:
        return "-"
    median, low, high = bound
    return f"{median:.2f} [{low:.2f}, {high:.2f}]"


def mechanics_section(runs: list[Run]) -> list[str]:
    """report.md's lines on what the updates did ([] when there is nothing to say)."""
    lines: list[str] = []
    pairs = identical_methods(runs)
    if pairs:
        lines += [
            "Methods that trained identically (every update logged the same loss and gradient norm, "
            "in every seed both ran): their comparison in that setting is no comparison.",
            "",
        ]
        lines += [f"- {setting}: {a} and {b} ({seeds} seed{'s' * (seeds != 1)})" for setting, a, b, seeds in pairs]
        lines.append("")
    outcomes = search_outcomes(runs)
    if outcomes:
        lines += [
            "BAPO's bound search, share of optimizer updates by outcome (seeds pooled): met at the "
            "start bounds (the update is a fixed clip at them), met after moving the bounds, not met "
            "(the bounds end at their maxima), no signal (no token with a non-zero advantage).",
            "",
            "| setting | method | updates | " + " | ".join(OUTCOMES) + " |",
            "|---|---|---|" + "---|" * len(OUTCOMES),
        ]
        lines += [
            f"| {row['setting']} | {row['method']} | {row['updates']} | "
            + " | ".join(f"{row[name]:.2f}" for name in OUTCOMES)
            + " |"
            for row in outcomes
        ]
        lines += [
            "",
            "Its positive share before the search (at the start bounds) and after it (at the bounds "
            "used), means, and the bounds used, median [min, max] (min = max: a fixed clip), over the "
            'updates with signal; "-": not logged (runs made before positive_share/start_bounds was).',
            "",
            "| setting | method | share at start bounds | share at bounds used | lower bound | upper bound |",
            "|---|---|---|---|---|---|",
        ]
        bounds = search_bounds(runs)
        lines += [
            f"| {row['setting']} | {row['method']} | {_share(row['share_start'])} | {_share(row['share_used'])} | "
            f"{_spread(row['lower'])} | {_spread(row['upper'])} |"
            for row in bounds
        ]
        lines += [
            "",
            "Where the search moved the bounds: the share of updates with signal, the positive share there "
            "before and after the search, and the tokens clipped at the start bounds (updates that met the "
            "target there) and at the moved bounds: negative tokens below the lower bound, positive tokens "
            "above the upper one (clip_frac/lower, clip_frac/upper). Few tokens clipped at the moved bounds "
            "mean the search had little to act on: with ratios near 1 the share stays where the replies' "
            "lengths and advantages put it.",
            "",
            "| setting | method | updates moved | share before -> after there | negative clipped low: start / moved "
            "| positive clipped high: start / moved |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {row['setting']} | {row['method']} | {_share(row['moved'])} | "
            f"{_share(row['moved_share_start'])} -> {_share(row['moved_share_used'])} | "
            f"{_pair(row['clip_lower'])} | {_pair(row['clip_upper'])} |"
            for row in bounds
        ]
        lines.append("")
    return lines

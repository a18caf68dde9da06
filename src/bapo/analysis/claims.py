"""The one claims engine, shared by `bapo lab`, `bapo demo` and `bapo compare --claims`.

A claim is tested as an effect per seed whose sign says which way it went (positive = the way the
paper claims). The verdict comes from the 95% interval of the mean effect over seeds (Student t):
  held      the whole interval is above 0
  not held  the whole interval is below 0 (the opposite of the claim)
  mixed     the interval contains 0 (the effect is within seed noise)

Claims are data (`ClaimSpec`: id, text, the metric, the two arms compared, the expected sign);
`evaluate_claims` judges them over seed-indexed values (`SeedValues`: per arm and metric, {seed: value}),
which the loaders make from metrics.jsonl runs (bapo.analysis.run_claims.run_values) or from the
lab's cells (bapo.lab.claims.cell_values). `leaderboard` ranks every method of every setting on one
metric against a baseline method, so a new method is one more name in the list it is given.
"""

from __future__ import annotations

import json
import math
import statistics
import string
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import NamedTuple, Protocol

# two-sided 95% Student t quantiles t_{0.975, df} for df = 1..30; above 30 the normal 1.96 is used
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
# one-sided 80% quantiles t_{0.80, df}, df = 1..30 (power 0.8 in detectable_effect); above 30: 0.842
_T80 = (1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873, 0.870, 0.868, 0.866)
_T80 += (0.865, 0.863, 0.862, 0.861, 0.860, 0.859, 0.858, 0.858, 0.857, 0.856, 0.856, 0.855, 0.855, 0.854, 0.854)
VERDICTS = ("held", "not held", "mixed")


def detectable_effect(low: float, high: float, seeds: int) -> float:
    """The smallest true effect a paired test over `seeds` seeds detects with 80% power at the 5%
    level, given the seed spread behind the 95% interval [low, high]: (t_0.975 + t_0.80) * s/sqrt(n).
    NaN without an interval (one seed)."""
    if seeds < 2 or not (math.isfinite(low) and math.isfinite(high)):
        return math.nan
    df = seeds - 1
    t975 = _T975[df - 1] if df <= len(_T975) else 1.96
    t80 = _T80[df - 1] if df <= len(_T80) else 0.842
    standard_error = (high - low) / 2 / t975
    return (t975 + t80) * standard_error


def mean_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` and its 95% Student-t interval (NaNs are dropped).
    One value gives (v, nan, nan); none gives (nan, nan, nan)."""
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not finite:
        return math.nan, math.nan, math.nan
    mean = sum(finite) / len(finite)
    if len(finite) < 2:
        return mean, math.nan, math.nan
    std = math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1))
    df = len(finite) - 1
    half = (_T975[df - 1] if df <= len(_T975) else 1.96) * std / math.sqrt(len(finite))
    return mean, mean - half, mean + half


def judge(low: float, high: float) -> str:
    """The verdict of an effect interval (positive = the claimed direction); see the module doc."""
    if math.isnan(low) or math.isnan(high):
        return "mixed"
    if low > 0:
        return "held"
    if high < 0:
        return "not held"
    return "mixed"


@dataclass(frozen=True)
class Claim:
    """One claim tested in one setting.

    id: short key ("1-entropy-falls-with-E"); text: the claim in one line; setting: the regime;
    effect/low/high: mean effect over seeds and its 95% interval (positive = as claimed);
    seeds: how many seeds; verdict: held | not held | mixed; detail: the numbers behind it.
    """

    id: str
    text: str
    setting: str
    effect: float
    low: float
    high: float
    seeds: int
    verdict: str
    detail: str = ""

    @classmethod
    def from_effects(cls, id: str, text: str, setting: str, effects: Sequence[float], detail: str = "") -> Claim:
        """A claim judged from one effect per seed."""
        mean, low, high = mean_interval(effects)
        seeds = sum(1 for v in effects if v is not None and math.isfinite(float(v)))
        return cls(id, text, setting, mean, low, high, seeds, judge(low, high), detail)


def claims_json(claims: Sequence[Claim]) -> str:
    """The claims table as one JSON list (claim id, held, effect size, interval, seeds, ...)."""
    rows = [{**asdict(c), "interval": [c.low, c.high], "held": c.verdict == "held"} for c in claims]
    return json.dumps(rows, indent=2, default=float)


def claims_markdown(claims: Sequence[Claim]) -> str:
    """The claims table as Markdown: claim, setting, verdict, effect [95% interval], seeds, numbers."""
    lines = ["| claim | setting | verdict | effect [95% interval] | seeds | numbers |", "|---|---|---|---|---|---|"]
    for c in claims:
        lines.append(
            f"| {c.id}: {c.text} | {c.setting} | **{c.verdict}** | {c.effect:+.4g} "
            f"[{c.low:+.4g}, {c.high:+.4g}] | {c.seeds} | {c.detail} |"
        )
    return "\n".join(lines)


class Arm(NamedTuple):
    """One side of a comparison: a method in a setting (bapo.analysis.runs.setting_name, "E=2")."""

    method: str
    setting: str


class SeedValues(Protocol):
    """Per-seed values of `metric` for `arm`: {seed: value} (NaN: missing), None when the arm or
    the metric is absent (its claims are skipped)."""

    def __call__(self, arm: Arm, metric: str) -> dict[int, float] | None: ...


@dataclass(frozen=True)
class ClaimSpec:
    """One claim as data.

    id, text, setting: as in the judged `Claim`; metric: a per-seed measure (a series and how it is
    aggregated, e.g. "entropy at the end"), named in the loader's measures; treatment, baseline:
    the arms compared, paired by seed; baseline None compares with the constant `reference`;
    sign: +1 when the paper claims treatment > baseline, -1 when it claims treatment < baseline:
    the effect per seed is sign * (treatment - baseline). detail: a template of the numbers shown,
    "{treatment}" / "{baseline}" (the metric over the paired seeds) and any name of `shows`,
    (name, arm, metric) triples over every seed of that arm.
    """

    id: str
    text: str
    setting: str
    metric: str
    treatment: Arm
    baseline: Arm | None = None
    sign: int = 1
    reference: float = 0.0
    detail: str = ""
    shows: tuple[tuple[str, Arm, str], ...] = ()


def format_mean(values: Sequence[float]) -> str:
    """The mean of the finite values, 3 decimals ("nan" when none)."""
    finite = [v for v in values if math.isfinite(v)]
    return f"{statistics.fmean(finite):.3f}" if finite else "nan"


def format_interval(values: Sequence[float]) -> str:
    """The mean and its 95% interval, 3 decimals: "0.412 [0.395, 0.430]"."""
    mean, low, high = mean_interval(values)
    return f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def _rounded(value: float, resolution: float | None) -> float:
    """`value` to a multiple of `resolution` (half to even; NaN and None unchanged)."""
    if resolution is None or not math.isfinite(value):
        return value
    return round(value / resolution) * resolution


def evaluate_claims(
    specs: Sequence[ClaimSpec],
    values: SeedValues,
    *,
    fmt: Callable[[Sequence[float]], str] = format_interval,
    resolution: float | None = None,
    min_seeds: int = 0,
) -> list[Claim]:
    """The judged claims of `specs`, in their order; a spec whose arm or metric is absent is
    skipped, and so is one with fewer than `min_seeds` finite effects. resolution: effects are
    rounded to it first (below it a difference is float rounding, not an effect); fmt: how the
    detail's numbers are written."""
    claims = []
    for spec in specs:
        treatment = values(spec.treatment, spec.metric)
        baseline = values(spec.baseline, spec.metric) if spec.baseline is not None else None
        if treatment is None or (spec.baseline is not None and baseline is None):
            continue
        seeds = [seed for seed in treatment if baseline is None or seed in baseline]
        compared = [treatment[seed] for seed in seeds]
        against = [baseline[seed] for seed in seeds] if baseline is not None else [spec.reference] * len(seeds)
        effects = [_rounded(spec.sign * (a - b), resolution) for a, b in zip(compared, against)]
        if sum(math.isfinite(effect) for effect in effects) < min_seeds:
            continue
        shown = {"treatment": fmt(compared), "baseline": fmt(against)}
        for name, arm, metric in spec.shows:
            shown[name] = fmt(list((values(arm, metric) or {}).values()))
        detail = string.Formatter().vformat(spec.detail, (), shown)
        claims.append(Claim.from_effects(spec.id, spec.text, spec.setting, effects, detail))
    return claims


@dataclass(frozen=True)
class Standing:
    """One method in one setting of a leaderboard: `metric` over seeds (mean, 95% interval) and,
    for every method but the baseline, its paired effect against the baseline (`versus`, a Claim
    whose verdict says whether it is better: effect = sign * (method - baseline))."""

    setting: str
    method: str
    metric: str
    mean: float
    low: float
    high: float
    seeds: int
    versus: Claim | None = None


def leaderboard(
    methods: Sequence[str],
    settings: Sequence[str],
    metric: str,
    values: SeedValues,
    *,
    baseline: str,
    sign: int = 1,
    resolution: float | None = None,
) -> list[Standing]:
    """Every method of `methods` present in each setting of `settings`, best first (by its mean,
    higher when sign is +1), with its 95% interval and its verdict against `baseline`."""
    standings = []
    for setting in settings:
        rows = []
        for method in methods:
            per_seed = values(Arm(method, setting), metric)
            if per_seed is None:
                continue
            mean, low, high = mean_interval(list(per_seed.values()))
            versus = None
            if method != baseline:
                spec = ClaimSpec(
                    f"{metric}-{method}-vs-{baseline}-{setting}",
                    f"{method} {'above' if sign > 0 else 'below'} {baseline} on {metric}",
                    setting,
                    metric,
                    Arm(method, setting),
                    Arm(baseline, setting),
                    sign,
                )
                versus = next(iter(evaluate_claims([spec], values, resolution=resolution)), None)
            seeds = sum(math.isfinite(v) for v in per_seed.values())
            rows.append(Standing(setting, method, metric, mean, low, high, seeds, versus))
        rows.sort(key=lambda row: -sign * row.mean if math.isfinite(row.mean) else math.inf)
        standings += rows
    return standings


def leaderboard_markdown(standings: Sequence[Standing]) -> str:
    """The leaderboard as Markdown: setting, method, metric [95% interval], seeds, vs the baseline."""
    lines = ["| setting | method | mean [95% interval] | seeds | vs baseline: effect [95% interval] |"]
    lines.append("|---|---|---|---|---|")
    for row in standings:
        if row.versus is None:
            versus = "(baseline)"
        elif not math.isfinite(row.versus.effect):  # e.g. at matched reward: no seed pair reached the level
            versus = "n/a (no seed with a value in both)"
        else:
            effect = row.versus
            versus = f"**{effect.verdict}** {effect.effect:+.4g} [{effect.low:+.4g}, {effect.high:+.4g}]"
        interval = f"{row.mean:.4g} [{row.low:.4g}, {row.high:.4g}]"
        lines.append(f"| {row.setting} | {row.method} | {interval} | {row.seeds} | {versus} |")
    return "\n".join(lines)

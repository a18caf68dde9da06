"""One schema for "does this claim of the paper hold here?", shared by `bapo lab` and `bapo demo`.

A claim is tested as an effect per seed whose sign says which way it went (positive = the way the
paper claims). The verdict comes from the 95% interval of the mean effect over seeds (Student t):
  held      the whole interval is above 0
  not held  the whole interval is below 0 (the opposite of the claim)
  mixed     the interval contains 0 (the effect is within seed noise)
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

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
VERDICTS = ("held", "not held", "mixed")


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

"""bapo.analysis.regime: the regime gate's three tests on hand-made GRPO runs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bapo.analysis.regime import gate_section, heldout_lift, length_ratios, share_below
from bapo.analysis.runs import Run


def _run(seed: int, setting: str, rewarded, unrewarded, shares, start=0.2, end=0.5, method="grpo") -> Run:
    rows = [
        {
            "update": i + 1,
            "response_length/rewarded": r,
            "response_length/unrewarded": u,
            "positive_share": share,
            "positive_share/start_bounds": share,
            "entropy": 0.9 - 0.1 * i,
            "reward/mean": 0.2 + 0.1 * i,
            "grad_norm": 1.0 + i,
        }
        for i, (r, u, share) in enumerate(zip(rewarded, unrewarded, shares, strict=True))
    ]
    rows[0].update({"heldout/start/avg@4": start, "heldout/start/pass@4": 0.5})
    rows[-1].update({"heldout/avg@4": end, "heldout/pass@4": 0.9})
    return Run(Path(f"{method}-{setting}-{seed}"), method, setting, seed, rows)


def test_length_ratio_is_taken_per_third_and_skips_updates_without_both_kinds():
    run = _run(0, "E=0", [10, 10, 10, 20, 20, 20], [20, 20, 20, 20, 20, 20], [0.3] * 6)
    run.rows[0]["response_length/unrewarded"] = float("nan")  # an update with no unrewarded response
    first, middle, last = length_ratios(run)
    # five usable updates (rewarded 10, 10, 20, 20, 20; unrewarded 20 each): thirds of 1, 2, 2 updates,
    # each third's ratio of its mean lengths: 20/10, 20/15, 20/20
    assert (first, middle, last) == pytest.approx((2.0, 20 / 15, 1.0))
    assert share_below(_run(0, "E=3", [1] * 4, [2] * 4, [0.3, 0.5, 0.39, float("nan")]), 0.4) == (2, 3)


def test_heldout_lift_needs_both_scores_at_the_same_k():
    assert heldout_lift(_run(0, "E=0", [1], [2], [0.3], start=0.25, end=0.5)) == pytest.approx(0.25)
    run = _run(0, "E=0", [1], [2], [0.3])
    run.rows[-1] = {key: value for key, value in run.rows[-1].items() if not key.startswith("heldout/avg")}
    run.rows[-1]["heldout/avg@8"] = 0.9
    assert math.isnan(heldout_lift(run))


def test_gate_passes_only_when_lift_lengths_and_stale_share_all_hold():
    long_failures = dict(rewarded=[15] * 6, unrewarded=[30] * 6)
    passing = [
        *[_run(seed, "E=0", **long_failures, shares=[0.33] * 6, end=0.5 + 0.01 * seed) for seed in range(3)],
        *[_run(seed, "E=3", **long_failures, shares=[0.3, 0.35, 0.45, 0.3, 0.2, 0.6]) for seed in range(2)],
        _run(0, "E=3", **long_failures, shares=[0.1] * 6, method="bapo"),  # not grpo: ignored
    ]
    text = "\n".join(gate_section(passing, 0.4))
    assert "(a) on-policy held-out lift +0.310" in text and "over 3 seeds: **passes**" in text
    assert "(b) every third of every setting >= 1.3: **passes**" in text
    assert "(c) E=3: positive share < 0.4 in 8 of 12 updates (67%): **passes**" in text
    assert text.count("| E=3 |") == 3  # two grpo runs in the per-run table, one row in (d): the bapo run in neither
    # (d): per setting, seed means; six updates 0.9, 0.8, ... entropy, 0.2, 0.3, ... reward, grad norm 1-6
    assert "| E=0 | 3 | +0.310 | 0.850 -> 0.450 | 0.250 -> 0.650 | 3.500; 6.000 | 0 |" in text
    assert "| E=3 | 2 | +0.300 | 0.850 -> 0.450 |" in text

    # the imbalance fades in the last third (replies shorten): (b) fails; the stale share > 0.4: (c) fails
    fading = dict(rewarded=[15] * 6, unrewarded=[30, 30, 30, 30, 16, 16])
    failing = [
        *[_run(seed, "E=0", **fading, shares=[0.33] * 6, end=0.2 + 0.3 * (seed % 2) - 0.1) for seed in range(3)],
        _run(0, "E=3", **fading, shares=[0.45] * 6),
    ]
    text = "\n".join(gate_section(failing, 0.4))
    assert "(b) E=0: unrewarded / rewarded length by third 2.00 / 2.00 / 1.07" in text
    assert "(b) every third of every setting >= 1.3: **fails**" in text
    assert "(c) E=3: positive share < 0.4 in 0 of 6 updates (0%): **fails**" in text
    assert "**fails**" in next(line for line in text.splitlines() if line.startswith("- (a)"))
    assert gate_section([_run(0, "E=0", [1], [2], [0.3], method="bapo")], 0.4) == []


def test_staleness_effects_name_the_seeds_a_cell_lacks_and_count_non_finite_gradient_norms():
    from bapo.analysis.regime import staleness_effects

    full = _run(0, "E=3", [15] * 6, [30] * 6, [0.3] * 6)
    short = _run(1, "E=3", [15] * 2, [30] * 2, [0.3] * 2)  # two updates: no thirds
    short.rows[1]["grad_norm"] = float("nan")  # a skipped update
    del short.rows[0]["heldout/start/avg@4"]  # no held-out start: no lift
    (row,) = staleness_effects({"E=3": [full, short]})[2:]
    assert row == (
        "| E=3 | 2 | +0.300 (1 of 2 seeds) | 0.850 (1 of 2 seeds) -> 0.450 (1 of 2 seeds) "
        "| 0.250 (1 of 2 seeds) -> 0.650 (1 of 2 seeds) | 2.250; 6.000 | 1 |"
    )
    (empty,) = staleness_effects({"E=0": [_run(0, "E=0", [1], [2], [0.3])]})[2:]
    assert empty == "| E=0 | 1 | +0.300 | - -> - | - -> - | 1.000; 1.000 | 0 |"

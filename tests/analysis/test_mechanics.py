"""bapo.analysis.mechanics: identical-training detection and BAPO's search outcomes, on hand-made runs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bapo.analysis.mechanics import identical_methods, mechanics_section, search_bounds, search_outcomes
from bapo.analysis.report import write_report
from bapo.analysis.runs import Run


def _run(method: str, seed: int, losses, setting: str = "E=4", extra=None, grad_norms=None) -> Run:
    grad_norms = grad_norms or [1.0] * len(losses)
    rows = [
        {"update": i + 1, "loss": loss, "grad_norm": norm} for i, (loss, norm) in enumerate(zip(losses, grad_norms))
    ]
    for row, more in zip(rows, extra or [], strict=False):
        row.update(more)
    return Run(Path(f"{method}-{setting}-{seed}"), method, setting, seed, rows)


def test_methods_identical_in_every_shared_seed_are_reported_once():
    runs = [
        _run("grpo", 0, [0.5, 0.4]),
        _run("grpo", 1, [0.6, 0.3]),
        _run("decoupled-ppo", 0, [0.5, 0.4]),
        _run("decoupled-ppo", 1, [0.6, 0.3]),
        _run("bapo", 0, [0.5, 0.4]),
        _run("bapo", 1, [0.6, 0.3000001]),  # one update differs in one seed: not identical
    ]
    assert identical_methods(runs) == [("E=4", "grpo", "decoupled-ppo", 2)]


def test_identical_needs_the_same_updates_both_keys_and_nan_matches_nan():
    # metrics.jsonl writes NaN as the string "nan" (read_metrics keeps it so)
    for nan in (float("nan"), "nan"):
        assert identical_methods([_run("grpo", 0, [0.5, nan]), _run("bapo", 0, [0.5, nan])]) == [
            ("E=4", "grpo", "bapo", 1)
        ]
    assert identical_methods([_run("grpo", 0, [0.5, "nan"]), _run("bapo", 0, [0.5, 0.4])]) == []
    assert identical_methods([_run("grpo", 0, [0.5, 0.4]), _run("bapo", 0, [0.5])]) == []
    # the same losses with another gradient norm are another training
    assert identical_methods([_run("grpo", 0, [0.5, 0.4]), _run("bapo", 0, [0.5, 0.4], grad_norms=[1.0, 1.5])]) == []
    # a key logged by one run only differs; rows with neither key prove nothing
    one_sided = _run("bapo", 0, [0.5])
    del one_sided.rows[0]["grad_norm"]
    assert identical_methods([_run("grpo", 0, [0.5]), one_sided]) == []
    empty = [Run(Path(m), m, "E=4", 0, [{"update": 1}]) for m in ("grpo", "bapo")]
    assert identical_methods(empty) == []
    # different settings never pair, and no shared seed is no evidence
    assert identical_methods([_run("grpo", 0, [0.5]), _run("bapo", 0, [0.5], setting="E=2")]) == []
    assert identical_methods([_run("grpo", 0, [0.5]), _run("bapo", 1, [0.5])]) == []


def test_search_outcomes_count_each_update_once():
    search = [
        {"bapo/search/reached": 1.0, "bapo/search/steps": 0.0, "bapo/search/no_signal": 0.0},
        {"bapo/search/reached": 1.0, "bapo/search/steps": 3.0, "bapo/search/no_signal": 0.0},
        {"bapo/search/reached": 0.0, "bapo/search/steps": 51.0, "bapo/search/no_signal": 0.0},
        {"bapo/search/reached": "nan", "bapo/search/steps": "nan", "bapo/search/no_signal": 1.0},
    ]
    runs = [_run("bapo", 0, [0.1] * 4, extra=search), _run("grpo", 0, [0.2] * 4)]
    (row,) = search_outcomes(runs)  # grpo has no search: no row
    assert (row["method"], row["updates"]) == ("bapo", 4)
    assert [row[name] for name in ("no signal", "met at start bounds", "met after moving", "not met")] == [
        0.25,
        0.25,
        0.25,
        0.25,
    ]


def test_report_gets_the_section_only_when_there_is_something_to_say(tmp_path):
    different = [_run("grpo", 0, [0.5, 0.4]), _run("bapo", 0, [0.5, 0.3])]
    assert mechanics_section(different) == []
    text = write_report(tmp_path / "a.md", different, [], [], 0.4, []).read_text()
    assert "What the updates did" not in text
    alike = [_run("grpo", 0, [0.5, 0.4]), _run("decoupled-ppo", 0, [0.5, 0.4])]
    text = write_report(tmp_path / "b.md", alike, [], [], 0.4, []).read_text()
    assert "## What the updates did" in text and "- E=4: grpo and decoupled-ppo (1 seed)" in text
    assert "BAPO's bound search" not in text  # no run searched
    search = [{"bapo/search/reached": 1.0, "bapo/search/steps": 0.0, "bapo/search/no_signal": 0.0}] * 2
    searched = [_run("grpo", 0, [0.5, 0.4]), _run("bapo", 0, [0.5, 0.3], extra=search)]
    text = write_report(tmp_path / "c.md", searched, [], [], 0.4, []).read_text()
    assert "identically" not in text
    assert "| E=4 | bapo | 2 | 0.00 | 1.00 | 0.00 | 0.00 |" in text


def test_search_bounds_pool_seeds_and_report_the_share_before_and_after():
    def search(lower, upper, share, start):
        row = {"bapo/search/reached": 1.0, "bapo/search/no_signal": 0.0, "bapo/search/steps": 1.0}
        row.update({"bapo/search/lower": lower, "bapo/search/upper": upper, "bapo/search/share": share})
        return row | ({} if start is None else {"positive_share/start_bounds": start})

    seed0 = [search(0.6, 1.2, 0.40, 0.30), search(0.7, 1.4, 0.42, 0.36)]
    seed1 = [search(0.8, 1.2, 0.50, "nan"), search(0.8, 1.2, 0.48, None)]  # start share not logged
    no_signal = {"bapo/search/reached": "nan", "bapo/search/no_signal": 1.0, "bapo/search/share": "nan"}
    no_signal |= {"bapo/search/lower": 0.5, "bapo/search/upper": 1.1}  # not searched: left out of the bounds
    runs = [
        _run("bapo", 0, [0.1, 0.1], extra=seed0),
        _run("bapo", 1, [0.1, 0.1, 0.1], extra=[*seed1, no_signal]),
        _run("grpo", 0, [0.1, 0.1]),
    ]
    (row,) = search_bounds(runs)
    assert (row["method"], row["updates"]) == ("bapo", 4)
    assert row["share_start"] == pytest.approx(0.33)
    assert row["share_used"] == pytest.approx((0.40 + 0.42 + 0.50 + 0.48) / 4)
    assert row["lower"] == (0.75, 0.6, 0.8) and row["upper"] == (1.2, 1.2, 1.4)
    lines = mechanics_section(runs)
    assert "| E=4 | bapo | 0.330 | 0.450 | 0.75 [0.60, 0.80] | 1.20 [1.20, 1.40] |" in lines
    # a run that never logged a start share or a bound shows "-", not nan
    bare = [_run("bapo", 0, [0.1], extra=[{"bapo/search/reached": 1.0, "bapo/search/no_signal": 0.0}])]
    assert "| E=4 | bapo | - | - | - | - |" in mechanics_section(bare)


def test_search_bounds_split_the_clipped_tokens_by_whether_the_search_moved_the_bounds():
    def update(steps, reached, share_start, share_used, clip_lower, clip_upper):
        return {
            "bapo/search/reached": reached,
            "bapo/search/no_signal": 0.0,
            "bapo/search/steps": steps,
            "bapo/search/lower": 0.6 if steps == 0 else 0.9,
            "bapo/search/upper": 1.2 if steps == 0 else 3.0,
            "positive_share/start_bounds": share_start,
            "bapo/search/share": share_used,
            "clip_frac/lower": clip_lower,
            "clip_frac/upper": clip_upper,
        }

    rows = [
        update(0, 1.0, 0.50, 0.50, 0.00, 0.02),  # met at the start bounds
        update(0, 1.0, 0.46, 0.46, 0.01, 0.00),
        update(3, 0.0, 0.30, 0.32, 0.06, 0.00),  # not met: the bounds ran to their maxima
        update(2, 1.0, 0.38, 0.40, 0.04, "nan"),  # met after moving; a NaN clip share is left out
    ]
    (row,) = search_bounds([_run("bapo", 0, [0.1] * 4, extra=rows)])
    assert row["moved"] == pytest.approx(0.5)
    assert row["moved_share_start"] == pytest.approx(0.34) and row["moved_share_used"] == pytest.approx(0.36)
    assert row["clip_lower"] == pytest.approx((0.005, 0.05))
    assert row["clip_upper"] == pytest.approx((0.01, 0.0))
    lines = mechanics_section([_run("bapo", 0, [0.1] * 4, extra=rows)])
    assert "| E=4 | bapo | 0.500 | 0.340 -> 0.360 | 0.005 / 0.050 | 0.010 / 0.000 |" in lines
    # a search that never moved: its "moved" columns are empty, not zero
    (still,) = search_bounds([_run("bapo", 0, [0.1, 0.1], extra=rows[:2])])
    assert still["moved"] == 0.0 and all(map(math.isnan, (still["moved_share_start"], still["clip_lower"][1])))

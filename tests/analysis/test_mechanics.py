"""bapo.analysis.mechanics: identical-training detection and BAPO's search outcomes, on hand-made runs."""

from __future__ import annotations

from pathlib import Path

from bapo.analysis.mechanics import identical_methods, mechanics_section, search_outcomes
from bapo.analysis.report import write_report
from bapo.analysis.runs import Run


def _run(method: str, seed: int, losses, setting: str = "E=4", extra=None) -> Run:
    rows = [{"update": i + 1, "loss": loss, "grad_norm": 2.0 * loss} for i, loss in enumerate(losses)]
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


def test_identical_needs_the_same_updates_and_nan_matches_nan():
    nan = float("nan")
    assert identical_methods([_run("grpo", 0, [0.5, nan]), _run("bapo", 0, [0.5, nan])]) == [("E=4", "grpo", "bapo", 1)]
    assert identical_methods([_run("grpo", 0, [0.5, 0.4]), _run("bapo", 0, [0.5])]) == []
    # different settings never pair, and no shared seed is no evidence
    assert identical_methods([_run("grpo", 0, [0.5]), _run("bapo", 0, [0.5], setting="E=2")]) == []
    assert identical_methods([_run("grpo", 0, [0.5]), _run("bapo", 1, [0.5])]) == []


def test_search_outcomes_count_each_update_once():
    search = [
        {"bapo/search/reached": 1.0, "bapo/search/steps": 0.0, "bapo/search/no_signal": 0.0},
        {"bapo/search/reached": 1.0, "bapo/search/steps": 3.0, "bapo/search/no_signal": 0.0},
        {"bapo/search/reached": 0.0, "bapo/search/steps": 51.0, "bapo/search/no_signal": 0.0},
        {"bapo/search/reached": "nan", "bapo/search/steps": 0.0, "bapo/search/no_signal": 1.0},
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

"""The one claims engine: today's tables reproduced from data, and the leaderboard."""

import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path

import pytest

from bapo.analysis.claims import Arm, ClaimSpec, evaluate_claims, leaderboard, leaderboard_markdown
from bapo.analysis.run_claims import run_claims
from tests.analysis.synthetic import synthetic_runs

FIXTURES = Path(__file__).parent / "fixtures"


def assert_same_claims(claims, golden_file: Path) -> None:
    """Ids, texts, settings, verdicts, seeds and details equal; effect and interval to 1e-12."""
    golden = json.loads(golden_file.read_text())
    assert [c.id for c in claims] == [row["id"] for row in golden]
    for claim, row in zip(claims, golden):
        got = asdict(claim)
        for key in ("text", "setting", "verdict", "seeds", "detail"):
            assert got[key] == row[key], (claim.id, key)
        for key in ("effect", "low", "high"):
            expected = float(row[key])
            assert got[key] == pytest.approx(expected, rel=1e-12, abs=1e-15, nan_ok=True), (claim.id, key)


def test_run_claims_equal_those_of_the_engine_before_it_was_data():
    assert_same_claims(run_claims(synthetic_runs(), 0.4), FIXTURES / "claims_before_engine.json")


def _values(table: dict[tuple[str, str], dict[str, list[float]]]):
    def values(arm, metric):
        per_arm = table.get(tuple(arm))
        return dict(enumerate(per_arm[metric])) if per_arm and metric in per_arm else None

    return values


def test_evaluate_claims_pairs_by_seed_signs_and_skips_absent_arms():
    values = _values(
        {
            ("bapo", "E=2"): {"entropy": [0.9, 0.8, 0.85]},
            ("grpo", "E=2"): {"entropy": [0.5, 0.6, 0.55]},
        }
    )
    spec = ClaimSpec("x", "bapo keeps entropy", "E=2", "entropy", Arm("bapo", "E=2"), Arm("grpo", "E=2"))
    (held,) = evaluate_claims([spec], values)
    assert held.verdict == "held" and held.effect == pytest.approx(0.3) and held.seeds == 3
    (opposite,) = evaluate_claims([ClaimSpec(**{**asdict(spec), "sign": -1})], values)
    assert opposite.verdict == "not held" and opposite.effect == pytest.approx(-0.3)
    absent = ClaimSpec("y", "", "E=4", "entropy", Arm("bapo", "E=4"), Arm("grpo", "E=4"))
    unknown_metric = ClaimSpec("z", "", "E=2", "reward", Arm("bapo", "E=2"), Arm("grpo", "E=2"))
    assert evaluate_claims([absent, unknown_metric], values) == []
    against_constant = ClaimSpec("c", "", "E=2", "entropy", Arm("grpo", "E=2"), sign=-1, reference=0.7)
    (below,) = evaluate_claims([against_constant], values)
    assert below.verdict == "held" and below.effect == pytest.approx(0.15)
    # resolution: a difference below it is rounding, and min_seeds drops a claim without an interval
    tiny = _values({("a", "s"): {"m": [1.0 + 1e-9, 2.0 + 1e-9]}, ("b", "s"): {"m": [1.0, 2.0]}})
    (rounded,) = evaluate_claims([ClaimSpec("r", "", "s", "m", Arm("a", "s"), Arm("b", "s"))], tiny, resolution=1e-6)
    assert rounded.effect == 0.0 and rounded.verdict == "mixed"
    one = _values({("a", "s"): {"m": [1.0, math.nan]}, ("b", "s"): {"m": [0.0, 0.0]}})
    assert evaluate_claims([ClaimSpec("r", "", "s", "m", Arm("a", "s"), Arm("b", "s"))], one, min_seeds=2) == []


def test_leaderboard_ranks_every_method_with_its_interval_and_verdict():
    values = _values(
        {
            ("grpo", "E=4"): {"reward": [0.50, 0.52, 0.48]},
            ("m2po", "E=4"): {"reward": [0.70, 0.75, 0.72]},
            ("bapo", "E=4"): {"reward": [0.60, 0.66, 0.63]},
            ("gspo", "E=4"): {"reward": [0.40, 0.42, 0.41]},
            ("grpo", "E=0"): {"reward": [0.5, 0.6, 0.4]},
            ("bapo", "E=0"): {"reward": [0.5, 0.6, 0.4]},
        }
    )
    methods = ("grpo", "bapo", "m2po", "gspo", "absent")
    board = leaderboard(methods, ("E=0", "E=4"), "reward", values, baseline="grpo")
    e4 = [row for row in board if row.setting == "E=4"]
    assert [row.method for row in e4] == ["m2po", "bapo", "grpo", "gspo"]
    verdicts = {row.method: row.versus.verdict if row.versus else None for row in e4}
    assert verdicts == {"m2po": "held", "bapo": "held", "grpo": None, "gspo": "not held"}
    m2po = e4[0]
    assert m2po.mean == pytest.approx(0.72333, abs=1e-5) and m2po.low < m2po.mean < m2po.high and m2po.seeds == 3
    e0 = {row.method: row for row in board if row.setting == "E=0"}
    assert e0["bapo"].versus.verdict == "mixed" and e0["bapo"].versus.effect == 0.0
    lower_is_better = leaderboard(methods, ("E=4",), "reward", values, baseline="grpo", sign=-1)
    assert [row.method for row in lower_is_better] == ["gspo", "grpo", "bapo", "m2po"]
    assert lower_is_better[0].versus.verdict == "held"
    table = leaderboard_markdown(board)
    assert "| E=4 | m2po | 0.7233 [" in table and "**held**" in table and "(baseline)" in table
    nan = float("nan")  # a baseline that never reached the level (entropy at matched reward): no pair to compare
    unmatched = _values(
        {("grpo", "k=64"): {"entropy": [nan, nan, nan]}, ("bapo", "k=64"): {"entropy": [2.9, 3.0, nan]}}
    )
    rows = leaderboard(("grpo", "bapo"), ("k=64",), "entropy", unmatched, baseline="grpo")
    assert [(row.method, row.seeds) for row in rows] == [("bapo", 2), ("grpo", 0)]
    assert "| k=64 | bapo | 2.95 [" in leaderboard_markdown(rows) and "n/a (no seed with a value in both)" in (
        leaderboard_markdown(rows)
    )


def test_detectable_effect_follows_the_seed_spread_and_the_t_quantiles():
    from bapo.analysis.claims import detectable_effect, mean_interval

    effects = [0.02, 0.05, 0.08, 0.03, 0.07]
    mean, low, high = mean_interval(effects)
    standard_error = statistics.stdev(effects) / math.sqrt(len(effects))
    assert detectable_effect(low, high, 5) == pytest.approx((2.776 + 0.941) * standard_error, rel=1e-3)
    # more seeds with the same spread detect a smaller effect; one seed detects nothing
    _, low10, high10 = mean_interval(effects * 2)
    assert detectable_effect(low10, high10, 10) < detectable_effect(low, high, 5)
    assert math.isnan(detectable_effect(math.nan, math.nan, 1))

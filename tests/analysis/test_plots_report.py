from pathlib import Path

import pytest
from typer.testing import CliRunner

from bapo.analysis.plots import FIGURES
from bapo.analysis.report import markdown_table, summary
from bapo.analysis.run_claims import run_claims
from bapo.analysis.runs import Run, find_runs, group_runs, setting_name, upgrade_names
from bapo.cli.main import app

# a few updates of real demo runs (metrics.jsonl as written then, under the names of the committed
# study records, docs/study/full: staleness/* for the policy lag)
RECORDED = Path(__file__).parent / "fixtures" / "recorded"


def test_recorded_runs_load_with_identity():
    runs = find_runs([RECORDED])
    groups = group_runs(runs)
    assert list(groups) == ["E=0", "E=0, async delay 4"]
    assert set(groups["E=0, async delay 4"]) == {"grpo", "bapo"}
    assert all(r.rows and r.final.get("k") == 8 for r in runs)


def test_old_metric_names_read_as_the_trainers():
    """The study records' policy lag, logged as staleness/*, reads as the trainer's policy_lag/*,
    and a row that has both keeps the new value."""
    assert upgrade_names({"staleness/max": 0.0, "policy_lag/max": 1.0}) == {"policy_lag/max": 1.0}
    assert upgrade_names({"bapo/no_signal": 1.0}) == {"bapo/no_signal": 1.0}  # the diagnostics' own name
    # the policy lag in optimizer updates was logged as staleness/*, which is the paper's E's name
    assert '"staleness/max": ' in next(RECORDED.glob("grpo-*/metrics.jsonl")).read_text()
    for run in find_runs([RECORDED]):
        assert all("staleness/mean" not in row for row in run.rows) and run.values("policy_lag/max")


def test_bapo_plot_writes_every_figure(tmp_path):
    result = CliRunner().invoke(app, ["plot", str(RECORDED), "--out", str(tmp_path), "--target", "0.4"])
    assert result.exit_code == 0, result.output
    for name in FIGURES:
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert png.stat().st_size > 10_000  # drawn lines, not an empty canvas
    assert len(result.output.split()) == len(FIGURES)


def test_bapo_plot_accepts_a_single_run_dir(tmp_path):
    run_dir = next(p for p in RECORDED.iterdir() if p.is_dir())
    result = CliRunner().invoke(app, ["plot", str(run_dir), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "entropy.png").exists()


def test_bapo_compare_prints_each_run():
    result = CliRunner().invoke(app, ["compare", str(RECORDED), "--markdown"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("| E=0")]
    assert len(lines) == len(find_runs([RECORDED]))
    assert "avg@8" in result.output and "pass@8" in result.output
    assert "| start policy | sft | - | 0.274 | 0.883 |" in result.output


def test_setting_is_read_from_a_plain_bapo_train_config(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"update": 1, "entropy": 0.5}\n')
    (run_dir / "config.yaml").write_text(
        "loss: {method: bapo}\noffpolicy: {mini_batches: 3, async_delay: 2}\nrun: {seed: 4}\n"
    )
    (run,) = find_runs([run_dir])
    assert (run.method, run.setting, run.seed) == ("bapo", "E=2, async delay 2", 4)
    # a run written before offpolicy.staleness (the async delay) was renamed reads the same
    (run_dir / "config.yaml").write_text("offpolicy: {mini_batches: 1, staleness: 4}\n")
    (run,) = find_runs([run_dir])
    assert run.setting == "E=0, async delay 4"
    assert setting_name(0, 0, True) == "E=0, partial rollout"


def _fake_run(method, e, entropy, accuracy, seed=0, share=0.4, start_entropy=0.6):
    rows = [
        {
            "update": i + 1,
            "rollout_step": i,
            "entropy": start_entropy if i == 0 else entropy,
            "reward/mean": 0.5,
            "positive_share": share,
            "grad_norm": 1.0 + (i == 5),
            "lower": 0.8,
            "upper": 1.2,
        }
        for i in range(10)
    ]
    rows[0].update({"heldout/start/avg@8": 0.3, "heldout/start/pass@8": 0.6})
    rows[-1].update({"heldout/avg@8": accuracy, "heldout/pass@8": accuracy})
    return Run(Path(f"{method}-{e}-{seed}"), method, f"E={e}", seed, rows)


def _verdicts(runs):
    return {c.id: c.verdict for c in run_claims(runs, target=0.4)}


def _three_seeds(cells):
    """cells: (method, E, entropy, accuracy, share) -> runs for seeds 0-2 with a little noise."""
    return [
        _fake_run(m, e, h + n, acc + n, seed, share=share)
        for seed, n in enumerate((0.0, 0.01, -0.01))
        for m, e, h, acc, share in cells
    ]


@pytest.mark.parametrize("bapo_wins", [True, False])
def test_claims_follow_the_numbers_both_ways(bapo_wins):
    if bapo_wins:
        cells = [("grpo", 0, 0.50, 0.5, 0.35), ("grpo", 4, 0.20, 0.3, 0.3), ("bapo", 4, 0.45, 0.5, 0.4)]
    else:
        cells = [("grpo", 0, 0.30, 0.2, 0.6), ("grpo", 4, 0.60, 0.6, 0.4), ("bapo", 4, 0.30, 0.2, 0.6)]
    v = _verdicts(_three_seeds(cells))
    expected = "held" if bapo_wins else "not held"
    for claim in (
        "0-rl-improves",
        "3-negative-dominate",
        "1-entropy-E4-samples",
        "4-entropy-E=4",
        "4-heldout-E=4",
        "4-share-E=4",
    ):
        assert v[claim] == expected, claim


def test_peers_are_judged_on_held_out_accuracy_against_the_same_grpo_runs():
    """Claim 5: each peer present in a stale setting gets one held-out claim against that
    setting's GRPO, its verdict following the numbers; absent peers and the default get none."""
    cells = [("grpo", 0, 0.5, 0.4, 0.4), ("grpo", 4, 0.5, 0.5, 0.4), ("m2po", 4, 0.5, 0.3, 0.4)]
    cells += [("decoupled-ppo", 4, 0.5, 0.7, 0.4), ("clip-higher", 4, 0.5, 0.5, 0.4)]
    runs = _three_seeds(cells)
    claims = {c.id: c for c in run_claims(runs, 0.4, peers=("m2po", "decoupled-ppo", "clip-higher", "cispo"))}
    assert claims["5-heldout-m2po@E=4"].verdict == "not held"
    assert claims["5-heldout-decoupled-ppo@E=4"].verdict == "held"
    assert claims["5-heldout-clip-higher@E=4"].verdict == "mixed"
    assert abs(claims["5-heldout-decoupled-ppo@E=4"].effect - 0.2) < 1e-9
    assert not any("cispo" in claim_id for claim_id in claims)  # no runs, no claim
    assert list(claims)[-3:] == [f"5-heldout-{p}@E=4" for p in ("m2po", "decoupled-ppo", "clip-higher")]
    assert not any(c.id.startswith("5-") for c in run_claims(runs, 0.4))
    # on-policy, a peer with runs of its own at E=0 (grpo-seq-mean) is judged there too; BAPO's
    # claims 2 and 4 stay off at E=0, where the clipped methods share grpo's runs
    on_policy = _three_seeds(
        [("grpo", 0, 0.5, 0.4, 0.4), ("grpo-seq-mean", 0, 0.5, 0.6, 0.4), ("bapo", 0, 0.5, 0.6, 0.4)]
    )
    ids = {c.id: c for c in run_claims(on_policy, 0.4, peers=("grpo-seq-mean",))}
    assert ids["5-heldout-grpo-seq-mean@E=0"].verdict == "held" and not any(i.startswith(("2-", "4-")) for i in ids)
    # a peer ahead in one seed and behind in another: the interval straddles 0
    noisy = [_fake_run("grpo", 4, 0.5, 0.5, seed) for seed in range(3)]
    noisy += [_fake_run("m2po", 4, 0.5, 0.5 + d, seed) for seed, d in enumerate((0.1, -0.08, 0.02))]
    (claim,) = [c for c in run_claims(noisy, 0.4, peers=("m2po",)) if c.id.startswith("5-")]
    assert claim.verdict == "mixed" and claim.low < 0 < claim.high and abs(claim.effect - 0.04 / 3) < 1e-9


def test_claims_within_noise_are_mixed():
    same = [_fake_run(m, e, 0.5, 0.5, s) for s in range(3) for m, e in (("grpo", 0), ("grpo", 2), ("bapo", 2))]
    v = _verdicts(same)
    assert v["4-entropy-E=2"] == "mixed" and v["1-gradnorm-unstable-E2-samples"] == "mixed"


def test_seeds_aggregate_to_mean_and_95_interval():
    runs = [_fake_run("bapo", 4, 0.4, acc, seed=s) for s, acc in enumerate((0.2, 0.4, 0.6))]
    (row,) = summary(runs)
    assert row["seeds"] == 3
    mean, low, high = row["avg@8"]
    # t_{0.975, 2} = 4.303, std 0.2, 3 seeds: half-width 4.303 * 0.2 / sqrt(3) = 0.497
    assert abs(mean - 0.4) < 1e-9 and abs(high - mean - 0.4969) < 1e-3 and abs(mean - low - 0.4969) < 1e-3
    assert "0.400 [-0.097, 0.897]" in markdown_table([row])
    assert abs(row["grad max/median"][0] - 2.0) < 1e-9

from pathlib import Path

from typer.testing import CliRunner

from bapo.cli.main import app
from bapo.analysis.plots import FIGURES
from bapo.analysis.report import findings, markdown_table, summary
from bapo.analysis.runs import Run, find_runs, group_runs

RECORDED = Path(__file__).parent / "fixtures" / "recorded"  # a few updates of real demo runs (metrics.jsonl as written)


def test_recorded_runs_load_with_identity():
    runs = find_runs([RECORDED])
    groups = group_runs(runs)
    assert set(groups) == {"staleness 0", "staleness 4"}
    assert set(groups["staleness 4"]) == {"grpo", "bapo"}
    assert all(r.rows and r.final.get("k") == 8 for r in runs)


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
    lines = [l for l in result.output.splitlines() if l.startswith("| staleness")]
    assert len(lines) == len(find_runs([RECORDED]))
    assert "avg@8" in result.output and "pass@8" in result.output


def _fake_run(method, staleness, entropy, accuracy, seed=0):
    rows = [{"step": i + 1, "entropy": entropy, "reward/mean": 0.5, "positive_share": 0.4,
             "lower": 0.8, "upper": 1.2} for i in range(10)]
    return Run(Path(f"{method}-{staleness}-{seed}"), method, f"staleness {staleness}", seed, rows,
               {"k": 8, "avg@8": accuracy, "pass@8": accuracy})


def test_findings_follow_the_numbers_both_ways():
    bapo_wins = [_fake_run("grpo", 0, 0.50, 0.4), _fake_run("bapo", 0, 0.55, 0.4),
                 _fake_run("grpo", 4, 0.20, 0.3), _fake_run("bapo", 4, 0.45, 0.5)]
    text = " ".join(findings(summary(bapo_wins), None, 0.4))
    assert "bapo's final entropy (0.450) is higher than grpo's (0.200)" in text
    assert "grpo -0.300" in text and "smallest loss or largest gain: bapo" in text
    assert "highest avg@8 bapo (0.500)" in text
    grpo_wins = [_fake_run("grpo", 0, 0.50, 0.4), _fake_run("bapo", 0, 0.55, 0.4),
                 _fake_run("grpo", 4, 0.60, 0.6), _fake_run("bapo", 4, 0.30, 0.2)]
    text = " ".join(findings(summary(grpo_wins), None, 0.4))
    assert "is lower than grpo's" in text and "highest avg@8 grpo (0.600)" in text


def test_seeds_aggregate_to_mean_and_std():
    runs = [_fake_run("bapo", 4, 0.4, acc, seed=s) for s, acc in enumerate((0.2, 0.4, 0.6))]
    (row,) = summary(runs)
    assert row["seeds"] == 3
    assert abs(row["avg@8"][0] - 0.4) < 1e-9 and abs(row["avg@8"][1] - 0.2) < 1e-9
    assert "0.400 +- 0.200" in markdown_table([row])
